"""Fault-injection checkpoints for the chaos tests; inert unless AGENTS_FAULT_PAUSE is set.

With `AGENTS_FAULT_PAUSE=<name>`, a worker reaching checkpoint `<name>` records it in Redis
(`<prefix>:fault:<name>` = session id) and stops there, so a test can SIGKILL it at exactly that
point: a step message just taken from its queue, before `begin_step` (`step_taken`); a step just
begun, its lease held, before its model call (`step_begun`); right before the model is asked
(`before_llm`: the queue read, an interrupt not yet looked at); after the model answered (before the
step commits, `after_llm`); after a commit and before what follows is published; and along a sub-agent call:
`child_created`, `child_committed`, `child_finished` (before its parent's call records it),
`parent_woken` (before the parent's step is published); and in a command interrupted by Ctrl-C,
just after its step let the session's lease go (`step_interrupted`).
With `AGENTS_FAULT_CLOCK_SHIFT=<seconds>`, a worker's wall clock reads that far off (`shift_clock`),
as on a host whose clock is wrong. Both are read with the worker's settings (`config.Settings`).
"""

from __future__ import annotations

import time

from celery_agents.store import Store


def checkpoint(name: str, store: Store, session_id: str) -> None:
    settings = store.settings
    if not settings.fault_pause or name != settings.fault_pause:
        return
    store.mark_checkpoint(name, session_id)
    time.sleep(settings.fault_pause_seconds)


def shift_clock(shift: float) -> None:
    """Make this process's wall clock (`time.time`) read `shift` seconds ahead (negative: behind);
    its monotonic clock is untouched, as on a host whose clock is off."""
    if not shift:
        return
    real, real_ns = time.time, time.time_ns
    setattr(time, "time", lambda: real() + shift)  # noqa: B010 - patching the module is the point
    setattr(time, "time_ns", lambda: real_ns() + int(shift * 1e9))  # noqa: B010
