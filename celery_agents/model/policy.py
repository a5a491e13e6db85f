"""The tool-call policy: which disposition a call gets, read from the agent spec alone."""

from __future__ import annotations

from typing import Any

from celery_agents.model.agent import AgentSpec, Disposition


def disposition_for(agent: AgentSpec, tool_name: str, arguments: Any = None) -> Disposition:
    """`default` unless a rule applies to the call: the first rule naming the tool exactly, else
    the first prefix rule (`"mcp__files__*"`) matching it; a rule with `when` applies only when the
    call's `arguments` validate against that schema (rules are still tried in order).

    External tools have no implementation, so they are always deferred. In synchronous mode every
    other call runs inline, keeping the rule's decorators (timeout, retries, truncate).
    """
    policy = agent.tool_call_policy
    if policy is None:
        # Made here rather than at import, which would build its schema for every command.
        chosen = Disposition(tag="runSync")
    else:
        exact = (r for r in policy.rules if not r.is_prefix and r.applies(tool_name, arguments))
        prefix = (r for r in policy.rules if r.is_prefix and r.applies(tool_name, arguments))
        rule = next(exact, None) or next(prefix, None)
        chosen = rule.disposition if rule is not None else policy.default
    if agent.sub_agent(tool_name) is not None:
        # A sub-agent runs as a child session the parent waits for, whatever the mode; a rule may
        # still have a person approve the delegation first.
        return chosen if chosen.tag == "defer" else chosen.model_copy(update={"tag": "runAsync"})
    tool = agent.tool(tool_name)
    if tool is not None and tool.external:
        # Nothing to run once approved: a person supplies the result, gate or not.
        if chosen.tag == "defer":
            return chosen.model_copy(update={"then": None}) if chosen.then else chosen
        return chosen.model_copy(update={"tag": "defer", "reason": chosen.reason or "external tool"})
    if agent.mode == "synchronous" and chosen.tag != "runSync":
        return chosen.model_copy(update={"tag": "runSync", "reason": None, "then": None})
    return chosen
