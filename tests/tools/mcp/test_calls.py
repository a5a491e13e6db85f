"""Calling MCP tools through `ToolRunner` against real servers: results (structured, text, images,
errors), the idempotency key in `_meta`, servers kept per process and restarted when they die, a
hung server cut off at the call's timeout, Streamable HTTP with headers from the environment, the
third-party `mcp-server-time`, and a runIsolated call whose server starts inside the sandbox."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest

from celery_agents.model import AgentSpec
from celery_agents.tools import ToolRunner
from celery_agents.tools.mcp import pool as pool_module
from tests.support.workers import pid_alive
from tests.tools.mcp.conftest import TIME_SERVER, mcp_agent, mcp_call, sample_stdio


@pytest.fixture(scope="module")
def agent() -> AgentSpec:
    return mcp_agent(
        [sample_stdio(env={"MARKER": "from-the-agent-file"})],
        rules=[{"tool": "mcp__sample__sleep", "disposition": {"tag": "runSync", "timeoutSeconds": 2}}],
        executionMode="asynchronous",
    )


def run(agent: AgentSpec, tool: str, arguments: dict[str, Any], session: str = "s1", **kw: Any) -> Any:
    return ToolRunner(**kw).run(agent, session, mcp_call(tool, arguments))


def test_results_map_onto_tool_results(agent: AgentSpec) -> None:
    added = run(agent, "mcp__sample__add", {"a": 2, "b": 40})
    assert (added.state, added.result) == ("completed", {"result": 42}), "the structured result, as JSON"
    image = run(agent, "mcp__sample__image", {})
    assert image.state == "completed" and [m.mime_type for m in image.media] == ["image/png"]
    assert image.result.startswith("attached: image/png"), "the model sees the image as media, not base64 text"


def test_a_tool_error_is_a_failed_call_whose_text_the_model_sees(agent: AgentSpec) -> None:
    out = run(agent, "mcp__sample__fail", {"why": "no disk"})
    assert out.state == "failed" and (out.error or "").endswith("failed on purpose: no disk")


def test_the_idempotency_key_travels_in_the_calls_meta(agent: AgentSpec) -> None:
    out = run(agent, "mcp__sample__whoami", {}, session="sess-9")
    assert out.state == "completed", out.error
    meta = out.result["meta"]
    assert meta["celery-agents/idempotencyKey"] == mcp_call("x", {}).idempotency_key("sess-9")
    assert (meta["celery-agents/sessionId"], meta["celery-agents/callId"]) == ("sess-9", "call_1")
    assert out.result["marker"] == "from-the-agent-file", "the server got the env of its entry"
    assert "AGENTS_REDIS_URL" not in out.result["env"] and "OPENAI_API_KEY" not in out.result["env"]


def test_a_server_is_reused_across_calls_and_sessions_and_restarted_when_it_died(agent: AgentSpec) -> None:
    first = run(agent, "mcp__sample__whoami", {}, session="a").result["pid"]
    assert run(agent, "mcp__sample__whoami", {}, session="b").result["pid"] == first, "one server per process"
    assert first != os.getpid() and pid_alive(first)
    time.sleep(pool_module._IDLE_PING + 0.1)  # idle long enough to be checked before its next use
    assert run(agent, "mcp__sample__whoami", {}, session="b").result["pid"] == first, "an idle server is kept"
    os.kill(first, signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + 10
    while pid_alive(first) and time.monotonic() < deadline:
        time.sleep(0.02)
    # Between calls: the connection has been idle at least as long as the pool waits before it
    # checks one (the death may not have been noticed from the server's output yet).
    time.sleep(max(0.0, pool_module._IDLE_PING - (time.monotonic() - killed_at)))
    again = run(agent, "mcp__sample__whoami", {}, session="c")
    assert again.state == "completed", again.error
    assert again.result["pid"] != first, "a fresh server answered"


def test_a_call_that_hangs_is_cut_off_at_its_timeout_and_the_next_call_works(agent: AgentSpec) -> None:
    before = run(agent, "mcp__sample__whoami", {}).result["pid"]
    started = time.monotonic()
    out = run(agent, "mcp__sample__sleep", {"seconds": 60})
    took = time.monotonic() - started
    assert out.state == "failed" and out.meta.timed_out and "did not answer within 2 s" in (out.error or "")
    assert took < 10, f"cut off at the timeout, not after the tool's 60 s ({took:.1f} s)"
    after = run(agent, "mcp__sample__whoami", {})
    assert after.state == "completed" and after.result["pid"] != before, "the hung server was replaced"
    deadline = time.monotonic() + 15
    while pid_alive(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(before), "the hung server was stopped"


def test_a_server_that_never_answers_is_cut_off_at_the_timeout() -> None:
    listed = mcp_agent([sample_stdio()]).model_dump(mode="json", by_alias=True, exclude_none=True)
    listed["mcpServers"] = [{"name": "sample", "command": [sys.executable, "-c", "import time; time.sleep(600)"]}]
    listed["toolCallPolicy"] = {
        "rules": [{"tool": "mcp__sample__add", "disposition": {"tag": "runSync", "timeoutSeconds": 2}}]
    }
    mute = AgentSpec.model_validate(listed)  # as a worker reads it: no listing
    started = time.monotonic()
    out = run(mute, "mcp__sample__add", {"a": 1, "b": 2})
    assert out.state == "failed" and out.meta.timed_out, out.error
    assert "did not start within 2 s" in (out.error or "") and time.monotonic() - started < 10


def test_the_third_party_time_server_over_stdio() -> None:
    agent = mcp_agent([{"name": "time", "command": TIME_SERVER}])
    out = run(agent, "mcp__time__get_current_time", {"timezone": "Europe/Paris"})
    assert out.state == "completed", out.error
    assert out.result["timezone"] == "Europe/Paris" and out.result["datetime"].startswith("20")
    bad = run(agent, "mcp__time__get_current_time", {"timezone": "Mars/Olympus"})
    assert bad.state == "failed" and "Mars/Olympus" in (bad.error or "")


def test_a_streamable_http_server_gets_its_headers_from_the_environment(
    http_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAMPLE_TOKEN", "Bearer t0ken")
    agent = mcp_agent([{"name": "web", "url": http_server, "headersEnv": {"Authorization": "SAMPLE_TOKEN"}}])
    assert "t0ken" not in agent.to_json(), "the header's value is never stored, only its variable's name"
    out = run(agent, "mcp__web__whoami", {})
    assert out.state == "completed", out.error
    assert out.result["authorization"] == "Bearer t0ken"
    assert out.result["meta"]["celery-agents/callId"] == "call_1"
    image = run(agent, "mcp__web__image", {})
    assert [m.mime_type for m in image.media] == ["image/png"]
    monkeypatch.delenv("SAMPLE_TOKEN")
    missing = run(agent, "mcp__web__whoami", {})
    assert missing.state == "failed" and "SAMPLE_TOKEN" in (missing.error or "")


def test_an_isolated_call_starts_the_server_inside_the_sandbox_for_that_call(agent: AgentSpec) -> None:
    mine = run(agent, "mcp__sample__whoami", {}).result["pid"]
    out = run(agent, "mcp__sample__whoami", {}, session="iso", isolated=True)
    assert out.state == "completed", out.error
    assert out.meta.isolation in ("bwrap", "rlimits")
    assert out.result["pid"] != mine and out.result["ppid"] != os.getpid(), "not this process's server"
    assert out.result["meta"]["celery-agents/sessionId"] == "iso"
    assert any(k.startswith("HOME") for k in out.result["env"])
    image = run(agent, "mcp__sample__image", {}, isolated=True)
    assert [m.mime_type for m in image.media] == ["image/png"]


def test_an_isolated_call_of_an_http_server_needs_the_network_its_entry_allows(
    http_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_agents.tools import Sandbox, SandboxConfig

    if Sandbox(SandboxConfig()).bwrap() is None:
        pytest.skip("only bubblewrap cuts the network here")
    monkeypatch.setenv("SAMPLE_TOKEN", "Bearer t0ken")
    entry = {"name": "web", "url": http_server, "headersEnv": {"Authorization": "SAMPLE_TOKEN"}}
    cut = run(mcp_agent([entry]), "mcp__web__add", {"a": 1, "b": 2}, isolated=True)
    assert cut.state == "failed" and '"network": true' in (cut.error or "")
    allowed = run(mcp_agent([{**entry, "network": True}]), "mcp__web__whoami", {}, isolated=True)
    assert allowed.state == "completed", allowed.error
    assert allowed.result["authorization"] == "Bearer t0ken"
    rule = {"tool": "mcp__web__*", "disposition": {"tag": "runIsolated", "network": True}}
    by_rule = run(
        mcp_agent([entry], rules=[rule], executionMode="asynchronous"), "mcp__web__add", {"a": 1, "b": 2}, isolated=True
    )
    assert (by_rule.state, by_rule.result) == ("completed", {"result": 3}), "a rule's network: true opens it too"


def test_pass_env_gives_a_stdio_server_a_secret_that_is_never_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAMPLE_SECRET", "s3cret-value")
    monkeypatch.setenv("OTHER_SECRET", "not-for-the-server")
    agent = mcp_agent([sample_stdio(name="keyed", passEnv=["SAMPLE_SECRET"])])
    assert "s3cret-value" not in agent.to_json()
    for isolated in (False, True):
        out = run(agent, "mcp__keyed__whoami", {}, isolated=isolated)
        assert out.state == "completed", out.error
        assert "SAMPLE_SECRET" in out.result["env"] and "OTHER_SECRET" not in out.result["env"], isolated


def test_a_call_stops_when_its_session_is_cancelled() -> None:
    import threading

    from celery_agents.tools.cancel import cancellable

    long = mcp_agent([sample_stdio()])  # no timeout rule: the default 300 s
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    started = time.monotonic()
    with cancellable(stop):
        out = run(long, "mcp__sample__sleep", {"seconds": 60})
    assert out.state == "failed" and "cancelled" in (out.error or "")
    assert time.monotonic() - started < 10


def test_calls_from_many_threads_share_one_server_and_a_timeout_spares_the_others(agent: AgentSpec) -> None:
    from concurrent.futures import ThreadPoolExecutor

    patient = mcp_agent(
        [sample_stdio(env={"MARKER": "from-the-agent-file"})],  # the same server as `agent`'s
        rules=[{"tool": "mcp__sample__sleep", "disposition": {"tag": "runSync", "timeoutSeconds": 60}}],
        executionMode="asynchronous",
    )
    with ThreadPoolExecutor(8) as threads:
        pids = set(
            threads.map(lambda i: run(agent, "mcp__sample__whoami", {}, session=f"t{i}").result["pid"], range(8))
        )
    assert len(pids) == 1, "one server for every thread of the process"
    with ThreadPoolExecutor(2) as threads:
        hung = threads.submit(run, agent, "mcp__sample__sleep", {"seconds": 60})  # cut off at 2 s
        time.sleep(0.5)
        slow = threads.submit(run, patient, "mcp__sample__sleep", {"seconds": 4})
        assert hung.result().meta.timed_out
        done = slow.result()
    assert (done.state, done.result) == ("completed", {"result": "slept 4 s"}), "the other call finished first"
    (pid,) = pids
    deadline = time.monotonic() + 15
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), "then the retired server was stopped"


def test_a_server_that_dies_during_a_call_fails_it_with_its_last_words_and_is_restarted(agent: AgentSpec) -> None:
    out = run(agent, "mcp__sample__crash", {})
    assert out.state == "failed" and "exited during the call" in (out.error or "")
    assert "crashing on purpose" in (out.error or ""), "the model sees what the server said"
    assert run(agent, "mcp__sample__add", {"a": 1, "b": 1}).result == {"result": 2}


def test_an_http_server_that_went_away_fails_the_call_and_is_reached_again_when_back() -> None:
    import socket
    import subprocess

    from tests.tools.mcp.conftest import SAMPLE, free_port

    port = free_port()

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, str(SAMPLE), "http", str(port)], stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                return proc
            except OSError:
                time.sleep(0.05)
        proc.kill()
        raise RuntimeError("the HTTP sample server did not start")

    server = start()
    try:
        agent = mcp_agent([{"name": "web", "url": f"http://127.0.0.1:{port}/mcp"}])
        first = run(agent, "mcp__web__whoami", {}).result["pid"]
        server.kill()
        server.wait()
        down = run(agent, "mcp__web__whoami", {})
        assert down.state == "failed" and "'web'" in (down.error or "")
        server = start()
        back = run(agent, "mcp__web__whoami", {})
        assert back.state == "completed" and back.result["pid"] not in (first, None), back.error
    finally:
        server.kill()
        server.wait()


def test_a_forked_child_starts_its_own_server_and_leaves_the_parents_alone(agent: AgentSpec) -> None:
    parent_server = run(agent, "mcp__sample__whoami", {}).result["pid"]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: a prefork pool process would be here
        try:
            out = run(agent, "mcp__sample__whoami", {})
            os.write(write, str(out.result["pid"] if out.state == "completed" else out.error).encode())
        finally:
            os._exit(0)
    os.close(write)
    answer = os.read(read, 4096).decode()
    os.waitpid(child, 0)
    assert answer.isdigit() and int(answer) != parent_server, answer
    assert pid_alive(parent_server) and run(agent, "mcp__sample__whoami", {}).result["pid"] == parent_server
