"""Model calls wait on one event loop per process: many threads' calls are coroutines on it, all at
the server at once; an interrupted wait cancels its call; a forked child makes a loop of its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy
from celery_agents.llm import loop as loop_module
from celery_agents.llm.loop import allow_connections, model_loop, wait_on_loop
from celery_agents.llm.stream import Relay, await_answer
from celery_agents.scheduler import LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.support.interrupt import sigint_raises
from tests.support.llm_server import HeldModel, LlmServer, text

THREADS = 40
CALLERS = 8


def test_forty_threads_waiting_on_the_model_are_forty_coroutines_on_one_loop(llm_server: LlmServer) -> None:
    held = HeldModel()
    scenario = llm_server.scenario([held])
    agent = parse_agent({"slug": "t", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    port = LitellmPort(RetryPolicy(attempts=1, timeout=30))
    answers: list[str | None] = []

    def one() -> None:
        turn = port.complete(LlmRequest(agent=agent, messages=[{"role": "user", "content": "hi"}], tools=[]))
        answers.append(turn.text)

    threads = [threading.Thread(target=one) for _ in range(THREADS)]
    for t in threads:
        t.start()
    try:
        deadline = 30.0
        while held.holding < THREADS and deadline > 0:
            threading.Event().wait(0.02)
            deadline -= 0.02
        assert held.holding == THREADS, f"{held.holding} of {THREADS} calls reached the server"
        on_loop = asyncio.run_coroutine_threadsafe(_count_tasks(), model_loop()).result(5)
        assert on_loop >= THREADS, f"{on_loop} coroutines on the model loop for {THREADS} calls in flight"
    finally:
        held.released.set()
        for t in threads:
            t.join(30)
    assert answers == ["done"] * THREADS


async def _count_tasks() -> int:
    return len(asyncio.all_tasks()) - 1  # this one


class SleepingCall:
    """A model call that sleeps until cancelled, saying when it started and when it was cancelled,
    and a Ctrl-C sent to the main thread (waiting on it) once it has started."""

    def __init__(self) -> None:
        self.started, self.cancelled = threading.Event(), threading.Event()
        main = threading.main_thread().ident
        assert main is not None and threading.get_ident() == main
        self.main = main

    async def call(self) -> None:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    def interrupt_once_started(self) -> None:
        def interrupt() -> None:
            if self.started.wait(10):
                signal.pthread_kill(self.main, signal.SIGINT)  # Ctrl-C of the CLI waiting on its inline step

        threading.Thread(target=interrupt, daemon=True).start()


@pytest.mark.parametrize("attempt", range(20))  # the interrupt lands anywhere in the wait's start
def test_an_interrupted_wait_cancels_its_call(attempt: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C once the call started cancels it. A SIGINT from elsewhere in the process may come
    first, before the call started (the helper waits for the start): then the call must never
    start, which 30 s without its start or its cancel shows."""
    # What a failure needs to say (it happened under load, about once in four full test runs):
    # which futures the wait gave up and what became of them, what the loop still runs, and any
    # exception Python swallowed meanwhile (a KeyboardInterrupt raised inside a finalizer is).
    given: list[Any] = []
    swallowed: list[str] = []
    put = loop_module.give_up
    monkeypatch.setattr(loop_module, "give_up", lambda done: (given.append(done), put(done)))
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(f"{u.exc_type.__name__} in {u.object!r}"))
    call = SleepingCall()
    loop = model_loop()
    with sigint_raises():  # also in a test run that ignores SIGINT
        call.interrupt_once_started()
        with pytest.raises(KeyboardInterrupt):
            wait_on_loop(call.call())
    if not (call.cancelled.wait(30) or not call.started.is_set()):
        try:  # read from this thread while the loop runs: a set that changed meanwhile is said so
            tasks = [repr(t) for t in asyncio.all_tasks(loop)]
        except RuntimeError as exc:
            tasks = [f"unread: {exc}"]
        pytest.fail(
            f"the call went on after its wait was interrupted; given up: {given}; the loop's tasks: {tasks}; "
            f"swallowed: {swallowed}; {_loop_threads(loop)}"
        )


