"""`agents serve` fixtures: one worker and one serve process for the whole tests/web package (both real processes
on the private Redis), an HTTP client holding the API token, and Server-Sent Events read until an
event arrives."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import record_tool, start_workers
from tests.support.llm_server import LlmServer, Reply, calls, text
from tests.support.serve import Serve
from tests.support.workers import Worker, worker_env

#: the parameters of `gated_agent`'s pay tool
PAY = {"type": "object", "properties": {"amount": {"type": "number"}}, "required": ["amount"]}
#: the limits the module's serve process runs with, small so tests can cross them cheaply
LIMIT_BYTES = 4096


@pytest.fixture(scope="package")
def module_prefix() -> str:
    return f"w{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="package")
def api_token() -> str:
    return f"tok-{uuid.uuid4().hex}"


@pytest.fixture(scope="package")
def web_workers(redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Worker]]:
    ws = start_workers(redis_url, module_prefix, tmp_path_factory.mktemp("logs"), count=1, concurrency=1)
    yield ws
    for w in ws:
        w.stop()


def serve_env(redis_url: str, prefix: str, **extra: str) -> dict[str, str]:
    return worker_env(
        redis_url, prefix, AGENTS_MAX_PROMPT_BYTES=str(LIMIT_BYTES), AGENTS_MAX_RESULT_BYTES=str(LIMIT_BYTES), **extra
    )


@pytest.fixture(scope="package")
def server(
    redis_url: str, module_prefix: str, api_token: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Serve]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with Serve(serve_env(redis_url, module_prefix, AGENTS_API_TOKEN=api_token), log) as s:
        yield s


@pytest.fixture(scope="package")
def api(server: Serve, api_token: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {api_token}"}, timeout=60) as c:
        yield c


def approval_agent(llm_server: LlmServer, replies: list[Reply], slug: str = "approver") -> dict[str, Any]:
    """An agent whose `approve` tool waits for a person (defer), talking to a scripted model."""
    return {
        "slug": slug,
        "model": f"openai/{llm_server.scenario(replies)}",
        "apiBase": llm_server.url,
        "tools": [
            {
                "name": "approve",
                "description": "a person decides",
                "external": True,
                "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}}},
            }
        ],
        "toolCallPolicy": {
            "default": "runSync",
            "rules": [{"tool": "approve", "disposition": {"tag": "defer", "reason": "payments need a person"}}],
        },
    }


def one_approval(llm_server: LlmServer, answer: str = "done", slug: str = "approver") -> dict[str, Any]:
    return approval_agent(llm_server, [calls(("approve", {"amount": 42})), text(answer)], slug)


def gated_agent(
    llm_server: LlmServer,
    log: Path,
    replies: list[Reply],
    then: str = "runSync",
    slug: str = "gated",
    **disposition: Any,
) -> dict[str, Any]:
    """An agent whose `pay` waits at an approval gate (runs under `then` once approved) and whose
    `note` is a plain deferred call (a person gives its result); both tools record their runs."""
    return {
        "slug": slug,
        "model": f"openai/{llm_server.scenario(replies)}",
        "apiBase": llm_server.url,
        "tools": [{**record_tool("pay", log), "parameters": PAY}, record_tool("note", log)],
        "toolCallPolicy": {
            "default": "runSync",
            "rules": [
                {
                    "tool": "pay",
                    "disposition": {"tag": "defer", "then": then, "reason": "a payment", **disposition},
                },
                {"tool": "note", "disposition": {"tag": "defer", "reason": "a person writes it"}},
            ],
        },
    }


def read_events(
    api: httpx.Client, session_id: str, until: str, last_event_id: str | None = None, timeout: float = 60
) -> list[dict[str, Any]]:
    """The session's Server-Sent Events, read until one of type `until` arrives."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    seen: list[dict[str, Any]] = []
    with api.stream(
        "GET", f"/v1/sessions/{session_id}/events", headers=headers, timeout=httpx.Timeout(timeout)
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        frame: dict[str, str] = {}
        for line in response.iter_lines():
            if line:
                key, _, value = line.partition(": ")
                frame[key] = value
                continue
            if "data" in frame:
                event = json.loads(frame["data"])
                assert frame["id"] == event["id"]
                seen.append(event)
                if event["type"] == until:
                    return seen
            frame = {}
    raise AssertionError(f"the stream ended without a {until!r} event: {[e['type'] for e in seen]}")


def finished(api: httpx.Client, sid: str) -> dict[str, Any]:
    """The session once it completed, with its transcript."""
    read_events(api, sid, until="completed")
    shown: dict[str, Any] = api.get(f"/v1/sessions/{sid}", params={"detail": "true"}).json()
    return shown


def results(shown: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(tool, content, is_error) of every tool result the model was given."""
    return [
        (r["tool"], r["content"], bool(r.get("is_error"))) for t in shown["turns"] for r in t.get("tool_responses", [])
    ]


def started(api: httpx.Client, agent: dict[str, Any], prompt: str = "pay", **body: Any) -> dict[str, Any]:
    r = api.post("/v1/sessions", json={"agent": agent, "prompt": prompt, **body})
    assert r.status_code == 201, r.text
    doc: dict[str, Any] = r.json()
    return doc


def blocked(api: httpx.Client, agent: dict[str, Any], prompt: str = "pay") -> dict[str, Any]:
    """A session driven until it waits on its deferred call; its view."""
    return started(api, agent, prompt, run="until_blocked", wait=True, timeout=60)
