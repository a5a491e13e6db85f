"""The model adapter: litellm behind the scheduler's `LlmPort`, plus the offline demo model.

litellm costs seconds to import, so nothing here imports it at module level: `LitellmPort` does it
on first use, and the CLI imports this package only in commands that call a model.
"""

from celery_agents.llm.adapter import LitellmPort, RetryPolicy, ensure_litellm

__all__ = ["LitellmPort", "RetryPolicy", "ensure_litellm"]
