"""Whether a worker may run a dispatched call, judged by the signed spec alone: a stored call
record (which anyone who can write Redis can write) that disagrees with the policy runs nothing."""

from __future__ import annotations

from typing import Any

import pytest

from celery_agents.model import CallState, Lane, TrackedCall, child_session_id
from celery_agents.scheduler.policy import dispatched_refusal
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import make_agent

AGENT = make_agent(executionMode="asynchronous")
BOSS = parse_agent(
    {
        "slug": "boss",
        "model": "fake/model",
        "executionMode": "asynchronous",
        "subAgents": [
            {"slug": "helper", "model": "fake/model", "description": "helps"},
            {"slug": "careful", "model": "fake/model", "description": "asks first"},
        ],
        "toolCallPolicy": {"rules": [{"tool": "prompt_agent_careful", "disposition": "defer"}]},
    }
)


def record(tool: str, disposition: str, **extra: Any) -> TrackedCall:
    fields: dict[str, Any] = {"state": CallState.RUNNING, **extra}
    return TrackedCall(call_id="c", tool=tool, batch=1, position=0, disposition=disposition, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tool", "disposition", "lane"),
    [("async_t", "runAsync", "runAsync"), ("isolated_t", "runIsolated", "runIsolated")],
)
def test_a_call_runs_in_the_lane_its_policy_gives_it(tool: str, disposition: str, lane: Lane) -> None:
    assert dispatched_refusal(AGENT, "s1", record(tool, disposition), lane) is None


@pytest.mark.parametrize(
    ("tool", "disposition", "lane", "why"),
    [
        # the isolated tool's record rewritten to run outside the sandbox
        ("isolated_t", "runAsync", "runAsync", "the stored call says runAsync"),
        # the record left alone, but published to the tools queue by hand
        ("isolated_t", "runIsolated", "runAsync", "not runAsync"),
        # a deferred call (a person supplies its result) made to run before anyone decided
        ("defer_t", "runAsync", "runAsync", "the stored call says runAsync"),
        ("defer_t", "defer", "runAsync", "has its result supplied by a person"),
        # an inline tool run a second time through the tools queue
        ("sync_a", "runSync", "runAsync", "runs in its step"),
        # a runAsync tool in the sandbox lane still is not its policy
        ("async_t", "runAsync", "runIsolated", "not runIsolated"),
        ("no_such_tool", "runAsync", "runAsync", "declares no tool"),
    ],
)
def test_a_record_that_disagrees_with_the_policy_is_refused(tool: str, disposition: str, lane: Lane, why: str) -> None:
    refusal = dispatched_refusal(AGENT, "s1", record(tool, disposition), lane)
    assert refusal is not None and why in refusal


def test_a_sub_agent_call_starts_only_the_child_derived_from_it() -> None:
    field = "1:0"
    own = record("prompt_agent_helper", "runAsync", meta={"child": child_session_id("s1", field)})
    assert dispatched_refusal(BOSS, "s1", own, "runAsync") is None
    # a child link pointing at any other session, e.g. one the writer made, is refused
    other = record("prompt_agent_helper", "runAsync", meta={"child": child_session_id("s2", field)})
    assert "not the one derived" in (dispatched_refusal(BOSS, "s1", other, "runAsync") or "")
    assert dispatched_refusal(BOSS, "s1", own, "runIsolated") is not None


def test_a_deferred_delegation_starts_its_child_only_once_decided() -> None:
    child = {"child": child_session_id("s1", "1:0")}
    waiting = record("prompt_agent_careful", "defer", meta=child, state=CallState.DEFERRED)
    assert "waits for a decision" in (dispatched_refusal(BOSS, "s1", waiting, "runAsync") or "")
    # a record saying running (a writer's) is no decision
    running = record("prompt_agent_careful", "defer", meta=child)
    assert "waits for a decision" in (dispatched_refusal(BOSS, "s1", running, "runAsync") or "")
    assert dispatched_refusal(BOSS, "s1", running, "runAsync", decided=True) is None


GATED = parse_agent(
    {
        "slug": "gated",
        "model": "fake/model",
        "executionMode": "asynchronous",
        "tools": [{"name": "pay", "command": ["true"]}, {"name": "wipe", "command": ["true"]}],
        "toolCallPolicy": {
            "rules": [
                {"tool": "pay", "disposition": {"tag": "defer", "then": "runAsync"}},
                {"tool": "wipe", "disposition": {"tag": "defer", "then": "runIsolated"}},
            ]
        },
    }
)


def test_an_approval_gate_runs_only_on_a_recorded_decision_and_only_in_its_then_lane() -> None:
    gate = record("pay", "defer", then="runAsync")
    # the call's record says running (what a Redis writer writes): no decision was recorded
    assert "none approved it" in (dispatched_refusal(GATED, "s1", gate, "runAsync") or "")
    assert dispatched_refusal(GATED, "s1", gate, "runAsync", decided=True) is None
    assert dispatched_refusal(GATED, "s1", gate, "runIsolated", decided=True) is not None
    # an isolated gate, once approved, still never leaves the sandbox
    wipe = record("wipe", "defer", then="runIsolated")
    assert dispatched_refusal(GATED, "s1", wipe, "runIsolated", decided=True) is None
    assert "not runAsync" in (dispatched_refusal(GATED, "s1", wipe, "runAsync", decided=True) or "")
    relabelled = record("wipe", "defer", then="runAsync")
    assert "gate says runAsync" in (dispatched_refusal(GATED, "s1", relabelled, "runAsync", decided=True) or "")
    # under a grant the call is recorded under its `then`, and runs in that lane only
    granted = record("pay", "runAsync")
    assert dispatched_refusal(GATED, "s1", granted, "runAsync", granted=True) is None
    assert "the stored call says runAsync" in (dispatched_refusal(GATED, "s1", granted, "runAsync") or "")
