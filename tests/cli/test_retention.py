"""Old sessions go away: `session delete` removes every key of a session and its entries in every
shared index, `session purge` deletes finished sessions by age, and a worker with
AGENTS_RETENTION_DAYS does it by itself; `doctor` shows memory per session and sessions by state."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.cli.probe import write_probe_agent
from tests.cli.process import agents, check_error, cli_env, ok, poll, snapshot
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.usefixtures("cli_worker")


def every_tool_then_answer(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text("done")
    return calls(("probe_sync", {"x": "1"}), ("probe_async", {"x": "2"}), ("approve", {"x": "3"}))


@pytest.fixture(scope="module")
def probe(llm_server: LlmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    scenario = llm_server.scenario([every_tool_then_answer])
    agent, _ = write_probe_agent(tmp_path_factory.mktemp("retention"), scenario, llm_server.url)
    return agent


def finished_session(agent: Path, env: dict[str, str]) -> str:
    """A session that ran a runSync, a runAsync and a deferred call (tokens, call keys) and completed."""
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "go", "--run", "--json", env=env))
    token = view["pending"][0]["token"]
    ok(agents("session", "complete", token, "-", "--json", stdin='{"ok": true}', env=env))
    sid = str(view["session_id"])
    poll(lambda: ok(agents("session", "show", sid, "--json", env=env))["state"] == "completed", "completion")
    return sid


def traces(client: redis.Redis, prefix: str, sid: str) -> list[str]:
    """Every key of the prefix that is the session's or whose value still names it — but the
    replies kept for retried writes (`:req:`), which expire by themselves within minutes."""
    found = []
    for key, (_, value) in snapshot(client, prefix).items():
        if ":req:" in key:
            assert 0 < client.ttl(key) <= 600, key
            continue
        if sid in key or sid in repr(value):
            found.append(key)
    return found


def test_delete_removes_every_key_and_index_entry_of_a_session(
    probe: Path, qenv: dict[str, str], cli_redis: redis.Redis, cli_prefix: str
) -> None:
    sid = finished_session(probe, qenv)
    kept = finished_session(probe, qenv)
    assert len(traces(cli_redis, cli_prefix, sid)) > 5
    run = agents("session", "delete", sid[:10], env=qenv)
    assert run.returncode == 0 and run.stdout == f"deleted {sid}\n", str(run)
    assert traces(cli_redis, cli_prefix, sid) == []
    assert ok(agents("session", "show", kept, "--json", env=qenv))["state"] == "completed"
    check_error(agents("session", "show", sid, "--json", env=qenv), "unknown_session")


def test_an_active_session_is_deleted_only_with_force(
    probe: Path, qenv: dict[str, str], cli_redis: redis.Redis, cli_prefix: str
) -> None:
    view = ok(agents("session", "start", "--agent-file", probe, "-p", "go", "--run", "--json", env=qenv))
    sid = view["session_id"]
    assert view["state"] == "waiting"
    err = check_error(agents("session", "delete", sid, "--json", env=qenv), "session_not_advanceable")
    assert "cancel it first" in err["message"]
    assert ok(agents("session", "delete", sid, "--force", "--json", env=qenv)) == {"deleted": [sid]}
    assert traces(cli_redis, cli_prefix, sid) == []


def test_a_delete_of_several_that_refuses_one_deletes_none(probe: Path, qenv: dict[str, str]) -> None:
    """A finished session named before an active one (or an unknown id) is not deleted when the
    command is refused: a refused command changes nothing."""
    done = finished_session(probe, qenv)
    active = ok(agents("session", "start", "--agent-file", probe, "-p", "go", "--run", "--json", env=qenv))
    err = check_error(
        agents("session", "delete", done, active["session_id"], "--json", env=qenv), "session_not_advanceable"
    )
    assert "nothing was deleted" in err["message"]
    check_error(agents("session", "delete", done, "f" * 32, "--json", env=qenv), "unknown_session")
    assert ok(agents("session", "show", done, "--json", env=qenv))["state"] == "completed"
    both = ok(agents("session", "delete", done, active["session_id"], "--force", "--json", env=qenv))
    assert both == {"deleted": [done, active["session_id"]]}


def test_purge_deletes_finished_sessions_older_than_the_age_given(
    probe: Path, qenv: dict[str, str], cli_redis: redis.Redis, cli_prefix: str
) -> None:
    bad = check_error(agents("session", "purge", "--older-than", "soon", "--json", env=qenv), "invalid_input")
    assert "30d" in bad["message"]
    old = finished_session(probe, qenv)
    waiting = ok(agents("session", "start", "--agent-file", probe, "-p", "go", "--run", "--json", env=qenv))
    updated = float(cli_redis.zscore(f"{cli_prefix}:state:completed", old) or 0) / 1000
    # The age is wide enough for a slow machine: the young session must still be younger when
    # purge runs (each `agents` process here takes seconds).
    poll(lambda: cli_redis.time()[0] > updated + 20, "Redis's clock to pass the age", timeout=60)
    young = finished_session(probe, qenv)
    purged = ok(agents("session", "purge", "--older-than", "20s", "--json", env=qenv))["deleted"]
    assert old in purged and young not in purged and waiting["session_id"] not in purged
    assert traces(cli_redis, cli_prefix, old) == []
    assert ok(agents("session", "show", young, "--json", env=qenv))["state"] == "completed"
    assert ok(agents("session", "show", waiting["session_id"], "--json", env=qenv))["state"] == "waiting"


def test_a_worker_with_a_retention_deletes_old_finished_sessions_by_itself(
    probe: Path, redis_url: str, tmp_path: Path
) -> None:
    prefix = f"ret{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # 0.00012 days: 10.4 s, time enough to see the sessions first.
    worker = Worker(worker_env(redis_url, prefix, AGENTS_RETENTION_DAYS="0.00012"), log=tmp_path / "w.log").start()
    try:
        worker.wait_ready(client, prefix)
        env = cli_env(redis_url, prefix)
        waiting = ok(agents("session", "start", "--agent-file", probe, "-p", "go", "--run", "--json", env=env))
        # Doctor first, on the waiting session only: the finished one may be gone within 10.4 s,
        # which a busy machine can spend on one command.
        report = ok(agents("doctor", "--json", env=env))
        assert report["memory_per_session_bytes"] > 0 and report["retention_days"] == 0.00012
        assert report["sessions"]["waiting"] == 1
        sid = finished_session(probe, env)
        poll(lambda: not client.exists(f"{prefix}:s:{{{sid}}}:meta"), "the worker to delete it", timeout=60)
        assert traces(client, prefix, sid) == []
        assert ok(agents("session", "show", waiting["session_id"], "--json", env=env))["state"] == "waiting"
    finally:
        worker.kill()
        client.close()
