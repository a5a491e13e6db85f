"""Listing the tools of an agent's MCP servers when the agent is resolved (`tools/resolve.py`).

Each server is started (or reached) once from the resolving process; its tools join the agent's
`tools` as `mcp__<server>__<tool>` with the description and input schema the server gives, so the
stored agent names every tool and workers never list again. A server that cannot be listed, or
whose listing goes past a bound (`ListingBounds`: tools, description, schema, the whole listing),
makes the file invalid, with a message naming the server, the tool and the bound.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from celery_agents.config import Settings
from celery_agents.errors import InvalidAgentFile
from celery_agents.model.agent_file import AgentFile
from celery_agents.model.limits import UnusableJson, check_depth
from celery_agents.model.mcp import MCP_TOOL_NAME_MAX, McpServer, mcp_tool_name
from celery_agents.tools.mcp.pool import McpCallError, pool
from celery_agents.tools.mcp.servers import target_for

#: how long a server may take to start and list its tools
LIST_TIMEOUT = 60.0


@dataclass(frozen=True)
class ListingBounds:
    """How much one server's listing may hold (settings `AGENTS_MCP_MAX_*`, read where the file
    is loaded). The tools join every model request of the agent, so a server past a bound is
    refused rather than cut: a shortened description or schema would mislead the model."""

    tools: int
    description_bytes: int
    schema_bytes: int
    listing_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ListingBounds:
        return cls(
            settings.mcp_max_tools,
            settings.mcp_max_description_bytes,
            settings.mcp_max_schema_bytes,
            settings.mcp_max_listing_bytes,
        )

    def excess(self, entries: list[dict[str, Any]]) -> str | None:
        """What in one server's tool entries goes past a bound, naming it; None when nothing does."""
        if len(entries) > self.tools:
            return f"it lists more than {self.tools} tools (AGENTS_MCP_MAX_TOOLS)"
        total = 0
        for entry in entries:
            tool = entry["mcp"]["tool"]
            if len(tool) > MCP_TOOL_NAME_MAX:
                chars = len(tool)
                return f"it lists a tool with a name of {chars} characters, more than {MCP_TOOL_NAME_MAX} (MCP's bound)"
            described = len(entry["description"].encode())
            if described > self.description_bytes:
                return (
                    f"tool {tool!r} has a description of {described} bytes, more than {self.description_bytes} "
                    "(AGENTS_MCP_MAX_DESCRIPTION_BYTES)"
                )
            try:
                check_depth(entry["parameters"])
            except UnusableJson as exc:
                return f"tool {tool!r} has an input schema that is not usable: {exc}"
            schema = len(json.dumps(entry["parameters"], separators=(",", ":"), ensure_ascii=False).encode())
            if schema > self.schema_bytes:
                return (
                    f"tool {tool!r} has an input schema of {schema} bytes of JSON, more than {self.schema_bytes} "
                    "(AGENTS_MCP_MAX_SCHEMA_BYTES)"
                )
            total += described + schema
        if total > self.listing_bytes:
            return (
                f"its tools' descriptions and input schemas come to {total} bytes, more than {self.listing_bytes} "
                "bytes (AGENTS_MCP_MAX_LISTING_BYTES)"
            )
        return None


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


def list_servers(agent: AgentFile, bounds: ListingBounds) -> tuple[tuple[dict[str, Any], ...], ...]:
    """The tool entries of each of the agent's MCP servers, in `mcpServers` order. A server that
    cannot be listed, or whose listing goes past `bounds`, makes the file invalid."""
    servers, source = agent.mcp_servers, agent.source
    # Servers start in parallel: each may take seconds to boot.
    with ThreadPoolExecutor(max_workers=min(8, len(servers) or 1)) as threads:
        listings = list(threads.map(lambda s: _list(s, agent.base_dir, bounds.tools), servers))
    found = []
    for i, (server, listed) in enumerate(zip(servers, listings, strict=True)):
        where = f"{source}: mcpServers[{i}] ({server.name})"
        if isinstance(listed, McpCallError):
            fix = "check its command and that it runs" if server.command else "check its url and that it is up"
            raise InvalidAgentFile(f"{where}: cannot list its tools: {listed.message} ({fix})", file=source)
        entries = [tool_entry(server, t) for t in listed if isinstance(t, dict) and t.get("name")]
        excess = bounds.excess(entries)
        if excess is not None:
            raise InvalidAgentFile(
                f"{where}: {excess}; every model request of this agent would carry its tools (use a server "
                "that lists less, or raise the bound where the file is loaded if you trust this one)",
                file=source,
            )
        found.append(tuple(entries))
    return tuple(found)


def _list(server: McpServer, base_dir: str | None, most: int) -> list[dict[str, Any]] | McpCallError:
    try:
        return pool().list_tools(target_for(server, base_dir), LIST_TIMEOUT, most)
    except McpCallError as exc:
        return exc
