"""The boundary of `agents serve`, in process on the real Redis (no worker needed): the token,
loopback only without it (bind address and Host header), no state change from another site, CSRF
on the page's forms, bounded bodies, escaped output and the security headers on every answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.web.app import create_app
from celery_agents.web.security import check_bind, is_loopback
from tests.cli.process import agents, cli_env
from tests.scheduler.fakes import ScriptedLlm, llm_turn, make_agent
from tests.store.scenario import start, step, waiting_on

TOKEN = "s3cret-token-for-tests-32-chars-or-more"


def app_for(settings: Settings, **overrides: Any) -> Any:
    from dataclasses import replace

    settings = replace(settings, **overrides)
    return create_app(settings, Client(settings, inline=False))


@pytest.fixture
def open_page(settings: Settings) -> Iterator[TestClient]:
    """The server without a token (loopback only), as a browser on 127.0.0.1 reaches it."""
    with TestClient(app_for(settings), base_url="http://127.0.0.1:8765") as c:
        yield c


@pytest.fixture
def locked(settings: Settings) -> Iterator[TestClient]:
    with TestClient(app_for(settings, api_token=TOKEN), base_url="http://127.0.0.1:8765") as c:
        yield c


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found, "the page carries a CSRF field"
    return found.group(1)


def test_without_a_token_serve_refuses_an_address_other_than_loopback(redis_url: str, tmp_path: Any) -> None:
    env = cli_env(redis_url, "nobind", home=tmp_path)
    env.pop("AGENTS_API_TOKEN", None)
    run = agents("serve", "--host", "0.0.0.0", "--port", "1", env=env)
    assert run.returncode == 2
    assert "AGENTS_API_TOKEN" in run.stderr
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert is_loopback(host), host
        check_bind(host, None)
    for host in ("0.0.0.0", "192.168.1.4", "example.com", "::"):
        assert not is_loopback(host), host
        check_bind(host, TOKEN)  # with a token any address is fine


def test_without_a_token_a_request_naming_another_host_is_refused(open_page: TestClient) -> None:
    """A site that rebinds its name to 127.0.0.1 sends its own name as Host."""
    r = open_page.get("/v1/sessions", headers={"Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert open_page.get("/v1/sessions").status_code == 200


def test_a_request_from_another_site_changes_nothing(open_page: TestClient, settings: Settings) -> None:
    agent = {"slug": "evil", "model": "openai/x", "tools": [{"name": "sh", "command": ["sh", "-c", "id"]}]}
    body = {"agent": agent, "prompt": "run"}
    for headers in ({"Origin": "https://attacker.example"}, {"Sec-Fetch-Site": "cross-site"}, {"Origin": "null"}):
        r = open_page.post("/v1/sessions", json=body, headers=headers)
        assert r.status_code == 403, headers
    assert open_page.get("/v1/sessions").json() == {"sessions": []}
    same = open_page.post("/v1/sessions", json=body, headers={"Origin": "http://127.0.0.1:8765"})
    assert same.status_code == 201


def test_the_page_asks_for_the_token_once_and_keeps_a_strict_httponly_cookie(locked: TestClient) -> None:
    assert locked.get("/", headers={"Accept": "text/html"}, follow_redirects=False).headers["location"] == "/login"
    form = locked.get("/login").text
    wrong = locked.post("/login", data={"token": TOKEN + "x", "csrf": csrf_of(form)}, follow_redirects=False)
    assert wrong.status_code == 401
    r = locked.post("/login", data={"token": TOKEN, "csrf": csrf_of(form)}, follow_redirects=False)
    assert r.status_code == 303
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("agents_auth="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert TOKEN not in cookie, "the cookie is derived from the token, not the token"
    assert locked.get("/", headers={"Accept": "text/html"}).status_code == 200
    assert locked.get("/v1/pending").status_code == 200, "the cookie also opens the API the page reads"


def test_a_form_without_its_csrf_token_completes_nothing(open_page: TestClient, settings: Settings) -> None:
    client = Client(settings, inline=False)
    sid, calls = waiting_on(client.store, ("c1", "defer_t"))
    token = calls[0].token
    page = open_page.get("/").text
    assert token in page
    forged = open_page.post("/approve", data={"token": token, "csrf": "guess", "back": "/"}, follow_redirects=False)
    assert forged.headers["location"] == "/?problem=csrf"
    assert [p.token for p in client.pending(sid)] == [token], "still waiting"
    ok = open_page.post(
        "/approve",
        data={"token": token, "csrf": csrf_of(page), "back": "https://attacker.example/"},
        follow_redirects=False,
    )
    assert ok.headers["location"] == "/?done=approved", "a foreign `back` falls back to the page"
    assert client.pending(sid) == []
    client.close()


def test_a_gates_forms_and_the_session_buttons_change_nothing_without_their_csrf_token(
    open_page: TestClient, settings: Settings
) -> None:
    """Every form of a gate and of a session page, posted with a guessed CSRF token; and arguments
    that try to close the editor's textarea stay text in it."""
    attack = "</textarea><script>window.pwned=1</script>"
    policy = {"default": "runSync", "rules": [{"tool": "defer_t", "disposition": {"tag": "defer", "then": "runSync"}}]}
    llm = ScriptedLlm(llm_turn(("c1", "defer_t", json.dumps({"note": attack}))))
    with Client(settings, inline=True, llm=llm) as client:
        sid = client.start(make_agent(policy), "go", run=True).session_id
        before = client.view(sid)
    (gate,) = before.pending
    page = open_page.get(f"/sessions/{sid}").text
    assert gate.kind == "approval" and f'name="digest" value="{gate.digest}"' in page
    assert "</textarea><script>" not in page and "&lt;/textarea&gt;&lt;script&gt;" in page
    for path, extra in (
        ("/gates/approve", {"digest": gate.digest or ""}),
        ("/gates/approve", {"arguments": '{"note": "edited"}'}),
        ("/gates/reject", {"reason": "no"}),
        ("/extend", {}),
        (f"/sessions/{sid}/pause", {}),
        (f"/sessions/{sid}/cancel", {}),
    ):
        form = {"token": gate.token or "", "csrf": "guess", "back": f"/sessions/{sid}", **extra}
        forged = open_page.post(path, data=form, follow_redirects=False)
        assert forged.headers["location"] == f"/sessions/{sid}?problem=csrf", path
    with Client(settings, inline=False) as client:
        after = client.view(sid)
    assert (after.state, after.drive, after.pending) == (before.state, "auto", before.pending), "nothing changed"


