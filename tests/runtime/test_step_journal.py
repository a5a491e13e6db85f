"""`run_step` under at-least-once delivery: journaled inline tool results are reused by a
redelivered step, a step killed before its commit asks the model at most once more, stale copies
do nothing, racing copies commit once. Real Redis, scripted model and tools that count what they do."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_agents.model import CallOutcome, CallState, LlmTurn, TrackedCall, UserTurn
from celery_agents.runtime import run_step
from celery_agents.scheduler import LlmRequest
from celery_agents.store import Store
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import start, step

ROUNDS = 10


class WorkerDied(BaseException):
    """The worker process vanished mid-step (not an error the step could catch and record)."""


def drop_lease(store: Store, sid: str) -> None:
    """The dead worker's lease runs out; the broker redelivers the step message."""
    store.client.delete(store.keys.lease(sid))


def step_events(store: Store, sid: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in store.read_events(sid) if e["type"] == kind]


# -- a journaled model answer is reused ----------------------------------------------------------


def test_a_worker_dying_after_the_answer_and_before_its_commit_costs_at_most_one_more_model_call(
    store: Store, stores: Any
) -> None:
    sid = start(store)
    llm = ScriptedLlm(llm_turn(text="Sunny, 21 degrees."), llm_turn(text="Sunny, 22 degrees."))
    dying = stores()

    def die(*args: Any, **kwargs: Any) -> Any:
        raise WorkerDied

    dying.commit = die  # type: ignore[method-assign]
    with pytest.raises(WorkerDied):
        run_step(dying, sid, 1, llm=llm, tools=RecordingTools(), owner="worker-a")
    assert llm.calls == 1
    assert store.header(sid).version == 1, "nothing was committed"
    assert not store.client.exists(store.keys.journal(sid)), "the answer travels in the commit, not the journal"
    drop_lease(store, sid)

    res = run_step(stores(), sid, 1, llm=llm, tools=RecordingTools(), owner="worker-b")
    assert res.outcome == "committed"
    assert llm.calls == 2, "the redelivered step asked the model once more"
    h = store.header(sid)
    assert (h.status.value, h.response) == ("completed", "Sunny, 22 degrees.")
    assert h.usage.total_tokens == 12, "only the committed call counts"
    assert [t.kind for t in store.turns(sid)] == ["UserTurn", "LlmTurn"]

    again = run_step(stores(), sid, 1, llm=llm, tools=RecordingTools(), owner="worker-c")
    assert again.outcome in ("ended", "stale") and llm.calls == 2, "after the commit, the model is never asked again"


def test_a_model_step_writes_no_journal(store: Store) -> None:
    sid = start(store)
    writes: list[str] = []
    journal_put = store.journal_put

    def counted(session_id: str, field: str, *args: Any, **kwargs: Any) -> str:
        writes.append(field)
        return journal_put(session_id, field, *args, **kwargs)

    store.journal_put = counted  # type: ignore[method-assign]
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}")), llm_turn(text="done"))
    tools = RecordingTools()
    for version in (1, 2, 3):
        assert run_step(store, sid, version, llm=llm, tools=tools, owner="w").outcome == "committed"
    assert writes == ["tool:1:0"], "only the inline tool result was journaled"


def test_the_journal_is_per_version_so_the_next_step_asks_the_model(store: Store) -> None:
    sid = start(store)
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}")), llm_turn(text="done"))
    tools = RecordingTools()
    assert run_step(store, sid, 1, llm=llm, tools=tools, owner="w").outcome == "committed"
    assert run_step(store, sid, 2, llm=llm, tools=tools, owner="w").outcome == "committed"
    res = run_step(store, sid, 3, llm=llm, tools=tools, owner="w")
    assert res.outcome == "committed"
    assert llm.calls == 2
    assert store.header(sid).response == "done"


# -- a journaled inline tool result is reused ----------------------------------------------------


def test_a_redelivered_tools_step_does_not_rerun_a_journaled_sync_tool(store: Store, stores: Any) -> None:
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", '{"n": 1}'), ("c2", "sync_b", '{"n": 2}'))))
    runs: dict[str, int] = {}

    def counted(call: TrackedCall) -> CallOutcome:
        runs[call.call_id] = runs.get(call.call_id, 0) + 1
        return CallOutcome(state="completed", result=f"{call.call_id} run {runs[call.call_id]}")

    def dies_on_c2(call: TrackedCall) -> CallOutcome:
        if call.call_id == "c2":
            raise WorkerDied
        return counted(call)

    with pytest.raises(WorkerDied):
        run_step(
            stores(),
            sid,
            2,
            llm=ScriptedLlm(),
            owner="worker-a",
            tools=RecordingTools({"sync_a": dies_on_c2, "sync_b": dies_on_c2}),
        )
    assert runs == {"c1": 1}
    drop_lease(store, sid)

    tools = RecordingTools({"sync_a": counted, "sync_b": counted})
    res = run_step(stores(), sid, 2, llm=ScriptedLlm(), tools=tools, owner="worker-b")
    assert res.outcome == "committed"
    assert tools.ran == ["c2"], "c1 came from the journal"
    assert runs == {"c1": 1, "c2": 1}
    answer = store.turns(sid)[-1]
    assert isinstance(answer, UserTurn)
    assert [(r.call_id, r.content) for r in answer.tool_responses] == [("c1", "c1 run 1"), ("c2", "c2 run 1")]
    assert [c.state for c in store.calls(sid)] == [CallState.COMPLETED, CallState.COMPLETED]


