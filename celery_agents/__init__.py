"""celery-agents: durable, step-wise LLM agent sessions on Celery workers with all state in Redis."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Client", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from celery_agents.client import Client

        return Client
    raise AttributeError(name)
