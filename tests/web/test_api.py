"""The HTTP API of `agents serve` with real workers: every endpoint, the CLI's documents as replies,
the contract's error codes as statuses, Server-Sent Events with Last-Event-ID resume, /metrics."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from tests.support.llm_server import LlmServer, calls, text
from tests.support.serve import Serve
from tests.web.conftest import LIMIT_BYTES, blocked, one_approval, read_events, serve_env, started

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("web_workers")]


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    code: str = response.json()["error"]["code"]
    return code


def test_a_deferred_call_is_listed_completed_over_http_and_the_session_finishes(
    api: httpx.Client, llm_server: LlmServer
) -> None:
    view = blocked(api, one_approval(llm_server, answer="paid 42"))
    sid = view["session_id"]
    assert view["state"] == "waiting" and view["agent"] == "approver"
    (call,) = view["pending"]
    assert (call["tool"], call["arguments"], call["reason"]) == ("approve", {"amount": 42}, "payments need a person")

    everywhere = api.get("/v1/pending").json()["pending"]
    assert call["token"] in [p["token"] for p in everywhere]
    assert api.get(f"/v1/sessions/{sid[:10]}/pending").json() == {"pending": [call]}

    done = api.post(f"/v1/continuations/{call['token']}", json={"result": {"ok": True}, "by": "http-test"})
    assert done.status_code == 200, done.text
    assert done.json() == {
        "token": call["token"],
        "session_id": sid,
        "call_id": call["call_id"],
        "accepted": True,
        "remaining": 0,
        "woken": True,
        "decision": "responded",
    }
    kinds = [e["type"] for e in read_events(api, sid, until="completed")]
    assert "token_completed" in kinds
    shown = api.get(f"/v1/sessions/{sid}", params={"detail": "true"}).json()
    assert (shown["state"], shown["response"]) == ("completed", "paid 42")
    results = [r for t in shown["turns"] for r in t.get("tool_responses", [])]
    assert [(r["tool"], r["content"]) for r in results] == [("approve", {"ok": True})]
    assert "turns" not in api.get(f"/v1/sessions/{sid}").json()


def test_a_session_is_stepped_paused_resumed_and_cancelled_over_http(api: httpx.Client, llm_server: LlmServer) -> None:
    view = started(api, one_approval(llm_server))
    sid = view["session_id"]
    assert (view["state"], view["steps"]) == ("ready", 0)

    stepped = api.post(f"/v1/sessions/{sid}/step", params={"wait": "true", "timeout": 60}).json()
    assert (stepped["state"], stepped["head"]) == ("tools", "LlmTurn")
    paused = api.post(f"/v1/sessions/{sid}/pause").json()
    assert paused["drive"] == "manual"
    resumed = api.post(f"/v1/sessions/{sid}/resume", params={"wait": "true", "timeout": 60}).json()
    assert resumed["state"] == "waiting" and resumed["pending"][0]["tool"] == "approve"
    token = resumed["pending"][0]["token"]

    cancelled = api.post(f"/v1/sessions/{sid}/cancel").json()
    assert cancelled["state"] == "cancelled"
    assert error_of(api.post(f"/v1/sessions/{sid}/step"), 409) == "session_not_advanceable"
    assert error_of(api.post(f"/v1/continuations/{token}", json={"result": "late"}), 409) == "token_cancelled"


def test_a_session_started_over_http_takes_the_priority_asked_for(api: httpx.Client, llm_server: LlmServer) -> None:
    agent = one_approval(llm_server)
    assert started(api, agent)["priority"] == 5
    assert started(api, agent, priority=8)["priority"] == 8
    assert started(api, {**agent, "priority": 2})["priority"] == 2


def test_sessions_are_listed_by_state(api: httpx.Client, llm_server: LlmServer) -> None:
    sid = started(api, one_approval(llm_server))["session_id"]
    ready = api.get("/v1/sessions", params={"status": "ready", "limit": 500}).json()["sessions"]
    assert sid in [v["session_id"] for v in ready]
    assert all(v["state"] == "ready" for v in ready)
    cancelled = api.get("/v1/sessions", params={"status": "cancelled", "limit": 500}).json()["sessions"]
    assert sid not in [v["session_id"] for v in cancelled]
    assert error_of(api.get("/v1/sessions", params={"status": "sleeping"}), 400) == "invalid_input"


def test_a_token_completes_once_and_refusals_carry_the_contracts_codes(
    api: httpx.Client, llm_server: LlmServer
) -> None:
    token = blocked(api, one_approval(llm_server))["pending"][0]["token"]
    assert error_of(api.post(f"/v1/continuations/{token}", json={}), 400) == "invalid_result"
    assert error_of(api.post(f"/v1/continuations/{token}", json={"result": 1, "error": "x"}), 400) == "invalid_result"
    big = "x" * (LIMIT_BYTES + 1)
    assert error_of(api.post(f"/v1/continuations/{token}", json={"result": big}), 400) == "invalid_result"
    rejected = api.post(f"/v1/continuations/{token}", json={"error": "  no, too much  "})
    assert rejected.status_code == 200 and rejected.json()["accepted"] is True
    again = api.post(f"/v1/continuations/{token}", json={"result": "yes"})
    assert error_of(again, 409) == "token_already_completed"

    assert error_of(api.post(f"/v1/continuations/{token}x", json={"result": 1}), 404) == "unknown_token"
    assert error_of(api.get("/v1/sessions/0123456789abcdef0123456789abcdef"), 404) == "unknown_session"
    assert error_of(api.get("/v1/sessions/0123456789abcdef0123456789abcdef/pending"), 404) == "unknown_session"
    assert error_of(api.post("/v1/sessions/0123456789abcdef0123456789abcdef/resume"), 404) == "unknown_session"


def test_invalid_bodies_are_refused_with_400_and_nothing_is_stored(api: httpx.Client, llm_server: LlmServer) -> None:
    before = len(api.get("/v1/sessions", params={"limit": 1000}).json()["sessions"])
    agent = one_approval(llm_server)
    assert error_of(api.post("/v1/sessions", json={"agent": {"slug": "x"}, "prompt": "p"}), 400) == "invalid_agent_file"
    assert error_of(api.post("/v1/sessions", json={"agent": agent, "prompt": " "}), 400) == "invalid_input"
    too_long = "p" * (LIMIT_BYTES + 1)
    assert error_of(api.post("/v1/sessions", json={"agent": agent, "prompt": too_long}), 400) == "invalid_input"
    for extra in ({"run": "fast"}, {"extra": 1}, {"timeout": -1}, {"priority": 10}):
        bad = api.post("/v1/sessions", json={"agent": agent, "prompt": "p", **extra})
        assert error_of(bad, 400) == "invalid_input", extra
    not_json = api.post("/v1/sessions", content=b"{", headers={"content-type": "application/json"})
    assert error_of(not_json, 400) == "invalid_input"
    assert not_json.json()["error"]["message"].startswith("the body is not JSON (at character 1"), not_json.text
    huge = api.post("/v1/sessions", content=b"[" + b"0," * (4 * 1024 * 1024) + b"0]")
    assert error_of(huge, 413) == "invalid_input"
    assert len(api.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]) == before


def test_events_resume_after_the_last_event_id(api: httpx.Client, llm_server: LlmServer) -> None:
    sid = blocked(api, one_approval(llm_server))["session_id"]
    first = read_events(api, sid, until="token_created")
    assert first[0]["type"] == "session_started"
    mark = first[-1]["id"]
    api.post(f"/v1/sessions/{sid}/cancel")
    rest = read_events(api, sid, until="cancelled", last_event_id=mark)
    assert all(e["id"] > mark for e in rest) and [e["type"] for e in rest][-1] == "cancelled"
    assert mark not in [e["id"] for e in rest]
    bad = api.get(f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": "yesterday"})
    assert error_of(bad, 400) == "invalid_input"


def test_metrics_count_sessions_by_state_from_the_indexes(api: httpx.Client, llm_server: LlmServer) -> None:
    def waiting() -> float:
        lines = api.get("/metrics").text.splitlines()
        (line,) = [x for x in lines if x.startswith('agents_sessions{state="waiting"}')]
        return float(line.split()[-1])

    before = waiting()
    blocked(api, one_approval(llm_server))
    assert waiting() == before + 1
    (deferred,) = [
        x for x in api.get("/metrics").text.splitlines() if x.startswith('agents_pending_calls{disposition="defer"}')
    ]
    assert float(deferred.split()[-1]) >= 1


def test_a_message_continues_a_completed_session(api: httpx.Client, llm_server: LlmServer) -> None:
    agent = one_approval(llm_server)
    agent["model"] = f"openai/{llm_server.scenario([text('first'), text('second')])}"
    sid = started(api, agent, run="until_blocked", wait=True, timeout=60)["session_id"]
    view = api.post(f"/v1/sessions/{sid}/messages", json={"prompt": "and again", "run": "until_blocked", "wait": True})
    assert view.status_code == 200, view.text
    assert (view.json()["state"], view.json()["response"]) == ("completed", "second")


def test_a_message_to_an_unknown_session_is_404(api: httpx.Client) -> None:
    missing = api.post("/v1/sessions/0123456789abcdef0123456789abcdef/messages", json={"prompt": "hi"})
    assert error_of(missing, 404) == "unknown_session"


def test_a_message_to_a_cancelled_session_is_409(api: httpx.Client, llm_server: LlmServer) -> None:
    sid = started(api, one_approval(llm_server))["session_id"]
    api.post(f"/v1/sessions/{sid}/cancel")
    refused = api.post(f"/v1/sessions/{sid}/messages", json={"prompt": "still there?"})
    assert error_of(refused, 409) == "session_not_advanceable"


def test_every_request_needs_the_token(server: Serve, api_token: str) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        for method, path in [
            ("GET", "/v1/sessions"),
            ("GET", "/v1/pending"),
            ("POST", "/v1/continuations/a.b"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
        ]:
            r = anonymous.request(method, path)
            assert error_of(r, 401) == "unauthorized", path
            assert r.headers["www-authenticate"].startswith("Bearer")
        wrong = anonymous.get("/v1/sessions", headers={"Authorization": f"Bearer {api_token}x"})
        assert error_of(wrong, 401) == "unauthorized"
        page = anonymous.get("/", headers={"Accept": "text/html"})
        assert (page.status_code, page.headers["location"]) == (303, "/login")


def test_openapi_describes_every_endpoint_and_docs_load_without_a_cdn(api: httpx.Client) -> None:
    paths = api.get("/openapi.json").json()["paths"]
    for path in (
        "/v1/sessions",
        "/v1/sessions/{session_id}",
        "/v1/sessions/{session_id}/step",
        "/v1/sessions/{session_id}/resume",
        "/v1/sessions/{session_id}/pause",
        "/v1/sessions/{session_id}/cancel",
        "/v1/sessions/{session_id}/messages",
        "/v1/pending",
        "/v1/sessions/{session_id}/pending",
        "/v1/continuations/{token}",
        "/v1/sessions/{session_id}/events",
        "/v1/sessions/{session_id}/history",
        "/v1/sessions/{session_id}/fork",
        "/v1/sessions/{session_id}/rerun",
    ):
        assert path in paths
    docs = api.get("/docs")
    assert docs.status_code == 200
    links = re.findall(r'(?:src|href)="([^"]+)"', docs.text)
    assert links and all(link.startswith("/") and not link.startswith("//") for link in links)
    assert api.get("/docs-assets/swagger-ui-bundle.js").status_code == 200


def test_two_serve_processes_answer_alike_and_accept_each_others_forms(
    api: httpx.Client,
    api_token: str,
    llm_server: LlmServer,
    redis_url: str,
    module_prefix: str,
    tmp_path: Path,
) -> None:
    env = serve_env(redis_url, module_prefix, AGENTS_API_TOKEN=api_token)
    with (
        Serve(env, tmp_path / "second.log") as second,
        httpx.Client(base_url=second.url, headers={"Authorization": f"Bearer {api_token}"}, timeout=60) as other,
    ):
        view = blocked(api, one_approval(llm_server, answer="both agree"))
        sid, call = view["session_id"], view["pending"][0]
        assert other.get(f"/v1/sessions/{sid}/pending").json() == {"pending": [call]}
        # The form comes from the first process, its submission goes to the second.
        page = api.get("/")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf
        cookies = {"agents_csrf": api.cookies["agents_csrf"]}
        form = {"csrf": csrf.group(1), "token": call["token"], "result": "fine", "back": f"/sessions/{sid}"}
        done = httpx.post(
            f"{second.url}/approve",
            data=form,
            cookies=cookies,
            headers={"Authorization": f"Bearer {api_token}"},
            follow_redirects=False,
        )
        assert done.headers["location"] == f"/sessions/{sid}?done=approved"
        assert [e["type"] for e in read_events(other, sid, until="completed")][-1] == "completed"
        assert api.get(f"/v1/sessions/{sid}").json()["response"] == "both agree"


def test_a_wait_that_runs_out_is_504_and_the_work_goes_on(api: httpx.Client, llm_server: LlmServer) -> None:
    agent = one_approval(llm_server)
    agent["model"] = f"openai/{llm_server.scenario([text('slow answer', delay=1.5)])}"
    sid = started(api, agent)["session_id"]
    timed_out = api.post(f"/v1/sessions/{sid}/step", params={"wait": "true", "timeout": 0.2})
    assert error_of(timed_out, 504) == "wait_timeout"
    assert read_events(api, sid, until="completed")[-1]["type"] == "completed"


def test_a_childs_deferred_call_is_approved_on_the_page_and_its_parent_finishes(
    api: httpx.Client, llm_server: LlmServer, tmp_path: Path
) -> None:
    helper = one_approval(llm_server, answer="Paris", slug="helper")
    (tmp_path / "helper.json").write_text(json.dumps(helper))
    boss_model = llm_server.scenario(
        [calls(("prompt_agent_helper", {"prompt": "the capital of France?"})), text("The helper said Paris")]
    )
    boss = {"slug": "boss", "model": f"openai/{boss_model}", "apiBase": llm_server.url, "subAgents": ["helper.json"]}
    parent = blocked(api, {**boss, "baseDir": str(tmp_path)}, "ask the helper")
    (child,) = parent["children"]
    (call,) = [p for p in api.get(f"/v1/sessions/{parent['session_id']}/pending").json()["pending"] if p["token"]]
    assert (call["session_id"], call["tool"]) == (child, "approve")

    page = api.get(f"/sessions/{parent['session_id']}", headers={"Accept": "text/html"}).text
    assert f'href="/sessions/{child}"' in page, "the parent's page links its child"
    child_page = api.get(f"/sessions/{child}", headers={"Accept": "text/html"}).text
    assert f'href="/sessions/{parent["session_id"]}"' in child_page, "and the child's page its parent"
    csrf = re.search(r'name="csrf" value="([^"]+)"', child_page)
    assert csrf
    form = {"csrf": csrf.group(1), "token": call["token"], "result": "", "back": f"/sessions/{child}"}
    assert api.post("/approve", data=form).headers["location"] == f"/sessions/{child}?done=approved"

    read_events(api, parent["session_id"], until="completed")
    assert api.get(f"/v1/sessions/{parent['session_id']}").json()["response"] == "The helper said Paris"


def test_a_session_stopped_by_its_budget_goes_on_with_a_grant_over_http(
    api: httpx.Client, llm_server: LlmServer
) -> None:
    pay = {"name": "pay", "description": "pays", "parameters": {"type": "object"},
           "command": [sys.executable, "-c", "print('paid')"]}  # fmt: skip
    replies = [calls(("pay", {})), text("paid")]
    model = llm_server.scenario(replies)
    agent = {"slug": "payer", "model": f"openai/{model}", "apiBase": llm_server.url, "tools": [pay],
             "budget": {"modelCalls": 1}}  # fmt: skip
    view = started(api, agent, run="until_blocked", wait=True, timeout=60)
    assert view["state"] == "failed" and view["error"]["code"] == "budget_exceeded", view
    assert view["spent"]["modelCalls"] == 1 and view["spent"]["toolCalls"] == 1
    sid = view["session_id"]
    refused = api.post(f"/v1/sessions/{sid}/resume", json={"grant": {"steps": 1}})
    assert error_of(refused, 400) == "invalid_input"
    resumed = api.post(
        f"/v1/sessions/{sid}/resume", params={"wait": "true", "timeout": 60}, json={"grant": {"modelCalls": 1}}
    )
    assert resumed.status_code == 200, resumed.text
    doc = resumed.json()
    assert (doc["state"], doc["response"], doc["budget"]["modelCalls"]) == ("completed", "paid", 2)