def test_a_ctrl_c_another_thread_takes_ends_the_main_threads_wait_at_once() -> None:
    """A terminal's Ctrl-C is sent to the process; when another thread takes it (here the main
    thread holds SIGINT back, as it may at that moment), Python asks the main thread to raise
    KeyboardInterrupt at its next bytecode, but a main thread blocked on the call's answer has
    none to run until the call ends. Its wait is sliced: the interrupt is raised within a fraction
    of a second, and the call is cancelled."""
    call = SleepingCall()
    loop_module.model_loop()

    def ctrl_c_to_the_process() -> None:
        if call.started.wait(10):
            os.kill(os.getpid(), signal.SIGINT)

    with sigint_raises():
        threading.Thread(target=ctrl_c_to_the_process, daemon=True).start()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        t0 = time.monotonic()
        try:
            with pytest.raises(KeyboardInterrupt):
                try:
                    wait_on_loop(call.call())
                finally:
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        waited = time.monotonic() - t0
    assert waited < 5, f"the interrupt was raised after {waited:.1f} s"
    assert call.cancelled.wait(10), "the call went on"


class SecondCtrlC:
    """A trace function of the main thread that sends a second Ctrl-C at the `at`-th Python
    function to start after the first KeyboardInterrupt was raised, until the wait ends: where the
    main thread raises it at once (a function's start checks for signals). To the main thread
    (`raise_signal`), or to the process, as a terminal's Ctrl-C is sent: another thread takes it
    if the main thread holds SIGINT back, and the main thread raises it at its next check."""

    def __init__(self, at: int, to_process: bool, wait: Callable[..., Any]) -> None:
        self.at, self.to_process, self.wait = at, to_process, wait.__code__
        self.interrupted, self.over, self.starts, self.where = False, False, 0, ""

    @property
    def sent(self) -> bool:
        return bool(self.where)

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "exception" and isinstance(arg, tuple) and arg[0] is KeyboardInterrupt and not self.over:
            self.interrupted = True
        elif event == "return" and frame.f_code is self.wait:
            self.interrupted, self.over = False, True  # the wait is over: no place after it counts
        elif event == "call" and self.interrupted and not self.sent:
            if self.starts == self.at:
                self.where = frame.f_code.co_qualname
                if self.to_process:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.05)  # for the thread that takes it, if not this one
                else:
                    signal.raise_signal(signal.SIGINT)
            self.starts += 1
        return self.trace


class QuietLive:
    """A live output nobody interrupts, whose writes are dropped."""

    interval, max_chars = 0.05, 4096

    def start(self) -> None: ...

    def write(self, parts: object) -> None: ...

    def interrupted(self) -> bool:
        return False

    def on_interrupt(self, wake: Callable[[], None]) -> None: ...


def streamed_wait(coro: Coroutine[Any, Any, Any]) -> Any:
    return await_answer(coro, QuietLive(), Relay(4096, 0.05), idle_timeout=60)  # type: ignore[arg-type]


@pytest.mark.parametrize("sent_to", ["main thread", "process"])
@pytest.mark.parametrize("wait", [wait_on_loop, await_answer], ids=["answer", "streamed answer"])
def test_a_second_ctrl_c_anywhere_while_the_wait_gives_up_still_cancels_the_call(
    sent_to: str, wait: Callable[..., Any]
) -> None:
    """A person pressing Ctrl-C twice: the second lands while the first's wait gives up, at each
    place in turn where the main thread can raise it, from the first KeyboardInterrupt to the end
    of the wait. Wherever it lands, the call is cancelled and the loop goes on answering. Where
    Python code gives up, there are such places: one after `Future.cancel` marked the future
    cancelled and before its callbacks ran leaves the call running; one inside the `with` of a
    lock taken by Python code (the future's, an Event's) leaves it held by the main thread, for the
    loop to wait on for ever."""
    places: list[str] = []
    run = wait_on_loop if wait is wait_on_loop else streamed_wait
    while True:
        call = SleepingCall()
        second = SecondCtrlC(at=len(places), to_process=sent_to == "process", wait=wait)
        with sigint_raises():
            call.interrupt_once_started()
            sys.settrace(second.trace)
            try:
                with pytest.raises(KeyboardInterrupt):
                    run(call.call())
            finally:
                sys.settrace(None)
        where = second.where or "none (the first alone)"
        assert call.cancelled.wait(30), f"the call went on after a second Ctrl-C in {where}; before, in {places}"
        assert _loop_answers(), f"the model loop stopped answering after a second Ctrl-C in {where}"
        if not second.sent or len(places) == 100:
            break
        places.append(second.where)