def test_model_and_tool_text_is_escaped_on_the_page(open_page: TestClient, settings: Settings) -> None:
    client = Client(settings, inline=False)
    store = client.store
    sid = start(store)
    attack = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
    step(
        store,
        sid,
        llm=ScriptedLlm(llm_turn(("c1", "defer_t", json.dumps({"note": attack})), text=attack)),
    )
    step(store, sid)
    for path in (f"/sessions/{sid}", f"/sessions/{sid}/live", "/"):
        html = open_page.get(path).text
        assert "<script>window" not in html and "<img src=x" not in html, path
        assert "&lt;script&gt;window.pwned=1&lt;/script&gt;" in html, path
    client.close()


def test_every_answer_carries_a_strict_content_security_policy(open_page: TestClient) -> None:
    for path in ("/", "/v1/sessions", "/login", "/static/page.js", "/nowhere"):
        headers = open_page.get(path).headers
        csp = headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("style-src")[0], path
        assert "frame-ancestors 'none'" in csp
        assert headers["x-content-type-options"] == "nosniff"
    page = open_page.get("/").text
    assert not re.search(r"<script(?![^>]*\bsrc=\"/static/)", page), "no inline script on the page"
    assert not re.search(r"<[^>]+\son\w+=", page), "no event-handler attributes either"


