"""The benchmark: celery-agents against plain Celery, in one run, on one Redis, same worker count.

    python bench/run.py [--json] [--quick] [--workers N]

Starts a private redis-server on a free port (or uses `AGENTS_REDIS_URL`), then measures in turn:

1. bytes written by the commit of step 2 and step 200 of one long session (inline, no workers);
2. plain Celery (`bench/bare_celery.py`, N prefork processes): a no-op task's round trip (publish
   → the task's `RPUSH` seen by BLPOP) and no-op tasks completed per second;
3. celery-agents (`agents worker`, N prefork processes) with the offline demo model answering at
   once and no tools: a step's round trip (`Dispatcher.step` → `step_committed` on the session's
   stream) and steps committed per second across many sessions;
4. completion to next step started: sessions of an agent with one external tool, auto-driven until
   they wait on its token; each completed with `XADD <prefix>:completions`, timed to the session's
   `step_started` event (`at`, the worker's clock) from just before the XADD (the bench's clock:
   the same machine); while they wait, `agents session pending --json` wall time;
5. one demo model call through litellm, alone (`bench/model_call.py`): the floor under every step;
6. both step round trips again (celery-agents and the naive loop, one step at a time) with the model
   behind a local OpenAI-compatible server that answers at once (`bench/latency_curve.py`): the
   model call goes over HTTP through litellm as a provider's does, and `step_latency_vs_naive_http`
   compares the two there (their steps alternate, one at a time);
7. DBOS making the same model call as durable steps on PostgreSQL (`bench/dbos_phase.py`), when the
   `bench` extra is installed and a PostgreSQL server answers (`--dbos-url`, `DBOS_DATABASE_URL`,
   else the local one); otherwise `dbos_skipped` says why and its keys are absent;
8. sessions under a fleet limit (`agents limits set`) below the rate a local model server answers
   before it says 429 (`bench/limited.py`): wall time, 429s, calls per minute ÷ the limit;
9. with `--cluster`, phase 3's throughput again with state on a local 3-primary Redis Cluster (a
   replica each; the queues on a Redis of their own): `cluster_steps_per_s` and
   `cluster_vs_single_steps_per_s` (`bench/cluster_phase.py`).

Prints one JSON object (`--json`) or a table. Every process it starts is ended on exit and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from bench.dbos_phase import bench_dbos, database_url
from bench.harness import (
    DEFER_PROMPT,
    Agents,
    CpuSplit,
    NaiveLoop,
    Sizes,
    bench_client,
    command_counts,
    command_delta,
    default_step_processes,
    percentile,
    roundtrips,
    summary,
    wait_until,
)
from bench.in_flight import bench_slow_model
from bench.latency_curve import measure as measure_latency
from bench.limited import bench_limited
from bench.paused_memory import measure as measure_paused_memory
from bench.processes import Processes, agents_env, free_port, time_cli, wait_heartbeat
from bench.write_growth import measure as measure_write_growth
from celery_agents.store.codec import event_at


# -- plain Celery ---------------------------------------------------------------------------------
def bench_bare(procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    from bench.bare_celery import NOOP_TASK, QUEUE, done_key, make_bare_app
    from celery_agents.config import Settings

    client = bench_client(url)
    app = make_bare_app(Settings(redis_url=url, prefix=prefix))
    key = done_key(prefix)
    name = f"bare-{prefix}@bench"
    worker = procs.bare_worker(agents_env(url, prefix), workers, name)

    def send(tag: str) -> None:
        app.send_task(NOOP_TASK, args=(tag,), queue=QUEUE)

    try:
        client.delete(key)
        send("ready")
        if client.blpop([key], timeout=90) is None:
            raise RuntimeError(f"the bare Celery worker did not start:\n{procs.log_tail(name.split('@')[0])}")
        for i in range(sizes.warmup):
            send(f"w{i}")
            client.blpop([key], timeout=30)
        rtts = roundtrips(send, client, key, sizes.latency, "a no-op task")
        client.delete(key)
        n = sizes.throughput
        before = command_counts(client)
        cpu = CpuSplit(procs, worker.pid)
        t0 = time.perf_counter()
        for i in range(n):
            send(f"t{i}")
        wait_until(lambda: client.llen(key) >= n, 300, f"{n} no-op tasks")
        elapsed = time.perf_counter() - t0
        cpu_ms = cpu.per_task(n)
        per_task, detail = command_delta(before, command_counts(client), n)
    finally:
        procs.stop(worker, name)
        with contextlib.suppress(Exception):
            app.close()
    return {
        "bare_celery_tasks_per_s": n / elapsed,
        **{k.replace("rt_", "bare_celery_roundtrip_"): v for k, v in summary("rt", rtts).items()},
        "bare_celery_redis_commands_per_task": per_task,
        "bare_celery_cpu_ms_per_task": cpu_ms,
        "bare_celery_redis_commands_detail": detail,
    }


# -- the naive Celery loop ------------------------------------------------------------------------
def bench_naive(procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    """`bench/naive_celery.py`: one plain Celery task per step making the same model call, on as
    many threads-pool processes with as many threads as `agents worker` runs steps with."""
    with NaiveLoop(procs, url, prefix, workers, agents_env(url, prefix), "bench") as loop:
        client, key, send = loop.client, loop.key, loop.send
        for i in range(sizes.warmup):
            send(f"w{i}")
            client.blpop([key], timeout=30)
        client.delete(key)
        rtts = roundtrips(send, client, key, sizes.latency, "a naive step")
        client.delete(key)
        n = sizes.throughput
        before = command_counts(client)
        cpu = CpuSplit(procs, [w.pid for w in loop.started])
        t0 = time.perf_counter()
        for i in range(n):
            send(f"t{i}")
        wait_until(lambda: client.llen(key) >= n, 600, f"{n} naive steps")
        elapsed = time.perf_counter() - t0
        cpu_ms = cpu.per_task(n)
        per_task, _ = command_delta(before, command_counts(client), n)
    return {
        "naive_steps_per_s": n / elapsed,
        "naive_step_p50_ms": percentile(rtts, 50),
        "naive_step_p99_ms": percentile(rtts, 99),
        "naive_cpu_ms_per_step": cpu_ms,
        "naive_redis_commands_per_step": per_task,
    }


# -- celery-agents --------------------------------------------------------------------------------
def bench_agents(procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    agents = Agents(url, prefix)
    keys = agents.store.keys
    name = f"agents-{prefix}@bench"
    worker = procs.agents_worker(agents_env(url, prefix), workers, name)
    out: dict[str, Any] = {"step_processes": workers}
    try:
        wait_heartbeat(agents.client, prefix, name, worker)
        warm = agents.create(sizes.warmup, agent=agents.step_agent, text="Hello")
        for sid in warm:
            agents.step_roundtrip(sid)
        lat = agents.create(sizes.latency, agent=agents.step_agent, text="Hello")
        parts: dict[str, list[float]] = {}
        rtts = [agents.step_roundtrip(s, parts) for s in lat]
        out.update({k.replace("st_", "step_latency_"): v for k, v in summary("st", rtts).items()})
        out["step_latency_parts_p50_ms"] = {k: round(percentile(v, 50), 3) for k, v in parts.items()}

        n = sizes.throughput
        sids = agents.create(n, agent=agents.step_agent, text="Hello")
        done_before = agents.client.zcard(keys.state_index("completed"))
        before = command_counts(agents.client)
        cpu = CpuSplit(procs, worker.pid)
        t0 = time.perf_counter()
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: agents.client.zcard(keys.state_index("completed")) - done_before >= n, 600, f"{n} steps")
        elapsed = time.perf_counter() - t0
        out["cpu_ms_per_step"] = cpu.per_task(n)
        per_step, detail = command_delta(before, command_counts(agents.client), n)
        failed = agents.client.zcard(keys.state_index("failed"))
        if failed:
            raise RuntimeError(f"{failed} sessions failed during the throughput run")
        out.update(steps_per_s=n / elapsed, redis_commands_per_step=per_step, redis_commands_per_step_detail=detail)
        out.update(commands_under_a_limit(agents, sizes))
        out.update(bench_completions(agents, url, prefix, sizes))
    finally:
        procs.stop(worker, name)
        agents.close()
    return out


def commands_under_a_limit(agents: Agents, sizes: Sizes) -> dict[str, Any]:
    """`redis_commands_per_step` again with the model under a fleet limit that never binds (a
    request rate), on the same worker: what an admission costs a step. The limit is deleted after."""
    from celery_agents.model.admission import ModelLimit

    keys, model = agents.store.keys, agents.step_agent.model
    agents.store.set_limit(model, ModelLimit(rpm=10_000_000))
    try:
        time.sleep(agents.store.settings.limits_refresh * 1.5)  # every worker's copy of the limits has it
        n = max(100, sizes.throughput // 4)
        sids = agents.create(n, agent=agents.step_agent, text="Hello")
        done_before = agents.client.zcard(keys.state_index("completed"))
        before = command_counts(agents.client)
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: agents.client.zcard(keys.state_index("completed")) - done_before >= n, 600, f"{n} steps")
        per_step, detail = command_delta(before, command_counts(agents.client), n)
    finally:
        agents.store.delete_limit(model)
    return {"redis_commands_per_step_limited": per_step, "redis_commands_per_step_limited_detail": detail}


def bench_completions(agents: Agents, url: str, prefix: str, sizes: Sizes) -> dict[str, Any]:
    keys = agents.store.keys
    m = sizes.completions
    waiting_before = agents.client.zcard(keys.state_index("waiting"))
    sids = agents.create(m, agent=agents.defer_agent, text=DEFER_PROMPT, drive="auto", owe=True)
    for sid in sids:
        agents.dispatcher.step(sid, 1, "drive")
    wait_until(
        lambda: agents.client.zcard(keys.state_index("waiting")) - waiting_before >= m, 300, f"{m} sessions to wait"
    )
    env = agents_env(url, prefix)
    every = time_cli(["session", "pending", "--json"], env, sizes.cli_runs)
    one = time_cli(["session", "pending", sids[0], "--json"], env, sizes.cli_runs)
    tokens = {p.session_id: p.token for p in agents.store.pending_view(limit=m + 100) if p.token}
    by_clock, by_ids, seen = [], [], []
    for sid in sids:
        after = agents.store.last_event_id(sid)
        t_wall = time.time()
        t0 = time.perf_counter()
        entry = agents.client.xadd(keys.completions, {"token": tokens[sid], "result": '{"booked": true}'})
        eid, fields = agents.wait_event(sid, after, {"step_started"})
        seen.append((time.perf_counter() - t0) * 1000)
        by_clock.append((event_at(eid, fields) - t_wall) * 1000)
        by_ids.append(float(int(eid.split("-")[0]) - int(entry.split("-")[0])))
        agents.wait_event(sid, eid, {"step_committed"})  # the next sample starts on idle workers
    return {
        **{k.replace("cs_", "complete_to_step_"): v for k, v in summary("cs", by_clock).items()},
        "complete_to_step_p50_ms_by_stream_ids": percentile(by_ids, 50),
        # An upper bound beside the figure above: until this process has read the event (the
        # event's time is Redis's in whole milliseconds, which puts the figure above up to 1 ms low).
        "complete_to_step_seen_p50_ms": percentile(seen, 50),
        "complete_to_step_samples": m,
        "cli_pending_wall_ms": every["median_ms"],
        "cli_pending_wall_ms_min": every["min_ms"],
        "cli_pending_listed": len((every["output"] or {}).get("pending", [])),
        "cli_pending_one_session_wall_ms": one["median_ms"],
        "cli_pending_runs": sizes.cli_runs,
    }


# -- the model over HTTP -------------------------------------------------------------------------
def bench_http_latency(procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    """A step's round trip and the naive loop's with the model called over HTTP (a local
    OpenAI-compatible server answering at once), both loops running and their steps alternating
    (`bench/latency_curve.py`), p50 of each after a tenth of warm-up: measured one loop after the
    other, right after the throughput phases, the two were taken at different moments of a machine
    still settling (those phases' workers ending, other work), and the ratio moved with that."""
    row = measure_latency(procs, url, prefix + "h", workers, 0.0, sizes.http_latency)
    return {
        "http_model_step_p50_ms": row["step_p50_ms"],
        "http_model_naive_step_p50_ms": row["naive_step_p50_ms"],
        "step_latency_vs_naive_http": row["step_latency_vs_naive"],
    }


# -- the cost of metrics --------------------------------------------------------------------------
def bench_metrics_cost(procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes) -> dict[str, Any]:
    """Step throughput of `agents worker` without and with `--metrics-port`, in alternating rounds
    (off, on, off, on) so that the machine's load drifts over both alike; medians of the rounds.
    The metrics worker's `/metrics` is scraped after each round: it must have counted every step."""
    rounds: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    for i, mode in enumerate(["off", "on", "off", "on"]):
        port = free_port() if mode == "on" else None
        rounds[mode].append(metrics_round(procs, url, prefix, workers, sizes, f"metrics{mode}{i}-{prefix}@bench", port))
    off = statistics.median(r[0] for r in rounds["off"])
    on = statistics.median(r[0] for r in rounds["on"])
    return {
        "metrics_off_steps_per_s": off,
        "metrics_on_steps_per_s": on,
        "metrics_throughput_on_vs_off": on / off,
        "metrics_off_worker_cpu_ms_per_step": statistics.median(r[1] for r in rounds["off"]),
        "metrics_on_worker_cpu_ms_per_step": statistics.median(r[1] for r in rounds["on"]),
        "metrics_rounds_steps_per_s": {k: [round(r[0], 1) for r in vs] for k, vs in rounds.items()},
    }


def metrics_round(
    procs: Processes, url: str, prefix: str, workers: int, sizes: Sizes, name: str, port: int | None
) -> tuple[float, float]:
    """(steps/s, worker CPU ms per step) of one worker, with metrics on `port` (None: off)."""
    agents = Agents(url, prefix)
    keys = agents.store.keys
    extra = ["--metrics-port", str(port)] if port is not None else []
    worker = procs.agents_worker(agents_env(url, prefix), workers, name, extra=extra)
    try:
        wait_heartbeat(agents.client, prefix, name, worker)
        for sid in agents.create(sizes.warmup, agent=agents.step_agent, text="Hello"):
            agents.step_roundtrip(sid)
        n = sizes.throughput
        sids = agents.create(n, agent=agents.step_agent, text="Hello")
        done_before = agents.client.zcard(keys.state_index("completed"))
        split = CpuSplit(procs, worker.pid)
        t0 = time.perf_counter()
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: agents.client.zcard(keys.state_index("completed")) - done_before >= n, 600, f"{n} steps")
        result = n / (time.perf_counter() - t0), split.per_task(n)["worker"]
        if port is not None and (counted := scraped_steps(port)) < n + sizes.warmup:
            raise RuntimeError(f"/metrics counted {counted} committed steps of {n + sizes.warmup}")
        return result
    finally:
        procs.stop(worker, name)
        agents.close()


