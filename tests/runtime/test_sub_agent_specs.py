"""Sub-agent calls and signed specs (AGENTS_SPEC_KEY): a child started from a signed parent runs
(its spec stored signed); a parent spec written without the key starts no child at all."""

from __future__ import annotations

import dataclasses

from celery_agents.model import CallState, UserQuery
from celery_agents.runtime import run_call, run_step
from celery_agents.store import Store
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import RecordingTools, ScriptedLlm, llm_turn

BOSS = {"slug": "boss", "model": "fake/m", "subAgents": [{"slug": "helper", "model": "fake/m"}]}


def _delegating(store: Store) -> tuple[str, str]:
    """A session whose model delegated once: (session id, the call's field)."""
    h = store.create_session(parse_agent(BOSS), UserQuery(text="go"))
    llm = ScriptedLlm(llm_turn(("c1", "prompt_agent_helper", '{"prompt": "help"}')))
    run_step(store, h.session_id, 1, llm=llm, tools=RecordingTools(), owner="w")
    [call] = run_step(store, h.session_id, 2, llm=llm, tools=RecordingTools(), owner="w").dispatch
    return h.session_id, call.field


def test_a_child_of_a_signed_parent_is_stored_signed_and_runs(store: Store) -> None:
    keyed = Store(store.client, dataclasses.replace(store.settings, spec_key="k" * 32))
    sid, field = _delegating(keyed)
    ran = run_call(keyed, sid, field, RecordingTools(), "tools-worker", "runAsync")
    assert ran.status == "started" and ran.child is not None
    child = keyed.header(ran.child[0])
    fresh = Store(store.client, dataclasses.replace(store.settings, spec_key="k" * 32))
    assert fresh.agent(child.agent_hash).slug == "helper", "another worker verifies the child's spec"
    again = run_call(keyed, sid, field, RecordingTools(), "tools-worker", "runAsync")
    assert (again.status, again.child) == ("running", None), "a second run makes no second child"
    assert keyed.children(sid) == [child.session_id]


def test_a_parent_spec_written_without_the_key_starts_no_child(store: Store) -> None:
    sid, field = _delegating(store)
    keyed = Store(store.client, dataclasses.replace(store.settings, spec_key="k" * 32))
    ran = run_call(keyed, sid, field, RecordingTools(), "tools-worker", "runAsync")
    assert ran.child is None and store.children(sid) == []
    [call] = store.calls(sid)
    assert call.state == CallState.FAILED and "AGENTS_SPEC_KEY" in (call.error or "")
