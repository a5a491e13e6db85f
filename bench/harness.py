"""What the benchmark's phases and probes share: the sizes of a run, how samples are summarised,
the agents the benchmark runs, and the two loops under test as the benchmark drives them:
celery-agents through its store and dispatcher (`Agents`) and the naive Celery loop (`NaiveLoop`).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from bench.processes import Processes, agents_env, own_cpu_seconds, tree_cpu_seconds, wait_heartbeat
from celery_agents.store.codec import event_at

STEP_AGENT: dict[str, Any] = {"slug": "bench", "model": "demo/bench"}
DEFER_AGENT: dict[str, Any] = {
    "slug": "bench-defer",
    "model": "demo/bench",
    "tools": [
        {
            "name": "book_table",
            "description": "Book a restaurant table; a person confirms.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "external": True,
        }
    ],
}
DEFER_PROMPT = "Please book a table in Paris."


class Sizes:
    """How many of each sample a run takes: the full run's, or `--quick`'s for a smoke test."""

    def __init__(self, quick: bool) -> None:
        self.quick = quick
        self.warmup = 10 if quick else 30
        self.latency = 60 if quick else 500
        self.throughput = 300 if quick else 4000
        self.completions = 30 if quick else 200
        self.cli_runs = 3 if quick else 7
        self.model_calls = 200 if quick else 2000
        self.growth_steps = 200
        self.slow_sessions = 100 if quick else 1000
        self.limited_sessions = 20 if quick else 60
        self.http_latency = 60 if quick else 300


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def summary(name: str, values_ms: list[float]) -> dict[str, float]:
    return {f"{name}_p50_ms": percentile(values_ms, 50), f"{name}_p99_ms": percentile(values_ms, 99)}


def bench_client(url: str) -> redis.Redis:
    """The bench's own client: its BLPOPs wait up to 90 s for a worker that is starting, longer than
    redis-py's default socket timeout (5 s) would let them."""
    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=120)


def wait_until(check: Callable[[], bool], timeout: float, what: str, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def roundtrips(send: Callable[[str], None], client: redis.Redis, key: str, n: int, what: str) -> list[float]:
    """n tasks one at a time, each timed from its publish until its `RPUSH` to `key` is seen (ms)."""
    rtts = []
    for i in range(n):
        t0 = time.perf_counter()
        send(f"l{i}")
        if client.blpop([key], timeout=30) is None:
            raise TimeoutError(f"{what} did not finish within 30 s")
        rtts.append((time.perf_counter() - t0) * 1000)
    return rtts


def publish_and_wait(store: Any, dispatcher: Any, sids: list[str], timeout: float, what: str) -> float:
    """Publish the first step of each of `sids` and wait until every one has completed or failed
    (the state indexes); the wall time from the first publish (s)."""
    k, n = store.keys, len(sids)
    t0 = time.perf_counter()
    for sid in sids:
        dispatcher.step(sid, 1, "bench")
    deadline = time.monotonic() + timeout
    while store.client.zcard(k.state_index("completed")) + store.client.zcard(k.state_index("failed")) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{n} {what} sessions did not finish within {timeout:g} s")
        time.sleep(0.02)
    return time.perf_counter() - t0


def command_counts(client: redis.Redis) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in client.info("commandstats").items()}


def command_delta(before: dict[str, int], after: dict[str, int], per: int) -> tuple[float, dict[str, float]]:
    delta = {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0) > 0}
    for noise in ("info", "llen", "zcard"):  # the bench's own polling
        delta.pop(noise, None)
    return sum(delta.values()) / per, {k: round(v / per, 2) for k, v in sorted(delta.items(), key=lambda kv: -kv[1])}


class CpuSplit:
    """CPU time spent per task by the worker (parent and pool processes), redis-server and this
    process (publishing and polling), between `start` and `per_task`."""

    def __init__(self, procs: Processes, worker_pid: int | list[int]) -> None:
        self.workers = worker_pid if isinstance(worker_pid, list) else [worker_pid]
        self.redis = procs.redis_pid
        self.start = self._now()

    def _now(self) -> dict[str, float]:
        now = {"worker": sum(tree_cpu_seconds(pid) for pid in self.workers)}
        if self.redis:
            now["redis"] = tree_cpu_seconds(self.redis)
        now["worker_main_process"] = own_cpu_seconds(self.workers[0])
        now["bench"] = time.process_time()
        return now

    def per_task(self, n: int) -> dict[str, float]:
        end = self._now()
        return {k: round((end[k] - self.start[k]) * 1000 / n, 3) for k in end}


