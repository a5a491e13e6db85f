"""History, fork and rerun over HTTP against the package's serve process and worker: a fork of a
waiting session has a token of its own and leaves its origin's alone; a rerun reuses the result a
person gave the origin (nobody is asked twice); a dry run answers what would run; a fork's body may
bind another agent (`"agent"`), which then drives it."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.support.llm_server import LlmServer, text
from tests.web.conftest import approval_agent, one_approval, started

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("web_workers")]


def test_history_fork_and_rerun_over_http(api: httpx.Client, llm_server: LlmServer) -> None:
    origin = started(api, one_approval(llm_server), run="until_blocked", wait=True, timeout=60)
    sid = origin["session_id"]
    assert origin["state"] == "waiting"
    (gate,) = origin["pending"]

    versions = api.get(f"/v1/sessions/{sid}/history").json()["versions"]
    assert [v["version"] for v in versions] == list(range(1, origin["version"] + 1))
    assert [v["kind"] for v in versions] == ["started", "llm", "tools"]
    assert versions[-1]["summary"] == "tools: deferred approve"

    r = api.post(f"/v1/sessions/{sid}/fork", json={})
    assert r.status_code == 201, r.text
    fork = r.json()
    assert fork["forked_from"] == {"session_id": sid, "version": origin["version"]}
    (copied,) = fork["pending"]
    assert copied["token"] != gate["token"] and copied["token"].startswith(fork["session_id"] + ".")
    assert api.get(f"/v1/sessions/{sid}").json()["pending"][0]["token"] == gate["token"]

    plan = api.post(f"/v1/sessions/{sid}/rerun", json={"from": 2, "dry_run": True}).json()
    assert plan == {
        "would_run": [{"tool": "approve", "arguments": {"amount": 42}, "disposition": "defer"}],
        "reused": [],
    }

    done = api.post(f"/v1/continuations/{gate['token']}", json={"result": "yes", "by": "alice"})
    assert done.status_code == 200, done.text
    plan = api.post(f"/v1/sessions/{sid}/rerun", json={"from": 2, "dry_run": True}).json()
    assert plan["reused"] == [{"tool": "approve", "arguments": {"amount": 42}, "disposition": "defer"}]
    r = api.post(f"/v1/sessions/{sid}/rerun", json={"from": 1, "wait": True, "timeout": 60})
    assert r.status_code == 201, r.text
    rerun = r.json()
    assert (rerun["state"], rerun["response"], rerun["pending"]) == ("completed", "done", [])
    assert rerun["forked_from"] == {"session_id": sid, "version": 1}

    assert api.post(f"/v1/sessions/{sid}/fork", json={"at": 99}).status_code == 400
    assert api.get("/v1/sessions/nosuchsession/history").status_code == 404


def test_a_fork_over_http_binds_the_agent_its_body_gives(api: httpx.Client, llm_server: LlmServer) -> None:
    origin = started(api, one_approval(llm_server), run="until_blocked", wait=True, timeout=60)
    sid = origin["session_id"]
    # the other agent's model, asked with the copied call's result, answers at once
    other = approval_agent(llm_server, [text("the other agent's answer")], slug="other-approver")
    r = api.post(f"/v1/sessions/{sid}/fork", json={"at": origin["version"], "agent": other})
    assert r.status_code == 201, r.text
    fork = r.json()
    assert (fork["agent"], fork["forked_from"]) == ("other-approver", {"session_id": sid, "version": origin["version"]})
    (copied,) = fork["pending"]
    done = api.post(f"/v1/continuations/{copied['token']}", json={"result": "yes"})
    assert done.status_code == 200, done.text
    view = api.post(f"/v1/sessions/{fork['session_id']}/resume", params={"wait": True, "timeout": 60}).json()
    assert (view["state"], view["response"]) == ("completed", "the other agent's answer"), view
    assert api.get(f"/v1/sessions/{sid}").json()["agent"] == "approver", "the origin keeps its own"
    bad = api.post(f"/v1/sessions/{sid}/fork", json={"agent": {"slug": "no model"}})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_agent_file", bad.text


def test_fork_from_here_on_a_transcript_turn_makes_the_fork_and_shows_it(
    api: httpx.Client, llm_server: LlmServer
) -> None:
    origin = started(api, one_approval(llm_server), run="until_blocked", wait=True, timeout=60)
    sid = origin["session_id"]
    page = api.get(f"/sessions/{sid}", headers={"Accept": "text/html"}).text
    # One "Fork from here" per turn: the prompt (version 1) and the model's call (version 3, the
    # last version whose transcript ends with it).
    assert re.findall(r'name="at" value="(\d+)"', page) == ["1", "3"]
    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
    assert csrf
    form = {"csrf": csrf.group(1), "session_id": sid, "at": "1", "back": f"/sessions/{sid}"}
    r = api.post("/fork", data=form)
    assert r.status_code == 303 and r.headers["location"].endswith("?done=forked")
    fork_id = r.headers["location"].split("/sessions/")[1].split("?")[0]
    fork = api.get(f"/v1/sessions/{fork_id}").json()
    assert (fork["state"], fork["forked_from"]) == ("ready", {"session_id": sid, "version": 1})
    assert f'href="/sessions/{sid}"' in api.get(f"/sessions/{fork_id}", headers={"Accept": "text/html"}).text
    bad = api.post("/fork", data={**form, "csrf": "forged"})
    assert bad.headers["location"] == f"/sessions/{sid}?problem=csrf"