def _loop_answers() -> bool:
    async def answer() -> int:
        return 42

    try:
        return wait_on_loop(answer(), timeout=5) == 42
    except TimeoutError:
        return False


def _loop_threads(loop: asyncio.AbstractEventLoop) -> str:
    """The model loop the call went to, and what each model loop thread is doing, for a failure's
    message."""
    said = [f"the call's loop running: {loop.is_running()}, still the process's: {model_loop() is loop}"]
    frames = sys._current_frames()
    said.append(f"waits given up and not yet cancelled: {loop_module._given_up.qsize()}")
    for thread in threading.enumerate():
        if thread.name in ("agents-model-loop", "agents-model-cancel") and thread.ident in frames:
            said.append(f"{thread!r}:\n" + "".join(traceback.format_stack(frames[thread.ident])))
    return "\n".join(said)


def test_a_wait_that_outlasts_its_bound_gives_up_and_cancels_the_call() -> None:
    call = SleepingCall()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.2 s"):
        wait_on_loop(call.call(), timeout=0.2)
    assert call.cancelled.wait(5), "the call went on after its wait gave up"


def test_a_loop_whose_thread_stopped_is_replaced() -> None:
    async def answer() -> int:
        return 42

    stopped = model_loop()
    stopped.call_soon_threadsafe(stopped.stop)
    for _ in range(500):  # until its thread has left run_forever
        if not stopped.is_running():
            break
        threading.Event().wait(0.01)
    assert wait_on_loop(answer(), timeout=5) == 42
    assert model_loop() is not stopped


def test_an_error_of_the_call_is_raised_where_it_waits() -> None:
    async def call() -> None:
        raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        wait_on_loop(call())


def test_a_forked_child_calls_on_a_loop_of_its_own() -> None:
    async def where() -> list[int]:
        return [os.getpid(), threading.get_ident()]

    parent = wait_on_loop(where())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.write(write, json.dumps(wait_on_loop(where())).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as answer:
        child = json.loads(answer.read() or "null")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child[0] == pid and child[0] != parent[0]


def test_connection_limits_are_raised_for_more_threads_than_they_allow() -> None:
    environ: dict[str, str] = {}
    allow_connections(204, environ)  # the default threads: litellm's own limits (1000, 500 per host) suffice
    assert environ == {}
    environ["AIOHTTP_CONNECTOR_LIMIT"] = "5000"  # the operator's own setting stays
    allow_connections(804, environ)
    assert environ == {"AIOHTTP_CONNECTOR_LIMIT": "5000", "AIOHTTP_CONNECTOR_LIMIT_PER_HOST": "804"}


def established_to(port: int) -> int:
    """This machine's established TCP connections to `port` on the loopback (client ends)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if int(cols[2].split(":")[1], 16) == port and cols[3] == "01":
            count += 1
    return count


def test_many_calls_leave_no_thread_and_no_connection_behind(llm_server: LlmServer) -> None:
    scenario = llm_server.scenario([text("ok")])
    agent = parse_agent({"slug": "t", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    request = LlmRequest(agent=agent, messages=[{"role": "user", "content": "hi"}], tools=[])
    port = LitellmPort(RetryPolicy(attempts=1, timeout=30))
    server_port = int(llm_server.url.rsplit(":", 1)[1].split("/")[0])

    def calls(n: int) -> None:
        def some() -> None:
            for _ in range(n // CALLERS):
                port.complete(request)

        callers = [threading.Thread(target=some) for _ in range(CALLERS)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(120)

    calls(200)  # the client's pool grows to what the callers need
    before = threading.active_count(), established_to(server_port)
    calls(1_600)
    after = threading.active_count(), established_to(server_port)
    assert llm_server.count(scenario) == 1_800
    # The server keeps a thread per connection: both stay where the first calls left them, give or
    # take a connection per caller at a new peak; one left behind per call would add hundreds.
    assert after[1] <= before[1] + CALLERS, f"connections to the model grew from {before[1]} to {after[1]}"
    assert after[0] <= before[0] + 2 * CALLERS, f"threads grew from {before[0]} to {after[0]}"
    print(f"\n[model calls] threads {before[0]} -> {after[0]}, connections {before[1]} -> {after[1]}")
