"""Tool kinds (command, python callable, external) and executing one call with its decorators."""

from celery_agents.tools.executor import ToolRunner, parse_output

__all__ = ["ToolRunner", "parse_output"]
