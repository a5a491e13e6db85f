"""Ctrl-C in tests, whatever SIGINT's disposition the test run inherited.

A run started in the background of a shell without job control (`nohup python -m pytest ... &`,
or under `trap '' INT`) has SIGINT ignored, and so has every process it starts: Python then
installs no KeyboardInterrupt handler, and a test's Ctrl-C does nothing. A test that interrupts
sets SIGINT itself: `sigint_default` for a child it signals, `sigint_raises` in its own process.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


def sigint_default() -> None:
    """`preexec_fn` of a child a test interrupts: SIGINT at its default disposition, so the Python
    it execs installs its KeyboardInterrupt handler, as in a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process's main thread (Python's default) meanwhile."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
