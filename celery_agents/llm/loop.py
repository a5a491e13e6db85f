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
import signal
import threading
from collections.abc import Coroutine, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0

#: litellm's limits on the connections its async HTTP client opens (read once, when litellm is
#: imported): in all, and to one host
_CONNECTION_LIMITS = {"AIOHTTP_CONNECTOR_LIMIT": 1000, "AIOHTTP_CONNECTOR_LIMIT_PER_HOST": 500}


def _reset_after_fork() -> None:
    """A forked child makes its own loop, under its own lock (another thread of the parent may have
    held this one at the fork)."""
    global _lock, _loop, _loop_pid
    _lock, _loop, _loop_pid = threading.Lock(), None, 0


os.register_at_fork(after_in_child=_reset_after_fork)


def model_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for model calls, started on first use."""
    global _loop, _loop_pid
    with _lock:
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
    the future exists before the coroutine is handed over, so no moment of an interrupt escapes."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        start_on_loop(model_loop(), coro, done)
        return done.result(timeout)
    except concurrent.futures.TimeoutError:
        give_up(done)
        raise TimeoutError(f"no answer within {timeout} s") from None
    except BaseException:
        give_up(done)
        raise


def give_up(done: concurrent.futures.Future[Any]) -> None:
    """Cancel `done`, and with it its call (or the call's start), with Ctrl-C held back meanwhile
    in the main thread. A second Ctrl-C landing inside `cancel`, after the future is marked
    cancelled and before its callbacks ran, would skip the one that cancels the call and leave the
    call running: a person pressing Ctrl-C twice. Held back, it is raised right after."""
    if threading.current_thread() is not threading.main_thread():
        done.cancel()
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        done.cancel()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def start_on_loop(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], done: concurrent.futures.Future[T]
) -> None:
    """Hand `coro` to `loop`, its outcome to settle `done` (cancelling `done` cancels it)."""
    loop.call_soon_threadsafe(_start, loop, coro, done)


def _start(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], done: concurrent.futures.Future[T]) -> None:
    """On the loop: run `coro` as a task whose outcome settles `done`; cancelling `done` cancels it."""
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