def test_a_body_larger_than_the_limit_is_refused_before_it_is_read(settings: Settings) -> None:
    app = app_for(settings, max_prompt_bytes=1000, max_result_bytes=1000)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        big = b"x" * (3 * 1024 * 1024)
        r = c.post("/v1/sessions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "invalid_input"


def test_redis_out_of_reach_is_503(settings: Settings) -> None:
    from dataclasses import replace

    gone = replace(settings, redis_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(gone, Client(gone, inline=False)), base_url="http://127.0.0.1") as c:
        for r in (c.get("/v1/sessions"), c.get("/v1/pending"), c.get("/metrics")):
            assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
        page = c.get("/")  # a person gets a page saying so, not a JSON document
        assert page.status_code == 503 and "cannot reach Redis" in page.text, page.text[:300]


def test_guessing_the_token_is_throttled_per_client_address(settings: Settings) -> None:
    """An address giving wrong tokens gets 429 after a few of them, its tokens unweighed but one a
    second; its right token gets in at its turn (a guesser sharing a proxy or a NAT with you
    delays you, never locks you out), and another address is not throttled."""
    from celery_agents.web.security import ADMIT_INTERVAL_S, AUTH_FAILURES_ALLOWED

    app = app_for(settings, api_token=TOKEN)
    now = [100.0]
    app.throttle.clock = lambda: now[0]
    with TestClient(app, base_url="http://127.0.0.1:8765", client=("10.0.0.7", 5000)) as attacker:
        for i in range(AUTH_FAILURES_ALLOWED):
            r = attacker.get("/v1/sessions", headers={"Authorization": f"Bearer guess-{i}"})
            assert r.status_code == 401, (i, r.text)
        r = attacker.get("/v1/sessions", headers={"Authorization": "Bearer one-guess-too-many"})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) > 0
        assert r.json() == {"error": {"code": "too_many_requests", "message": r.json()["error"]["message"]}}
        assert attacker.get("/v1/sessions", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 429
        now[0] += ADMIT_INTERVAL_S
        assert attacker.get("/v1/sessions", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    with TestClient(app, base_url="http://127.0.0.1:8765", client=("10.0.0.8", 5000)) as other:
        assert other.get("/v1/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_guessing_the_token_on_the_login_form_is_throttled(settings: Settings) -> None:
    from celery_agents.web.security import ADMIT_INTERVAL_S, AUTH_FAILURES_ALLOWED

    app = app_for(settings, api_token=TOKEN)
    now = [100.0]
    app.throttle.clock = lambda: now[0]
    with TestClient(app, base_url="http://127.0.0.1:8765", client=("10.0.0.9", 5000)) as browser:
        csrf = csrf_of(browser.get("/login").text)
        for i in range(AUTH_FAILURES_ALLOWED):
            r = browser.post("/login", data={"csrf": csrf, "token": f"guess-{i}"}, follow_redirects=False)
            assert r.status_code == 401, i
        r = browser.post("/login", data={"csrf": csrf, "token": "one-guess-too-many"}, follow_redirects=False)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
        assert "Too many wrong tokens" in r.text
        assert "agents_auth" not in r.headers.get("set-cookie", "")
        r = browser.post("/login", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False)
        assert r.status_code == 429, "not weighed before its turn"
        now[0] += ADMIT_INTERVAL_S
        r = browser.post("/login", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False)
        assert r.status_code == 303, "the right token signs in at its turn, whatever came before it"
        assert "agents_auth=" in r.headers.get("set-cookie", "")


def test_every_refusal_has_the_contracts_error_shape(open_page: TestClient) -> None:
    """Bodies the JSON parser gives up on, methods a route does not take, routes that do not
    exist and parameters of the wrong type are answered `{"error": {"code", "message"}}` too."""
    deep = b"[" * 200_000 + b"]" * 200_000
    json_body = {"content-type": "application/json"}
    answers = {
        "200k-deep body": (open_page.post("/v1/sessions", content=deep, headers=json_body), 400, "invalid_input"),
        "deep result": (
            open_page.post("/v1/continuations/a.b", content=b'{"result": ' + deep + b"}", headers=json_body),
            400,
            "invalid_input",
        ),
        "cut JSON": (open_page.post("/v1/sessions", content=b'{"agent": ', headers=json_body), 400, "invalid_input"),
        "wrong method": (open_page.delete("/v1/sessions"), 405, "method_not_allowed"),
        "unknown route": (open_page.get("/v1/nowhere"), 404, "not_found"),
        "unknown page": (open_page.get("/nowhere"), 404, "not_found"),
        "bad parameter": (open_page.get("/v1/sessions", params={"limit": "many"}), 400, "invalid_input"),
    }
    for what, (r, status, code) in answers.items():
        assert r.status_code == status, (what, r.text)
        body = r.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, (what, body)
        assert body["error"]["code"] == code, (what, body)
        assert body["error"]["message"], what
    assert "POST" in answers["wrong method"][0].headers["allow"]
