"""The tool-call policy: which disposition a call gets, and why."""

from __future__ import annotations

from celery_agents.model import AgentSpec, Disposition


def disposition_for(agent: AgentSpec, tool_name: str) -> Disposition:
    """`default` unless a rule names the tool: the first rule naming it exactly, else the first
    prefix rule (`"mcp__files__*"`) matching it.

    External tools have no implementation, so they are always deferred. In synchronous mode every
    other call runs inline, keeping the rule's decorators (timeout, retries, truncate).
    """
    policy = agent.tool_call_policy
    if policy is None:
        # Made here rather than at import, which would build its schema for every command.
        chosen = Disposition(tag="runSync")
    else:
        exact = (r for r in policy.rules if not r.is_prefix and r.matches(tool_name))
        prefix = (r for r in policy.rules if r.is_prefix and r.matches(tool_name))
        rule = next(exact, None) or next(prefix, None)
        chosen = rule.disposition if rule is not None else policy.default
    if agent.sub_agent(tool_name) is not None:
        # A sub-agent runs as a child session the parent waits for, whatever the mode; a rule may
        # still have a person approve the delegation first.
        return chosen if chosen.tag == "defer" else chosen.model_copy(update={"tag": "runAsync"})
    tool = agent.tool(tool_name)
    if tool is not None and tool.external:
        if chosen.tag == "defer":
            return chosen
        return chosen.model_copy(update={"tag": "defer", "reason": chosen.reason or "external tool"})
    if agent.mode == "synchronous" and chosen.tag != "runSync":
        return chosen.model_copy(update={"tag": "runSync", "reason": None})
    return chosen
