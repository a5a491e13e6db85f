"""Resolving an agent: finding the tools its file leaves to be found, before a session stores it.

Reading a file (`model.agent_file`) runs nothing. Resolving does what that leaves: it describes
each toolbox (`X describe`, one process per executable), reads the signature of each python tool
that declares no `parameters` (importing its module, as the workers will), and lists the tools of
each MCP server (starting or reaching it), then hands those values to `AgentFile.resolved`. The
spec a session stores names every tool, so workers never resolve again. `Client` resolves when a
session starts or is forked onto another agent; `parse_agent` and `load_agent_file` read and
resolve in one call, for programs and tests that want the spec at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from celery_agents.config import Settings
from celery_agents.errors import InvalidAgentFile
from celery_agents.model.agent import AgentSpec
from celery_agents.model.agent_file import AgentFile, Resolution, read_agent, read_agent_file


def resolve_agent(agent: AgentFile, settings: Settings | None = None) -> AgentSpec:
    """The spec of `agent` with every tool found; raises `InvalidAgentFile` naming the file, the
    toolbox or server, and the fix. `settings` bound MCP listings (read from the environment
    when not given, and only when the agent has servers)."""
    if not agent.unresolved:
        return agent.declared
    toolboxes = tuple(_described(agent, i) for i in range(len(agent.toolboxes)))
    listed: tuple[tuple[dict[str, Any], ...], ...] = ()
    if agent.mcp_servers:
        from celery_agents.tools.mcp.listing import ListingBounds, list_servers

        listed = list_servers(agent, ListingBounds.from_settings(settings or Settings.from_env()))
    subs = tuple(resolve_agent(sub, settings) for sub in agent.sub_agents)
    return agent.resolved(Resolution(toolboxes, listed, _signatures(agent), subs))


def _described(agent: AgentFile, index: int) -> tuple[dict[str, Any], ...]:
    from celery_agents.tools.toolbox import ToolboxError, describe_toolbox

    try:
        return tuple(describe_toolbox(agent.toolboxes[index], agent.base_dir))
    except ToolboxError as exc:
        raise InvalidAgentFile(f"{agent.source}: toolboxes[{index}]: {exc}", file=agent.source) from None


def _signatures(agent: AgentFile) -> dict[str, tuple[dict[str, Any], str]]:
    """The schema and summary of each python tool that declares no parameters, by tool name. The
    module is looked up as the workers look it up: installed packages, then the agent file's
    folder; one that does not import here keeps the empty schema (the worker may have it)."""
    if not agent.python_tools:
        return {}
    from celery_agents.tools.signature import describe_function

    found = {}
    for tool in agent.python_tools:
        described = describe_function(tool.python or "", agent.base_dir)
        if described is not None:
            found[tool.name] = described
    return found


def parse_agent(
    data: Any, source: str = "<agent>", base_dir: str | None = None, settings: Settings | None = None
) -> AgentSpec:
    """An agent given as a JSON value, read (`model.read_agent`) and resolved."""
    return resolve_agent(read_agent(data, source, base_dir), settings)


def load_agent_file(path: str | Path, settings: Settings | None = None) -> AgentSpec:
    """An agent file, read (`model.read_agent_file`) and resolved."""
    return resolve_agent(read_agent_file(path), settings)
