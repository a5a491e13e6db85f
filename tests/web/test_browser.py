"""The approvals page in a real headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright): sign in once, approve one call and reject another through the page, watch a session
page finish live over Server-Sent Events; and hostile model and tool text stays text. Skipped
where no browser is installed. With AGENTS_SCREENSHOTS=DIR the pages are also saved as images
(docs/approvals-*.png are made this way)."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import runs
from tests.support.llm_server import LlmServer, calls, text
from tests.support.serve import Serve
from tests.web.conftest import approval_agent, blocked, finished, gated_agent, read_events, results

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("web_workers")]

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).exists()), None)
SCRIPT = "<script>window.__xss = 1</script>"
XSS = SCRIPT + '<img src="x" onerror="window.__xss = 2">'


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    playwright = pytest.importorskip("playwright.sync_api")
    if CHROMIUM is None:
        pytest.skip("no chromium installed (apt-get install chromium)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: Serve, api_token: str) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    tab = context.new_page()
    tab.set_default_timeout(60_000)
    tab.on("dialog", lambda d: pytest.fail(f"a dialog opened: {d.message}"))
    tab.goto(server.url + "/")
    assert tab.url.endswith("/login"), "the page asks for the token first"
    tab.fill("#token", api_token)
    tab.keyboard.press("Enter")
    tab.wait_for_url(server.url + "/")
    yield tab
    context.close()


def shot(tab: Any, name: str) -> None:
    folder = os.environ.get("AGENTS_SCREENSHOTS")
    if folder:
        tab.screenshot(path=str(Path(folder) / f"approvals-{name}.png"), full_page=True)


def test_a_person_approves_one_call_and_rejects_another_in_the_browser_and_both_sessions_finish(
    page: Any, api: httpx.Client, llm_server: LlmServer, server: Serve
) -> None:
    slug = f"payments-{uuid.uuid4().hex[:6]}"
    approved = blocked(
        api, approval_agent(llm_server, [calls(("approve", {"amount": 42})), text("paid 42")], slug), "pay 42"
    )
    rejected = blocked(
        api, approval_agent(llm_server, [calls(("approve", {"amount": 9000})), text("did not pay")], slug), "pay 9000"
    )
    a, b = approved["session_id"], rejected["session_id"]
    (call_a,), (call_b,) = approved["pending"], rejected["pending"]

    page.goto(server.url + "/")
    page.select_option("#f-agent", slug)
    page.click("text=Filter")
    page.wait_for_selector(f"#call-{a}-{call_a['call_id']}")
    assert page.locator("article.call").count() == 2, "the filter keeps this agent's calls"
    card = page.locator(f"#call-{b}-{call_b['call_id']}")
    assert '"amount": 9000' in card.locator("pre.args").inner_text()
    assert "payments need a person" in card.inner_text()

    watcher = page.context.new_page()
    watcher.goto(f"{server.url}/sessions/{b}")
    assert watcher.inner_text("#session-state") == "waiting"

    card_a = page.locator(f"#call-{a}-{call_a['call_id']}")
    card_a.locator("textarea").fill('{"approved_by": "browser"}')
    card_a.locator("button.approve-button").focus()
    page.keyboard.press("Enter")
    page.wait_for_selector("text=Approved.")

    card_b = page.locator(f"#call-{b}-{call_b['call_id']}")
    card_b.locator("input[name=reason]").fill("too expensive")
    card_b.locator("input[name=reason]").press("Enter")
    page.wait_for_selector("text=Rejected.")

    # The watcher never reloads: its page redraws from the session's events.
    watcher.wait_for_selector("#session-state.completed")
    assert "did not pay" in watcher.inner_text(".answer")
    assert "too expensive" in watcher.inner_text(".transcript")

    read_events(api, a, until="completed")
    shown_a = api.get(f"/v1/sessions/{a}", params={"detail": "true"}).json()
    shown_b = api.get(f"/v1/sessions/{b}", params={"detail": "true"}).json()
    assert (shown_a["state"], shown_a["response"]) == ("completed", "paid 42")
    assert (shown_b["state"], shown_b["response"]) == ("completed", "did not pay")
    results = {
        sid: [r for t in s["turns"] for r in t.get("tool_responses", [])] for sid, s in ((a, shown_a), (b, shown_b))
    }
    assert [(r["content"], r.get("is_error", False)) for r in results[a]] == [({"approved_by": "browser"}, False)]
    assert [(r["content"], r["is_error"]) for r in results[b]] == [("too expensive", True)]


def test_model_and_tool_output_carrying_script_renders_as_text_and_runs_nothing(
    page: Any, api: httpx.Client, llm_server: LlmServer, server: Serve
) -> None:
    agent = approval_agent(llm_server, [calls(("approve", {"note": XSS})), text(XSS)], f"xss-{uuid.uuid4().hex[:6]}")
    view = blocked(api, agent, XSS)
    sid, token = view["session_id"], view["pending"][0]["token"]

    page.goto(server.url + "/")
    page.wait_for_selector(f"#call-{sid}-{view['pending'][0]['call_id']}")
    arguments = page.inner_text(f"#call-{sid}-{view['pending'][0]['call_id']} pre.args")
    assert SCRIPT in arguments and 'onerror=\\"window' in arguments, "JSON arguments show as JSON text"

    assert api.post(f"/v1/continuations/{token}", json={"result": XSS}).status_code == 200
    read_events(api, sid, until="completed")
    page.goto(f"{server.url}/sessions/{sid}")
    assert page.inner_text(".answer .text") == XSS, "the model's answer shows as the text it is"
    transcript = page.inner_text(".transcript")
    assert transcript.count(XSS) >= 2 and transcript.count(SCRIPT) >= 3, "prompt, arguments and result show as text"
    assert page.locator("main img").count() == 0 and page.locator("main script").count() == 0
    assert page.evaluate("window.__xss") is None


def test_a_person_edits_one_gate_and_rejects_another_in_the_browser_and_the_tools_see_exactly_that(
    page: Any, api: httpx.Client, llm_server: LlmServer, server: Serve, tmp_path: Path
) -> None:
    slug = f"gates-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "runs.log"
    edited = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 500})), text("paid")], slug=slug))
    refused = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 9000})), text("no")], slug=slug))
    blocked(api, gated_agent(llm_server, log, [calls(("note", {"x": 1})), text("noted")], slug=slug))
    a, b = edited["session_id"], refused["session_id"]
    (gate_a,), (gate_b,) = edited["pending"], refused["pending"]

    page.goto(f"{server.url}/?agent={slug}")
    card_a = page.locator(f"#call-{a}-{gate_a['call_id']}")
    card_b = page.locator(f"#call-{b}-{gate_b['call_id']}")
    assert "approval gate" in card_a.inner_text() and "runSync" in card_a.inner_text()
    assert gate_a["digest"][:16] in card_a.locator(".digest").inner_text()
    assert re.fullmatch(r"23 h 5\d min left", card_a.locator(".countdown").inner_text())
    shot(page, "pending")
    if os.environ.get("AGENTS_SCREENSHOTS"):
        page.set_viewport_size({"width": 390, "height": 844})
        shot(page, "phone")
        page.set_viewport_size({"width": 1100, "height": 900})

    card_a.locator("button.extend-button").click()
    page.wait_for_selector("text=The deadline is an hour later.")
    assert re.fullmatch(r"1 d 0 h left", card_a.locator(".countdown").inner_text())

    card_a.locator("summary", has_text="Edit arguments and run").click()
    editor = card_a.locator("textarea[name=arguments]")
    assert json.loads(editor.input_value()) == {"amount": 500}, "the editor starts from the model's arguments"
    editor.fill('{"amount": 90')
    card_a.locator("button.edit-button").click()
    assert "not JSON" in card_a.locator(".edit-problem").inner_text(), "refused before it posts"
    assert editor.get_attribute("aria-invalid") == "true"
    editor.fill('{"amount": "ninety"}')
    card_a.locator("button.edit-button").click()
    page.wait_for_selector("p.flash.bad")
    assert "amount" in page.inner_text("p.flash.bad"), "the server names what does not fit the tool"
    assert card_a.locator("textarea[name=arguments]").input_value() == '{"amount": "ninety"}', "the edit is kept"
    shot(page, "edit")
    assert runs(log, phase="start") == [], "nothing ran"
    card_a.locator("textarea[name=arguments]").fill('{"amount": 90}')
    card_a.locator("button.edit-button").click()
    page.wait_for_selector("text=Approved with your arguments")

    card_b.locator("input[name=reason]").fill("too expensive")
    card_b.locator("input[name=reason]").press("Enter")
    page.wait_for_selector("text=Rejected.")

    shown_a = finished(api, a)
    shown_b = finished(api, b)
    assert [r["args"] for r in runs(log, "pay", "start")] == [{"amount": 90}], "exactly the edited call ran, once"
    assert results(shown_a)[0][1]["echo"] == {"amount": 90}
    assert results(shown_b) == [("pay", "rejected: too expensive", True)]
    assert (shown_a["response"], shown_b["response"]) == ("paid", "no")
    page.goto(f"{server.url}/sessions/{a}")
    call = page.inner_text(".msg.tool-call").lower()
    assert "defer then runsync → completed (edited by page)" in call and "ran with the edited arguments" in call
    assert '"amount": 90' in page.inner_text(".msg.tool-call pre.edited")
    shot(page, "session")


def test_the_session_page_pauses_resumes_and_cancels_a_session(
    page: Any, api: httpx.Client, llm_server: LlmServer, server: Serve, tmp_path: Path
) -> None:
    log = tmp_path / "runs.log"
    view = blocked(api, gated_agent(llm_server, log, [calls(("pay", {"amount": 5})), text("x")]))
    sid, (gate,) = view["session_id"], view["pending"]
    page.goto(f"{server.url}/sessions/{sid}")
    page.click("button.pause-button")
    page.wait_for_selector("text=Paused")
    assert api.get(f"/v1/sessions/{sid}").json()["drive"] == "manual"
    page.click("button.resume-button")
    page.wait_for_selector("text=Resumed.")
    assert api.get(f"/v1/sessions/{sid}").json()["drive"] == "auto"
    page.click("details.confirm summary")
    shot(page, "session-controls")
    page.click("button.cancel-button")
    page.wait_for_selector("#session-state.cancelled")
    assert page.locator("button.pause-button, button.resume-button, button.cancel-button").count() == 0
    refused = api.post(f"/v1/continuations/{gate['token']}", json={"decision": "approve"})
    assert (refused.status_code, refused.json()["error"]["code"]) == (409, "token_cancelled")
    assert runs(log, phase="start") == []


def test_the_session_page_shows_the_answer_as_it_streams_then_the_committed_one(
    page: Any, api: httpx.Client, llm_server: LlmServer, server: Serve
) -> None:
    answer = "<b>Sunny</b> in Paris, " + "and mild all afternoon, " * 12 + "then rain."
    reply = text(answer, chunk_chars=3, chunk_delay=0.02)
    agent = {"slug": "streamer", "model": f"openai/{llm_server.scenario([reply])}", "apiBase": llm_server.url}
    r = api.post("/v1/sessions", json={"agent": agent, "prompt": "Weather?"})
    sid = r.json()["session_id"]
    page.goto(f"{server.url}/sessions/{sid}")
    api.post(f"/v1/sessions/{sid}/resume")
    streaming = page.locator("li.streaming.text .text")
    streaming.wait_for()
    page.wait_for_function("() => document.querySelector('li.streaming.text .text').textContent.length > 20")
    shown = streaming.inner_text()
    assert answer.startswith(shown), "the pieces so far, in order, as text"
    assert page.locator("li.streaming b").count() == 0, "the model's markup stays text"
    page.wait_for_selector("#session-state.completed")
    page.wait_for_selector("li.streaming", state="detached")
    assert page.inner_text(".answer .text") == answer
    assert page.locator(".transcript").inner_text().count("then rain.") == 1, "the answer once"