# -- the loops under test -------------------------------------------------------------------------
class NaiveLoop:
    """Naive-loop workers (`bench/naive_celery.py`) started, ready, and ended on exit."""

    def __init__(self, procs: Processes, url: str, prefix: str, workers: int, env: dict[str, str], tag: str) -> None:
        from bench.naive_celery import NAIVE_TASK, QUEUE, done_key, make_naive_app
        from celery_agents.config import Settings
        from celery_agents.tasks.supervisor import DEFAULT_STEP_THREADS

        self.procs = procs
        self.client = bench_client(url)
        self.app = make_naive_app(Settings(redis_url=url, prefix=prefix))
        self.key = done_key(prefix)
        self.name = f"naive-{prefix}@{tag}"
        self.task, self.queue = NAIVE_TASK, QUEUE
        self.started = procs.naive_workers(env, workers, DEFAULT_STEP_THREADS, self.name)
        self.workers = workers

    def send(self, tag: str) -> None:
        self.app.send_task(self.task, args=(tag,), queue=self.queue)

    def __enter__(self) -> NaiveLoop:
        try:
            self.client.delete(self.key)
            for i in range(self.workers * 4):  # every process has started once these come back
                self.send(f"ready{i}")
            wait_until(lambda: self.client.llen(self.key) >= self.workers * 4, 120, "the naive workers to start")
            self.client.delete(self.key)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for i, w in enumerate(self.started):
            self.procs.stop(w, f"{self.name.split('@')[0]}{i}")
        with contextlib.suppress(Exception):
            self.app.close()
        self.client.close()


class Agents:
    """The bench's view of celery-agents on the benchmark's Redis: a store and a dispatcher
    (its Celery app named `main`)."""

    def __init__(self, url: str, prefix: str, main: str = "bench_client", broker: str | None = None) -> None:
        from celery_agents.config import Settings
        from celery_agents.store import Store, client_for_url
        from celery_agents.tasks.config import Dispatcher, make_app
        from celery_agents.tools.resolve import parse_agent

        self.settings = Settings(redis_url=url, prefix=prefix, broker_url=broker)
        self.store = Store(client_for_url(url), self.settings)
        self.client: Any = self.store.client
        self.app = make_app(self.settings, main=main)
        self.dispatcher = Dispatcher(self.app)
        self.step_agent = parse_agent(STEP_AGENT)
        self.defer_agent = parse_agent(DEFER_AGENT)

    def create(self, n: int, *, agent: Any, text: str, drive: str = "manual", owe: bool = False) -> list[str]:
        from celery_agents.model import UserQuery

        query = UserQuery(text=text)
        return [self.store.create_session(agent, query, drive=drive, owe=owe).session_id for _ in range(n)]

    def wait_event(self, sid: str, after: str, kinds: set[str], timeout: float = 30) -> tuple[str, dict[str, str]]:
        """The first event of one of `kinds` after `after`; a `failed` event is an error."""
        key = self.store.keys.events(sid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            res = self.client.xread({key: after}, block=int(timeout * 1000), count=50)
            for eid, fields in res[0][1] if res else []:
                after = eid
                if fields.get("type") in kinds:
                    return eid, fields
                if fields.get("type") == "failed":
                    raise RuntimeError(f"session {sid} failed: {fields.get('data')}")
        raise TimeoutError(f"no {sorted(kinds)} event of session {sid} within {timeout} s")

    def step_roundtrip(self, sid: str, parts: dict[str, list[float]] | None = None) -> float:
        """Publish → `step_committed` seen (ms); `parts` gets publish → `step_started` (the worker's
        clock), `step_started` → `step_committed` (the step's work) and the rest (seeing it)."""
        after = self.store.last_event_id(sid)
        t_wall = time.time()
        t0 = time.perf_counter()
        self.dispatcher.step(sid, 1, "bench")
        eid, started = self.wait_event(sid, after, {"step_started"})
        committed_id, committed = self.wait_event(sid, eid, {"step_committed"})
        total = (time.perf_counter() - t0) * 1000
        if parts is not None:
            pickup = (event_at(eid, started) - t_wall) * 1000
            work = (event_at(committed_id, committed) - event_at(eid, started)) * 1000
            parts.setdefault("pickup", []).append(pickup)
            parts.setdefault("work", []).append(work)
            parts.setdefault("seen", []).append(total - pickup - work)
        return total

    def close(self) -> None:
        self.client.close()
        with contextlib.suppress(Exception):
            self.app.close()


@contextlib.contextmanager
def served(
    procs: Processes, agents: Agents, step_processes: int | None, tag: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """An `agents worker` serving `agents`' prefix (`tag` in its name, `env` over `agents_env`),
    once its heartbeat is seen; the worker stopped and `agents` closed after."""
    url, prefix = agents.settings.redis_url or "", agents.settings.prefix
    name = f"{tag}-{prefix}@bench"
    try:
        worker = procs.agents_worker({**agents_env(url, prefix), **(env or {})}, step_processes, name)
        try:
            wait_heartbeat(agents.client, prefix, name, worker)
            yield worker
        finally:
            procs.stop(worker, name)
    finally:
        agents.close()


def default_step_processes() -> int:
    from celery_agents.tasks.supervisor import default_step_processes as default

    return default()
