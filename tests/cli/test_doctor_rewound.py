"""`agents doctor` fails while Redis has rewound a session (it lost writes it had acknowledged:
a completion given may be gone) until an operator acknowledges it with `--ack-rewound`; a session
rewound again after that fails doctor again. Every check says its severity, and the document's
`ok` is false exactly when a check is an error."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import redis

from celery_agents.store import Store
from tests.cli.process import agents, cli_env
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, start, step
from tests.store.test_rewound import lose_writes_since, saved_keys

SEVERITIES = {"ok", "warning", "error"}


def rewind(store: Store, stores: Any, sid: str) -> None:
    """Redis loses the step a worker had read (a failover, a crash during a slow fsync), another
    worker moves the session on, and the first one reads it again: it finds it rewound."""
    before = saved_keys(store, sid)
    step(store, sid, ScriptedLlm(llm_turn(("lost", "sync_a", "{}"))), owner="worker-a")
    lose_writes_since(store, sid, before)
    step(stores(), sid, ScriptedLlm(llm_turn(("kept", "sync_a", "{}"))), owner="worker-b")
    begin(store, sid, "worker-a")
    store.end_step(sid, "worker-a", "test", "done")


def doctor(env: dict[str, str], *flags: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """`agents doctor --json`: its document and its `rewound sessions` check."""
    run = agents("doctor", "--json", *flags, env=env)
    doc = run.doc
    assert all(c["severity"] in SEVERITIES for c in doc["checks"]), doc["checks"]
    assert doc["ok"] is not any(c["severity"] == "error" for c in doc["checks"]), doc["checks"]
    assert run.returncode == (0 if doc["ok"] else 1), run
    [check] = [c for c in doc["checks"] if c["name"] == "rewound sessions"]
    return doc, check


def alive(redis_url: str, prefix: str) -> None:
    """A live worker's heartbeat: the rewound sessions are then the only error."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.hset(f"{prefix}:workers", "w@test", json.dumps({"pid": 1, "host": "test", "at": time.time()}))
    client.close()


def test_a_rewound_session_fails_doctor_until_it_is_acknowledged(
    store: Store, stores: Any, redis_url: str, prefix: str, tmp_path: Path
) -> None:
    env = cli_env(redis_url, prefix, tmp_path / "home")
    agents("--version", env=env)  # the CLI's launcher warm: each doctor below is well within a heartbeat's life
    first = start(store)
    rewind(store, stores, first)
    alive(redis_url, prefix)

    doc, check = doctor(env)
    assert doc["ok"] is False and check["severity"] == "error" and first in check["detail"], check
    assert [c["name"] for c in doc["checks"] if c["severity"] == "error"] == ["rewound sessions"]
    # The test Redis keeps nothing on disk, and no spec key is set: warnings, which pass.
    warned = {c["name"] for c in doc["checks"] if c["severity"] == "warning"}
    assert {"persistence", "spec signing"} <= warned and all(not c["ok"] for c in doc["checks"] if c["name"] in warned)
    assert doc["rewound_unacknowledged"] == 1 and doc["rewound_sessions"][first]["seen_version"] == 2
    human = agents("doctor", env=env)
    assert human.returncode == 1 and "fail rewound sessions: 1 session(s)" in human.stdout, human

    alive(redis_url, prefix)
    doc, check = doctor(env, "--ack-rewound")
    assert doc["ok"] is True and doc["acknowledged_rewound"] == [first], doc
    assert check["severity"] == "ok" and "1 acknowledged" in check["detail"], check
    assert "acknowledged_at" in doc["rewound_sessions"][first] and doc["rewound_unacknowledged"] == 0
    assert doctor(env)[0]["ok"] is True, "the acknowledgement is kept in Redis"
    assert doctor(env, "--ack-rewound")[0]["acknowledged_rewound"] == [], "nothing new to acknowledge"

    # Redis rewinds another session, and the first one again: errors again, both.
    second = start(store)
    rewind(store, stores, second)
    rewind(store, stores, first)
    alive(redis_url, prefix)
    doc, check = doctor(env)
    assert doc["ok"] is False and check["severity"] == "error" and doc["rewound_unacknowledged"] == 2, doc
    assert "acknowledged_at" not in doc["rewound_sessions"][first]
    assert sorted(doctor(env, "--ack-rewound")[0]["acknowledged_rewound"]) == sorted([first, second])
