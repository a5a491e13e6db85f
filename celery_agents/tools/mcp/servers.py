"""An `mcpServers` entry as the process that calls it reaches it (`Target`): the command resolved
against the agent file's folder with its `passEnv` values read from this environment, or the URL
with its headers' values read from this environment."""

from __future__ import annotations

import os

from celery_agents.model.mcp import McpServer
from celery_agents.tools.command import resolve_argv
from celery_agents.tools.mcp.pool import McpCallError, Target


def target_for(server: McpServer, base_dir: str | None) -> Target:
    """Where to reach `server` from here; `McpCallError` when a header's variable is unset."""
    label = repr(server.name)
    key = server.identity(base_dir)
    if server.command is not None:
        cwd = base_dir if base_dir and os.path.isdir(base_dir) else None
        argv = tuple(resolve_argv(list(server.command), base_dir))
        passed = {name: os.environ[name] for name in server.pass_env if name in os.environ}
        env = tuple(sorted({**passed, **server.env}.items()))
        return Target(key=key, label=label, argv=argv, env=env, cwd=cwd)
    headers = []
    for header, variable in sorted(server.headers_env.items()):
        value = os.environ.get(variable)
        if value is None:
            raise McpCallError(
                f"the MCP server {label} needs header {header} from the environment variable {variable}, "
                "which is not set where the call runs (set it in the worker's environment)"
            )
        headers.append((header, value))
    return Target(key=key, label=label, url=server.url, headers=tuple(headers))