def scraped_steps(port: int) -> float:
    """`agents_steps_total{outcome="committed"}` as the worker's `/metrics` says."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('agents_steps_total{outcome="committed"}'):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the run --------------------------------------------------------------------------------------
def versions(url: str) -> dict[str, Any]:
    def v(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    client = redis.Redis.from_url(url)
    server = client.info("server").get("redis_version", "?")
    client.close()
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "celery": v("celery"),
        "kombu": v("kombu"),
        "redis_py": v("redis"),
        "redis_server": server,
        "litellm": v("litellm"),
        "pydantic": v("pydantic"),
        "celery_agents": v("celery-agents"),
        "dbos": v("dbos"),
    }


def run(
    quick: bool, workers: int, metrics_cost: bool = False, dbos_url: str | None = None, cluster: bool = False
) -> dict[str, Any]:
    sizes = Sizes(quick)
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    started = time.perf_counter()
    with Processes() as procs:
        url = os.environ.get("AGENTS_REDIS_URL") or procs.redis_server()
        result: dict[str, Any] = {"quick": quick, "workers": workers, "prefix": prefix}
        result["load_average_1m_at_start"] = os.getloadavg()[0]
        growth = measure_write_growth(url, prefix, sizes.growth_steps)
        result.update(measure_paused_memory(url, prefix, procs.dir / "paused-home"))
        result.update(bench_bare(procs, url, prefix, workers, sizes))
        result.update(bench_naive(procs, url, prefix, workers, sizes))
        result.update(bench_agents(procs, url, prefix, workers, sizes))
        result.update(bench_http_latency(procs, url, prefix, workers, sizes))
        result.update(bench_dbos(procs, prefix, workers, sizes, dbos_url))
        result.update(growth)
        result["step_throughput_ratio"] = result["steps_per_s"] / result["bare_celery_tasks_per_s"]
        result["step_latency_ratio"] = result["step_latency_p50_ms"] / result["bare_celery_roundtrip_p50_ms"]
        result["step_latency_p99_ratio"] = result["step_latency_p99_ms"] / result["bare_celery_roundtrip_p99_ms"]
        result.update(model_call_bounds(result, sizes))
        result.update(against_naive(result))
        if result.get("dbos_steps_per_s"):
            result.update(against_dbos(result))
        result.update(bench_slow_model(procs, url, prefix, workers, sizes.slow_sessions))
        result.update(slow_model_floor(result, sizes))
        result.update(bench_limited(procs, url, prefix, workers, sizes.limited_sessions))
        if metrics_cost:
            result.update(bench_metrics_cost(procs, url, prefix, workers, sizes))
        if cluster:
            from bench.cluster_phase import bench_cluster

            result.update(bench_cluster(procs, prefix, workers, sizes))
            result["cluster_vs_single_steps_per_s"] = result["cluster_steps_per_s"] / result["steps_per_s"]
        result["samples"] = {
            "roundtrip": sizes.latency,
            "throughput": sizes.throughput,
            "completions": sizes.completions,
            "cli_runs": sizes.cli_runs,
            "http_latency": sizes.http_latency,
        }
        result.update(versions(url))
        result["load_average_1m_at_end"] = os.getloadavg()[0]
        result["redis"] = "AGENTS_REDIS_URL" if os.environ.get("AGENTS_REDIS_URL") else "private redis-server"
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["goals_met"] = goals_met(result)
    return result


def _alone(script: str, calls: int, timeout: float) -> dict[str, Any]:
    """The JSON object `bench/<script> --calls N` prints, run in a fresh process."""
    path = Path(__file__).resolve().parent / script
    done = subprocess.run(
        [sys.executable, str(path), "--calls", str(calls)], capture_output=True, text=True, timeout=timeout, check=True
    )
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def model_call_bounds(result: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """The demo model's call through litellm, alone (`bench/model_call.py`, a fresh process), and
    what it leaves reachable: every step makes one such call on top of a Celery task, so its round
    trip is at least Celery's plus the call's wall time, and its CPU at least a no-op task's plus
    the call's CPU (throughput on a CPU-bound machine goes inversely with CPU per item)."""
    out = _alone("model_call.py", sizes.model_calls, 300)
    bare_rt = result["bare_celery_roundtrip_p50_ms"]
    bare_cpu = sum(result["bare_celery_cpu_ms_per_task"].get(k, 0.0) for k in ("worker", "redis", "bench"))
    out["step_latency_ratio_floor"] = (bare_rt + out["model_call_wall_p50_ms"]) / bare_rt
    out["step_throughput_ratio_ceiling"] = bare_cpu / (bare_cpu + out["model_call_cpu_ms"])
    return out


