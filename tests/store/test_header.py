"""The session header as its Redis hash, and a step's commit record, both derived from the model."""

from __future__ import annotations

import json

from celery_agents.model import ErrorInfo, EventType, SessionHeader, State, Status, Usage
from celery_agents.scheduler import Event, Transition
from celery_agents.store.commit import commit_record
from celery_agents.store.header import SPARSE, header_from_hash, header_to_hash, header_to_stored, sparse_update

FULL = SessionHeader(
    session_id="s1",
    agent_slug="a",
    agent_hash="h",
    execution_mode="asynchronous",
    version=7,
    status=Status.FAILED,
    state=State.FAILED,
    drive="auto",
    head="PartialUserTurn",
    created_at=1.25,
    updated_at=3.5,
    steps=3,
    step_limit=9,
    turn_count=4,
    turns_digest="d" * 32,
    usage=Usage(prompt_tokens=3, total_tokens=3),
    error=ErrorInfo(code="max_steps", message="m"),
    response="",
    inbox_waiting=2,
)


def test_every_header_field_round_trips_through_the_hash() -> None:
    assert header_from_hash(header_to_hash(FULL)) == FULL
    bare = SessionHeader(session_id="s2", agent_slug="a", agent_hash="h", head=None)
    assert header_from_hash(header_to_hash(bare)) == bare


def test_the_hash_holds_what_earlier_releases_wrote() -> None:
    stored = header_to_hash(FULL)
    assert stored["version"] == "7" and stored["status"] == "failed" and stored["created_at"] == "1.25"
    assert stored["inbox_waiting"] == "2", "the scripts count queued messages in this field"
    assert stored["response"] == '""', "an empty answer is not taken for none"
    assert stored["usage"] == "[3,0,3]", "usage as an array, trailing zeros and an unknown cost left out"
    assert json.loads(stored["error"])["code"] == "max_steps" and stored["error_code"] == "max_steps"
    assert header_to_hash(FULL.model_copy(update={"head": None, "error": None}))["head"] == ""


def test_a_price_of_0_is_a_price_not_none() -> None:
    priced = FULL.model_copy(update={"usage": Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3, cost=0.0)})
    assert header_to_hash(priced)["usage"] == "[1,2,3,0,0,0.0]"
    assert header_from_hash(header_to_hash(priced)) == priced


def test_a_hash_from_before_a_field_existed_reads_as_its_default() -> None:
    h = header_from_hash({"session_id": "old", "agent_slug": "a", "agent_hash": "h", "response": "null"})
    assert (h.version, h.status, h.drive, h.step_limit, h.turns_digest) == (1, Status.ACTIVE, "manual", 40, "")
    assert h.inbox_waiting == 0
    assert h.head is None and h.error is None and h.response is None and h.usage == Usage()


def test_a_commit_record_sets_the_header_fields_a_step_changes_as_the_hash_holds_them() -> None:
    header = FULL.model_copy(update={"status": Status.ACTIVE, "state": State.READY, "error": None})
    t = Transition(
        kind="llm",
        head="LlmTurn",
        state=State.FAILED,
        status=Status.FAILED,
        error=ErrorInfo(code="llm_error", message="down"),
        usage=Usage(prompt_tokens=2, total_tokens=2),
        events=[Event(EventType.FAILED, {"code": "llm_error"})],
    )
    record = commit_record(header, "w1", t, request="r1")
    control = json.loads(record.to_args("a1", 30_000)[0])
    assert control["version"] == "7" and control["owner"] == "w1" and control["owe"] is False
    assert (control["attempt"], control["lease_ms"]) == ("a1", 30_000)
    assert control["meta"]["error_code"] == "llm_error" and control["meta"]["head"] == "LlmTurn"
    assert control["meta"]["usage"] == "[5,0,5]", "usage adds up over steps"
    assert control["events"] == [["failed", '{"code":"llm_error"}']]


def test_a_new_headers_hash_leaves_out_the_fields_at_their_default_and_reads_the_same() -> None:
    bare = SessionHeader(session_id="s2", agent_slug="a", agent_hash="h")
    stored = header_to_stored(bare)
    assert not SPARSE & set(stored), "no parent, budget, error, grants... nor their names"
    assert {"version", "status", "state", "drive", "head", "turn_count"} <= set(stored)
    assert "session_id" not in stored, "its key names it"
    assert header_from_hash(stored, "s2") == bare
    assert header_from_hash(header_to_stored(FULL), "s1") == FULL
    assert {"error", "error_code", "response", "inbox_waiting", "execution_mode"} <= set(header_to_stored(FULL))


def test_a_commit_clears_a_sparse_field_that_was_set_and_leaves_alone_one_that_never_was() -> None:
    failed = header_to_hash(FULL)
    cleared = header_to_hash(FULL.model_copy(update={"error": None, "response": None}))
    update = sparse_update(failed, cleared)
    assert (update["error"], update["error_code"], update["response"]) == ("", "", "null")
    bare = header_to_hash(SessionHeader(session_id="s2", agent_slug="a", agent_hash="h"))
    assert not {"error", "error_code", "response"} & set(sparse_update(bare, bare))
    answered = header_to_hash(SessionHeader(session_id="s2", agent_slug="a", agent_hash="h", response="hi"))
    assert sparse_update(bare, answered)["response"] == '"hi"'
