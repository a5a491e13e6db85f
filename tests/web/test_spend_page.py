"""The session page shows what a session spent against its budget, the fleet limit holding its
next model call, and the tools approved for the rest of the session: the app in this process on a
real Redis, the sessions brought there by real steps (inline, scripted model)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model.admission import ModelLimit
from celery_agents.runtime import run_step
from celery_agents.store import Store
from celery_agents.store.records import Waiter
from celery_agents.tools.resolve import parse_agent
from celery_agents.web.app import create_app
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn
from tests.store.scenario import AGENT, start

TOKEN = "a-right-token-long-enough-for-any-address"
LOOKUP = {"name": "lookup", "python": "tests.x:y", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture
def browser(settings: Settings) -> Iterator[TestClient]:
    settings = settings.replace(api_token=TOKEN)
    with TestClient(create_app(settings, Client(settings, inline=False)), base_url="http://127.0.0.1:8765") as c:
        c.headers.update({"Authorization": f"Bearer {TOKEN}", "Accept": "text/html"})
        yield c


def paragraph(html: str, marker: str) -> str | None:
    found = re.search(rf'<p id="{marker}"[^>]*>(.*?)</p>', html, re.S)
    return found.group(0) if found else None


def shown(browser: TestClient, sid: str) -> str:
    """The session's page; its live refresh (the part the page fetches again as the session moves)
    says the same."""
    page = browser.get(f"/sessions/{sid}")
    live = browser.get(f"/sessions/{sid}/live")
    assert page.status_code == live.status_code == 200
    for marker in ("session-spend", "session-throttled"):
        assert paragraph(page.text, marker) == paragraph(live.text, marker)
    return page.text


def spend_of(html: str) -> dict[str, tuple[str, bool]]:
    """The page's spend line: kind -> (what it says, marked as reached)."""
    line = paragraph(html, "session-spend")
    assert line, "the page shows what the session spent"
    spans = re.findall(r'<span class="spend( bad)?" data-kind="(\w+)">\w+ ([^<]+)</span>', line)
    return {kind: (amount, bool(bad)) for bad, kind, amount in spans}


def test_the_page_shows_the_spend_against_the_budget_that_stopped_the_session(
    settings: Settings, browser: TestClient
) -> None:
    agent = parse_agent({"slug": "spender", "model": "fake/m", "tools": [LOOKUP], "budget": {"modelCalls": 2}})
    ask = [llm_turn((f"c{n}", "lookup", "{}")) for n in range(2)]
    with Client(settings, inline=True, llm=ScriptedLlm(*ask), tools=RecordingTools()) as client:
        view = client.start(agent, "go", run=True)
    assert view.error is not None and view.error.code == "budget_exceeded"
    html = shown(browser, view.session_id)
    spend = spend_of(html)
    assert spend["modelCalls"] == ("2/2", True), "the limit reached is shown against the spend, marked"
    assert spend["toolCalls"] == ("2", False) and spend["costUsd"] == ("0", False)
    assert "(of the budget)" in html and "budget exceeded: modelCalls spent 2, limit 2" in html


def test_a_session_without_spend_or_budget_shows_no_spend_line(settings: Settings, browser: TestClient) -> None:
    with Client(settings, inline=True) as client:
        view = client.start(parse_agent({"slug": "idle", "model": "fake/m"}), "go")
    assert 'id="session-spend"' not in shown(browser, view.session_id)


def test_the_page_shows_until_when_a_fleet_limit_holds_the_next_model_call(
    settings: Settings, store: Store, browser: TestClient
) -> None:
    store = Store(store.client, replace(store.settings, limits_refresh=0.0))
    store.set_limit(AGENT.model, ModelLimit(rpm=1))
    assert store.admit(AGENT.model, [AGENT.model], 0, "other:1:slot", Waiter("other", 1, 5)).admitted
    sid = start(store, drive="auto", owe=True)
    res = run_step(store, sid, 1, llm=ScriptedLlm(llm_turn(text="hi")), tools=RecordingTools(), owner="w1")
    assert res.outcome == "throttled"
    with Client(settings) as client:
        until = client.view(sid).throttled_until
    assert until
    html = shown(browser, sid)
    assert f'Throttled until <time datetime="{until}">' in html and "agents limits list" in html


def test_the_page_lists_the_tools_approved_for_the_rest_of_the_session(settings: Settings, browser: TestClient) -> None:
    gated = {"rules": [{"tool": "lookup", "disposition": {"tag": "defer", "then": "runSync", "reason": "ask"}}]}
    agent: Any = parse_agent(
        {"slug": "gated", "model": "fake/m", "tools": [LOOKUP], "toolCallPolicy": {"default": "runSync", **gated}}
    )
    llm = ScriptedLlm(llm_turn(("c0", "lookup", "{}")), llm_turn(text="done"))
    with Client(settings, inline=True, llm=llm, tools=RecordingTools()) as client:
        view = client.start(agent, "go", run=True)
        (gate,) = view.pending
        client.approve(gate.token or "", digest=gate.digest, for_session=True)
    html = shown(browser, view.session_id)
    assert re.search(r"Approved for the rest of the session: <code>lookup</code>", html)
