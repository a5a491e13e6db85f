"""The model call streamed through litellm against the local server: the turn it commits is the
turn the same answer makes asked for whole; pieces reach the live output in batches, before the
call returns; an interrupt cancels the call and counts what it spent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy
from celery_agents.model import LlmTurn
from celery_agents.scheduler import LlmRequest
from celery_agents.scheduler.ports import DeltaKind, LlmInterrupted
from celery_agents.tools.resolve import parse_agent
from tests.support.llm_server import LlmServer, Reply, calls, text


class Recorder:
    """A live output that keeps what it is given, when, and can be interrupted."""

    def __init__(self, interval: float = 0.05, max_chars: int = 4096, *, watched: bool = True) -> None:
        self.interval, self.max_chars, self.watched = interval, max_chars, watched
        self.writes: list[tuple[float, list[tuple[DeltaKind, str]]]] = []
        self.starts = 0
        self._interrupted = threading.Event()
        self._wake: list[Callable[[], None]] = []

    def start(self) -> None:
        self.starts += 1

    def write(self, parts: list[tuple[DeltaKind, str]]) -> None:
        self.writes.append((time.monotonic(), parts))

    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def on_interrupt(self, wake: Callable[[], None]) -> None:
        self._wake.append(wake)

    def interrupt(self) -> None:
        self._interrupted.set()
        for w in self._wake:
            w()

    def joined(self, kind: DeltaKind) -> str:
        return "".join(t for _, parts in self.writes for k, t in parts if k == kind)


def port() -> LitellmPort:
    return LitellmPort(RetryPolicy(attempts=1, timeout=10))


def request(server: LlmServer, reply: Reply, live: Recorder | None, **agent: Any) -> tuple[LlmRequest, str]:
    scenario = server.scenario([reply])
    spec = parse_agent({"slug": "t", "model": f"openai/{scenario}", "apiBase": server.url, **agent})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    return LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=tools, live=live), scenario


def comparable(turn: LlmTurn) -> dict[str, Any]:
    return turn.model_dump(exclude={"at", "duration_ms"})


ANSWERS = {
    "text": lambda: text("It is sunny in Paris today, 21 °C.", usage=(40, 12)),
    "reasoning and tool calls": lambda: Reply(
        content="Let me look that up.",
        reasoning="The user wants the weather; I call the tool.",
        tool_calls=[("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_weather", {"city": "Lyon"})],
        usage=(120, 30),
        reasoning_tokens=12,
    ),
    "tool calls only": lambda: calls(("get_weather", {"city": "Paris"}), usage=(50, 9)),
    # litellm counts reasoning tokens the provider did not report; the whole answer has none
    "reasoning with no reasoning tokens reported": lambda: text("Sunny.", reasoning="Let me think.", usage=(20, 9)),
}


@pytest.mark.parametrize("case", list(ANSWERS))
def test_a_streamed_answer_commits_the_turn_the_whole_answer_makes(llm_server: LlmServer, case: str) -> None:
    whole_req, whole_scn = request(llm_server, ANSWERS[case](), None)
    live = Recorder()
    streamed_req, streamed_scn = request(llm_server, ANSWERS[case](), live)
    whole = port().complete(whole_req)
    streamed = port().complete(streamed_req)
    assert llm_server.requests[streamed_scn][0]["stream"] is True
    assert "stream" not in llm_server.requests[whole_scn][0]
    # The model name is the scenario's in both; nothing else differs either.
    assert comparable(streamed) == {**comparable(whole), "model": comparable(streamed)["model"]}
    assert streamed.model.endswith(streamed_scn)
    assert live.joined("text") == (whole.text or "")
    assert live.joined("reasoning") == (whole.reasoning or "")


def test_pieces_are_written_in_batches_while_the_answer_streams(llm_server: LlmServer) -> None:
    answer = "one two three four five six seven eight nine ten eleven twelve"
    live = Recorder(interval=0.1)
    req, _ = request(llm_server, text(answer, chunk_chars=2, chunk_delay=0.02), live)
    returned: list[float] = []
    turn = port().complete(req)
    returned.append(time.monotonic())
    assert turn.text == answer
    assert live.joined("text") == answer
    chunks = len(answer) // 2
    # ~35 chunks 20 ms apart, batched by 100 ms: several writes, far fewer than chunks, all before
    # the call returned.
    assert 3 <= len(live.writes) < chunks / 3
    assert all(at <= returned[0] for at, _ in live.writes)


def test_streaming_off_asks_for_the_answer_whole(llm_server: LlmServer) -> None:
    live = Recorder()
    req, scenario = request(llm_server, text("whole"), live, stream=False)
    assert port().complete(req).text == "whole"
    assert "stream" not in llm_server.requests[scenario][0]
    assert live.writes == []


def test_an_answer_nobody_watches_is_asked_for_whole_and_still_interruptible(llm_server: LlmServer) -> None:
    """Streaming costs litellm ~0.5 ms of CPU per chunk: a session nobody follows asks whole."""
    live = Recorder(watched=False)
    req, scenario = request(llm_server, text("whole"), live)
    assert port().complete(req).text == "whole"
    assert "stream" not in llm_server.requests[scenario][0]
    assert live.writes == []
    slow = Recorder(watched=False)
    req, scenario = request(llm_server, text("word " * 200, delay=3.0), slow)
    threading.Timer(0.3, slow.interrupt).start()
    started = time.monotonic()
    with pytest.raises(LlmInterrupted):
        port().complete(req)
    assert time.monotonic() - started < 2, "an interrupt cancels a whole answer too"


def test_an_interrupt_cancels_the_call_and_counts_what_it_spent(llm_server: LlmServer) -> None:
    live = Recorder(interval=0.02)
    req, scenario = request(llm_server, text("word " * 200, chunk_chars=5, chunk_delay=0.02), live)
    threading.Timer(0.3, live.interrupt).start()
    started = time.monotonic()
    with pytest.raises(LlmInterrupted) as caught:
        port().complete(req)
    assert time.monotonic() - started < 2, "cancelled at once, not after the whole answer"
    exc = caught.value
    assert exc.called and 0 < exc.chars < 1000
    assert exc.usage.prompt_tokens > 0 and exc.usage.completion_tokens > 0
    assert live.joined("text"), "what streamed before the interrupt was written"
    deadline = time.monotonic() + 5
    while llm_server.cut[scenario] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert llm_server.cut[scenario] == 1, "the server saw its caller go away"


def test_an_interrupt_before_the_call_asks_nothing(llm_server: LlmServer) -> None:
    live = Recorder()
    live.interrupt()
    req, scenario = request(llm_server, text("never"), live)
    with pytest.raises(LlmInterrupted) as caught:
        port().complete(req)
    assert not caught.value.called
    assert llm_server.count(scenario) == 0


def test_the_waiting_thread_is_woken_when_a_batch_is_due_not_at_each_piece() -> None:
    """Pieces arriving on the model loop do not wake the step's thread one by one: it is woken
    once the batch's interval has passed, or at once when `max_chars` wait."""
    import asyncio

    from celery_agents.llm.stream import Relay

    async def feed(relay: Relay, pieces: int) -> list[bool]:
        woken = []
        for _ in range(pieces):
            relay.add("text", "abc")
            await asyncio.sleep(0)
            woken.append(relay.wake.is_set())
        woken.append(await asyncio.to_thread(relay.wake.wait, 5))
        return woken

    relay = Relay(max_chars=1000, interval=0.2)
    started = time.monotonic()
    *early, due = asyncio.run(feed(relay, 20))
    assert not any(early) and due
    assert time.monotonic() - started >= 0.2
    full = Relay(max_chars=30, interval=60)
    *early, due = asyncio.run(feed(full, 10))
    assert not any(early[:9]) and early[9], "woken at once by the tenth piece, the 30th character"
