"""One asyncio event loop per process, on a thread of its own, that every model call waiting on the
network runs on.

A step runs on a thread of its steps process and waits for its model call. With litellm's
synchronous client, hundreds of threads each drove an HTTP request through one shared connection
pool, and what they spent contending for the interpreter and that pool's lock cost as much CPU as
the calls themselves: 2,000 calls of a local server, 200 at a time from 200 threads, took 8.0 ms of
CPU each against 4.0 ms one at a time. Here each call is a coroutine (`litellm.acompletion`) on
the process's one loop and the step's thread only waits on its future, which costs nothing while
it waits: the same 2,000 calls took 4.4 ms each, and the whole steps process about half the CPU
per step (docs/performance.md, "What bounds them").

The loop is made on first use by the process that uses it: a forked child (a steps process forked
from the zygote) never inherits one, it makes its own. The loop's thread is a daemon, so a process
leaves without waiting for it; nothing on it needs flushing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_canceller: threading.Thread | None = None

#: the futures of waits given up, for the canceller thread (`_cancel_given_up`) to cancel
_given_up: queue.SimpleQueue[concurrent.futures.Future[Any]] = queue.SimpleQueue()

#: Give up a wait on `done`: its future is cancelled, and with it its call (or the call's start),
#: on the canceller thread. Not in the waiting thread: there (the main thread, for a CLI's inline
#: step) a second KeyboardInterrupt, Ctrl-C pressed twice, is raised as the next Python function
#: starts or the next call returns, so also after `Future.cancel` marked the future cancelled and
#: before its callbacks ran, skipping the one that cancels the call, which goes on with nobody
#: waiting. Holding SIGINT back in the main thread does not prevent that: a terminal's Ctrl-C is
#: sent to the process, another thread takes it, and the main thread raises it all the same. So
#: giving up is a C method (`SimpleQueue.put`) that the wait's `except` calls first: no Python runs
#: between the interrupt caught and the future handed over. The canceller thread, which no
#: KeyboardInterrupt reaches, cancels it and runs its callbacks.
give_up: Callable[[concurrent.futures.Future[Any]], None] = _given_up.put

#: litellm's limits on the connections its async HTTP client opens (read once, when litellm is
#: imported): in all, and to one host
_CONNECTION_LIMITS = {"AIOHTTP_CONNECTOR_LIMIT": 1000, "AIOHTTP_CONNECTOR_LIMIT_PER_HOST": 500}


def _reset_after_fork() -> None:
    """A forked child makes its own loop and canceller, under its own lock (another thread of the
    parent may have held this one at the fork). The parent's given-up futures are not the child's
    to cancel: its calls are not on the child's loop, and the parent's canceller may have been
    cancelling one at the fork, whose lock nobody in the child would release."""
    global _lock, _loop, _loop_pid, _canceller
    _lock, _loop, _loop_pid, _canceller = threading.Lock(), None, 0, None
    with contextlib.suppress(queue.Empty):
        while True:
            _given_up.get_nowait()


os.register_at_fork(after_in_child=_reset_after_fork)


def model_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for model calls, started on first use, with the thread that cancels the
    calls whose waits were given up."""
    global _loop, _loop_pid, _canceller
    with _lock:
        if _canceller is None or not _canceller.is_alive():
            _canceller = threading.Thread(target=_cancel_given_up, name="agents-model-cancel", daemon=True)
            _canceller.start()
        # Made again if its thread is gone: a call handed to a loop that no longer runs would
        # never be answered, and its step would hold its lease for ever.
        if _loop is None or _loop_pid != os.getpid() or not _loop.is_running():
            loop = asyncio.new_event_loop()
            running = threading.Event()
            loop.call_soon(running.set)
            threading.Thread(target=loop.run_forever, name="agents-model-loop", daemon=True).start()
            running.wait()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


def wait_on_loop(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run `coro` on the process's model loop and wait here for its result or its exception, at most
    `timeout` seconds (then `TimeoutError`). A wait that ends without a result (timed out, or
    interrupted: Ctrl-C of a step run by the CLI) cancels the coroutine, which is not left running;
    the future exists before the coroutine is handed over, so no moment of an interrupt escapes,
    and `give_up` hands it to be cancelled before another interrupt can land.

    The wait is on a queue the loop puts the settled future on, not in `Future.result`: that waits
    under the future's lock, taken and released by Python code (`threading.Condition`), where a
    KeyboardInterrupt can leave it held by this thread; then whatever settles or cancels the future
    would wait for it for ever. The future's lock is taken here only once it is settled."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    settled: queue.SimpleQueue[concurrent.futures.Future[T]] = queue.SimpleQueue()
    bound = None if timeout is None else max(0.0, timeout)
    # The main thread (a CLI's inline step) waits in slices: a Ctrl-C that arrives just before it
    # blocks would otherwise be noticed only once the call ends (Python runs a signal's handler
    # between bytecodes, or when the signal interrupts the wait; one that comes in between does
    # neither). No other thread is sent signals: those wait whole.
    slice_s = _SIGNAL_SLICE_S if threading.current_thread() is threading.main_thread() else None
    try:
        start_on_loop(model_loop(), coro, done, settled.put)
        if slice_s is None:
            settled.get(timeout=bound)
        else:
            deadline = None if bound is None else time.monotonic() + bound
            while True:
                left = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
                try:
                    settled.get(timeout=max(0.0, left))
                    break
                except queue.Empty:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
    except queue.Empty:
        give_up(done)
        raise TimeoutError(f"no answer within {timeout} s") from None
    except BaseException:
        give_up(done)
        raise
    return done.result()


#: how long the main thread waits on a call between looks for a signal that came meanwhile
_SIGNAL_SLICE_S = 0.1


def _cancel_given_up() -> None:
    """The canceller thread: cancels each future given up (`give_up`), and so its call."""
    while True:
        _given_up.get().cancel()


def start_on_loop(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    done: concurrent.futures.Future[T],
    then: Callable[[concurrent.futures.Future[T]], object] | None = None,
) -> None:
    """Hand `coro` to `loop`, its outcome to settle `done` (cancelling `done` cancels it); `then`,
    if given, is called with `done` once settled, on the loop (no waiting thread touches `done`'s
    lock to register it)."""
    loop.call_soon_threadsafe(_start, loop, coro, done, then)


def _start(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    done: concurrent.futures.Future[T],
    then: Callable[[concurrent.futures.Future[T]], object] | None,
) -> None:
    """On the loop: run `coro` as a task whose outcome settles `done`; cancelling `done` cancels it."""
    if then is not None:
        done.add_done_callback(then)
    if done.cancelled():  # given up before it started
        coro.close()
        return
    task = loop.create_task(coro)

    def settle(t: asyncio.Task[T]) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # `done` was cancelled meanwhile
            if t.cancelled():
                done.cancel()
            elif (exc := t.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(t.result())

    task.add_done_callback(settle)
    done.add_done_callback(lambda d: d.cancelled() and loop.call_soon_threadsafe(task.cancel))


def allow_connections(connections: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """Let one process hold `connections` model calls in flight at once, to one host or several:
    raises litellm's connection limits to that in `environ` where they are lower, unless set there
    already. Must run before litellm is imported (it reads them then), so in `agents worker`'s
    supervisor, before its zygote imports litellm for the steps processes it forks."""
    for variable, default in _CONNECTION_LIMITS.items():
        if connections > default:
            environ.setdefault(variable, str(connections))
