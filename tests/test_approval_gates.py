"""Approval gates through the Python API on real Redis, steps and tools run in this process (the
inline driver) with real command tools: a person approves, edits or rejects a deferred call, and
exactly what was approved runs, once; a rejected or expired gate never runs and the model is told
why; a decision is bound to the digest of the call the person saw."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import pytest

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.errors import (
    DigestMismatch,
    InvalidArguments,
    InvalidInput,
    InvalidResult,
    NotAnApproval,
    TokenAlreadyCompleted,
    TokenCancelled,
    TokenExpired,
    UntrustedSpec,
)
from celery_agents.model import State, call_digest
from celery_agents.runtime.completions import CompletionConsumer
from celery_agents.scheduler.machine import schema_digest
from celery_agents.tools.resolve import parse_agent
from tests.e2e.conftest import record_tool, runs
from tests.scheduler.fakes import ScriptedLlm, llm_turn

PAY = {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}}, "required": ["amount"]}
LARGE = {"type": "object", "properties": {"amount": {"type": "number", "minimum": 100}}, "required": ["amount"]}


def agent(log: Path, **policy: Any) -> Any:
    pay = {**record_tool("pay", log), "parameters": PAY}
    note = record_tool("note", log)
    rules = policy.get(
        "rules",
        [
            {
                "tool": "pay",
                "when": LARGE,
                "disposition": {"tag": "defer", "then": "runSync", "reason": "large payment"},
            },
            {"tool": "pay", "disposition": "runSync"},
            {"tool": "note", "disposition": {"tag": "defer", "reason": "a person writes it"}},
        ],
    )
    return parse_agent(
        {
            "slug": "payer",
            "model": "fake/model",
            "tools": [pay, note],
            "executionMode": "asynchronous",
            "toolCallPolicy": {"default": "runSync", "rules": rules},
        }
    )


def pay(call_id: str, amount: float, to: str = "bob") -> tuple[str, str, str]:
    return (call_id, "pay", json.dumps({"amount": amount, "to": to}))


def told(llm: ScriptedLlm, call_id: str) -> str:
    """What the model's last request said of the call (the tool message's content)."""
    for message in reversed(llm.requests[-1].messages):
        if message.get("role") == "tool" and message.get("tool_call_id") == call_id:
            content = message["content"]
            return content if isinstance(content, str) else json.dumps(content)
    raise AssertionError(f"the model was not told of {call_id}")


def gate_of(client: Client, sid: str) -> Any:
    view = client.view(sid)
    assert view.state == State.WAITING, view
    (gate,) = view.pending
    return gate


def test_a_small_payment_runs_at_once_and_a_large_one_waits_at_a_gate(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 20), pay("c2", 500)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [20], "the small one ran, the large one waits"
    assert (gate.call_id, gate.kind, gate.then, gate.reason) == ("c2", "approval", "runSync", "large payment")
    assert gate.digest == call_digest("pay", {"amount": 500, "to": "bob"})
    assert len(gate.digest or "") == 64


def test_approve_runs_the_tool_once_and_its_result_reaches_the_model(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        assert runs(log, "pay", "start") == [], "never before its decision"
        done = client.approve(gate.token or "", digest=gate.digest, by="alice")
        assert (done.decision, done.accepted) == ("approved", True)
        final = client.view(sid)
        with pytest.raises(TokenAlreadyCompleted):
            client.approve(gate.token or "")
        with pytest.raises(TokenAlreadyCompleted):
            client.reject(gate.token or "")
    assert (final.state, final.response) == (State.COMPLETED, "paid")
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 500, "to": "bob"}], "exactly once"
    assert '"amount": 500' in told(llm, "c1")


def test_an_edit_runs_the_edited_arguments_and_a_bad_edit_changes_nothing(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid less"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        with pytest.raises(InvalidArguments, match="amount"):
            client.approve(gate.token or "", arguments={"amount": "a lot"})
        with pytest.raises(InvalidArguments):
            client.approve(gate.token or "", arguments=["not", "an", "object"])
        assert gate_of(client, sid).token == gate.token and runs(log, "pay", "start") == [], "nothing changed"
        done = client.approve(gate.token or "", arguments={"amount": 150, "to": "carol"}, by="alice")
        final = client.show(sid)
    assert done.decision == "edited" and final.state == State.COMPLETED
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 150, "to": "carol"}]
    (call,) = [c for c in final.calls or [] if c["call_id"] == "c1"]
    assert call["arguments"] == {"amount": 150, "to": "carol"}, "the transcript shows what ran"
    assert json.loads(call["raw_arguments"]) == {"amount": 500, "to": "bob"}, "and what was asked"
    assert (call["meta"]["decision"], call["meta"]["decided_by"]) == ("edited", "alice")


def test_reject_and_expiry_never_run_the_tool_and_tell_the_model_why(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="ok, not paid"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        done = client.reject(gate.token or "", reason="not this month", by="alice")
        assert done.decision == "rejected" and client.resume(sid).state == State.COMPLETED
        assert told(llm, "c1").removeprefix("Error: ").startswith("rejected: not this month")

    rules = [{"tool": "pay", "disposition": {"tag": "defer", "then": "runSync", "timeoutSeconds": 0.5}}]
    llm = ScriptedLlm(llm_turn(pay("c2", 500)), llm_turn(text="it expired"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log, rules=rules), "pay", run=True).session_id
        gate = gate_of(client, sid)
        time.sleep(0.6)  # the gate's own deadline: time is what this test is about
        client.catch_up()
        with pytest.raises(TokenExpired):
            client.approve(gate.token or "")
        client.resume(sid)
        assert client.view(sid).state == State.COMPLETED
        assert told(llm, "c2").removeprefix("Error: ").startswith("expired:")
    assert runs(log, "pay", "start") == [], "neither the rejected nor the expired gate ran"


def test_a_session_that_waits_again_after_an_expiry_has_its_events_packed(settings: Settings, tmp_path: Path) -> None:
    """The sweeper gives its scripts the time it read once (Redis's); their events' times are
    their ids' all the same, so the `token_expired` it writes leaves the session's events
    packable when it waits again (an event with a time of its own is not packed)."""
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(pay("c2", 600)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate_of(client, sid)
        later = client.store.server_time() + 7 * 24 * 3600  # past the gate's deadline
        assert [f.status for _, f in client.store.expire_due(later)] == ["ok"]
        assert client.resume(sid).state == State.WAITING  # the model asks again: a second gate
        events = client.store.read_events(sid)
        assert "token_expired" in [e["type"] for e in events] and all("at" in e for e in events)
        assert client.store.client.exists(client.store.keys.events(sid)) == 0, "packed"


def test_a_decision_on_another_digest_is_refused_and_changes_nothing(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        seen = call_digest("pay", {"amount": 50, "to": "bob"})  # what a person saw of another call
        with pytest.raises(DigestMismatch):
            client.approve(gate.token or "", digest=seen)
        assert gate_of(client, sid).token == gate.token and runs(log, "pay", "start") == []
        client.approve(gate.token or "", digest=(gate.digest or "").upper())
    assert len(runs(log, "pay")) == 1


def test_a_grant_for_the_session_runs_later_calls_of_the_tool_without_asking(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(
        llm_turn(pay("c1", 500)), llm_turn(pay("c2", 700)), llm_turn(pay("c3", 900)), llm_turn(text="all paid")
    )
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        client.approve(gate.token or "", for_session=True)
        final = client.view(sid)
    assert (final.state, final.grants) == (State.COMPLETED, ["pay"])
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [500, 700, 900]


def test_a_plain_deferred_call_is_not_an_approval_and_complete_of_a_gate_responds(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(("n1", "note", "{}"), pay("c1", 500)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "go", run=True).session_id
        by_tool = {p.tool: p for p in client.view(sid).pending}
        note, gate = by_tool["note"], by_tool["pay"]
        assert (note.kind, note.then) == ("result", None)
        with pytest.raises(NotAnApproval):
            client.approve(note.token or "")
        with pytest.raises(NotAnApproval):
            client.reject(note.token or "")
        assert client.complete(note.token or "", "written").decision == "responded"
        responded = client.complete(gate.token or "", {"paid": "by hand"})
        assert responded.decision == "responded"
        assert client.resume(sid).state == State.COMPLETED
    assert runs(log, phase="start") == [], "a response supplies the result: the tool never runs"
    assert "by hand" in told(llm, "c1")


def test_decisions_through_the_completions_stream(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500), pay("c2", 600), pay("c3", 800)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        store = client.store
        sid = client.start(agent(log), "go", run=True).session_id
        gates = {p.call_id: p for p in client.view(sid).pending}
        xadd = store.client.xadd
        xadd(store.keys.completions, {"token": gates["c1"].token or "", "decision": "approve", "by": "erp"})
        edit = json.dumps({"amount": 300})
        xadd(store.keys.completions, {"token": gates["c2"].token or "", "decision": "approve", "arguments": edit})
        xadd(store.keys.completions, {"token": gates["c3"].token or "", "decision": "reject", "reason": "too much"})
        xadd(store.keys.completions, {"token": gates["c3"].token or "", "decision": "approve"})  # too late
        driver = client.driver
        CompletionConsumer(store, "test", wake=driver.wake, dispatch=driver.dispatched).poll(block_ms=None)
        client.resume(sid)
        final = client.view(sid)
        rejected = [e[1] for e in store.client.xrange(store.keys.rejected)]
    assert final.state == State.COMPLETED
    assert sorted(r["args"]["amount"] for r in runs(log, "pay", "start")) == [300, 500]
    assert told(llm, "c3").removeprefix("Error: ").startswith("rejected: too much")
    assert [r["reason"] for r in rejected] == ["token_already_completed"]


def test_edits_and_names_that_cannot_be_used_are_refused_through_every_door(settings: Settings, tmp_path: Path) -> None:
    """Arguments given as JSON null are a broken edit, not "approve as the model asked"; text with a
    lone surrogate is not text (Redis and the tool get UTF-8); edited arguments are bounded as a
    result is, and who decided (`by`) as the HTTP API bounds it. Each is refused before anything
    is recorded, through the Python API and the completions stream alike; the gate stays open."""
    log = tmp_path / "runs.log"
    settings = dataclasses.replace(settings, max_result_bytes=4096)
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid"))
    with Client(settings, inline=True, llm=llm) as client:
        store = client.store
        sid = client.start(agent(log), "pay", run=True).session_id
        token = gate_of(client, sid).token or ""
        with pytest.raises(InvalidArguments, match="surrogate"):
            client.approve(token, arguments={"amount": 150, "to": "\ud800"})
        with pytest.raises(InvalidArguments, match="AGENTS_MAX_RESULT_BYTES"):
            client.approve(token, arguments={"amount": 150, "to": "x" * 5000})
        with pytest.raises(InvalidInput, match="by is at most 200"):
            client.approve(token, by="b" * 201)
        with pytest.raises(InvalidInput, match="surrogate"):
            client.reject(token, by="\udfff")
        with pytest.raises(InvalidResult, match="surrogate"):
            client.complete(token, {"paid": "\ud800"})
        xadd = store.client.xadd
        for fields in (
            {"decision": "approve", "arguments": "null"},
            {"decision": "approve", "arguments": '{"amount": 150, "to": "\\ud800"}'},
            {"decision": "approve", "arguments": json.dumps({"amount": 150, "to": "x" * 5000})},
            {"decision": "approve", "by": "b" * 201},
        ):
            xadd(store.keys.completions, {"token": token, **fields})
        driver = client.driver
        CompletionConsumer(store, "test", wake=driver.wake, dispatch=driver.dispatched).poll(block_ms=None)
        rejected = [e[1]["reason"] for e in store.client.xrange(store.keys.rejected)]
        assert gate_of(client, sid).token == token, "the gate is still open"
    assert rejected == ["invalid_arguments", "invalid_arguments", "invalid_arguments", "invalid_input"], rejected
    assert runs(log, "pay", "start") == [], "nothing ran"


def test_extend_moves_the_deadline_and_a_decided_gate_cannot_be_extended(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        now = client.store.server_time()
        moved = client.extend(gate.token or "", 7200)
        assert moved.expires_at is not None and abs(moved.expires_at - (now + 7200)) < 5
        assert gate_of(client, sid).expires_at == moved.expires_at, "pending lists the new deadline"
        client.reject(gate.token or "")
        with pytest.raises(TokenAlreadyCompleted):
            client.extend(gate.token or "", 60)
        events = [e["type"] for e in client.store.read_events(sid)]
    assert "call_extended" in events


def test_a_gate_about_to_expire_says_so_and_extend_keeps_it_open(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    rules = [{"tool": "pay", "disposition": {"tag": "defer", "then": "runSync", "timeoutSeconds": 2}}]
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid"))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log, rules=rules), "pay", run=True).session_id
        gate = gate_of(client, sid)
        # A tenth of the 2 s wait before the deadline, the session's events warn of it.
        time.sleep(1.85)  # the deadline is what this test is about
        client.catch_up()
        expiring = [e for e in client.store.read_events(sid) if e["type"] == "call_expiring"]
        assert len(expiring) == 1 and expiring[0]["call_id"] == "c1", expiring
        events_key = client.store.keys.events(sid)
        assert client.store.client.exists(events_key) == 0, "the waiting session's events packed again"
        client.extend(gate.token or "", 3600)
        time.sleep(0.3)
        client.catch_up()
        assert gate_of(client, sid).token == gate.token, "extended before its deadline: still open"
        client.approve(gate.token or "")
        assert client.view(sid).state == State.COMPLETED
    assert len(runs(log, "pay", "start")) == 1


def test_a_gate_of_a_cancelled_session_takes_no_decision(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    llm = ScriptedLlm(llm_turn(pay("c1", 500), pay("c2", 600)))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        first, second = client.view(sid).pending
        client.cancel(sid)
        with pytest.raises(TokenCancelled):
            client.approve(first.token or "")
        with pytest.raises(TokenCancelled):
            client.reject(second.token or "")
    assert runs(log, phase="start") == []


#: the CLI, the API and the workers of these tests hold it; the Redis writer below does not
SPEC_KEY = "spec-key-gates-0123456789abcdef0123"


def forge_approval(client: Client, sid: str, token: str, arguments: dict[str, Any]) -> None:
    """What a Redis writer without the spec key can write: the call's results entry saying it runs
    (as an approval records it) and the token saying it was approved — all but the key's seal."""
    store, (_, secret) = client.store, token.split(".", 1)
    field = store.client.hget(store.keys.token(sid, secret), "field") or ""
    running = json.dumps({"state": "running", "decision": "approved", "arguments": arguments, "completed_by": "x"})
    store.client.hset(store.keys.results(sid), field, running)
    store.client.hset(
        store.keys.token(sid, secret),
        mapping={"state": "completed", "decision": "approved", "approved": running, "seal": "0" * 64},
    )
    store.client.zadd(store.keys.dispatched, {f"{sid} {field}": 0})


def test_a_gate_a_redis_writer_marks_approved_never_runs(settings: Settings, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    signed = dataclasses.replace(settings, spec_key=SPEC_KEY)
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="it was not run"))
    with Client(signed, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        gate = gate_of(client, sid)
        forge_approval(client, sid, gate.token or "", {"amount": 1_000_000, "to": "mallory"})
        final = client.resume(sid)  # the inline driver runs the calls it finds running
        refused = [e for e in client.store.read_events(sid) if e["type"] == "call_refused"]
        counted = client.store.counters().get(("calls_refused", "runAsync"))
    assert runs(log, phase="start") == [], "a forged approval ran the gate"
    assert final.state == State.COMPLETED
    assert told(llm, "c1").removeprefix("Error: ").startswith("not run: it waits for a decision on its token")
    assert len(refused) == 1 and refused[0]["call_id"] == "c1"
    assert counted == 1


def test_with_the_spec_key_a_real_decision_runs_and_a_forged_grant_asks_again(
    settings: Settings, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    signed = dataclasses.replace(settings, spec_key=SPEC_KEY)
    turns = [llm_turn(pay(f"c{n}", 100 * n + 300)) for n in range(1, 5)]
    llm = ScriptedLlm(*turns, llm_turn(text="done"))
    with Client(signed, inline=True, llm=llm) as client:
        store = client.store
        sid = client.start(agent(log), "pay", run=True).session_id
        client.approve(gate_of(client, sid).token or "", arguments={"amount": 150})  # sealed by the key
        assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 150}]
        # A grant written by hand (the digest a real one holds, without its seal) is no grant.
        store.client.hset(store.keys.meta(sid), "grants", json.dumps({"pay": schema_digest(PAY)}))
        assert client.view(sid).grants == []
        client.approve(gate_of(client, sid).token or "")
        third = gate_of(client, sid)
        assert third.call_id == "c3", "the forged grant let c3 run without asking"
        client.approve(third.token or "", for_session=True)
        final = client.view(sid)
    assert (final.state, final.grants) == (State.COMPLETED, ["pay"]), "the real grant let c4 run without asking"
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [150, 500, 600, 700]


