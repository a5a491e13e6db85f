"""The trust boundaries of a CLI that runs steps and calls itself (`--inline`, no worker on its
prefix): its environment holds `AGENTS_SPEC_KEY` and a provider key, and neither reaches a command
or a python tool it runs; a call record forged in Redis runs nothing through the inline driver nor
through `agents session run-isolated`."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents.model import CallState, TrackedCall
from celery_agents.store.counters import read_counters
from celery_agents.store.keys import Keys
from tests.cli.process import agents, check_view, cli_env, ok
from tests.support.llm_server import LlmServer, calls, text
from tests.support.tool_env import ENVTOOL

pytestmark = pytest.mark.slow

SPEC_KEY = "spec-key-inline-trust-0123456789abcdef"
SECRET = "sk-inline-provider-secret"

DUMP = """
import json, os
print(json.dumps({"env": dict(os.environ)}))
"""

ACT = """
import json, sys
exec(json.load(sys.stdin)["code"])
"""

CODE = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}


@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    """A CLI on a prefix no worker serves, holding the spec key and a provider key."""
    return cli_env(
        redis_url,
        f"inl{uuid.uuid4().hex[:8]}",
        tmp_path / "home",
        AGENTS_SPEC_KEY=SPEC_KEY,
        OPENAI_API_KEY=SECRET,
        AGENTS_SANDBOX_BWRAP="off",
    )


def write_agent(folder: Path, body: dict[str, Any]) -> Path:
    (folder / "envtool.py").write_text(ENVTOOL)
    (folder / "dump.py").write_text(DUMP)
    (folder / "act.py").write_text(ACT)
    path = folder / f"agent-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(body))
    return path


def test_tools_run_inline_see_neither_the_spec_key_nor_a_provider_key(
    env: dict[str, str], llm_server: LlmServer, tmp_path: Path
) -> None:
    names = ("cmd_sync", "cmd_async", "py_sync", "py_async")
    scenario = llm_server.scenario([calls(*[(n, {}) for n in names]), text("done")])
    dump = {"command": ["{python}", "dump.py"]}
    agent = write_agent(
        tmp_path,
        {
            "slug": "inline-env",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "apiKeyEnv": "OPENAI_API_KEY",
            "tools": [
                {"name": "cmd_sync", **dump},
                {"name": "cmd_async", **dump},
                {"name": "py_sync", "python": "envtool:dump"},
                {"name": "py_async", "python": "envtool:dump"},
            ],
            "toolCallPolicy": {
                "default": "runSync",
                "rules": [{"tool": t, "disposition": "runAsync"} for t in ("cmd_async", "py_async")],
            },
        },
    )
    view = check_view(ok(agents("run", "--agent-file", agent, "-p", "go", "--inline", "--json", env=env)))
    assert (view["state"], view["response"]) == ("completed", "done"), view
    shown = ok(agents("session", "show", view["session_id"], "--json", env=env))
    seen = {c["tool"]: c for c in shown["calls"]}
    assert sorted(seen) == sorted(names)
    for name, call in seen.items():
        assert call["state"] == "completed", call
        for where in ("env", "child"):
            got = call["result"].get(where, {})
            assert "AGENTS_SPEC_KEY" not in got and "OPENAI_API_KEY" not in got, f"{name} ({where}): {sorted(got)}"
        assert SPEC_KEY not in json.dumps(call["result"]) and SECRET not in json.dumps(call["result"]), name


def forge(client: redis.Redis, keys: Keys, sid: str, position: int, tool: str, disposition: str, marker: Path) -> None:
    """A dispatched call of the session's tool `tool`, written into Redis by a writer without the
    spec key: its record says `disposition`, its code is the writer's."""
    code = f"open({str(marker)!r}, 'w').write('ran')"
    call = TrackedCall(
        call_id=f"forged_{position}",
        tool=tool,
        arguments={"code": code},
        raw_arguments=json.dumps({"code": code}),
        batch=1,
        position=position,
        disposition=disposition,  # type: ignore[arg-type]
        state=CallState.RUNNING,
        created_at=time.time(),
    )
    client.hset(keys.calls(sid), call.field, call.model_dump_json())
    client.hset(keys.pending(sid), call.field, "")


def test_forged_calls_run_nothing_through_run_isolated_nor_the_inline_driver(
    env: dict[str, str], llm_server: LlmServer, tmp_path: Path, redis_url: str
) -> None:
    scenario = llm_server.scenario([calls(("ask", {"code": "pass"}), ("gate", {"code": "pass"})), text("done")])
    act = {"command": ["{python}", "act.py"], "parameters": CODE}
    agent = write_agent(
        tmp_path,
        {
            "slug": "inline-forgeable",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "apiKeyEnv": "OPENAI_API_KEY",
            "tools": [{"name": n, **act} for n in ("run_code", "plain", "ask", "gate")],
            "toolCallPolicy": {
                "default": "runSync",
                "rules": [
                    {"tool": "run_code", "disposition": "runIsolated"},
                    {"tool": "ask", "disposition": {"tag": "defer", "reason": "a person answers"}},
                    {"tool": "gate", "disposition": {"tag": "defer", "then": "runAsync", "reason": "approve"}},
                ],
            },
        },
    )
    view = ok(agents("run", "--agent-file", agent, "-p", "go", "--inline", "--json", env=env))
    sid = view["session_id"]
    assert [p["tool"] for p in view["pending"]] == ["ask", "gate"], view
    keys, drop = Keys(env["AGENTS_PREFIX"]), tmp_path / "ran"
    drop.mkdir()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        # For run-isolated: a deferred call and an inline one recorded as isolated calls.
        forge(client, keys, sid, 7, "ask", "runIsolated", drop / "ask-isolated")
        forge(client, keys, sid, 8, "plain", "runIsolated", drop / "plain-isolated")
        ok(agents("session", "run-isolated", sid, "--json", env=env))
        # For the inline driver (it runs the dispatched calls it finds before it steps): the
        # isolated tool recorded runAsync, and the gate marked approved by its results entry.
        forge(client, keys, sid, 9, "run_code", "runAsync", drop / "isolated-outside")
        [gate] = [p for p in view["pending"] if p["tool"] == "gate"]
        field = client.hget(keys.token(sid, gate["token"].split(".", 1)[1]), "field") or ""
        code = f"open({str(drop / 'gate')!r}, 'w')"
        running = {"state": "running", "decision": "approved", "arguments": {"code": code}}
        client.hset(keys.results(sid), field, json.dumps(running))
        resumed = ok(agents("session", "resume", sid, "--inline", "--json", env=env))
        events = client.xrange(keys.events(sid))
        refused = [json.loads(e["data"])["call_id"] for _, e in events if e.get("type") == "call_refused"]
        counted = read_counters(client, keys)
    finally:
        client.close()
    assert sorted(p.name for p in drop.iterdir()) == [], "a forged call ran"
    assert len(refused) == 4 and {"forged_7", "forged_8", "forged_9"} <= set(refused), refused
    assert counted.get(("calls_refused", "runIsolated")) == 2 and counted.get(("calls_refused", "runAsync")) == 2
    assert [p["tool"] for p in resumed["pending"]] == ["ask"], "the real deferred call still waits"
