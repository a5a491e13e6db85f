"""The tool-call policy: default, exact-name rules, first match wins, external, synchronous mode."""

from __future__ import annotations

from typing import Any

from celery_agents.model import Disposition
from celery_agents.model.policy import disposition_for
from celery_agents.tools.resolve import parse_agent
from tests.scheduler.fakes import make_agent


def agent(policy: dict[str, Any] | None, **extra: Any) -> Any:
    extra.setdefault("executionMode", "asynchronous")
    return make_agent(policy, **extra)


def test_no_policy_runs_every_implemented_tool_inline() -> None:
    a = parse_agent({"slug": "a", "model": "m", "tools": [{"name": "async_t", "python": "x.y:z", "parameters": {}}]})
    assert a.mode == "synchronous"
    assert disposition_for(a, "async_t").tag == "runSync"
    assert disposition_for(a, "no_such_tool").tag == "runSync"


def test_the_default_applies_when_no_rule_names_the_tool() -> None:
    a = agent({"default": {"tag": "runAsync"}, "rules": [{"tool": "sync_a", "disposition": "runSync"}]})
    assert disposition_for(a, "sync_b") == Disposition(tag="runAsync")
    assert disposition_for(a, "sync_a") == Disposition(tag="runSync")


def test_an_empty_policy_defaults_to_run_sync() -> None:
    assert disposition_for(agent({}), "async_t") == Disposition(tag="runSync")


def test_rules_match_the_tool_name_exactly() -> None:
    a = agent({"default": "runSync", "rules": [{"tool": "sync_a", "disposition": "runAsync"}]})
    assert disposition_for(a, "sync_a").tag == "runAsync"
    assert disposition_for(a, "sync_b").tag == "runSync"
    assert disposition_for(a, "SYNC_A").tag == "runSync"
    assert disposition_for(a, "sync_").tag == "runSync"


def test_the_first_matching_rule_wins() -> None:
    a = agent(
        {
            "default": "runSync",
            "rules": [
                {"tool": "sync_b", "disposition": "runIsolated"},
                {"tool": "sync_a", "disposition": {"tag": "defer", "reason": "first"}},
                {"tool": "sync_a", "disposition": "runAsync"},
            ],
        }
    )
    assert disposition_for(a, "sync_a") == Disposition(tag="defer", reason="first")


def test_rule_decorators_are_kept() -> None:
    a = agent(
        {
            "rules": [
                {
                    "tool": "async_t",
                    "disposition": {"tag": "runAsync", "timeoutSeconds": 5, "retries": 2, "truncate": 100},
                }
            ]
        }
    )
    d = disposition_for(a, "async_t")
    assert (d.tag, d.timeout_seconds, d.retries, d.truncate) == ("runAsync", 5, 2, 100)


def test_external_tools_are_always_deferred() -> None:
    for default in ("runSync", "runAsync", "runIsolated"):
        d = disposition_for(agent({"default": default}), "external_t")
        assert d.tag == "defer"
        assert d.reason == "external tool"


def test_external_tools_keep_the_reason_of_their_rule() -> None:
    a = agent({"rules": [{"tool": "external_t", "disposition": {"tag": "defer", "reason": "finance signs off"}}]})
    assert disposition_for(a, "external_t") == Disposition(tag="defer", reason="finance signs off")
    a = agent({"rules": [{"tool": "external_t", "disposition": {"tag": "runAsync", "reason": "ops"}}]})
    assert disposition_for(a, "external_t") == Disposition(tag="defer", reason="ops")


def test_external_tools_are_deferred_in_synchronous_mode_too() -> None:
    a = make_agent({"default": "runSync"}, executionMode="synchronous")
    assert disposition_for(a, "external_t").tag == "defer"


def test_synchronous_mode_runs_everything_inline_but_keeps_decorators() -> None:
    a = make_agent(
        {
            "default": "runAsync",
            "rules": [
                {
                    "tool": "defer_t",
                    "disposition": {"tag": "defer", "reason": "approval", "timeoutSeconds": 9},
                },
                {"tool": "isolated_t", "disposition": {"tag": "runIsolated", "retries": 3, "truncate": 50}},
            ],
        },
        executionMode="synchronous",
    )
    assert disposition_for(a, "sync_a").tag == "runSync"
    deferred = disposition_for(a, "defer_t")
    assert (deferred.tag, deferred.timeout_seconds) == ("runSync", 9)
    assert deferred.reason is None
    isolated = disposition_for(a, "isolated_t")
    assert (isolated.tag, isolated.retries, isolated.truncate) == ("runSync", 3, 50)


def test_a_policy_without_a_mode_is_asynchronous_and_honoured() -> None:
    a = make_agent({"default": "runAsync"})
    assert a.execution_mode is None
    assert disposition_for(a, "sync_a").tag == "runAsync"


def test_a_when_rule_applies_only_to_arguments_that_fit_it_and_rules_stay_in_order() -> None:
    large = {"type": "object", "properties": {"amount": {"type": "number", "minimum": 100}}, "required": ["amount"]}
    gate = {"tag": "defer", "then": "runAsync", "reason": "large"}
    a = agent(
        {
            "rules": [
                {"tool": "async_t", "when": large, "disposition": gate},
                {"tool": "async_t", "disposition": "runSync"},
            ]
        }
    )
    assert disposition_for(a, "async_t", {"amount": 500}).tag == "defer"
    assert disposition_for(a, "async_t", {"amount": 500}).applied().tag == "runAsync"
    assert disposition_for(a, "async_t", {"amount": 5}).tag == "runSync"
    assert disposition_for(a, "async_t", "not an object").tag == "runSync"


def test_then_belongs_to_defer_and_when_must_be_a_schema() -> None:
    import pytest

    from celery_agents.errors import InvalidAgentFile

    with pytest.raises(InvalidAgentFile, match="then"):
        agent({"rules": [{"tool": "async_t", "disposition": {"tag": "runAsync", "then": "runSync"}}]})
    with pytest.raises(InvalidAgentFile, match="then"):
        agent({"rules": [{"tool": "async_t", "disposition": {"tag": "defer", "then": "defer"}}]})
    with pytest.raises(InvalidAgentFile, match="when is not a valid JSON Schema"):
        agent({"rules": [{"tool": "async_t", "when": {"type": 12}, "disposition": "runSync"}]})
