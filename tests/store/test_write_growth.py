"""A measurement: the bytes a step's commit sends to Redis must not grow with the transcript.

One session runs 200 steps (the model asks for one tool, the tool answers, again and again). The
commits of step 2 and of step 200 are the same kind of step (a tools step) and must cost about the
same. Run with `-s` to see the figures.
"""

from __future__ import annotations

import itertools
from typing import Any

from celery_agents.model import LlmTurn
from celery_agents.scheduler import LlmRequest
from celery_agents.store import Store
from celery_agents.store.scripts import script_source
from tests.scheduler.fakes import RecordingTools, llm_turn
from tests.store.scenario import begin, commit, decide, start

STEPS = 200


class EndlessModel:
    """Always asks for one more tool call, with a fresh id of constant length."""

    def __init__(self) -> None:
        self._n = itertools.count(1)

    def complete(self, request: LlmRequest) -> LlmTurn:
        n = next(self._n)
        return llm_turn((f"call_{n:06d}", "sync_a", '{"city": "Paris"}'), text="Let me check the weather.")


def _net_input_bytes(store: Store) -> int:
    return int(store.client.info("stats")["total_net_input_bytes"])


def _arg_bytes(keys: list[str], args: list[Any]) -> int:
    return sum(len(str(k).encode()) for k in keys) + sum(len(str(a).encode()) for a in args)


def test_commit_bytes_do_not_grow_with_the_transcript(store: Store) -> None:
    # loaded up front, so that no measured commit carries the script's source
    store.client.script_load(script_source("commit_step"))
    sid = start(store)
    model, tools = EndlessModel(), RecordingTools()
    sent: dict[int, int] = {}  # step -> bytes Redis received for its commit
    args: dict[int, int] = {}  # step -> bytes of the commit script's keys and arguments

    run = store.scripts.run
    captured: list[int] = []

    def spy(name: str, keys: list[str], argv: list[Any], client: Any = None) -> Any:
        if name == "commit_step":
            captured.append(_arg_bytes(keys, argv))
        return run(name, keys, argv, client)

    store.scripts.run = spy  # type: ignore[method-assign]
    for n in range(1, STEPS + 1):
        loaded = begin(store, sid)
        t = decide(store, loaded, llm=model, tools=tools)  # type: ignore[arg-type]
        before = _net_input_bytes(store)
        res = commit(store, sid, loaded, t)
        sent[n] = _net_input_bytes(store) - before
        args[n] = captured[-1]
        assert res.outcome == "ok"

    h = store.header(sid)
    assert (h.steps, h.turn_count) == (STEPS, STEPS + 1)
    assert len(tools.runs) == STEPS // 2

    print(
        f"\nbytes written by the commit of step 2: {sent[2]} (script arguments {args[2]}); "
        f"of step {STEPS}: {sent[STEPS]} (script arguments {args[STEPS]}); "
        f"ratio {sent[STEPS] / sent[2]:.3f}; transcript {store.client.memory_usage(store.keys.turns(sid))} bytes"
    )
    print(f"model steps: step 1 {sent[1]} bytes, step {STEPS - 1} {sent[STEPS - 1]} bytes")
    assert sent[STEPS] / sent[2] < 1.5
    assert args[STEPS] / args[2] < 1.5
    assert sent[STEPS - 1] / sent[1] < 1.5
