"""A call's `meta`: typed fields to read, stored as the JSON object it was written as."""

from __future__ import annotations

import json

from celery_agents.model import CallMeta, CallOutcome, Media, TrackedCall
from celery_agents.runtime.ports import outcome_from_json, outcome_to_json

#: a call as the store keeps it (`model_dump_json(exclude_defaults=True)`), with the keys a sandboxed
#: run, retries, media, an approval and a sub-agent leave, a null, and a key of no field
STORED = (
    '{"call_id":"c1","tool":"t","batch":2,"position":0,"disposition":"runIsolated","state":"completed",'
    '"meta":{"retryable":false,"earlier_attempts":["busy"],"isolation":"namespaces","uid":null,'
    '"limits":{"memoryMb":64},"memory_scope":"process","media":[{"mime_type":"image/png","data_base64":"AA=="}],'
    '"decision":"edited","decided_by":"alice","child":"s-child","from_a_later_release":{"x":1}}}'
)


def test_a_stored_call_reads_its_meta_as_typed_fields_and_writes_it_back_unchanged() -> None:
    call = TrackedCall.model_validate_json(STORED)
    meta = call.meta
    assert (meta.child, meta.decision, meta.decided_by, meta.isolation) == ("s-child", "edited", "alice", "namespaces")
    assert (meta.retryable, meta.earlier_attempts, meta.uid, meta.limits) == (False, ["busy"], None, {"memoryMb": 64})
    assert meta.media == [{"mime_type": "image/png", "data_base64": "AA=="}]
    assert meta.model_extra == {"from_a_later_release": {"x": 1}}
    assert call.model_dump_json(exclude_defaults=True) == STORED
    assert call.model_dump(mode="json")["meta"] == json.loads(STORED)["meta"], "what `show --json` prints"


def test_a_call_with_no_meta_stores_none() -> None:
    call = TrackedCall(call_id="c", tool="t", batch=0, position=0, disposition="runSync")
    assert call.meta == CallMeta() and call.meta.child is None
    assert "meta" not in call.model_dump_json(exclude_defaults=True)


def test_a_value_of_the_wrong_type_reads_as_unset_and_is_kept() -> None:
    raw = {"child": 5, "signal": {"not": "a number"}, "timed_out": True}
    meta = CallMeta.model_validate(raw)
    assert (meta.child, meta.signal, meta.timed_out) == (None, None, True)
    assert meta.stored() == raw


def test_or_and_without_make_another_meta_in_the_order_given() -> None:
    meta = CallMeta(child="s-1")
    more = meta | CallMeta(retryable=True, child="s-2")
    assert (meta.child, more.child, more.retryable) == ("s-1", "s-2", True)
    assert list(more.stored()) == ["child", "retryable"]
    assert more.without("child").stored() == {"retryable": True}


def test_an_outcomes_meta_is_typed_and_crosses_the_journal_as_set() -> None:
    outcome = CallOutcome(state="failed", error="slow", meta=CallMeta(timed_out=True, retryable=True))
    outcome.meta |= CallMeta(earlier_attempts=["busy"])
    outcome.media = [Media(mime_type="image/png", data_base64="AA==")]
    again = outcome_from_json(outcome_to_json(outcome))
    assert (again.meta.timed_out, again.meta.retryable, again.meta.earlier_attempts) == (True, True, ["busy"])
    assert again.stored_meta().stored() == {
        "timed_out": True,
        "retryable": True,
        "earlier_attempts": ["busy"],
        "media": [{"mime_type": "image/png", "data_base64": "AA==", "filename": None}],
    }
    assert not CallOutcome(state="completed").meta, "nothing set: nothing stored"