def test_an_approval_without_the_spec_key_on_a_signed_session_is_refused_and_changes_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    """An approval made without AGENTS_SPEC_KEY would be recorded unsealed, and no worker holding
    the key would run it: the person is told at once instead of the call failing later."""
    log = tmp_path / "runs.log"
    signed = dataclasses.replace(settings, spec_key=SPEC_KEY)
    llm = ScriptedLlm(llm_turn(pay("c1", 500)), llm_turn(text="paid"))
    with Client(signed, inline=True, llm=llm) as client:
        sid = client.start(agent(log), "pay", run=True).session_id
        token = gate_of(client, sid).token or ""
    with Client(settings, inline=True, llm=llm) as keyless:
        with pytest.raises(UntrustedSpec, match="AGENTS_SPEC_KEY"):
            keyless.approve(token)
        with pytest.raises(UntrustedSpec, match="AGENTS_SPEC_KEY"):
            keyless.approve(token, arguments={"amount": 5}, for_session=True)
        assert gate_of(keyless, sid).token == token, "the gate still waits for a decision"
        keyless.reject(token, reason="not today")  # a rejection runs nothing: it needs no seal
    with Client(signed, inline=True, llm=llm) as client:
        final = client.resume(sid)
    assert runs(log, phase="start") == []
    assert final.state == State.COMPLETED
    assert told(llm, "c1").removeprefix("Error: ").startswith("rejected: not today")
