"""Fork and rerun's dry run on real worker processes (one, shared by the module), a real Redis and
the scripted model server.

An origin asks for two calls, `lookup` (run in its step) and `ask` (a person answers it), and
waits on `ask` with a message queued: its versions end UserTurn, LlmTurn, PartialUserTurn. A fork
at each is driven to completion by the workers; the origin's `show --json` and a DUMP of each of
its keys are byte for byte what they were. The copied unfinished `ask` has a token of the fork's;
the origin's token, completed afterwards, completes the origin only, on the workers. The queued
message stays the origin's. A dry run changes no key at all, with the workers stopped meanwhile
(SIGSTOP: their heartbeats and sweeps would change keys of their own; only a key they left with a
short time to live may lapse meanwhile)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import State
from tests.cli.process import agents, cli_env, ok
from tests.e2e.conftest import record_tool, runs, start_workers, wait_for
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.workers import Worker, stop_all

pytestmark = pytest.mark.slow

ASK = {
    "name": "ask",
    "description": "a person answers",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    "external": True,
}


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, list[Worker]]]:
    prefix = f"fk{uuid.uuid4().hex[:10]}"
    workers = start_workers(redis_url, prefix, tmp_path_factory.mktemp("logs"), count=1, concurrency=2)
    yield Settings(redis_url=redis_url, prefix=prefix, home=tmp_path_factory.mktemp("home")), workers
    stop_all(workers)


def look_then_ask(body: dict[str, Any]) -> Reply:
    """Both calls at first; once their results are in, an answer naming the last user message."""
    messages = body.get("messages", [])
    if any(m.get("role") == "tool" for m in messages):
        said = [m["content"] for m in messages if m.get("role") == "user"][-1]
        return text(f"done ({said})")
    return calls(("lookup", {"x": 1}), ("ask", {"x": 2}))


def asker(server: LlmServer, log: Path, write_agent: Any) -> Path:
    model = server.scenario([look_then_ask])
    spec = {
        "slug": "asker",
        "model": f"openai/{model}",
        "apiBase": server.url,
        "tools": [record_tool("lookup", log), ASK],
    }
    path: Path = write_agent(spec)
    return path


def waiting_origin(client: Client, path: Path) -> str:
    """An origin at PartialUserTurn: `lookup` ran, `ask` waits for a person."""
    view = client.start(path, "look it up", run=True, timeout=60)
    assert (view.state, view.head, [p.tool for p in view.pending]) == (State.WAITING, "PartialUserTurn", ["ask"])
    return str(view.session_id)


def keys_of(rclient: redis.Redis, pattern: str) -> dict[str, bytes | None]:
    return {k: rclient.dump(k) for k in sorted(rclient.scan_iter(pattern))}


def group(worker: Worker) -> int:
    """The process group of a worker's processes (it starts one of its own)."""
    assert worker.proc is not None
    return worker.proc.pid


def stopped(group: int) -> bool:
    """Every process of the process group `group` is stopped (state T in /proc)."""
    states = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[2]) == group:
            states.append(fields[0])
    return bool(states) and all(s in ("T", "t") for s in states)


def finish(client: Client, sid: str) -> Any:
    """Drive a session on the workers until it waits on a person, answer what it asks (once is all
    these forks need), and wait until it completes."""
    view = client.resume(sid, timeout=60)
    for p in view.pending:
        client.complete(p.token or "", {"answer": 42})
    return wait_for(lambda: (v := client.view(sid)).state == State.COMPLETED and v, timeout=60, what=f"{sid} done")


