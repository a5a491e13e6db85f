"""Real worker processes (`agents worker`: a supervisor, a threads-pool steps worker and a prefork
tool worker) for tests.

A worker is forked from the test run's warm launcher (tests/support/launcher.py) when it can be:
then it pays no import of its own (litellm, Celery), a start costs a fraction of a second of CPU
instead of ~10 s. `Worker(..., fork=False)` always execs a fresh interpreter (a test of the
worker's own start, its /proc environ...); a worker under a `prefix` argv or with an environment
that differs from the test run's in more than `AGENTS_*` is exec'd anyway."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from tests.support.launcher import LaunchedProcess, launcher


def worker_env(redis_url: str | None, prefix: str, home: Path | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("AGENTS_"):
            del env[k]
    if redis_url:
        env["AGENTS_REDIS_URL"] = redis_url
    env["AGENTS_PREFIX"] = prefix
    if home is not None:
        env["AGENTS_HOME"] = str(home)
    env.setdefault("AGENTS_SWEEP_INTERVAL", "0.2")
    env.setdefault("AGENTS_OWED_GRACE", "2")
    env.setdefault("AGENTS_LLM_BACKOFF", "0.05")
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Worker:
    """One worker process group; `wait_ready` waits for its heartbeat in Redis."""

    def __init__(
        self,
        env: dict[str, str],
        queues: str = "steps,tools,isolated",
        concurrency: int = 2,
        log: Path | None = None,
        name: str | None = None,
        prefix: Sequence[str] = (),
        step_processes: int = 1,
        step_threads: int | None = None,
        fork: bool = True,
        extra_args: Sequence[str] = (),
    ) -> None:
        """`prefix`: an argv the worker command runs under (tests/support/confinement.py)."""
        self.env = env
        self.name = name or f"w{os.getpid()}-{time.monotonic_ns()}@test"
        self.args = [
            *prefix,
            sys.executable,
            "-m",
            "celery_agents.cli",
            "worker",
            "--queues",
            queues,
            "--concurrency",
            str(concurrency),
            "--name",
            self.name,
            # One steps process (threads pool) per worker: tests start many workers on few cores.
            "--step-processes",
            str(step_processes),
        ]
        if step_threads is not None:
            self.args += ["--step-threads", str(step_threads)]
        self.args += list(extra_args)
        self.log = log
        self.fork = fork
        self.proc: subprocess.Popen[bytes] | LaunchedProcess | None = None

    def start(self) -> Worker:
        if self.fork and launcher().can_fork(self.args, self.env):
            self.proc = launcher().spawn(self.args, self.env, self.log, cwd=Path.cwd())
            return self
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 - held by the child
        self.proc = subprocess.Popen(
            self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        return self

    def wait_ready(self, client: redis.Redis, prefix: str, timeout: float = 60) -> Worker:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; see {self.log}")
            raw = client.hget(f"{prefix}:workers", self.name)
            if raw and json.loads(raw).get("at"):
                return self
            time.sleep(0.05)
        raise RuntimeError(f"worker not ready within {timeout} s; see {self.log}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        _wait_group_gone(self.proc.pid, timeout)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM to the main process only, as `docker stop` or systemd send it; waits for exit."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL, timeout=10)

    def __enter__(self) -> Worker:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """Until no process of the worker's group is left (its steps and tools processes may outlive
    the main one by a moment, still holding a broker consumer that would take the next test's
    messages); SIGKILL to what is left after `timeout`."""
    deadline, killed = time.monotonic() + timeout, False
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            if killed:
                return  # what is left does not go (a zombie nobody reaps): nothing more to do
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline, killed = time.monotonic() + 5, True
        time.sleep(0.02)  # polling the process table: there is no event for a group's end


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is left that is not a zombie."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_all(workers: Sequence[Worker], sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """Stop workers together: each is told at once, then each is waited for (a warm shutdown
    takes a second or more; one after the other, a fleet's would add up)."""
    for w in workers:
        if w.proc is not None and w.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(w.proc.pid, sig)
    for w in workers:
        w.stop(sig, timeout)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
