"""Every error code of the contract, provoked through a real `agents` process: the exit code,
the JSON error document, and Redis left exactly as it was (a snapshot of the prefix's keys and
values before and after)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents.store.codec import packed_entries
from tests.cli.probe import write_probe_agent
from tests.cli.process import agents, check_error, check_view, cli_env, ok, poll, snapshot
from tests.support.llm_server import LlmServer, Reply, calls, error, text
from tests.support.queues import depth
from tests.support.redis_server import free_port

pytestmark = pytest.mark.usefixtures("cli_worker")


@pytest.fixture(scope="module")
def probe(llm_server: LlmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An agent whose model asks for one deferred call, then answers (in every session)."""
    scenario = llm_server.scenario([approve_then_answer])
    agent, _ = write_probe_agent(tmp_path_factory.mktemp("errors"), scenario, llm_server.url)
    return agent


def approve_then_answer(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text("thanks")
    return calls(("approve", {"x": "1"}))


class Unchanged:
    """Asserts that the commands run inside change nothing under the prefix, but for the one
    thing the contract asks of a refused completion: a `token_rejected` event in the session's log
    (their reasons are collected in `rejections`)."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self.rejections: list[str] = []

    def __enter__(self) -> Unchanged:
        self.before = self._snapshot()
        return self

    def _snapshot(self) -> dict[str, Any]:
        """Under the prefix, a waiting session's packed events read as the stream they stand for
        (its next event, a rejection, brings the stream back)."""
        keys = snapshot(self.client, self.prefix)
        for key in [k for k in keys if k.endswith(":packed")]:
            _, value = keys.pop(key)
            keys[key.removesuffix(":packed") + ":events"] = ("stream", packed_entries(value))
        return keys

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            return
        after = self._snapshot()
        for key, (kind, entries) in after.items():
            if kind != "stream" or not key.endswith(":events") or key not in self.before:
                continue
            old = self.before[key][1]
            new = entries[len(old) :]
            rejected = [json.loads(fields["data"])["reason"] for _, fields in new if fields["type"] == "token_rejected"]
            if entries[: len(old)] == old and len(rejected) == len(new):
                self.rejections += rejected
                after[key] = (kind, old)
        # A worker starting meanwhile makes the completions stream for its consumer group (empty):
        # not a change a command made.
        stream = f"{self.prefix}:completions"
        if after.get(stream) == ("stream", []) and stream not in self.before:
            del after[stream]
        changed = {
            k: (self.before.get(k), after.get(k))
            for k in set(self.before) | set(after)
            if self.before.get(k) != after.get(k)
        }
        assert not changed, f"a refused command changed Redis: {changed}"


@pytest.fixture
def unchanged(cli_redis: redis.Redis, cli_prefix: str) -> Iterator[Unchanged]:
    yield Unchanged(cli_redis, cli_prefix)


def waiting_session(agent: Path, env: dict[str, str]) -> tuple[str, str]:
    """A session driven (by the worker) up to its deferred call; (session id, token)."""
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "please approve", "--run", "--json", env=env))
    assert view["state"] == "waiting", view
    (p,) = view["pending"]
    return view["session_id"], p["token"]


def finished(sid: str, env: dict[str, str]) -> None:
    """Wait for the worker to take a woken session to its answer."""
    poll(
        lambda: ok(agents("session", "show", sid, "--json", env=env))["state"] == "completed",
        f"session {sid} to complete",
        every=0.1,
    )


def result_file(folder: Path, body: str = '"yes"') -> Path:
    path = folder / "result.txt"
    path.write_text(body)
    return path


def test_invalid_agent_file(qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    tool = {"name": "t", "description": "", "external": True}
    bad = {
        "bad-json.json": '{"slug": "x", "model": ',
        "bad-tag.json": json.dumps(
            {
                "slug": "x",
                "model": "demo/x",
                "tools": [tool],
                "toolCallPolicy": {"rules": [{"tool": "t", "disposition": "runLater"}]},
            }
        ),
        "bad-rule.json": json.dumps(
            {
                "slug": "x",
                "model": "demo/x",
                "tools": [tool],
                "toolCallPolicy": {"rules": [{"tool": "nope", "disposition": "defer"}]},
            }
        ),
        "no-model.json": json.dumps({"slug": "x", "tools": [tool]}),
    }
    fields = {"bad-json.json": "JSON", "bad-tag.json": "disposition", "bad-rule.json": "nope", "no-model.json": "model"}
    with unchanged:
        for name, body in bad.items():
            path = tmp_path / name
            path.write_text(body)
            for command in (("session", "start"), ("run",)):
                run = agents(*command, "--agent-file", path, "-p", "hi", "--json", env=qenv)
                error = check_error(run, "invalid_agent_file")
                assert name in error["message"] and fields[name] in error["message"], str(run)
        missing = agents("session", "start", "--agent-file", tmp_path / "absent.json", "-p", "hi", "--json", env=qenv)
        check_error(missing, "invalid_agent_file")


def test_invalid_result(probe: Path, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    _, token = waiting_session(probe, qenv)
    with unchanged:
        for body in ("", "  \n\t\n"):
            run = agents("session", "complete", token, result_file(tmp_path, body), "--json", env=qenv)
            check_error(run, "invalid_result")
        run = agents("session", "complete", token, "-", "--json", env=qenv, stdin="")
        check_error(run, "invalid_result")
        run = agents("session", "complete", token, tmp_path / "absent.json", "--json", env=qenv)
        check_error(run, "invalid_result")


def test_unknown_session(qenv: dict[str, str], unchanged: Unchanged) -> None:
    ghost = "0123456789abcdef0123456789abcdef"
    with unchanged:
        for command in ("show", "step", "resume", "cancel", "pending", "logs"):
            check_error(agents("session", command, ghost, "--json", env=qenv), "unknown_session")
        check_error(agents("session", "show", "not a session id!", "--json", env=qenv), "unknown_session")


def test_unknown_token(probe: Path, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    sid, token = waiting_session(probe, qenv)
    result = result_file(tmp_path)
    forged = f"{sid}.{'A' * 24}"
    with unchanged:
        for bad in (forged, "0123456789abcdef0123456789abcdef.AAAAAAAAAAAAAAAAAAAAAAAA", "garbage"):
            check_error(agents("session", "complete", bad, result, "--json", env=qenv), "unknown_token")
    assert unchanged.rejections == ["unknown"]  # only the forged token names a session that exists
    assert ok(agents("session", "pending", sid, "--json", env=qenv))["pending"][0]["token"] == token


def test_token_already_completed(probe: Path, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    sid, token = waiting_session(probe, qenv)
    result = result_file(tmp_path)
    assert ok(agents("session", "complete", token, result, "--json", env=qenv))["woken"] is True
    finished(sid, qenv)
    with unchanged:
        check_error(agents("session", "complete", token, result, "--json", env=qenv), "token_already_completed")
        check_error(
            agents("session", "complete", token, result, "--error", "--json", env=qenv), "token_already_completed"
        )
    assert unchanged.rejections == ["completed", "completed"]


def test_token_expired(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("nobody answered")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url, defer_timeout=0.3)
    sid, token = waiting_session(agent, qenv)

    def settled() -> bool:
        # The worker's sweeper expires the call, wakes the session, and the model answers.
        view = ok(agents("session", "show", sid, "--json", env=qenv))
        return view["state"] == "completed" and view["response"] == "nobody answered"

    poll(settled, "the deadline to pass and the session to finish without the result", timeout=20, every=0.2)
    with unchanged:
        check_error(agents("session", "complete", token, result_file(tmp_path), "--json", env=qenv), "token_expired")
    assert unchanged.rejections == ["expired"]


def test_token_cancelled(probe: Path, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    sid, token = waiting_session(probe, qenv)
    assert ok(agents("session", "cancel", sid, "--json", env=qenv))["state"] == "cancelled"
    with unchanged:
        check_error(agents("session", "complete", token, result_file(tmp_path), "--json", env=qenv), "token_cancelled")
    assert unchanged.rejections == ["cancelled"]


def test_session_not_advanceable(probe: Path, qenv: dict[str, str], tmp_path: Path, unchanged: Unchanged) -> None:
    cancelled, _ = waiting_session(probe, qenv)
    ok(agents("session", "cancel", cancelled, "--json", env=qenv))
    completed, token = waiting_session(probe, qenv)
    assert ok(agents("session", "complete", token, result_file(tmp_path), "--json", env=qenv))["woken"] is True
    finished(completed, qenv)
    with unchanged:
        for command in ("step", "resume", "pause", "cancel"):
            check_error(agents("session", command, cancelled, "--json", env=qenv), "session_not_advanceable")
        check_error(agents("session", "step", completed, "--json", env=qenv), "session_not_advanceable")
        check_error(agents("session", "step", completed, "--inline", "--json", env=qenv), "session_not_advanceable")
        # Nothing is left to drive: resume is the completed session's view, and changes nothing.
        assert ok(agents("session", "resume", completed, "--json", env=qenv))["state"] == "completed"


def test_a_session_that_fails_exits_5_with_its_view(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    """The model refuses the key: not a success for a script, and the view says why and what next."""
    scenario = llm_server.scenario([error(401, "invalid api key"), text("fixed")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    run = agents("run", "--agent-file", agent, "-p", "hi", "--json", env=qenv)
    assert run.returncode == 5, str(run)
    view = check_view(run.doc)
    assert view["state"] == "failed" and view["error"]["code"] == "auth_error"
    assert "invalid api key" in view["error"]["message"]
    retried = agents("session", "step", view["session_id"], "--json", env=qenv)  # the cause is gone
    assert check_view(ok(retried))["state"] == "completed"
    assert ok(agents("session", "show", view["session_id"], "--json", env=qenv))["response"] == "fixed"


def test_redis_unavailable(probe: Path, tmp_path: Path) -> None:
    env = cli_env(f"redis://127.0.0.1:{free_port()}/0", "nowhere")
    for args in (
        ("session", "pending"),
        ("session", "start", "--agent-file", str(probe), "-p", "hi"),
        ("session", "complete", f"{'0' * 32}.{'A' * 24}", str(result_file(tmp_path))),
    ):
        check_error(agents(*args, "--json", env=env), "redis_unavailable")
    human = agents("doctor", env=env)
    assert human.returncode == 1 and human.stdout == "" and "Redis" in human.stderr, str(human)
    assert "Traceback" not in human.stderr, str(human)


def test_wait_timeout(redis_url: str, cli_redis: redis.Redis, probe: Path) -> None:
    """Queue mode with no worker: the wait gives up after --timeout, the step stays queued."""
    prefix = "noworker" + probe.parent.name[-6:]
    env = cli_env(redis_url, prefix)
    sid = ok(agents("session", "start", "--agent-file", probe, "-p", "hi", "--json", env=env))["session_id"]
    before = snapshot(cli_redis, prefix)
    run = agents("session", "step", sid, "--timeout", "0.5", "--json", env=env)
    error = check_error(run, "wait_timeout")
    assert sid in error["message"]
    assert run.seconds < 10
    after = snapshot(cli_redis, prefix)
    # The session itself is untouched; its step is owed (the outbox) and waits in the queue.
    meta = f"{prefix}:s:{{{sid}}}:meta"
    assert after[meta][1].pop("owed_version") == "1"
    # The command followed the session's events while it waited: its model call would stream.
    assert int(after[meta][1].pop("watch_until")) > 0
    assert [m for m, _ in after.pop(f"{prefix}:owed")[1]] == [sid]
    assert after == before
    assert depth(cli_redis, f"{prefix}:celery:") == 1
    run = agents("run", "--agent-file", probe, "-p", "hi", "--timeout", "0.5", "--json", env=env)
    check_error(run, "wait_timeout")


def test_a_timeout_inline_says_that_this_process_runs_the_steps_to_their_end(tmp_path: Path) -> None:
    """--timeout bounds the wait for workers; inline nothing else would run the steps, so it is not
    applied, and the command says so instead of ignoring it silently."""
    env = cli_env(None, "agents", home=tmp_path / "home")
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo-agent.json"
    run = agents("session", "start", "--agent-file", demo, "-p", "hi", "--run", "--timeout", "5", "--json", env=env)
    assert ok(run)["state"] in ("completed", "waiting")
    assert "--timeout bounds the wait for workers; here this process runs the steps" in run.stderr
    joined = agents("session", "start", "--agent-file", demo, "-p", "hi", "--run", "--timeout=5", "--json", env=env)
    assert "--timeout bounds the wait for workers" in joined.stderr, joined.stderr
    quiet = agents("session", "start", "--agent-file", demo, "-p", "hi", "--run", "--json", env=env)
    assert "--timeout" not in quiet.stderr


def test_a_worker_that_cannot_start_says_why_and_where(qenv: dict[str, str], tmp_path: Path) -> None:
    """An unreachable Redis is named with its URL and prefix, as every other command names it; a
    metrics port another process holds is said plainly, exit 2, not a traceback."""
    import socket

    port = free_port()
    away = cli_env(f"redis://127.0.0.1:{port}/0", "nowhere", home=tmp_path / "h1")
    run = agents("worker", "--queues", "tools", env=away, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert f"tried redis://127.0.0.1:{port}/0 (prefix nowhere)" in run.stderr, run.stderr[-2000:]
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    held = taken.getsockname()[1]
    try:
        run = agents("worker", "--queues", "tools", "--metrics-port", str(held), env=qenv, timeout=120)
    finally:
        taken.close()
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"--metrics-port {held}: cannot listen on 127.0.0.1:{held}" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
