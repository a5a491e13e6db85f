"""Tool kinds (command, python callable, agents-exe script, MCP, external), executing one call with
its decorators, the runIsolated sandbox, and resolving an agent's tools (`resolve.py`).
docs/tools.md is the user's guide.

The names below are imported on first use: resolving an agent (a CLI command starting a session)
needs none of the execution machinery.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from celery_agents.tools.executor import ToolRunner
    from celery_agents.tools.output import parse_output
    from celery_agents.tools.sandbox import Sandbox, SandboxConfig

__all__ = ["Sandbox", "SandboxConfig", "ToolRunner", "parse_output"]


def __getattr__(name: str) -> Any:
    if name == "ToolRunner":
        from celery_agents.tools.executor import ToolRunner

        return ToolRunner
    if name == "parse_output":
        from celery_agents.tools.output import parse_output

        return parse_output
    if name in ("Sandbox", "SandboxConfig"):
        from celery_agents.tools import sandbox

        return getattr(sandbox, name)
    raise AttributeError(name)
