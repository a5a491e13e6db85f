"""A model's answer as it streams: the pieces read on the model loop, handed to the step's thread
in batches, and the whole answer assembled from them as the committed turn.

The stream is read by a coroutine on the process's model loop (`llm/loop.py`), which only appends
what arrives to a `Relay`; the step's thread, waiting on the call, writes the relay's pieces to the
session's live output when a batch is due (`LiveOutput.interval` after its first piece, or once
`max_chars` wait: the loop wakes the thread then, and only then) and once more when the answer is
whole, so an answer costs a few writes however many chunks the model sends, and the loop never
waits on Redis. The step's thread also watches for
an interrupt (a message sent with `--interrupt`): the call is then cancelled on the loop.

The turn is assembled (from litellm's chunks here, or off the wire by `llm/wire.py`) as litellm's
`stream_chunk_builder` would (text and reasoning joined, tool
calls by index: the last id and name given, arguments joined; usage and cost from the last chunk
that carries them), without its per-chunk cost; provider thinking blocks, rare and fiddly to merge,
are left to `stream_chunk_builder` itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from celery_agents.llm.loop import give_up, model_loop, start_on_loop
from celery_agents.scheduler.ports import DeltaKind, LiveOutput


class Wake:
    """Wakes the step's thread: `threading.Event`'s `set`, `is_set` and `wait` (which also clears)
    on a queue written in C. An Event waits under a lock that Python code takes and releases, where
    a KeyboardInterrupt (Ctrl-C of a step run by the CLI) can leave it held by the waiting thread;
    the model loop setting it would then wait for ever, and every call of the process with it."""

    def __init__(self) -> None:
        self._woken: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def set(self) -> None:
        self._woken.put(True)

    def is_set(self) -> bool:
        return not self._woken.empty()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until set, at most `timeout` seconds; whether it was set. Clears it."""
        try:
            self._woken.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return False
        while not self._woken.empty():
            self._woken.get_nowait()
        return True


