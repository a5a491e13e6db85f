"""A dispatched call (runAsync, runIsolated) of a session whose spec is not signed with the
worker's AGENTS_SPEC_KEY: whoever published the call message, the tool does not run; the call is
recorded failed, saying why, instead of being published again forever."""

from __future__ import annotations

import dataclasses

from celery_agents.model import CallState, UserQuery
from celery_agents.runtime import run_call, run_step
from celery_agents.store import Store
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn


def test_a_dispatched_call_of_an_unsigned_spec_is_recorded_failed_and_not_run(store: Store) -> None:
    agent = parse_agent(
        {
            "slug": "unsigned",
            "model": "demo/echo",
            "tools": [{"name": "later", "command": ["true"]}],
            "toolCallPolicy": {"default": "runAsync"},
        }
    )
    h = store.create_session(agent, UserQuery(text="go"))
    llm = ScriptedLlm(llm_turn(("c1", "later", "{}")))
    assert run_step(store, h.session_id, 1, llm=llm, tools=RecordingTools(), owner="w").outcome == "committed"
    res = run_step(store, h.session_id, 2, llm=llm, tools=RecordingTools(), owner="w")
    [call] = res.dispatch
    keyed = Store(store.client, dataclasses.replace(store.settings, spec_key="k" * 32))
    tools = RecordingTools()
    ran = run_call(keyed, h.session_id, call.field, tools, "tools-worker", "runAsync")
    assert ran.status == "ok" and tools.runs == []
    [recorded] = store.calls(h.session_id)
    assert recorded.state == CallState.FAILED and "AGENTS_SPEC_KEY" in (recorded.error or "")
