"""Replacing a pool process that a python tool call has outrun.

A python tool run inside the worker (runSync, runAsync) that goes past its timeout is reported as
timed out, but its thread cannot be killed: it would go on spending CPU and memory in that pool
process for as long as the process lives. Once the task that ran it has recorded its outcome, the
process leaves (a `SystemExit` raised by the task itself: billiard reports the task's result, then
exits the process) and the pool starts a fresh one.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_process_init

from celery_agents.tools.python_call import overrunning_calls

log = logging.getLogger(__name__)

_pool_process = {"yes": False, "warned": False}


@worker_process_init.connect  # type: ignore[untyped-decorator]  # Celery is untyped
def _in_pool_process(**_: Any) -> None:
    # Sent in prefork pool processes only: elsewhere (solo, threads) nothing would replace us.
    _pool_process["yes"] = True


def leave_if_outrun() -> None:
    """Called by a task once its work is recorded and published."""
    tools = overrunning_calls()
    if not tools:
        return
    names = ", ".join(sorted(set(tools)))
    if not _pool_process["yes"]:
        if not _pool_process["warned"]:
            _pool_process["warned"] = True
            log.warning("python tool call(s) %s still running past their timeout (not a prefork pool: kept)", names)
        return
    log.warning("python tool call(s) %s still running past their timeout: this pool process is replaced", names)
    raise SystemExit(0)