def test_forks_at_each_head_run_to_completion_on_workers_and_leave_the_origin_as_it_was(
    fleet: tuple[Settings, list[Worker]],
    llm_server: LlmServer,
    write_agent: Any,
    tmp_path: Path,
    rclient: redis.Redis,
) -> None:
    settings, _ = fleet
    env = cli_env(settings.redis_url, settings.prefix, settings.home)
    log = tmp_path / "runs.jsonl"
    with Client(settings) as client:
        sid = waiting_origin(client, asker(llm_server, log, write_agent))
        assert client.send(sid, "and the weather").sent == "queued"
        (waiting,) = client.view(sid).pending
        shown_before = agents("session", "show", sid, "--json", env=env).stdout
        keys_before = keys_of(rclient, f"{settings.prefix}:s:{{{sid}}}:*")
        assert len(runs(log, "lookup")) == 1

        forks = {v: client.fork(sid, at=v) for v in (1, 2, 3)}
        heads = {v: (f.head, f.state) for v, f in forks.items()}
        assert heads == {
            1: ("UserTurn", State.READY),
            2: ("LlmTurn", State.TOOLS),
            3: ("PartialUserTurn", State.WAITING),
        }
        assert all(f.queued == [] for f in forks.values()), "the origin's queued message is not copied"
        (copied,) = forks[3].pending
        assert copied.token and copied.token != waiting.token and copied.token.startswith(forks[3].session_id + ".")

        # The fork at 3 takes its own token's answer; those at 1 and 2 run their steps again.
        client.complete(copied.token, {"answer": "for the fork"})
        done = {v: finish(client, f.session_id) for v, f in forks.items()}
        assert {v: d.response for v, d in done.items()} == {v: "done (look it up)" for v in (1, 2, 3)}
        assert len(runs(log, "lookup")) == 3, "forks 1 and 2 ran their own lookup; fork 3 copied the origin's"
        after = {v: client.view(f.session_id).version for v, f in forks.items()}

        assert agents("session", "show", sid, "--json", env=env).stdout == shown_before
        assert keys_of(rclient, f"{settings.prefix}:s:{{{sid}}}:*") == keys_before, "no key of the origin changed"

        # The origin's token completes the origin, on the workers, with its queued message.
        client.complete(waiting.token or "", {"answer": "for the origin"})
        origin = wait_for(lambda: (v := client.view(sid)).state == State.COMPLETED and v, timeout=60)
        assert origin.response == "done (and the weather)" and origin.queued == []
        assert {v: client.view(f.session_id).version for v, f in forks.items()} == after, "no fork moved"


def test_a_dry_run_on_workers_changes_no_key(
    fleet: tuple[Settings, list[Worker]],
    llm_server: LlmServer,
    write_agent: Any,
    tmp_path: Path,
    rclient: redis.Redis,
) -> None:
    settings, workers = fleet
    env = cli_env(settings.redis_url, settings.prefix, settings.home)
    with Client(settings) as client:
        sid = waiting_origin(client, asker(llm_server, tmp_path / "runs.jsonl", write_agent))
        for w in workers:
            os.killpg(group(w), signal.SIGSTOP)
        try:
            wait_for(lambda: all(stopped(group(w)) for w in workers), what="every worker process stopped")
            rclient.ping()  # a write they had sent before they stopped has landed
            everything = f"{settings.prefix}:*"
            before = keys_of(rclient, everything)
            dumped = time.monotonic()
            ttls = {k: rclient.pttl(k) for k in before}
            plan = client.rerun_plan(sid, from_version=2)
            printed = ok(agents("session", "rerun", sid, "--from", "2", "--dry-run", "--json", env=env))
            after = keys_of(rclient, everything)
        finally:
            for w in workers:
                os.killpg(group(w), signal.SIGCONT)
    # A key the stopped workers left with a short time to live (the sweeper's turn) may lapse
    # meanwhile: gone, it must have been due to (or gone already when its time to live was read:
    # -2); no other key may differ.
    due = (time.monotonic() - dumped) * 1000 + 50
    lapsed = {k for k in before.keys() - after.keys() if ttls[k] == -2 or 0 <= ttls[k] <= due}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k) and k not in lapsed)
    assert changed == [], f"a dry run changed {changed}"
    assert len(before) > 20, "the dump holds the fleet's keys, the queues' among them"
    # the origin ran `lookup` after version 2: a rerun from there reuses it; `ask` would wait again
    expected = {
        "would_run": [{"tool": "ask", "arguments": {"x": 2}, "disposition": "defer"}],
        "reused": [{"tool": "lookup", "arguments": {"x": 1}, "disposition": "runSync"}],
    }
    assert plan == printed == expected
