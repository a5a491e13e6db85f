"""Running `agents` as a real process, checking its JSON against the contract, and snapshotting
what a prefix holds in Redis (to show that a refused command changed nothing)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis

from tests.support.launcher import launcher
from tests.support.launcher import run as launched
from tests.support.workers import worker_env

CLI = [sys.executable, "-m", "celery_agents.cli"]
ROOT = Path(__file__).resolve().parents[2]
DEMO_AGENT = ROOT / "examples" / "demo-agent.json"

VIEW_STATES = {"ready", "tools", "running", "waiting", "completed", "failed", "cancelled"}
HEADS = {"UserTurn", "LlmTurn", "PartialUserTurn", None}
DISPOSITIONS = {"runSync", "runAsync", "runIsolated", "defer"}
EXIT_CODES = {
    "invalid_input": 2,
    "invalid_agent_file": 2,
    "invalid_result": 2,
    "invalid_arguments": 2,
    "unknown_session": 3,
    "unknown_token": 3,
    "unknown_limit": 3,
    "token_already_completed": 5,
    "token_expired": 5,
    "token_cancelled": 5,
    "session_not_advanceable": 5,
    "not_an_approval": 5,
    "digest_mismatch": 5,
    "budget_exceeded": 5,
    "redis_unavailable": 1,
    "wait_timeout": 4,
}

T = TypeVar("T")


@dataclass
class Run:
    """One finished `agents` process."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def doc(self) -> Any:
        """The one JSON document on stdout; fails if stdout holds anything else."""
        assert self.stdout.endswith("\n") and self.stdout.count("\n") == 1, (
            f"stdout of {self.args} is not exactly one JSON line:\n{self.stdout!r}\nstderr:\n{self.stderr}"
        )
        return json.loads(self.stdout)

    @property
    def lines(self) -> list[Any]:
        """stdout as JSON lines (`logs --json`)."""
        return [json.loads(line) for line in self.stdout.splitlines()]

    def __str__(self) -> str:
        return f"agents {' '.join(self.args)} -> {self.returncode}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def agents(
    *args: str | Path,
    env: dict[str, str],
    stdin: str | None = None,
    timeout: float = 90,
    cwd: Path | None = None,
    python_flags: tuple[str, ...] = (),
    fork: bool = True,
) -> Run:
    """Run `python -m celery_agents.cli ARGS` and wait for it. The process is forked from the
    test run's warm launcher (tests/support/launcher.py) unless `fork=False`, `python_flags` are
    given (`-X importtime` must see every import) or the environment rules it out: then a fresh
    interpreter runs it. Tests of what a process imports, or of how fast it starts, exec."""
    argv = [str(a) for a in args]
    started = time.monotonic()
    command = [CLI[0], *python_flags, *CLI[1:], *argv]
    if fork and launcher().can_fork(command, env):  # forked from the warm launcher: no imports to pay
        code, out, err = launched(command, env, stdin, timeout, cwd)
        return Run(argv, code, out, err, time.monotonic() - started)
    proc = subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return Run(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def cli_env(redis_url: str | None, prefix: str, home: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CLI process: real Redis (queue mode) or, with no URL, the embedded default."""
    env = worker_env(redis_url, prefix, home, **extra)
    env["COLUMNS"] = "200"
    return env


def poll(probe: Callable[[], T | None], what: str, timeout: float = 30.0, every: float = 0.05) -> T:
    """Call `probe` until it returns something truthy, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def snapshot(client: redis.Redis, prefix: str) -> dict[str, Any]:
    """Every key of the prefix with its value, except the worker's own bookkeeping (heartbeats,
    the sweeper's lock), the fleet's metrics counters, the Celery broker's keys and the script
    replies kept minutes for retried calls (`:req:`, they expire by themselves)."""
    volatile = (
        f"{prefix}:workers",
        f"{prefix}:lock:",
        f"{prefix}:counters",
        f"{prefix}:tally",
        f"{prefix}:celery:",
        f"_kombu.binding.{prefix}:",
    )
    out: dict[str, Any] = {}
    for key in sorted(client.scan_iter(match=f"{prefix}:*", count=1000)):
        if key.startswith(volatile) or ":req:" in key:
            continue
        kind = client.type(key)
        if kind == "string":
            value: Any = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "list":
            value = client.lrange(key, 0, -1)
        elif kind == "set":
            value = sorted(client.smembers(key))
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = client.xrange(key)
        else:
            continue  # expired between SCAN and TYPE
        out[key] = (kind, value)
    return out


# -- the contract's documents -------------------------------------------------------------------
def check_pending_call(p: dict[str, Any]) -> None:
    keys = {
        "session_id",
        "call_id",
        "tool",
        "arguments",
        "disposition",
        "reason",
        "state",
        "token",
        "created_at",
        "expires_at",
    }
    assert keys <= p.keys(), f"pending call lacks {keys - p.keys()}: {p}"
    assert isinstance(p["session_id"], str) and isinstance(p["call_id"], str) and isinstance(p["tool"], str)
    assert isinstance(p["arguments"], dict)
    assert p["disposition"] in DISPOSITIONS
    assert p["reason"] is None or isinstance(p["reason"], str)
    assert isinstance(p["state"], str)
    if p["disposition"] == "defer" and p["state"] == "deferred":
        assert isinstance(p["token"], str) and p["token"]
    else:
        assert p["token"] is None
    assert isinstance(p["created_at"], int | float)
    assert p["expires_at"] is None or isinstance(p["expires_at"], int | float)


def check_view(v: dict[str, Any]) -> dict[str, Any]:
    keys = {"session_id", "state", "head", "version", "steps", "pending", "response", "error"}
    assert keys <= v.keys(), f"session view lacks {keys - v.keys()}: {v}"
    assert isinstance(v["session_id"], str) and v["session_id"]
    assert v["state"] in VIEW_STATES
    assert v["head"] in HEADS
    assert isinstance(v["version"], int) and not isinstance(v["version"], bool)
    assert isinstance(v["steps"], int) and not isinstance(v["steps"], bool)
    assert isinstance(v["pending"], list)
    for p in v["pending"]:
        check_pending_call(p)
    assert v["response"] is None or isinstance(v["response"], str)
    assert v["error"] is None or (
        isinstance(v["error"], dict) and isinstance(v["error"]["code"], str) and isinstance(v["error"]["message"], str)
    )
    return v


def check_completion(d: dict[str, Any]) -> dict[str, Any]:
    assert set(d) == {"token", "session_id", "call_id", "accepted", "remaining", "woken", "decision"}, d
    assert d["decision"] in ("approved", "edited", "rejected", "responded"), d
    assert isinstance(d["token"], str) and isinstance(d["session_id"], str) and isinstance(d["call_id"], str)
    assert d["accepted"] is True
    assert isinstance(d["remaining"], int) and not isinstance(d["remaining"], bool)
    assert isinstance(d["woken"], bool)
    return d


def check_error(run: Run, code: str) -> dict[str, Any]:
    """The command failed with the contract's code, exit code and one JSON error document."""
    doc = run.doc
    assert set(doc) == {"error"}, str(run)
    assert doc["error"]["code"] == code, str(run)
    assert isinstance(doc["error"]["message"], str) and doc["error"]["message"], str(run)
    assert run.returncode == EXIT_CODES[code], str(run)
    return doc["error"]


def ok(run: Run) -> Any:
    """The command succeeded; its JSON document."""
    assert run.returncode == 0, str(run)
    return run.doc