def test_a_journaled_tool_failure_is_reused_too(store: Store, stores: Any) -> None:
    sid = start(store)
    step(store, sid, llm=ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))
    first = RecordingTools({"sync_a": CallOutcome(state="failed", error="exit 2: boom", exit_status=2)})
    dying = stores()
    dying.commit = lambda *a, **k: (_ for _ in ()).throw(WorkerDied())  # type: ignore[method-assign]
    with pytest.raises(WorkerDied):
        run_step(dying, sid, 2, llm=ScriptedLlm(), tools=first, owner="worker-a")
    drop_lease(store, sid)
    again = RecordingTools()
    assert run_step(stores(), sid, 2, llm=ScriptedLlm(), tools=again, owner="worker-b").outcome == "committed"
    assert again.runs == []
    [call] = store.calls(sid)
    assert (call.state, call.error, call.exit_status) == (CallState.FAILED, "exit 2: boom", 2)


# -- stale and racing copies ---------------------------------------------------------------------


def test_a_stale_copy_does_nothing(store: Store) -> None:
    sid = start(store)
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}")))
    assert run_step(store, sid, 1, llm=llm, tools=RecordingTools(), owner="w").outcome == "committed"
    before = (store.header(sid), store.turns(sid))

    late_llm, late_tools = ScriptedLlm(), RecordingTools()
    res = run_step(store, sid, 1, llm=late_llm, tools=late_tools, owner="w-late")
    assert (res.outcome, res.version) == ("stale", 2)
    assert late_llm.calls == 0 and late_tools.runs == []
    after = (store.header(sid), store.turns(sid))
    assert after[0].version == before[0].version and after[1] == before[1]
    assert store.lease_holder(sid) is None
    assert step_events(store, sid, "step_skipped")[-1]["reason"] == "stale"


def test_a_copy_for_an_ended_session_does_nothing(store: Store) -> None:
    sid = start(store)
    store.cancel(sid)
    llm = ScriptedLlm()
    res = run_step(store, sid, 2, llm=llm, tools=RecordingTools(), owner="w")
    assert res.outcome == "ended" and llm.calls == 0


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_two_threads_racing_the_same_step_commit_exactly_once(store: Store, stores: Any, round_: int) -> None:
    sid = start(store)
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}"), text="once"), llm_turn(text="twice?!"))
    barrier = threading.Barrier(2)
    results: list[Any] = [None, None]

    def worker(i: int, s: Store) -> None:
        barrier.wait()
        results[i] = run_step(s, sid, 1, llm=llm, tools=RecordingTools(), owner=f"worker-{i}")

    threads = [threading.Thread(target=worker, args=(i, stores())) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    outcomes = sorted(r.outcome for r in results)
    assert outcomes.count("committed") == 1, outcomes
    assert outcomes in (["busy", "committed"], ["committed", "stale"])
    assert llm.calls == 1
    assert [t.kind for t in store.turns(sid)] == ["UserTurn", "LlmTurn"]
    assert store.header(sid).version == 2
    assert len(step_events(store, sid, "step_committed")) == 1


def test_a_copy_whose_lease_lapsed_mid_step_loses_to_the_one_that_took_over(store: Store, stores: Any) -> None:
    sid = start(store)
    in_model, release = threading.Event(), threading.Event()

    class SlowModel:
        calls = 0

        def complete(self, request: LlmRequest) -> LlmTurn:
            self.calls += 1
            in_model.set()
            assert release.wait(timeout=30)
            return llm_turn(text="from the slow worker")

    slow: list[Any] = []
    a = threading.Thread(
        target=lambda: slow.append(
            run_step(stores(), sid, 1, llm=SlowModel(), tools=RecordingTools(), owner="worker-a")
        )
    )
    a.start()
    assert in_model.wait(timeout=30)
    drop_lease(store, sid)  # worker-a looks dead: its step is redelivered to worker-b
    fast = run_step(
        stores(),
        sid,
        1,
        llm=ScriptedLlm(llm_turn(text="from the fast worker")),
        tools=RecordingTools(),
        owner="worker-b",
    )
    release.set()
    a.join(timeout=30)
    assert fast.outcome == "committed"
    assert slow[0].outcome in ("stale", "lost")
    assert store.header(sid).response == "from the fast worker"
    assert len(store.turns(sid)) == 2
    assert len(step_events(store, sid, "step_committed")) == 1
