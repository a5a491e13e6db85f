"""AGENTS_SPEC_KEY on real workers: a process that can write to Redis, but holds no key, stores an
agent spec whose runSync tool is a shell command and an auto-driven session owed a step (exactly
the writes of `Store.create_session`, which is what such a process could do). The workers run
nothing of it: no model call, no tool, the session fails saying why. Sessions stored by a holder
of the key run as usual, and the key is nowhere in Redis."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store, client_for_url
from celery_agents.tasks.config import Dispatcher, make_app
from celery_agents.tools.resolve import parse_agent
from tests.e2e.conftest import start_workers, wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.workers import Worker, stop_all

pytestmark = pytest.mark.slow

KEY = "spec-key-for-tests-0123456789abcdef"


@pytest.fixture(scope="module")
def signing_workers(
    redis_url: str, module_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    ws = start_workers(redis_url, module_prefix, tmp_path_factory.mktemp("logs"), AGENTS_SPEC_KEY=KEY)
    yield ws
    stop_all(ws)


def shell_agent(llm_server: LlmServer, marker: Path) -> dict[str, Any]:
    scenario = llm_server.scenario([calls(("pwn", {})), text("done")])
    return {
        "slug": "intruder",
        "model": f"openai/{scenario}",
        "apiBase": llm_server.url,
        "tools": [{"name": "pwn", "command": ["sh", "-c", f"env > {marker}"]}],
    }


def intruder_session(settings: Settings, agent: dict[str, Any]) -> str:
    """What a Redis writer without the key can do: store the spec and an auto session owed a step."""
    unkeyed = dataclasses.replace(settings, spec_key=None)
    store = Store(client_for_url(settings.redis_url or ""), unkeyed)
    try:
        header = store.create_session(parse_agent(agent), UserQuery(text="go"), drive="auto", owe=True)
    finally:
        store.client.close()
    return header.session_id


def failed_view(settings: Settings, session_id: str) -> Any:
    with Client(dataclasses.replace(settings, spec_key=KEY)) as client:
        return wait_for(
            lambda: (v := client.view(session_id)).state.value == "failed" and v, timeout=60, what="the refusal"
        )


def test_a_spec_stored_without_the_key_runs_nothing(
    signing_workers: Any, module_settings: Settings, llm_server: LlmServer, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    agent = shell_agent(llm_server, marker)
    sid = intruder_session(module_settings, agent)
    view = failed_view(module_settings, sid)
    assert view.error is not None and view.error.code == "untrusted_agent_spec"
    assert "AGENTS_SPEC_KEY" in view.error.message
    assert llm_server.count(agent["model"].split("/", 1)[1]) == 0, "no model call"
    assert not marker.exists(), "no tool ran"


def test_a_signature_copied_from_another_spec_does_not_verify(
    signing_workers: Any, module_settings: Settings, llm_server: LlmServer, tmp_path: Path, rclient: redis.Redis
) -> None:
    keyed = dataclasses.replace(module_settings, spec_key=KEY)
    good = {"slug": "good", "model": "demo/echo"}
    with Client(keyed) as client:
        client.start(parse_agent(good), "hi", run=True, timeout=60)
    signature = rclient.get(f"{module_settings.prefix}:agent:{parse_agent(good).content_hash()}:sig")
    assert signature
    marker = tmp_path / "ran"
    agent = shell_agent(llm_server, marker)
    rclient.set(f"{module_settings.prefix}:agent:{parse_agent(agent).content_hash()}:sig", signature)
    sid = intruder_session(module_settings, agent)
    assert failed_view(module_settings, sid).error.code == "untrusted_agent_spec"
    assert not marker.exists()


def test_a_signed_spec_whose_content_is_replaced_runs_nothing(
    signing_workers: Any, module_settings: Settings, llm_server: LlmServer, tmp_path: Path, rclient: redis.Redis
) -> None:
    keyed = dataclasses.replace(module_settings, spec_key=KEY)
    marker = tmp_path / "ran"
    scenario = llm_server.scenario([calls(("harmless", {})), text("done")])
    agent = parse_agent(
        {
            "slug": "victim",
            "model": f"openai/{scenario}",
            "apiBase": llm_server.url,
            "tools": [{"name": "harmless", "command": ["true"]}],
        }
    )
    with Client(keyed) as client:
        view = client.start(agent, "go")  # stored and signed; not driven yet
        evil = json.loads(agent.to_json())
        evil["tools"][0]["command"] = ["sh", "-c", f"env > {marker}"]
        rclient.set(f"{module_settings.prefix}:agent:{agent.content_hash()}", json.dumps(evil))
        Dispatcher(make_app(module_settings, main="intruder")).step(view.session_id, view.version, "intruder")
    refused = failed_view(module_settings, view.session_id)
    assert refused.error.code == "untrusted_agent_spec"
    assert not marker.exists() and llm_server.count(scenario) == 0


def test_a_keyed_session_runs_and_the_key_is_never_stored(
    signing_workers: Any, module_settings: Settings, rclient: redis.Redis
) -> None:
    from tests.cli.process import DEMO_AGENT

    with Client(dataclasses.replace(module_settings, spec_key=KEY)) as client:
        view = client.start(DEMO_AGENT, "What is the weather in Paris?", run=True, timeout=60)
    assert view.state.value == "completed" and "Paris" in (view.response or "")
    for key in rclient.scan_iter(match=f"{module_settings.prefix}:*"):
        kind = rclient.type(key)
        value = rclient.get(key) if kind == "string" else rclient.dump(key)
        assert KEY not in str(value), f"the key is stored under {key}"