def slow_model_floor(result: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """What a step of the slow-model phase cannot cost less than in worker CPU on this machine
    (`bench/slow_floor.py`, a fresh process): a no-op Celery task's (`bare_celery_cpu_ms_per_task`,
    its worker), plus a third of what a session's two model calls over HTTP and its forked tool
    call cost alone. A loop of plain Celery tasks making the same calls costs at least this much;
    the durable step's own work (its two scripts, the scheduler, publishing the next step) comes
    on top."""
    out = _alone("slow_floor.py", sizes.model_calls, 600)
    calls = (2 * out["slow_model_model_call_cpu_ms"] + out["slow_model_tool_call_cpu_ms"]) / 3
    floor = result["bare_celery_cpu_ms_per_task"]["worker"] + calls
    out["slow_model_cpu_floor_ms_per_step"] = round(floor, 3)
    out["slow_model_cpu_vs_floor"] = result["slow_model_worker_cpu_ms_per_step"] / floor
    return out


def against_naive(result: dict[str, Any]) -> dict[str, Any]:
    """celery-agents ÷ the naive loop; CPU per step counts the workers and redis-server (the work
    each side makes the machine do), and `own_cpu_ms_per_step` is the workers' CPU per step
    minus the model call's, as `bench/model_call.py` measured it alone."""

    def cpu(split: dict[str, float]) -> float:
        return split.get("worker", 0.0) + split.get("redis", 0.0)

    return {
        "step_throughput_vs_naive": result["steps_per_s"] / result["naive_steps_per_s"],
        "step_latency_vs_naive": result["step_latency_p50_ms"] / result["naive_step_p50_ms"],
        "cpu_per_step_vs_naive": cpu(result["cpu_ms_per_step"]) / cpu(result["naive_cpu_ms_per_step"]),
        "own_cpu_ms_per_step": result["cpu_ms_per_step"]["worker"] - result["model_call_cpu_ms"],
    }


def against_dbos(result: dict[str, Any]) -> dict[str, Any]:
    """celery-agents ÷ DBOS: steps per second, and CPU per step of the workers and the store
    (redis-server; PostgreSQL, all of the server's processes) as information."""
    ours = result["cpu_ms_per_step"].get("worker", 0.0) + result["cpu_ms_per_step"].get("redis", 0.0)
    theirs = result["dbos_cpu_ms_per_step"].get("worker", 0.0) + result["dbos_cpu_ms_per_step"].get("postgres", 0.0)
    return {
        "step_throughput_vs_dbos": result["steps_per_s"] / result["dbos_steps_per_s"],
        "cpu_per_step_vs_dbos": ours / theirs if theirs else None,
    }


GOALS = [
    # the model over HTTP, against the naive Celery loop making the same litellm call
    ("step_latency_vs_naive_http", "<=", 1.10),
    ("step_throughput_vs_naive", ">=", 0.95),
    ("cpu_per_step_vs_naive", "<=", 1.10),
    ("step_throughput_vs_dbos", ">=", 1.5),
    # 1,000 sessions x 3 steps against a model answering in 1 s
    ("slow_model_wall_s", "<=", 8.0),
    ("slow_model_peak_rss_mb", "<=", 1200.0),
    ("slow_model_worker_cpu_ms_per_step", "<=", 3.0),
    ("cli_pending_wall_ms", "<=", 250.0),
    ("complete_to_step_p50_ms", "<=", 3.0),
    ("redis_commands_per_step", "<=", 20.0),
    ("write_growth_ratio", "<=", 1.01),
    ("paused_session_bytes", "<=", 4096),
    ("limited_429_failures", "<=", 2.0),
    ("limited_rate_vs_limit", ">=", 0.9),
]
# Goals judged only when their phase ran: DBOS's needs the `bench` extra and a PostgreSQL server.
OPTIONAL_GOALS = {"step_throughput_vs_dbos"}


def render(result: dict[str, Any]) -> str:
    rows = [
        ("plain Celery no-op tasks/s", result["bare_celery_tasks_per_s"], ""),
        ("celery-agents steps/s", result["steps_per_s"], ""),
        ("  throughput ratio (goal >= 0.5)", result["step_throughput_ratio"], ""),
        ("  ceiling: no-op task + one model call", result["step_throughput_ratio_ceiling"], ""),
        (
            "plain Celery round trip p50 / p99",
            result["bare_celery_roundtrip_p50_ms"],
            result["bare_celery_roundtrip_p99_ms"],
        ),
        ("step round trip p50 / p99", result["step_latency_p50_ms"], result["step_latency_p99_ms"]),
        ("  latency ratio p50 (goal <= 2)", result["step_latency_ratio"], ""),
        ("  floor: Celery + one model call", result["step_latency_ratio_floor"], ""),
        *[(f"  step {k} p50 (ms)", v, "") for k, v in result["step_latency_parts_p50_ms"].items()],
        ("naive Celery loop (same model call) steps/s", result["naive_steps_per_s"], ""),
        ("  steps/s vs naive (goal >= 0.95)", result["step_throughput_vs_naive"], ""),
        ("naive step round trip p50", result["naive_step_p50_ms"], ""),
        ("  step p50 vs naive", result["step_latency_vs_naive"], ""),
        ("  CPU per step vs naive (goal <= 1.10)", result["cpu_per_step_vs_naive"], ""),
        (
            "model over HTTP: step p50 / naive p50",
            result["http_model_step_p50_ms"],
            result["http_model_naive_step_p50_ms"],
        ),
        ("  step p50 vs naive, model over HTTP (goal <= 1.10)", result["step_latency_vs_naive_http"], ""),
        ("own CPU ms per step (minus the model call)", result["own_cpu_ms_per_step"], ""),
        (
            f"slow model: {result['slow_model_sessions']} sessions x 3 steps: wall s / steps/s",
            result["slow_model_wall_s"],
            result["slow_model_steps_per_s"],
        ),
        (
            "  peak RSS MB (worker tree) / most in flight",
            result["slow_model_peak_rss_mb"],
            result["slow_model_max_in_flight"],
        ),
        ("  worker CPU ms per step (goal <= 3)", result["slow_model_worker_cpu_ms_per_step"], ""),
        (
            "  floor: no-op task + a third of 2 model calls + 1 tool call (ms)",
            result["slow_model_cpu_floor_ms_per_step"],
            "",
        ),
        (
            f"limited: {result['limited_sessions']} sessions under {result['limited_limit_rpm']} rpm: wall s / 429s",
            result["limited_wall_s"],
            result["limited_429_failures"],
        ),
        (
            "  calls per minute ÷ limit / Redis commands per step",
            result["limited_rate_vs_limit"],
            result["limited_redis_commands_per_step"],
        ),
        ("completion -> step started p50 / p99", result["complete_to_step_p50_ms"], result["complete_to_step_p99_ms"]),
        ("bytes written, commit of step 2 / 200", result["bytes_written_step_2"], result["bytes_written_step_200"]),
        ("  write growth ratio (goal <= 1.01)", result["write_growth_ratio"], ""),
        ("paused session: Redis bytes (goal <= 4096)", result["paused_session_bytes"], ""),
        ("agents session pending --json (ms, goal <= 250)", result["cli_pending_wall_ms"], ""),
        ("demo model call via litellm: wall p50 / CPU", result["model_call_wall_p50_ms"], result["model_call_cpu_ms"]),
        (
            "Redis commands per no-op task / step",
            result["bare_celery_redis_commands_per_task"],
            result["redis_commands_per_step"],
        ),
        ("  per step under a limit that never binds", result["redis_commands_per_step_limited"], ""),
        (
            "CPU ms per task / step: worker",
            result["bare_celery_cpu_ms_per_task"].get("worker", 0.0),
            result["cpu_ms_per_step"].get("worker", 0.0),
        ),
    ]
    if "dbos_steps_per_s" in result:
        rows += [
            (f"DBOS {result['dbos_version']} (same model call) steps/s", result["dbos_steps_per_s"], ""),
            ("  steps/s vs DBOS (goal >= 1.5)", result["step_throughput_vs_dbos"], ""),
            (
                "DBOS workflow p50: in process / queued",
                result["dbos_step_p50_ms"],
                result["dbos_queued_step_p50_ms"],
            ),
            (
                "DBOS send -> next step started p50 / p99",
                result["dbos_resume_p50_ms"],
                result["dbos_resume_p99_ms"],
            ),
            (
                "  CPU ms per step: DBOS workers / postgres",
                result["dbos_cpu_ms_per_step"].get("worker", 0.0),
                result["dbos_cpu_ms_per_step"].get("postgres", 0.0),
            ),
        ]
    else:
        rows.append(("DBOS phase skipped", result.get("dbos_skipped", ""), ""))
    if "metrics_throughput_on_vs_off" in result:
        rows += [
            (
                "steps/s without / with --metrics-port",
                result["metrics_off_steps_per_s"],
                result["metrics_on_steps_per_s"],
            ),
            ("  with ÷ without", result["metrics_throughput_on_vs_off"], ""),
        ]
    if "cluster_steps_per_s" in result:
        rows += [
            ("steps/s on a 3-primary Redis Cluster", result["cluster_steps_per_s"], ""),
            ("  Cluster ÷ one Redis", result["cluster_vs_single_steps_per_s"], ""),
        ]
    lines = [
        f"celery-agents benchmark ({'quick' if result['quick'] else 'full'}; {result['workers']} steps processes; "
        f"{result['cores']} cores; redis-server {result['redis_server']})"
    ]
    for label, a, b in rows:
        fa = f"{a:,.2f}" if isinstance(a, float) else str(a)
        fb = f"{b:,.2f}" if isinstance(b, float) else str(b)
        lines.append(f"  {label:<42} {fa:>12} {fb:>12}")
    missed = [goal for goal, met in result["goals_met"].items() if not met]
    lines.append("  goals: " + ("all met" if not missed else "not met: " + "; ".join(missed)))
    return "\n".join(lines)


def _meets(value: float, op: str, limit: float) -> bool:
    return {">=": value >= limit, "<=": value <= limit, "<": value < limit}[op]


def goals_met(result: dict[str, Any]) -> dict[str, bool]:
    """Each goal of docs/performance.md, met or not in this run."""
    return {
        f"{k} {op} {lim}": _meets(result[k], op, lim)
        for k, op, lim in GOALS
        if k not in OPTIONAL_GOALS or result.get(k) is not None
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a short run for CI smoke tests")
    parser.add_argument(
        "--workers",
        type=int,
        default=default_step_processes(),
        help="steps processes of `agents worker` and of the naive loop, prefork processes of bare Celery "
        "(default: one per core, as `agents worker` runs)",
    )
    parser.add_argument(
        "--metrics-port",
        action="store_true",
        help="also measure step throughput with and without `agents worker --metrics-port`, in alternating rounds",
    )
    parser.add_argument(
        "--dbos-url",
        default=database_url(None),
        help="a PostgreSQL server for the DBOS phase, as postgresql://user:password@host:port/db: the run creates "
        "its own database there and drops it at the end (default: $DBOS_DATABASE_URL, else the local server "
        "over its unix socket, else 127.0.0.1:5432)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="also run the throughput phase with state on a local 3-primary Redis Cluster (redis-server and "
        "redis-cli 7 with cluster support)",
    )
    args = parser.parse_args(argv)
    try:
        result = run(args.quick, args.workers, args.metrics_port, args.dbos_url, args.cluster)
    except KeyboardInterrupt:
        print("interrupted; every process the benchmark started was stopped", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
