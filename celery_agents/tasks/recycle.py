"""Replacing a worker process that a python tool call has outrun.

A python tool run inside the worker (runSync, runAsync) that goes past its timeout is reported as
timed out, but its thread cannot be killed: it would go on spending CPU and memory in that process
for as long as the process lives. Once the task that ran it has recorded its outcome:
- a prefork pool process leaves (a `SystemExit` raised by the task itself: billiard reports the
  task's result, then exits the process) and the pool starts a fresh one;
- a threads-pool worker run by `agents worker` (tasks/supervisor.py) shuts itself down warm (the
  other steps in flight finish and commit) and the supervisor starts a fresh one;
- any other worker (a threads or solo pool started by hand) can only warn.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from celery.signals import worker_process_init

from celery_agents.tools.python_call import overrunning_calls

log = logging.getLogger(__name__)

_process = {"pool_process": False, "supervised": False, "warned": False, "leaving": False}


@worker_process_init.connect  # type: ignore[untyped-decorator]  # Celery is untyped
def _in_pool_process(**_: Any) -> None:
    # Sent in prefork pool processes only: elsewhere (solo, threads) no pool replaces us.
    _process["pool_process"] = True


def mark_supervised() -> None:
    """This worker runs under `agents worker`, which starts another when it exits."""
    _process["supervised"] = True


def leave_if_outrun() -> None:
    """Called by a task once its work is recorded and published."""
    tools = overrunning_calls()
    if not tools:
        return
    names = ", ".join(sorted(set(tools)))
    if _process["pool_process"]:
        log.warning("python tool call(s) %s still running past their timeout: this pool process is replaced", names)
        raise SystemExit(0)
    if _process["supervised"]:
        if not _process["leaving"]:
            _process["leaving"] = True
            log.warning(
                "python tool call(s) %s still running past their timeout: this worker finishes its steps in "
                "flight, then leaves, and the supervisor starts a fresh one",
                names,
            )
            os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown
        return
    if not _process["warned"]:
        _process["warned"] = True
        log.warning("python tool call(s) %s still running past their timeout (not a prefork pool: kept)", names)
