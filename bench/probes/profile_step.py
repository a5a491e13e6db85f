"""Where a step's time goes, in one process: the pieces of `run_step` timed apart, the Redis
round trips it makes counted, and a pyinstrument profile of many steps.

    python bench/probes/profile_step.py [--steps N] [--html out.html]

Runs on a private redis-server (or `AGENTS_REDIS_URL`), with the bench agent (demo model, no tools).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import redis

from bench.harness import STEP_AGENT, percentile
from bench.processes import Processes


class InstantModel:
    """The demo model's answer without litellm: what the step costs around the model call."""

    def complete(self, request: Any) -> Any:
        from celery_agents.model import LlmTurn, Usage

        return LlmTurn(
            text="(offline demo model) You said: Hello",
            usage=Usage(prompt_tokens=3, completion_tokens=9),
            model="demo/bench",
        )


class RoundTrips:
    """Counts commands sent by one client (a pipeline counts once) by name."""

    def __init__(self, client: redis.Redis) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        inner = client.execute_command

        def counted(*args: Any, **kw: Any) -> Any:
            name = str(args[0]).upper()
            if name == "EVALSHA":
                name = f"EVALSHA {self.script_names.get(str(args[1]), '?')}"
            self.counts[name] += 1
            return inner(*args, **kw)  # type: ignore[no-untyped-call]

        client.execute_command = counted  # type: ignore[method-assign]
        pipeline_execute = redis.client.Pipeline.execute

        def counted_pipeline(pipe: Any, *a: Any, **kw: Any) -> Any:
            if pipe.command_stack:
                self.counts["PIPELINE(" + ",".join(str(c[0][0]) for c in pipe.command_stack) + ")"] += 1
            return pipeline_execute(pipe, *a, **kw)

        redis.client.Pipeline.execute = counted_pipeline  # type: ignore[method-assign,assignment]
        self.script_names: dict[str, str] = {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--html", default="")
    args = parser.parse_args()

    with Processes() as procs:
        url = os.environ.get("AGENTS_REDIS_URL") or procs.redis_server()
        prefix = f"prof{uuid.uuid4().hex[:6]}"
        from celery_agents.config import Settings
        from celery_agents.llm import LitellmPort
        from celery_agents.model import UserQuery
        from celery_agents.runtime import run_step
        from celery_agents.store import Store, client_for_url
        from celery_agents.tasks.config import Dispatcher, make_app
        from celery_agents.tools.resolve import parse_agent

        t0 = time.perf_counter()
        from celery_agents.llm.adapter import ensure_litellm

        ensure_litellm()
        print(f"import + set up litellm: {(time.perf_counter() - t0) * 1000:.0f} ms")
        settings = Settings(redis_url=url, prefix=prefix)
        store = Store(client_for_url(url), settings)
        agent = parse_agent(STEP_AGENT)
        query = UserQuery(text="Hello")

        def sessions(n: int) -> list[str]:
            return [store.create_session(agent, query).session_id for _ in range(n)]

        def timed_steps(llm: Any, sids: list[str]) -> list[float]:
            out = []
            for sid in sids:
                t = time.perf_counter()
                res = run_step(store, sid, 1, llm=llm, tools=None, owner="prof")  # type: ignore[arg-type]
                out.append((time.perf_counter() - t) * 1000)
                assert res.outcome == "committed", res
            return out

        litellm_port = LitellmPort()
        timed_steps(litellm_port, sessions(30))  # warm up
        n = args.steps
        with_litellm = timed_steps(litellm_port, sessions(n))
        without = timed_steps(InstantModel(), sessions(n))
        for label, walls in (("demo model through litellm", with_litellm), ("instant model, no litellm", without)):
            print(f"run_step, {label:27}: p50 {percentile(walls, 50):.2f} ms, mean {sum(walls) / n:.2f} ms")

        from celery_agents.llm.adapter import ensure_litellm as _e
        from celery_agents.scheduler import LlmRequest
        from celery_agents.scheduler.messages import build_messages

        lit = _e()
        msgs = build_messages(agent, store.turns(sessions(1)[0]))
        req = LlmRequest(agent=agent, messages=msgs, tools=[], session_id="x", version=1)
        t = time.perf_counter()
        for _ in range(200):
            litellm_port.complete(req)
        print(f"LitellmPort.complete (demo provider) alone: {(time.perf_counter() - t) * 5:.2f} ms per call")
        t = time.perf_counter()
        for _ in range(200):
            lit.completion(model="demo/bench", messages=msgs)
        print(f"litellm.completion (demo provider) alone: {(time.perf_counter() - t) * 5:.2f} ms per call")

        app = make_app(settings, main="prof")
        dispatcher = Dispatcher(app)
        sid = sessions(1)[0]
        dispatcher.step(sid, 99, "warm")
        t = time.perf_counter()
        for _ in range(500):
            dispatcher.step(sid, 99, "prof")
        print(f"Dispatcher.step (send_task) publish: {(time.perf_counter() - t) * 2:.3f} ms per call")
        from celery_agents.tasks.queues import redis_lists

        store.client.delete(*redis_lists(store.keys.celery_prefix, "steps"))

        trips = RoundTrips(store.client)
        from celery_agents.store.scripts import script_names

        trips.script_names = {store.scripts.sha(name): name for name in script_names()}
        sids = sessions(50)
        trips.counts.clear()
        timed_steps(litellm_port, sids)
        print("Redis round trips per step (client side, this process):")
        total = 0.0
        for name, count in trips.counts.most_common():
            print(f"  {count / 50:5.2f}  {name}")
            total += count / 50
        print(f"  {total:5.2f}  total")

        from pyinstrument import Profiler

        sids = sessions(n)
        profiler = Profiler(interval=0.0002)
        profiler.start()
        timed_steps(litellm_port, sids)
        profiler.stop()
        print(profiler.output_text(unicode=False, color=False, show_all=False))
        if args.html:
            Path(args.html).write_text(profiler.output_html())
        store.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
