"""The benchmark's DBOS phase: the same model call as durable DBOS steps, on PostgreSQL.

`bench_dbos` creates a throwaway database on the PostgreSQL server of `--dbos-url` /
`DBOS_DATABASE_URL` (default: the local server, over its unix socket, else 127.0.0.1), starts as
many `bench/dbos_loop.py` executors as `agents worker` runs steps processes, measures, stops them
and drops the database. When DBOS (the `bench` extra) is not installed or no server answers, it
returns only `dbos_skipped`, a reason, and the run goes on without the DBOS keys.

- `dbos_step_p50_ms`: one-step workflows one at a time, `DBOS.start_workflow` → `get_result()`
  inside the first executor (DBOS's own path: no queue, the result handed over in process);
- `dbos_queued_step_p50_ms`: the same enqueued from the benchmark with `DBOSClient.enqueue` →
  `get_result()` (polled every ms): the path that crosses processes, as a celery-agents step does;
- `dbos_steps_per_s`: N one-step workflows enqueued back to back with `DBOSClient.enqueue`; time
  from the first enqueue until N are `SUCCESS` in `dbos.workflow_status`;
- `dbos_resume_p50_ms`: workflows that set an event and wait in `DBOS.recv`; one at a time, sent
  `DBOS.send` (`DBOSClient.send`), timed from just before the send (the benchmark's clock) to the
  start of the step after `recv` (the executor's clock, same machine).
"""

from __future__ import annotations

import contextlib
import getpass
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Sizes, default_step_processes, percentile
from bench.processes import ROOT, Processes, tree_cpu_seconds

LOCAL_SERVERS = (
    f"postgresql://{getpass.getuser()}@/postgres?host=/var/run/postgresql",
    "postgresql://postgres@/postgres?host=/var/run/postgresql",
    "postgresql://postgres@127.0.0.1:5432/postgres",
)


def missing_dbos() -> str | None:
    """Why the phase cannot run for want of packages, or None."""
    try:
        import dbos  # noqa: F401
        import psycopg  # noqa: F401
    except ImportError as e:
        return f"DBOS is not installed ({e.name}): pip install -e '.[bench]'"
    return None


def reachable_server(url: str | None) -> tuple[str | None, str]:
    """The first server URL that accepts a connection (`url`, else the local candidates), and why
    none did."""
    import psycopg

    errors = []
    for candidate in [url] if url else LOCAL_SERVERS:
        try:
            psycopg.connect(candidate, connect_timeout=3).close()
            return candidate, ""
        except psycopg.Error as e:
            errors.append(f"{redacted(candidate)}: {str(e).strip().splitlines()[0] if str(e).strip() else e}")
    return None, "PostgreSQL cannot be reached (" + "; ".join(errors) + ")"


def redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def with_database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@contextlib.contextmanager
def throwaway_database(server: str, name: str, synchronous_commit: str) -> Any:
    """A fresh database on `server` for this run, dropped at the end (its connections ended)."""
    import psycopg
    from psycopg import sql

    url = create_database(server, name, synchronous_commit)
    try:
        yield url
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class CannotCreate(Exception):
    pass


def create_database(server: str, name: str, synchronous_commit: str) -> str:
    import psycopg
    from psycopg import sql

    try:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET synchronous_commit = {}").format(
                    sql.Identifier(name), sql.Literal(synchronous_commit)
                )
            )
    except psycopg.Error as e:
        raise CannotCreate(f"cannot create database {name} on {redacted(server)}: {e}") from e
    return with_database(server, name)


def bench_dbos(
    procs: Processes,
    prefix: str,
    workers: int,
    sizes: Sizes,
    url: str | None,
    queue: list[str] | None = None,
    synchronous_commit: str = "off",
) -> dict[str, Any]:
    """The DBOS keys, or only `dbos_skipped`. `queue`: extra `bench/dbos_loop.py` flags
    (`--concurrency`, `--polling`). `synchronous_commit` of the run's database: `off` by default,
    as durable as the benchmark's redis-server, which writes nothing to disk (`on`: every commit
    waits for its WAL flush)."""
    reason = missing_dbos()
    if reason is None:
        server, reason = reachable_server(url)
    if reason:
        return {"dbos_skipped": reason}
    assert server is not None
    started = time.perf_counter()
    try:
        with throwaway_database(server, f"dbos_{prefix}", synchronous_commit) as db:
            out = run_phase(procs, db, workers, sizes, queue or [])
    except CannotCreate as e:
        return {"dbos_skipped": str(e)}
    out["dbos_phase_wall_s"] = round(time.perf_counter() - started, 1)
    out["dbos_database"] = f"dbos_{prefix} on {redacted(server)} (dropped)"
    out["dbos_synchronous_commit"] = synchronous_commit
    return out


