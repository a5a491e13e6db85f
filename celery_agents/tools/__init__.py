"""Tool kinds (command, python callable, agents-exe script, external), executing one call with
its decorators, and the runIsolated sandbox. docs/tools.md is the user's guide."""

from celery_agents.tools.executor import ToolRunner
from celery_agents.tools.output import parse_output
from celery_agents.tools.sandbox import Sandbox, SandboxConfig

__all__ = ["Sandbox", "SandboxConfig", "ToolRunner", "parse_output"]
