"""`agents limits set/list/delete` and `--priority`, as processes against the real Redis: what a
limit holds is what `list` and `doctor` show, and every bad input exits 2 with the contract's
error document, changing nothing."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import redis

from tests.cli.process import DEMO_AGENT, agents, check_error, cli_env, ok


def test_a_limit_set_is_listed_replaced_and_deleted(redis_url: str) -> None:
    env = cli_env(redis_url, f"lim{uuid.uuid4().hex[:8]}")
    key = "openai/gpt-4o-mini"
    doc = ok(agents("limits", "set", key, "--rpm", "100", "--concurrency", "3", "--json", env=env))
    assert (doc["key"], doc["rpm"], doc["tpm"], doc["concurrency"]) == (key, 100, None, 3)
    assert doc["usage"]["in_flight"] == 0 and doc["usage"]["requests_this_minute"] == 0
    ok(agents("limits", "set", "team-a", "--tpm", "20000", "--json", env=env))
    listed = ok(agents("limits", "list", "--json", env=env))
    assert [(x["key"], x["rpm"], x["tpm"], x["concurrency"]) for x in listed["limits"]] == [
        (key, 100, None, 3),
        ("team-a", None, 20000, None),
    ]
    assert listed["paused"] == []
    # set again: the KEY's limits are the ones given now
    ok(agents("limits", "set", key, "--tpm", "5000", "--json", env=env))
    human = agents("limits", "list", env=env)
    assert human.returncode == 0
    assert f"{key}  tpm 5000" in human.stdout and "team-a  tpm 20000" in human.stdout
    doctor = agents("doctor", "--json", env=env).doc  # fails for want of a worker: beside the point
    assert [x["key"] for x in doctor["limits"]["limits"]] == [key, "team-a"]
    assert any(c["name"] == "limits" and key in c["detail"] for c in doctor["checks"])
    assert ok(agents("limits", "delete", key, "--json", env=env)) == {"key": key, "deleted": True}
    assert [x["key"] for x in ok(agents("limits", "list", "--json", env=env))["limits"]] == ["team-a"]
    check_error(agents("limits", "delete", key, "--json", env=env), "unknown_limit")


def test_bad_keys_and_numbers_exit_2_and_change_nothing(redis_url: str) -> None:
    prefix = f"lim{uuid.uuid4().hex[:8]}"
    env = cli_env(redis_url, prefix)
    for args in (
        ("bad key", "--rpm", "5"),
        ("-starts-with-dash", "--rpm", "5"),
        ("x" * 201, "--rpm", "5"),
        ("m", "--rpm", "-5"),
        ("m", "--tpm", "0"),
        ("m", "--concurrency", "-1"),
        ("m", "--rpm", "many"),
        ("m",),
    ):
        check_error(agents("limits", "set", *args, "--json", env=env), "invalid_input")
    check_error(agents("limits", "delete", "bad key", "--json", env=env), "invalid_input")
    client = redis.Redis.from_url(redis_url)
    assert list(client.scan_iter(f"{prefix}:*")) == []
    client.close()


def test_priority_comes_from_the_option_else_the_agent_file(redis_url: str, tmp_path: Path) -> None:
    env = cli_env(redis_url, f"pri{uuid.uuid4().hex[:8]}")
    plain = ok(agents("session", "start", "--agent-file", DEMO_AGENT, "-p", "hi", "--json", env=env))
    assert (plain["priority"], plain["throttled_until"]) == (5, None)
    agent = {
        "slug": "urgent",
        "model": json.loads(DEMO_AGENT.read_text())["model"],
        "priority": 8,
        "limitKey": "team-a",
    }
    path = tmp_path / "urgent.json"
    path.write_text(json.dumps(agent))
    assert ok(agents("session", "start", "--agent-file", path, "-p", "hi", "--json", env=env))["priority"] == 8
    chosen = agents("session", "start", "--agent-file", path, "-p", "hi", "--priority", "2", "--json", env=env)
    assert ok(chosen)["priority"] == 2
    check_error(
        agents("session", "start", "--agent-file", path, "-p", "hi", "--priority", "10", "--json", env=env),
        "invalid_input",
    )
    agent["priority"] = 11
    path.write_text(json.dumps(agent))
    check_error(agents("session", "start", "--agent-file", path, "-p", "hi", "--json", env=env), "invalid_agent_file")
    agent["priority"], agent["limitKey"] = 3, "no spaces allowed"
    path.write_text(json.dumps(agent))
    check_error(agents("session", "start", "--agent-file", path, "-p", "hi", "--json", env=env), "invalid_agent_file")
