"""What streaming costs a step: worker CPU and Redis commands per step, streaming on and off, for a
500-token answer.

    python bench/probes/stream_cost.py [--steps N] [--http-steps N] [--tokens 500] [--token-ms 20] [--json]

Starts a private redis-server, one `agents worker` (one steps process) and the local model server
(`bench/slow_model.py --delay 0 --tokens N`, and `--token-ms` between chunks), then, for each case,
publishes one-step sessions (manual drive, no tools), each followed as `agents logs --follow` follows
one (a call streams only while someone does), waits for all to complete, and divides the worker's CPU (its whole
process tree, `bench/processes.py`) and the Redis commands (INFO commandstats, the commands run
inside scripts included) by the steps; `--pairs` runs of each case, off and on in turn, give the
medians and the median of the pairs' CPU ratios (a shared machine drifts between runs):

- `demo`: the offline demo model asked to "count to N" (an answer of about N tokens, produced at
  once): what the live output itself costs (the batch of deltas written, deleted by the commit);
- `http`: the local server, streaming the N-token answer one token per chunk as OpenAI does, all
  at once, or answering it whole: the cost of reading a stream through litellm, per chunk;
- `http_paced`: the same, a chunk every `--token-ms` (20 ms: 50 tokens a second, a provider's pace),
  so that the answer arrives over seconds and the live output is written in batches by time; its
  "off" case gets the whole answer when such a model would have made it, N times `--token-ms` later,
  so that both steps last as long (and hold their leases as long);
- `http_unwatched`: the `http` case with nobody following: the call is asked for whole, as every
  session of a fleet nobody watches asks it.

The same agent with `"stream": false` is the "off" case of each. Prints one JSON object (`--json`)
or a table, with `cpu_ratio` (on ÷ off) and `extra_commands` (on - off) per case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness import Agents, CpuSplit, command_counts, command_delta, served, wait_until
from bench.processes import Processes


def _agent(case: str, stream: bool, url: str) -> dict[str, Any]:
    if case == "demo":
        return {"slug": "bench-stream", "model": "demo/bench", "stream": stream}
    return {"slug": "bench-stream-http", "model": "openai/bench", "apiBase": url, "stream": stream}


#: how long the probe says it follows each session (ms): longer than any run, so that no renewal
#: falls inside the commands counted
WATCH_MS = 600_000


def _run(agents: Agents, agent: Any, prompt: str, n: int, cpu_of: Any, watch: bool = True) -> dict[str, Any]:
    """n one-step sessions, each followed unless not `watch` (a model call streams only while
    someone follows its session: `Client.watch`), published and completed; CPU (ms) and Redis
    commands per step."""
    keys = agents.store.keys
    sids = agents.create(n, agent=agent, text=prompt)
    for sid in sids if watch else []:
        agents.store.scripts.run("watch", [keys.meta(sid)], [WATCH_MS])
    done_before = agents.client.zcard(keys.state_index("completed"))
    before = command_counts(agents.client)
    cpu = cpu_of()
    t0 = time.perf_counter()
    for sid in sids:
        agents.dispatcher.step(sid, 1, "bench")
    wait_until(lambda: agents.client.zcard(keys.state_index("completed")) - done_before >= n, 600, f"{n} steps")
    elapsed = time.perf_counter() - t0
    cpu_ms = cpu.per_task(n)
    per_step, detail = command_delta(before, command_counts(agents.client), n)
    failed = agents.client.zcard(keys.state_index("failed"))
    if failed:
        raise RuntimeError(f"{failed} sessions failed")
    return {
        "worker_cpu_ms_per_step": cpu_ms["worker"],
        "redis_commands_per_step": round(per_step, 2),
        "steps_per_s": round(n / elapsed, 1),
        "commands": detail,
    }


def _case(run_of: Any, case: str, url: str, prompt: str, n: int, pairs: int, watch: bool = True) -> dict[str, Any]:
    """One case, streaming on and off: `pairs` runs of each in turn, their medians and ratios."""
    from celery_agents.tools.resolve import parse_agent

    for stream in (True, False):
        run_of(parse_agent(_agent(case, stream, url)), prompt, max(10, n // 10), watch)  # warm up
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    for _ in range(pairs):  # off then on, in turn: a drift of the machine hits both alike
        for stream in (False, True):
            runs[stream].append(run_of(parse_agent(_agent(case, stream, url)), prompt, n, watch))
    out: dict[str, Any] = {}
    for stream, key in ((True, f"{case}_on"), (False, f"{case}_off")):
        mine = runs[stream]
        out[key] = {
            "worker_cpu_ms_per_step": round(statistics.median(r["worker_cpu_ms_per_step"] for r in mine), 3),
            "redis_commands_per_step": statistics.median(r["redis_commands_per_step"] for r in mine),
            "steps_per_s": statistics.median(r["steps_per_s"] for r in mine),
            "commands": mine[-1]["commands"],
        }
    # Each pair's ratio, then their median: a pair ran within a minute of itself.
    ratios = [
        on["worker_cpu_ms_per_step"] / off["worker_cpu_ms_per_step"]
        for on, off in zip(runs[True], runs[False], strict=True)
    ]
    out[f"{case}_cpu_ratio"] = round(statistics.median(ratios), 3)
    out[f"{case}_cpu_ratios"] = [round(r, 3) for r in ratios]
    extra = out[f"{case}_on"]["redis_commands_per_step"] - out[f"{case}_off"]["redis_commands_per_step"]
    out[f"{case}_extra_commands"] = round(extra, 2)
    return out


def measure(steps: int, http_steps: int, tokens: int, pairs: int = 5, token_ms: float = 20.0) -> dict[str, Any]:
    out: dict[str, Any] = {"tokens": tokens, "token_ms": token_ms}
    with Processes() as procs:
        url = procs.redis_server()
        fast_url = procs.slow_model(0.0, tokens=tokens)
        paced_url = procs.slow_model(0.0, tokens=tokens, token_ms=token_ms) if token_ms else ""
        prefix = f"str{uuid.uuid4().hex[:6]}"
        agents = Agents(url, prefix)
        with served(procs, agents, 1, "stream") as worker:

            def run_of(agent: Any, prompt: str, n: int, watch: bool) -> dict[str, Any]:
                return _run(agents, agent, prompt, n, lambda: CpuSplit(procs, worker.pid), watch)

            out.update(_case(run_of, "demo", "", f"Count to {tokens}.", steps, pairs))
            out.update(_case(run_of, "http", fast_url, "Hello", http_steps, pairs))
            if paced_url:
                out.update(_case(run_of, "http_paced", paced_url, "Hello", http_steps, pairs))
            unwatched = _case(run_of, "http", fast_url, "Hello", http_steps, pairs, watch=False)
            out.update({k.replace("http", "http_unwatched", 1): v for k, v in unwatched.items()})
    out["load_1m"] = os.getloadavg()[0]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run of the demo case")
    parser.add_argument("--http-steps", type=int, default=100, help="steps per run of the http case")
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--pairs", type=int, default=5, help="runs of each case, on and off in turn")
    parser.add_argument(
        "--token-ms", type=float, default=20.0, help="the http_paced case: a chunk every T ms (0: no such case)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.steps, args.http_steps, args.tokens, args.pairs, args.token_ms)
    if args.json:
        print(json.dumps(result))
        return 0
    for case in [c for c in ("demo", "http", "http_paced", "http_unwatched") if f"{c}_on" in result]:
        on, off = result[f"{case}_on"], result[f"{case}_off"]
        print(f"{case}: {args.tokens}-token answer")
        print(
            f"  worker CPU ms/step   on {on['worker_cpu_ms_per_step']:8.3f}   off {off['worker_cpu_ms_per_step']:8.3f}"
            f"   ratio {result[f'{case}_cpu_ratio']:.3f}"
        )
        print(
            f"  Redis commands/step  on {on['redis_commands_per_step']:8.2f}"
            f"   off {off['redis_commands_per_step']:8.2f}"
            f"   extra {result[f'{case}_extra_commands']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
