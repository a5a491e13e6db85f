"""Profile `agents worker` pool processes while they run many steps, with py-spy.

    pip install py-spy
    python bench/probes/profile_worker.py [--steps N] [--workers N] [--out stacks.txt] [--gil]

Starts a private redis-server and one `agents worker`, publishes N one-step sessions (the demo
model, no tools), records every process of the worker with `py-spy record --subprocesses` in raw
(collapsed stacks) form, and prints the share of samples in which chosen frames appear, so that the
cost of a step can be split into Celery/kombu, litellm, the store, pydantic and the rest.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import shutil
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Agents, served, wait_until
from bench.processes import Processes

# (label, substring of a frame) — a sample counts for a label if any frame matches
BUCKETS = [
    ("step task (celery_agents.tasks.step.step)", "step (celery_agents/tasks/step.py"),
    ("  run_step", "run_step (celery_agents/runtime/step.py"),
    ("    litellm.completion", "completion (litellm/"),
    ("      litellm cost calculation", "response_cost_calculator"),
    ("    StepStore.begin_step", "begin_step (celery_agents/store/steps.py"),
    ("    StepStore.commit", "commit (celery_agents/store/steps.py"),
    ("    StepStore.journal_put", "journal_put (celery_agents/store/steps.py"),
    ("    LeaseKeeper (thread start/join)", "(celery_agents/runtime/lease.py"),
    ("    build_messages", "build_messages (celery_agents/scheduler/messages.py"),
    ("    pydantic (anywhere in the step)", "pydantic"),
    ("  publish_after_step", "publish_after_step"),
    ("worker_context", "worker_context (celery_agents/tasks/context.py"),
    ("kombu/celery outside the task", "kombu/"),
    ("idle (waiting on the pool pipe / select)", "select"),
]

# a sample is in the pool if one of its frames is one of these: the threads pool's workers (what
# `agents worker` runs steps in) or a prefork pool process
POOL_FRAMES = ("(concurrent/futures/thread.py", "(celery/concurrency/asynpool.py", "(billiard/pool.py")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--gil",
        action="store_true",
        help="sample only the thread holding the GIL (where the processes' Python CPU goes, not where threads wait)",
    )
    args = parser.parse_args()
    pyspy = shutil.which("py-spy")
    if not pyspy:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    with Processes() as procs, contextlib.ExitStack() as stack:
        url = procs.redis_server()
        prefix = f"pw{uuid.uuid4().hex[:6]}"
        agents = Agents(url, prefix)
        worker = stack.enter_context(served(procs, agents, args.workers, "agents"))
        for sid in agents.create(20, agent=agents.step_agent, text="Hello"):
            agents.step_roundtrip(sid)
        sids = agents.create(args.steps, agent=agents.step_agent, text="Hello")
        raw = procs.dir / "stacks.txt"
        spy = procs.start(
            "py-spy",
            [
                pyspy,
                "record",
                "--pid",
                str(worker.pid),
                "--subprocesses",
                "--format",
                "raw",
                "--rate",
                "500",
                "--output",
                str(raw),
                "--nonblocking",
                *(["--gil"] if args.gil else []),
            ],
        )
        time.sleep(1.0)
        done_key = agents.store.keys.state_index("completed")
        before = agents.client.zcard(done_key)
        t0 = time.perf_counter()
        for sid in sids:
            agents.dispatcher.step(sid, 1, "bench")
        wait_until(lambda: agents.client.zcard(done_key) - before >= len(sids), 600, "steps")
        elapsed = time.perf_counter() - t0
        spy.send_signal(2)
        spy.wait(timeout=30)
        print(f"{len(sids)} steps in {elapsed:.2f} s: {len(sids) / elapsed:.1f} steps/s")
        report(raw)
        if args.out:
            shutil.copy(raw, args.out)
    return 0


def report(raw: Path) -> None:
    per_thread: collections.Counter[str] = collections.Counter()
    hits: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        # only where steps run: the pool's threads (threads pool) or its processes (prefork)
        frames = stack.split(";")
        if not any(any(pool in f for pool in POOL_FRAMES) for f in frames):
            continue
        total += n
        per_thread[frames[0]] += n
        for label, needle in BUCKETS:
            if any(needle in f for f in frames):
                hits[label] += n
    print(f"pool-process samples: {total}")
    for label, _ in BUCKETS:
        print(f"  {100 * hits[label] / max(total, 1):5.1f}%  {label}")


if __name__ == "__main__":
    sys.exit(main())
