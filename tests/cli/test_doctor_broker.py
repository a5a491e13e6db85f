"""`agents doctor` with `AGENTS_BROKER_URL` naming a broker it cannot reach: a failed check that
names the broker (without its password), queue depths unknown, exit 1."""

from __future__ import annotations

import json
import time
from pathlib import Path

import redis

from tests.cli.process import agents, cli_env
from tests.support.redis_server import free_port


def test_an_unreachable_broker_is_a_failed_check(redis_url: str, prefix: str, tmp_path: Path) -> None:
    broker = f"amqp://guest:s3cr3t-pw@127.0.0.1:{free_port()}/"  # nothing listens there
    env = cli_env(redis_url, prefix, tmp_path / "home", AGENTS_BROKER_URL=broker)
    agents("--version", env=env)  # the CLI's launcher warm: doctor runs well within the heartbeat's 15 s
    # A live worker's heartbeat, so that the broker is the only thing wrong.
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.hset(f"{prefix}:workers", "w@test", json.dumps({"pid": 1, "host": "test", "at": time.time(), "queues": []}))
    client.close()
    run = agents("doctor", "--json", env=env)
    assert run.returncode == 1, run
    report = run.doc
    assert report["ok"] is False
    # (The test Redis keeps nothing on disk and no spec key is set: those checks warn, without
    # failing doctor.)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == ["persistence", "spec signing", "broker"], report[
        "checks"
    ]
    [check] = [c for c in report["checks"] if c["name"] == "broker"]
    assert check["ok"] is False and "cannot read its queues" in check["detail"]
    assert "127.0.0.1" in check["detail"] and "s3cr3t-pw" not in run.stdout + run.stderr
    assert report["queues"] == {"steps": None, "tools": None, "isolated": None}
    human = agents("doctor", env=env)
    assert "queues: steps ?, tools ?, isolated ? (the broker could not be read)" in human.stdout, human
