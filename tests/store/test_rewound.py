"""Redis loses writes a process had read (failover, power cut) and the session moves on from the
older state: the cached transcript is checked by content, never by count alone."""

from __future__ import annotations

import threading
from typing import Any

from celery_agents.model import LlmTurn
from celery_agents.store import Store
from tests.scheduler.fakes import ScriptedLlm, llm_turn
from tests.store.scenario import begin, start, step


def lose_writes_since(store: Store, sid: str, saved: dict[str, bytes]) -> None:
    """Put the session's keys back as they were when `saved` (as after a replica promotion)."""
    for key, dump in saved.items():
        store.client.restore(key, 0, dump, replace=True)


def saved_keys(store: Store, sid: str) -> dict[str, bytes]:
    keys = [store.keys.meta(sid), store.keys.turns(sid)]
    return {k: store.client.dump(k) for k in keys}  # type: ignore[misc]


def test_a_transcript_that_went_back_and_moved_on_is_read_again(store: Store, stores: Any) -> None:
    sid = start(store)
    before = saved_keys(store, sid)
    step(store, sid, ScriptedLlm(llm_turn(("lost", "sync_a", "{}"))), owner="worker-a")
    lose_writes_since(store, sid, before)
    step(stores(), sid, ScriptedLlm(llm_turn(("kept", "sync_a", "{}"))), owner="worker-b")
    assert store.header(sid).turn_count == 2  # the same count as the lost transcript

    loaded = begin(store, sid, "worker-a")
    head = loaded.turns[-1]
    assert isinstance(head, LlmTurn) and [c.id for c in head.tool_calls] == ["kept"]
    count, rewound = store.rewound()
    assert count == 1 and rewound[sid]["seen_version"] == 2 and rewound[sid]["stored_version"] == 2


def test_a_transcript_read_as_stored_is_not_reported(store: Store, stores: Any) -> None:
    sid = start(store)
    llm = ScriptedLlm(llm_turn(("c1", "sync_a", "{}")), llm_turn(text="done"))
    other = stores()
    for s in (store, other, store):
        step(s, sid, llm)
    assert store.rewound()[0] == 0
    assert store.header(sid).turns_digest


def test_a_step_committed_by_another_thread_while_one_reads_is_not_reported(store: Store) -> None:
    """Steps run in many threads of one process sharing one Store and its transcript cache: a
    thread reading a session while another thread of the same process commits a step of it (a
    duplicate delivery, `session show` beside a worker) reads the session as stored, and Redis is
    not reported to have lost writes."""
    sid = start(store)
    step(store, sid, ScriptedLlm(llm_turn(("c1", "sync_a", "{}"))))  # cached in this process
    step(store, sid)
    reading, committed = threading.Event(), threading.Event()
    run = store.scripts.run

    def held_run(name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        if name == "load_session" and threading.current_thread().name == "reader":
            reading.set()
            assert committed.wait(10)  # the other thread's commit lands between the read's two halves
        return run(name, keys, args, client=client)

    store.scripts.run = held_run  # type: ignore[method-assign]
    seen: list[Any] = []
    reader = threading.Thread(target=lambda: seen.append(store.load(sid)), name="reader")
    reader.start()
    assert reading.wait(10)
    step(store, sid, ScriptedLlm(llm_turn(text="done")))
    committed.set()
    reader.join(10)

    (loaded,) = seen
    assert [type(t).__name__ for t in loaded.turns] == [type(t).__name__ for t in store.turns(sid)]
    assert len(loaded.turns) == store.header(sid).turn_count
    assert store.rewound()[0] == 0, "no write was lost: doctor must not say Redis lost any"


def test_deleting_a_rewound_session_clears_it_from_doctor(store: Store, stores: Any) -> None:
    """`agents session delete` removes a session's entries in every shared index: doctor no longer
    names a session that does not exist (nor does retention let the list grow for ever)."""
    sid = start(store)
    before = saved_keys(store, sid)
    step(store, sid, ScriptedLlm(llm_turn(("lost", "sync_a", "{}"))), owner="worker-a")
    lose_writes_since(store, sid, before)
    step(stores(), sid, ScriptedLlm(llm_turn(("kept", "sync_a", "{}"))), owner="worker-b")
    begin(store, sid, "worker-a")
    assert store.rewound()[0] == 1
    store.end_step(sid, "worker-a", "test", "done")
    store.cancel(sid)
    store.delete_session(sid)
    assert store.rewound() == (0, {})
