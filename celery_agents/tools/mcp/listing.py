"""Listing the tools of an agent's MCP servers when its file is loaded.

Each server is started (or reached) once from the loading process; its tools join the agent's
`tools` as `mcp__<server>__<tool>` with the description and input schema the server gives, so the
stored agent names every tool and workers never list again. A server that cannot be listed makes
the file invalid, with a message naming the server and what went wrong.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from celery_agents.errors import InvalidAgentFile
from celery_agents.model.mcp import McpServer, mcp_tool_name, normalise_servers
from celery_agents.tools.mcp.pool import McpCallError, pool
from celery_agents.tools.mcp.servers import target_for

#: how long a server may take to start and list its tools
LIST_TIMEOUT = 60.0


def tool_entry(server: McpServer, listed: dict[str, Any]) -> dict[str, Any]:
    """The agent-file tool entry for one tool a server listed."""
    schema = listed.get("inputSchema") if isinstance(listed.get("inputSchema"), dict) else None
    return {
        "name": mcp_tool_name(server.name, str(listed["name"])),
        "description": str(listed.get("description") or listed.get("title") or ""),
        "parameters": schema or {"type": "object", "properties": {}},
        "mcp": {"server": server.name, "tool": str(listed["name"])},
        "network": server.network,
    }


def _servers(data: dict[str, Any], source: str) -> list[McpServer]:
    raw = normalise_servers(data).get("mcpServers")
    if not isinstance(raw, list):
        raise InvalidAgentFile(
            f'{source}: mcpServers: give a list, e.g. [{{"name": "files", "command": ["python3", "server.py"]}}]',
            file=source,
        )
    servers = []
    for i, entry in enumerate(raw):
        try:
            servers.append(McpServer.model_validate(entry))
        except ValidationError as exc:
            from celery_agents.model.agent import describe_validation_error

            message = describe_validation_error(f"{source}: mcpServers[{i}]", exc).replace(": (top level)", "")
            raise InvalidAgentFile(message, file=source) from None
    return servers


def with_mcp_tools(data: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` with the tools of its MCP servers appended to `tools` (a tool already declared under
    the same name is kept as written)."""
    tools = list(data.get("tools") or [])
    declared = {t.get("name") for t in tools if isinstance(t, dict)}
    servers = _servers(data, source)
    # Servers start in parallel: each may take seconds to boot.
    with ThreadPoolExecutor(max_workers=min(8, len(servers) or 1)) as threads:
        listings = list(threads.map(lambda s: _list(s, data.get("baseDir")), servers))
    for i, (server, listed) in enumerate(zip(servers, listings, strict=True)):
        if isinstance(listed, McpCallError):
            fix = "check its command and that it runs" if server.command else "check its url and that it is up"
            raise InvalidAgentFile(
                f"{source}: mcpServers[{i}] ({server.name}): cannot list its tools: {listed.message} ({fix})",
                file=source,
            )
        for entry in (tool_entry(server, t) for t in listed if isinstance(t, dict) and t.get("name")):
            if entry["name"] not in declared:
                tools.append(entry)
                declared.add(entry["name"])
    return {**normalise_servers(data), "tools": tools}


def _list(server: McpServer, base_dir: str | None) -> list[dict[str, Any]] | McpCallError:
    try:
        return pool().list_tools(target_for(server, base_dir), LIST_TIMEOUT)
    except McpCallError as exc:
        return exc