class Relay:
    """Pieces of an answer, appended on the model loop and taken by the step's thread."""

    def __init__(self, max_chars: int, interval: float) -> None:
        self.max_chars, self.interval = max_chars, interval
        self.wake = Wake()
        self._lock = threading.Lock()
        self._parts: list[tuple[DeltaKind, str]] = []
        self._chars = 0
        #: when the oldest piece not yet taken arrived (monotonic); None: nothing waits
        self.since: float | None = None
        #: when the last piece of any kind arrived (monotonic): the stream is alive
        self.last_seen = time.monotonic()

    def add(self, kind: DeltaKind, text: str) -> None:
        self.add_all([(kind, text)])

    def add_all(self, pieces: list[tuple[DeltaKind, str]]) -> None:
        """Append pieces that arrived together (one read of a stream) at once."""
        with self._lock:
            first = not self._parts
            parts = self._parts
            for kind, text in pieces:
                if parts and parts[-1][0] == kind:
                    parts[-1] = (kind, parts[-1][1] + text)
                else:
                    parts.append((kind, text))
                self._chars += len(text)
            now = time.monotonic()
            self.last_seen = now
            if first:
                self.since = now
            full = self._chars >= self.max_chars
        if full:
            self.wake.set()
        elif first:
            self._wake_when_due()

    def _wake_when_due(self) -> None:
        """Wake the step's thread when the batch begun now falls due, not now: a timer on the loop
        costs less than a thread woken twice a batch."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop: the waiting thread times the batch itself
            self.wake.set()
            return
        loop.call_later(self.interval, self.wake.set)

    def due(self, interval: float, now: float) -> bool:
        with self._lock:
            return bool(self._parts) and (self._chars >= self.max_chars or now - (self.since or now) >= interval)

    def take(self) -> list[tuple[DeltaKind, str]]:
        with self._lock:
            parts, self._parts, self._chars, self.since = self._parts, [], 0, None
            return parts

    def seen(self) -> None:
        """A chunk carrying nothing to show arrived (usage, a tool call's arguments): still alive."""
        self.last_seen = time.monotonic()


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    arguments: list[str] = field(default_factory=list)


class Answer:
    """The answer assembled from the chunks read so far (`litellm.ModelResponseStream`s)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, _Call] = {}
        self.usage: Any = None
        self.cost: float | None = None
        self.model = ""
        self.finish_reason: str | None = None
        #: some chunk carried provider thinking blocks: they are merged by litellm
        self.thinking = False
        self.chunks: list[Any] = []

    @property
    def chars(self) -> int:
        return sum(len(t) for t in self.text) + sum(len(r) for r in self.reasoning)

    def call(self, index: int) -> _Call:
        """The tool call at `index`, begun when first named."""
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = _Call()
        return call

    def add(self, chunk: Any, relay: Relay) -> None:
        self.chunks.append(chunk)
        model = getattr(chunk, "model", None)
        if model:
            self.model = str(model)
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self.usage = usage
        hidden = getattr(chunk, "_hidden_params", None) or {}
        if hidden.get("response_cost") is not None:
            self.cost = float(hidden["response_cost"])
        shown = False
        for choice in getattr(chunk, "choices", None) or []:
            if getattr(choice, "index", 0) != 0:
                continue
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            delta = choice.delta
            if delta is None:
                continue
            reasoning = getattr(delta, "reasoning_content", None)
            if isinstance(reasoning, str) and reasoning:
                self.reasoning.append(reasoning)
                relay.add("reasoning", reasoning)
                shown = True
            content = getattr(delta, "content", None)
            if isinstance(content, str) and content:
                self.text.append(content)
                relay.add("text", content)
                shown = True
            if getattr(delta, "thinking_blocks", None):
                self.thinking = True
            for tc in getattr(delta, "tool_calls", None) or []:
                call = self.calls.setdefault(int(getattr(tc, "index", 0) or 0), _Call())
                if getattr(tc, "id", None):
                    call.id = tc.id
                fn = getattr(tc, "function", None)
                if fn is not None:
                    if fn.name:
                        call.name = fn.name
                    if fn.arguments:
                        call.arguments.append(fn.arguments)
        if not shown:
            relay.seen()

    def reported(self, raw_chunks: Any) -> None:
        """Prefer the usage the provider reported to the one litellm passes on: litellm fills in
        what the provider left out (reasoning tokens counted from the text), which the same answer
        asked for whole does not have. `raw_chunks`: the chunks as litellm received them."""
        for chunk in reversed(raw_chunks if isinstance(raw_chunks, list) else []):
            usage = getattr(chunk, "usage", None)
            if usage is not None:
                self.usage = usage
                return

    def thinking_blocks(self, litellm: Any) -> list[Any] | None:
        if not self.thinking:
            return None
        built = litellm.stream_chunk_builder(self.chunks)
        return getattr(built.choices[0].message, "thinking_blocks", None) if built is not None else None


class Interrupted(Exception):
    """The live output said the call is interrupted; it was cancelled on the loop."""


def await_answer(coro: Coroutine[Any, Any, Any], live: LiveOutput, relay: Relay, idle_timeout: float) -> Any:
    """Run `coro` on the model loop and wait for it here, writing the relay's pieces to `live` as
    batches fall due and the rest once it is done. Raises `Interrupted` (the call cancelled) when
    `live` is interrupted, `TimeoutError` when nothing arrived for `idle_timeout` seconds; a wait
    that ends without a result cancels the coroutine."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()
    wake = relay.wake
    settled: list[bool] = []  # set on the loop once `done` is: no lock of `done` taken before

    def finished(_: concurrent.futures.Future[Any]) -> None:
        settled.append(True)
        wake.set()

    live.on_interrupt(wake.set)
    try:
        start_on_loop(model_loop(), coro, done, finished)
        while True:
            if live.interrupted():
                raise Interrupted
            if settled:
                break
            now = time.monotonic()
            if relay.due(live.interval, now):
                live.write(relay.take())
            idle_left = relay.last_seen + idle_timeout - now
            if idle_left <= 0:
                raise TimeoutError(f"nothing arrived for {idle_timeout:g} s")
            since = relay.since
            wait = idle_left if since is None else min(idle_left, max(0.0, since + live.interval - now))
            wake.wait(wait)
        result = done.result()
        rest = relay.take()
        if rest:
            live.write(rest)
        return result
    except BaseException:
        give_up(done)
        raise
