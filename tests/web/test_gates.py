"""Approval gates over the HTTP API of a real `agents serve`, with a real worker running real command
tools: approve (bound to the digest), edit, reject, respond and extend answer the CLI's documents;
wrong edits, digests, targets and fields are refused with the contract's codes and statuses and
change nothing; a gate of a cancelled session is refused `token_cancelled`; `/metrics` counts the
gates by time left."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import runs
from tests.support.llm_server import LlmServer, calls, text
from tests.web.conftest import blocked, finished, gated_agent, results

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("web_workers")]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    code: str = response.json()["error"]["code"]
    return code


def decide(api: httpx.Client, token: str, **body: Any) -> httpx.Response:
    # json.dumps escapes what is not ASCII (a lone surrogate too, which httpx would not encode).
    content = json.dumps(body).encode()
    return api.post(f"/v1/continuations/{token}", content=content, headers={"Content-Type": "application/json"})


def test_an_approved_gate_runs_once_bound_to_the_digest_it_was_decided_on(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(
        api, gated_agent(llm_server, log, [calls(("pay", {"amount": 500}), ("pay", {"amount": 900})), text("ok")])
    )
    sid = view["session_id"]
    first, second = sorted(view["pending"], key=lambda p: p["arguments"]["amount"])
    assert (first["kind"], first["then"], len(first["digest"])) == ("approval", "runSync", 64)

    mismatch = decide(api, first["token"], decision="approve", digest=second["digest"])
    assert error_of(mismatch, 409) == "digest_mismatch"
    for bad in ({"amount": "a lot"}, ["not", "an", "object"], {}, None, {"amount": 900, "memo": "\ud800"}):
        refused = decide(api, first["token"], decision="approve", arguments=bad)
        assert error_of(refused, 400) == "invalid_arguments", bad
    assert runs(log, phase="start") == [], "nothing ran before a decision"
    assert api.get(f"/v1/sessions/{sid}/pending").json()["pending"] == view["pending"], "nothing changed"

    done = decide(api, first["token"], decision="approve", digest=first["digest"].upper(), by="alice")
    assert done.status_code == 200, done.text
    assert done.json() == {
        "token": first["token"],
        "session_id": sid,
        "call_id": first["call_id"],
        "accepted": True,
        "remaining": 2,
        "woken": False,
        "decision": "approved",
    }
    assert error_of(decide(api, first["token"], decision="approve"), 409) == "token_already_completed"
    assert error_of(decide(api, first["token"], decision="reject"), 409) == "token_already_completed"
    assert error_of(decide(api, first["token"], result="late"), 409) == "token_already_completed"

    edited = decide(api, second["token"], decision="approve", arguments={"amount": 90}, digest=second["digest"])
    assert edited.status_code == 200 and edited.json()["decision"] == "edited", edited.text
    shown = finished(api, sid)
    assert sorted(r["args"]["amount"] for r in runs(log, "pay", "start")) == [90, 500], "each exactly once"
    told = {json.dumps(content) for _, content, _ in results(shown)}
    assert any('"amount": 90' in t for t in told) and any('"amount": 500' in t for t in told)


def test_a_rejected_gate_never_runs_and_the_model_is_told_why(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 500})), text("did not pay")]))
    (gate,) = view["pending"]
    done = decide(api, gate["token"], decision="reject", reason="too much", by="bob")
    assert done.status_code == 200 and done.json()["decision"] == "rejected", done.text
    shown = finished(api, view["session_id"])
    assert results(shown) == [("pay", "rejected: too much", True)]
    assert shown["response"] == "did not pay"
    assert runs(log, phase="start") == []


def test_respond_records_a_result_without_running_the_tool(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    agent = gated_agent(llm_server, log, [calls(("pay", {"amount": 1}), ("pay", {"amount": 2})), text("answered")])
    view = blocked(api, agent)
    one, two = sorted(view["pending"], key=lambda p: p["arguments"]["amount"])
    by_decision = decide(api, one["token"], decision="respond", result={"paid": "by hand"})
    by_result_only = decide(api, two["token"], error="the bank is closed")
    assert [r.json()["decision"] for r in (by_decision, by_result_only)] == ["responded", "responded"]
    shown = finished(api, view["session_id"])
    assert sorted(results(shown), key=str) == sorted(
        [("pay", {"paid": "by hand"}, False), ("pay", "the bank is closed", True)], key=str
    )
    assert runs(log, phase="start") == [], "a response is the result: the tool never runs"


def test_fields_of_another_decision_are_refused_not_ignored(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 5}), ("note", {})), text("x")]))
    gate, note = sorted(view["pending"], key=lambda p: p["tool"] == "note")
    for body in (
        {"decision": "approve", "reason": "why not"},
        {"decision": "approve", "result": 1},
        {"decision": "reject", "arguments": {"amount": 1}},
        {"decision": "reject", "for_session": True},
        {"decision": "respond", "result": 1, "digest": gate["digest"]},
        {"result": 1, "arguments": {"amount": 1}},
        {"decision": "respond"},
    ):
        assert error_of(decide(api, gate["token"], **body), 400) in ("invalid_input", "invalid_result"), body
    assert error_of(decide(api, gate["token"], decision="maybe"), 400) == "invalid_input"
    assert error_of(decide(api, gate["token"], decision="reject", digest="0" * 64), 409) == "digest_mismatch"
    assert error_of(decide(api, note["token"], decision="approve"), 409) == "not_an_approval"
    assert error_of(decide(api, note["token"], decision="reject", reason="no"), 409) == "not_an_approval"
    assert error_of(decide(api, "0123456789abcdef0123456789abcdef.nope", decision="approve"), 404) == "unknown_token"
    assert api.get(f"/v1/sessions/{view['session_id']}/pending").json()["pending"] == view["pending"]
    assert runs(log, phase="start") == []


def test_extend_moves_a_deadline_and_is_refused_once_the_call_is_decided(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 5}), ("note", {})), text("x")]))
    gate, note = sorted(view["pending"], key=lambda p: p["tool"] == "note")
    moved = api.post(f"/v1/continuations/{gate['token']}/extend", json={"seconds": 172800})
    assert moved.status_code == 200, moved.text
    assert {k: v for k, v in moved.json().items() if k != "expires_at"} == {
        k: v for k, v in gate.items() if k != "expires_at"
    }, "the pending object, with its new deadline"
    assert abs(moved.json()["expires_at"] - (time.time() + 172800)) < 60
    shorter = api.post(f"/v1/continuations/{note['token']}/extend", json={"seconds": 60}).json()
    assert abs(shorter["expires_at"] - (time.time() + 60)) < 30, "a plain deferred call's deadline moves too"
    listed = {
        p["token"]: p["expires_at"] for p in api.get(f"/v1/sessions/{view['session_id']}/pending").json()["pending"]
    }
    assert listed == {gate["token"]: moved.json()["expires_at"], note["token"]: shorter["expires_at"]}

    for seconds in (0, -5, "soon"):
        bad = api.post(f"/v1/continuations/{gate['token']}/extend", json={"seconds": seconds})
        assert error_of(bad, 400) == "invalid_input", seconds
    assert error_of(api.post(f"/v1/continuations/{gate['token']}/extend", json={}), 400) == "invalid_input"
    missing = api.post("/v1/continuations/0123456789abcdef0123456789abcdef.nope/extend", json={"seconds": 5})
    assert error_of(missing, 404) == "unknown_token"
    assert decide(api, gate["token"], decision="reject").status_code == 200
    late = api.post(f"/v1/continuations/{gate['token']}/extend", json={"seconds": 60})
    assert error_of(late, 409) == "token_already_completed"


def test_a_gate_of_a_cancelled_session_is_refused_token_cancelled(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 5})), text("x")]))
    (gate,) = view["pending"]
    assert api.post(f"/v1/sessions/{view['session_id']}/cancel").json()["state"] == "cancelled"
    for body in ({"decision": "approve", "digest": gate["digest"]}, {"decision": "reject"}, {"result": 1}):
        assert error_of(decide(api, gate["token"], **body), 409) == "token_cancelled", body
    extend = api.post(f"/v1/continuations/{gate['token']}/extend", json={"seconds": 60})
    assert error_of(extend, 409) == "token_cancelled"
    assert runs(log, phase="start") == []


def test_approved_for_the_session_later_calls_of_the_tool_run_without_asking(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    replies = [calls(("pay", {"amount": 10})), calls(("pay", {"amount": 20})), text("paid twice")]
    view = blocked(api, gated_agent(llm_server, log, replies, then="runAsync"))
    (gate,) = view["pending"]
    done = decide(api, gate["token"], decision="approve", for_session=True)
    assert done.status_code == 200, done.text
    shown = finished(api, view["session_id"])
    assert (shown["response"], shown["grants"]) == ("paid twice", ["pay"])
    assert [r["args"]["amount"] for r in runs(log, "pay", "start")] == [10, 20]


def gates_pending(api: httpx.Client) -> dict[str, float]:
    lines = [x for x in api.get("/metrics").text.splitlines() if x.startswith("agents_gates_pending{")]
    return {line.split('"')[1]: float(line.split()[-1]) for line in lines}


def test_metrics_count_the_gates_waiting_by_time_left(api: httpx.Client, llm_server: LlmServer, tmp_path: Path) -> None:
    before = gates_pending(api)
    assert set(before) == {"<1h", "<1d", ">=1d"}
    log = tmp_path / "runs.log"
    soon = blocked(
        api, gated_agent(llm_server, log, [calls(("pay", {"amount": 1}), ("note", {})), text("x")], timeoutSeconds=600)
    )
    later = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 2})), text("x")]))
    after = gates_pending(api)
    assert {k: after[k] - before[k] for k in after} == {"<1h": 1, "<1d": 1, ">=1d": 0}, "the plain note is no gate"

    (gate,) = later["pending"]
    api.post(f"/v1/continuations/{gate['token']}/extend", json={"seconds": 3 * 86400})
    moved = gates_pending(api)
    assert {k: moved[k] - before[k] for k in moved} == {"<1h": 1, "<1d": 0, ">=1d": 1}
    (first,) = [p for p in soon["pending"] if p["tool"] == "pay"]
    decide(api, first["token"], decision="reject")
    decide(api, gate["token"], decision="reject")
    assert gates_pending(api) == before


def test_the_pages_gate_forms_are_bound_to_the_digest_shown_and_to_the_csrf_token(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    replies = [calls(("pay", {"amount": 500}), ("pay", {"amount": 900})), text("ok")]
    view = blocked(api, gated_agent(llm_server, log, replies))
    sid = view["session_id"]
    first, second = sorted(view["pending"], key=lambda p: p["arguments"]["amount"])
    page = api.get(f"/sessions/{sid}", headers={"Accept": "text/html"}).text
    for gate in (first, second):  # Approve and run, Edit arguments and run, Reject
        assert page.count(f'name="digest" value="{gate["digest"]}"') == 3, "every form carries the digest it shows"
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found
    form = {"csrf": found.group(1), "token": first["token"], "back": f"/sessions/{sid}"}

    other = api.post("/gates/approve", data={**form, "digest": second["digest"]})
    assert other.headers["location"] == f"/sessions/{sid}?problem=digest_mismatch"
    not_this = api.post("/gates/reject", data={**form, "digest": second["digest"], "reason": "no"})
    assert not_this.headers["location"] == f"/sessions/{sid}?problem=digest_mismatch", "a rejection is bound too"
    forged = api.post("/gates/approve", data={**form, "csrf": "x" * 43, "digest": first["digest"]})
    assert forged.headers["location"] == f"/sessions/{sid}?problem=csrf"
    not_json = api.post("/gates/approve", data={**form, "digest": first["digest"], "arguments": '{"amount": 9'})
    assert (
        not_json.status_code == 400
        and "not JSON" in not_json.text
        and "{&#34;amount&#34;: 9</textarea>" in not_json.text
    )
    assert (
        api.post("/sessions/" + sid + "/cancel", data={**form, "csrf": "y" * 43})
        .headers["location"]
        .endswith("problem=csrf")
    )
    assert runs(log, phase="start") == [] and len(api.get(f"/v1/sessions/{sid}/pending").json()["pending"]) == 2

    extended = api.post("/extend", data=form)
    assert extended.headers["location"] == f"/sessions/{sid}?done=extended"
    (moved,) = [p for p in api.get(f"/v1/sessions/{sid}/pending").json()["pending"] if p["token"] == first["token"]]
    assert 3500 < moved["expires_at"] - first["expires_at"] < 3700, "an hour later than it was, not an hour from now"
    done = api.post("/gates/approve", data={**form, "digest": first["digest"]})
    assert done.headers["location"] == f"/sessions/{sid}?done=run"
    again = api.post("/gates/reject", data={**form, "reason": "late"})
    assert again.headers["location"] == f"/sessions/{sid}?problem=token_already_completed"
    rejected = api.post(
        "/gates/reject", data={**form, "token": second["token"], "digest": second["digest"], "reason": "no"}
    )
    assert rejected.headers["location"] == f"/sessions/{sid}?done=rejected"
    shown = finished(api, sid)
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 500}]
    assert ("pay", "rejected: no", True) in results(shown)
