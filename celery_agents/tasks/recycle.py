"""Replacing a pool process that a python tool call has outrun.

A python tool run inside the worker (runSync, runAsync) that goes past its timeout is reported as
timed out, but its thread cannot be killed: it would go on spending CPU and memory in that pool
process for as long as the process lives. Once the task that ran it has recorded its outcome, the
process leaves (a `SystemExit` raised by the task itself: billiard reports the task's result, then
exits the process) and the pool starts a fresh one.
"""

from __future__ import annotations

import logging

from celery_agents.tools.python_call import overrunning_calls

log = logging.getLogger(__name__)


def leave_if_outrun() -> None:
    """Called by a task once its work is recorded and published."""
    tools = overrunning_calls()
    if tools:
        log.warning(
            "python tool call(s) %s still running past their timeout: this pool process is replaced",
            ", ".join(sorted(set(tools))),
        )
        raise SystemExit(0)
