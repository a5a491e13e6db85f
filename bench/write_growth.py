"""Bytes a step's commit sends to Redis, early and late in one long session.

One session is driven inline for 200+ steps with `run_step` and fake ports: the model always asks
for one runSync tool call (ids of constant length) until the last step, the tool answers at once.
Odd steps call the model, even steps run the tool, so step 2 and step 200 are the same kind of
step. Two figures per commit:

- `total_net_input_bytes` of `INFO stats` read just before and just after the commit, minus the
  bytes of one `INFO stats` command itself (measured the same way with nothing in between). Run
  this with no other client writing to the Redis (no workers yet).
- the bytes of the keys and arguments the bench hands to the `commit_step` script.
"""

from __future__ import annotations

import itertools
from typing import Any

from celery_agents.config import Settings
from celery_agents.model import AgentSpec, CallOutcome, LlmTurn, ToolCall, TrackedCall, Usage, UserQuery
from celery_agents.runtime import run_step
from celery_agents.scheduler import LlmRequest
from celery_agents.store import Store, client_for_url
from celery_agents.store.scripts import script_source
from celery_agents.tools.resolve import parse_agent

AGENT: dict[str, Any] = {
    "slug": "bench-growth",
    "model": "demo/bench",
    "maxSteps": 100_000,
    "tools": [
        {
            "name": "lookup",
            "description": "Looks a city up.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "command": ["true"],
        }
    ],
}


class EndlessModel:
    """Asks for one `lookup` call per turn (ids of constant length) until `tool_turns` have been asked."""

    def __init__(self, tool_turns: int) -> None:
        self.tool_turns = tool_turns
        self._n = itertools.count(1)

    def complete(self, request: LlmRequest) -> LlmTurn:
        n = next(self._n)
        usage = Usage(prompt_tokens=100 + n, completion_tokens=10, total_tokens=110 + n)
        if n > self.tool_turns:
            return LlmTurn(text="Done.", usage=usage, model="demo/bench")
        call = ToolCall(id=f"call_{n:06d}", name="lookup", arguments='{"city": "Paris"}')
        return LlmTurn(text="Let me look that up.", tool_calls=[call], usage=usage, model="demo/bench")


class InstantTool:
    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        return CallOutcome(state="completed", result={"city": "Paris", "temperature_c": 21}, duration_ms=0.1)


def _info_bytes(store: Store) -> int:
    return int(store.client.info("stats")["total_net_input_bytes"])


def measure(redis_url: str, prefix: str, steps: int = 200) -> dict[str, Any]:
    """Drive one session `steps` steps (then its final answer); bytes of each commit."""
    store = Store(client_for_url(redis_url), Settings(redis_url=redis_url, prefix=prefix))
    store.client.script_load(script_source("commit_step"))  # no measured commit loads it
    agent = parse_agent(AGENT)
    sid = store.create_session(agent, UserQuery(text="What is the weather in Paris?")).session_id
    info_self = min(-_info_bytes(store) + _info_bytes(store) for _ in range(5))

    net: list[int] = []
    args: list[int] = []
    commit = store.commit
    run_script = store.scripts.run

    def spy_script(name: str, keys: list[str], argv: list[Any], client: Any = None) -> Any:
        if name == "commit_step":
            args.append(sum(len(str(k).encode()) for k in keys) + sum(len(str(a).encode()) for a in argv))
        return run_script(name, keys, argv, client)

    def measured_commit(*a: Any, **kw: Any) -> Any:
        before = _info_bytes(store)
        res = commit(*a, **kw)
        net.append(_info_bytes(store) - before - info_self)
        return res

    store.scripts.run = spy_script  # type: ignore[method-assign,assignment]
    store.commit = measured_commit  # type: ignore[method-assign]
    llm, tools = EndlessModel(tool_turns=(steps + 1) // 2), InstantTool()
    version = 1
    for _ in range(steps + 1):
        res = run_step(store, sid, version, llm=llm, tools=tools, owner="bench")
        if res.outcome != "committed":
            raise RuntimeError(f"step at version {version} did not commit: {res.outcome}")
        version = res.version
    h = store.header(sid)
    turns_bytes = store.client.memory_usage(store.keys.turns(sid)) or 0
    store.client.close()
    return {
        "bytes_written_step_1": net[0],
        "bytes_written_step_2": net[1],
        "bytes_written_step_199": net[steps - 2],
        "bytes_written_step_200": net[steps - 1],
        "write_growth_ratio": net[steps - 1] / net[1],
        "commit_args_bytes_step_2": args[1],
        "commit_args_bytes_step_200": args[steps - 1],
        "write_growth_steps": h.steps,
        "write_growth_transcript_bytes": turns_bytes,
        "write_growth_method": "INFO stats total_net_input_bytes around Store.commit, minus one INFO's own bytes",
    }
