"""The benchmark's `limited` phase: sessions under a fleet limit below a provider's own.

The model server (`bench/slow_model.py --limit --window`) answers at once, and with a 429 and
`Retry-After` beyond `PROVIDER_RPM` requests a minute, counted over a window of `WINDOW_S`
seconds (a provider's minute, shortened: the phase stays short). `agents limits set` puts the model
under `LIMIT_RPM`, below it. N sessions of the slow-model phase's agent (model call, runSync python
tool, model call) are created in auto drive and their first steps published back to back to one
`agents worker` started as a user starts it, the burst a limit lets start at once shortened as the
provider's minute is (`AGENTS_LIMITS_BURST`: a second of a minute, a tenth of a second of six
seconds), so the phase's figures are a minute's. Measured: the wall time
until every session completed, the 429s the server answered (`limited_429_failures`: model calls
refused; sessions do not fail on them, and none may fail), the model calls per minute the server
answered between its first and last answer ÷ the limit (`limited_rate_vs_limit`), and the Redis
commands per committed step, the admissions and the steps put back included.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

from bench.harness import Agents, command_counts, command_delta, publish_and_wait, served
from bench.in_flight import slow_agent
from bench.processes import Processes

#: the fleet's limit and the provider's, model calls per minute
LIMIT_RPM, PROVIDER_RPM = 600, 720
#: the provider counts its limit over this many seconds (its limit per minute scaled to them)
WINDOW_S = 6.0


def bench_limited(procs: Processes, url: str, prefix: str, step_processes: int, n: int) -> dict[str, Any]:
    from celery_agents.model.admission import ModelLimit
    from celery_agents.tools.resolve import parse_agent

    model_url = procs.slow_model(0.0, limit=round(PROVIDER_RPM * WINDOW_S / 60), window=WINDOW_S)
    prefix = f"{prefix}lim"
    bench = Agents(url, prefix, main="bench_limited")
    store, k = bench.store, bench.store.keys
    agent = parse_agent(slow_agent(model_url))
    store.set_limit(agent.model, ModelLimit(rpm=LIMIT_RPM))
    with served(procs, bench, step_processes, "limited", env={"AGENTS_LIMITS_BURST": str(WINDOW_S / 60)}):
        sids = bench.create(n, agent=agent, text="go", drive="auto", owe=True)
        before = command_counts(store.client)
        wall = publish_and_wait(store, bench.dispatcher, sids, 300, "limited")
        per_step, _ = command_delta(before, command_counts(store.client), 3 * n)
        failed = store.client.zcard(k.state_index("failed"))
        if failed:
            raise RuntimeError(f"{failed} limited sessions failed")
        throttled = int(store.counters().get(("model_calls_throttled", agent.model), 0))
        with urllib.request.urlopen(model_url + "/stats", timeout=10) as reply:
            stats = json.loads(reply.read())
    span = stats["last_at"] - stats["first_at"]
    per_minute = (stats["answered"] - 1) / span * 60 if span > 0 else 0.0
    return {
        "limited_sessions": n,
        "limited_wall_s": round(wall, 3),
        "limited_429_failures": stats["refused"],
        "limited_rate_vs_limit": per_minute / LIMIT_RPM,
        "limited_model_calls": stats["answered"],
        "limited_calls_put_back": throttled,
        "limited_redis_commands_per_step": per_step,
        "limited_limit_rpm": LIMIT_RPM,
        "limited_provider_rpm": PROVIDER_RPM,
        "limited_provider_window_s": WINDOW_S,
    }
