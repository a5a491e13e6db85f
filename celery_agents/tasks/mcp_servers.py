"""Stopping the MCP servers a worker process started, when that process shuts down.

Pool processes leave through `os._exit` (no `atexit`), so the pool's own shutdown signal stops
them; a worker running tasks in its main process (solo, threads) stops them with the worker.
"""

from __future__ import annotations

from typing import Any

from celery.signals import worker_process_shutdown, worker_shutdown

from celery_agents.tools.mcp.pool import pool


@worker_process_shutdown.connect  # type: ignore[untyped-decorator]  # Celery is untyped
def _pool_process_leaves(**_: Any) -> None:
    pool().close()


@worker_shutdown.connect  # type: ignore[untyped-decorator]  # Celery is untyped
def _worker_leaves(**_: Any) -> None:
    pool().close()