def start_executors(procs: Processes, db: str, workers: int, latency: int, warmup: int, queue: list[str]) -> list[Any]:
    """The executors, the first alone until it has migrated the system database and measured the
    in-process latency (the others idle meanwhile would only add noise), then the rest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTS_", "DBOS_"))}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
    )
    started = []
    for i in range(workers):
        report = procs.dir / f"dbos{i}.json"
        args = [sys.executable, str(ROOT / "bench" / "dbos_loop.py"), "--url", db, "--executor", f"dbos{i}"]
        args += ["--report", str(report), *queue]
        if i == 0:
            args += ["--latency", str(latency), "--warmup", str(warmup)]
        proc = procs.start(f"dbos{i}", args, env)
        started.append((proc, report))
        if i == 0:
            wait_report(procs, proc, report, f"dbos{i}")
    for i, (proc, report) in enumerate(started):
        wait_report(procs, proc, report, f"dbos{i}")
    return [(proc, json.loads(report.read_text())) for proc, report in started]


def wait_report(procs: Processes, proc: Any, report: Any, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not report.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"DBOS executor {name} exited {proc.returncode}:\n{procs.log_tail(name)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"DBOS executor {name} did not start within {timeout} s")
        time.sleep(0.05)


def run_phase(procs: Processes, db: str, workers: int, sizes: Sizes, queue: list[str]) -> dict[str, Any]:
    import psycopg
    from dbos import DBOSClient, EnqueueOptions

    from bench.dbos_loop import APP, QUEUE, one_step

    executors = start_executors(procs, db, workers, sizes.latency, sizes.warmup, queue)
    client = DBOSClient(system_database_url=db, application_name=APP)
    watch = psycopg.connect(db, autocommit=True)
    one = EnqueueOptions(queue_name=QUEUE, workflow_name=one_step.__qualname__)
    try:
        for i in range(sizes.warmup):
            client.enqueue({**one, "workflow_id": f"w{i}"}).get_result(polling_interval_sec=0.001)
        queued = []
        for i in range(sizes.latency):
            t0 = time.perf_counter()
            client.enqueue({**one, "workflow_id": f"l{i}"}).get_result(polling_interval_sec=0.001)
            queued.append((time.perf_counter() - t0) * 1000)

        n = sizes.throughput
        pids = [proc.pid for proc, _ in executors]
        postgres = postmaster_pid(watch)
        cpu0 = cpu_now(pids, postgres)
        t0 = time.perf_counter()
        for i in range(n):
            client.enqueue({**one, "workflow_id": f"t{i}"})
        wait_done(watch, "t%", n)
        elapsed = time.perf_counter() - t0
        cpu1 = cpu_now(pids, postgres)

        # Only as many workflows as the executors run at once can wait in `recv` at a time.
        at_once = sum(report["concurrency"] for _, report in executors)
        resumes = resume_samples(client, sizes.completions, at_once)
    finally:
        watch.close()
        client.destroy()
        for i, (proc, _) in enumerate(executors):
            procs.stop(proc, f"dbos{i}")
    first = executors[0][1]
    return {
        "dbos_steps_per_s": n / elapsed,
        "dbos_step_p50_ms": percentile(first["latency_ms"], 50),
        "dbos_step_p99_ms": percentile(first["latency_ms"], 99),
        "dbos_queued_step_p50_ms": percentile(queued, 50),
        "dbos_queued_step_p99_ms": percentile(queued, 99),
        "dbos_resume_p50_ms": percentile(resumes, 50),
        "dbos_resume_p99_ms": percentile(resumes, 99),
        "dbos_resume_samples": len(resumes),
        "dbos_cpu_ms_per_step": {k: round((cpu1[k] - cpu0[k]) * 1000 / n, 3) for k in cpu1},
        "dbos_processes": workers,
        "dbos_worker_concurrency": first["concurrency"],
        "dbos_queue_polling_sec": first["polling_sec"],
        "dbos_version": importlib.metadata.version("dbos"),
        "dbos_postgres_server": server_version(db),
    }


def resume_samples(client: Any, m: int, at_once: int) -> list[float]:
    """M resume samples, in rounds of at most `at_once` workflows all waiting in `recv` first."""
    samples: list[float] = []
    for first in range(0, m, at_once):
        samples += _resume_round(client, [f"r{i}" for i in range(first, min(m, first + at_once))])
    return samples


def _resume_round(client: Any, ids: list[str]) -> list[float]:
    from bench.dbos_loop import QUEUE, TOPIC, WAITING_EVENT, resume_after_signal

    for wid in ids:
        client.enqueue({"queue_name": QUEUE, "workflow_name": resume_after_signal.__qualname__, "workflow_id": wid})
    for wid in ids:
        if client.get_event(wid, WAITING_EVENT, timeout_seconds=120) is not True:
            raise TimeoutError(f"DBOS workflow {wid} did not reach DBOS.recv within 120 s")
    time.sleep(0.2)  # every one of them is inside recv, not between set_event and recv
    samples = []
    for wid in ids:
        t_wall = time.time()
        client.send(wid, "booked", TOPIC)
        started = client.retrieve_workflow(wid).get_result(polling_interval_sec=0.001)
        samples.append((float(started) - t_wall) * 1000)
    return samples


def wait_done(conn: Any, pattern: str, n: int, timeout: float = 600) -> None:
    """Until `n` workflows whose id matches `pattern` have succeeded; a failed one is an error."""
    deadline = time.monotonic() + timeout
    while True:
        rows = dict(
            conn.execute(
                "SELECT status, count(*) FROM dbos.workflow_status WHERE workflow_uuid LIKE %s GROUP BY status",
                (pattern,),
            ).fetchall()
        )
        if rows.get("ERROR"):
            raise RuntimeError(f"{rows['ERROR']} DBOS workflows failed")
        if rows.get("SUCCESS", 0) >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {n} DBOS workflows: {rows}")
        time.sleep(0.01)


def postmaster_pid(conn: Any) -> int | None:
    """The PostgreSQL server's main process when it runs on this machine and is readable."""
    with contextlib.suppress(Exception):
        backend = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])
        with open(f"/proc/{backend}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    return None


def cpu_now(pids: list[int], postgres: int | None) -> dict[str, float]:
    now = {"worker": sum(tree_cpu_seconds(pid) for pid in pids), "bench": time.process_time()}
    if postgres:
        now["postgres"] = tree_cpu_seconds(postgres)
    return now


def server_version(db: str) -> str:
    import psycopg

    with psycopg.connect(db) as conn:
        return str(conn.execute("SHOW server_version").fetchone()[0])


def database_url(option: str | None) -> str | None:
    return option or os.environ.get("DBOS_DATABASE_URL") or None


def main() -> int:
    """The DBOS phase alone, with the sizes of `bench/run.py` (or smaller)."""
    import argparse
    import uuid

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workers", type=int, default=default_step_processes())
    parser.add_argument("--dbos-url", default=database_url(None))
    parser.add_argument("--throughput", type=int, help="workflows in the throughput phase (default: the run's)")
    parser.add_argument("--concurrency", type=int, help="workflows at once per executor")
    parser.add_argument("--polling", type=float, help="the queue's polling interval (s)")
    parser.add_argument("--synchronous-commit", default="off", choices=["off", "on"])
    args = parser.parse_args()
    sizes = Sizes(args.quick)
    if args.throughput:
        sizes.throughput = args.throughput
    queue = [] if args.concurrency is None else ["--concurrency", str(args.concurrency)]
    queue += [] if args.polling is None else ["--polling", str(args.polling)]
    with Processes() as procs:
        out = bench_dbos(
            procs,
            f"bench{uuid.uuid4().hex[:8]}",
            args.workers,
            sizes,
            args.dbos_url,
            queue,
            args.synchronous_commit,
        )
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
