"""A streamed answer read off the wire (`llm/wire.py`) gives the session what litellm's own reading
of the same stream gave it: the turn (text, reasoning, tool calls, usage, cost, model, finish
reason), the pieces streamed, and a failure's code, retry class and message. Each case asks the
local server the same stream twice, once read by litellm (wire.py's reading switched off) and
once off the wire, and checks which of the two read it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_agents.llm import LitellmPort, RetryPolicy, wire
from celery_agents.llm.adapter import HTTP_ROUTE_VARIABLE, ensure_litellm
from celery_agents.llm.sse import MAX_LINE
from celery_agents.scheduler import LlmFailure, LlmRequest
from celery_agents.tools.resolve import parse_agent
from tests.llm.test_streaming import Recorder
from tests.support.llm_server import LlmServer, Reply, text


def sse(*events: dict[str, Any] | str, done: bool = True, end: str = "\n\n") -> list[bytes]:
    """Frames of an event stream: each event a `data:` line (a dict as JSON, a str as it is)."""
    frames = [f"data: {e if isinstance(e, str) else json.dumps(e)}{end}".encode() for e in events]
    return frames + ([f"data: [DONE]{end}".encode()] if done else [])


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **top: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
        **top,
    }


def usage(p: int, c: int, **more: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, **more}}  # fmt: skip


def call(i: int, args: str, name: str | None = None, cid: str | None = None) -> dict[str, Any]:
    tc: dict[str, Any] = {"index": i, "function": {"arguments": args}}
    if name:
        tc.update(id=cid, type="function")
        tc["function"]["name"] = name
    return chunk({"tool_calls": [tc]})


class Reads:
    """Which reading takes each stream: wire.py's (`fold`, counted) or litellm's (`litellm_only`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wire = 0
        self.off = False
        readable, fold = wire.readable, wire.fold

        def maybe(*args: Any) -> Any:
            return None if self.off else readable(*args)

        async def counted(*args: Any) -> None:
            self.wire += 1
            await fold(*args)

        monkeypatch.setattr(wire, "readable", maybe)
        monkeypatch.setattr(wire, "fold", counted)

    def litellm_only(self) -> None:
        self.off, self.wire = True, 0

    def both(self) -> None:
        self.off, self.wire = False, 0


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reads]:
    ensure_litellm()
    monkeypatch.setenv(HTTP_ROUTE_VARIABLE, "true")
    yield Reads(monkeypatch)


def seen(server: LlmServer, reply: Reply, model: str | None = None, **agent: Any) -> dict[str, Any]:
    """What a session keeps of one streamed call: its turn or its failure, and the pieces."""
    name = model or server.scenario([reply])
    if model:
        server.script(model, [reply])
    spec = parse_agent({"slug": "t", "model": f"openai/{name}", "apiBase": server.url, **agent})
    live = Recorder()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=tools, live=live)
    out: dict[str, Any] = {}
    try:
        turn = LitellmPort(RetryPolicy(attempts=1, timeout=10)).complete(req)
        out["turn"] = turn.model_dump(exclude={"at", "duration_ms"})
        out["turn"]["model"] = turn.model.replace(name, "<scenario>")
    except LlmFailure as exc:
        # (what streamed before a failure depends on when the step's thread woke: not compared)
        out["failure"] = (exc.code, exc.transient, exc.retry_after, exc.message.replace(name, "<scenario>"))
        return out
    out["pieces"] = (live.joined("reasoning"), live.joined("text"))
    return out


def both_readings(server: LlmServer, reads: Reads, make: Callable[[], Reply], **kw: Any) -> dict[str, Any]:
    """The same stream read by litellm, then off the wire: equal, and each read as said."""
    reads.litellm_only()
    theirs = seen(server, make(), **kw)
    assert reads.wire == 0
    reads.both()
    ours = seen(server, make(), **kw)
    assert reads.wire == 1, "read off the wire"
    assert ours == theirs
    return ours


STREAMS: dict[str, Callable[[], Reply]] = {
    "text a token an event, with usage": lambda: text(
        "It is sunny in Paris today, 21 °C, and tomorrow too.", usage=(40, 12), chunk_chars=1
    ),
    "reasoning, text and two tool calls, arguments split": lambda: Reply(
        content="Let me look that up.",
        reasoning="The user wants the weather; I call the tool.",
        tool_calls=[("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_weather", {"city": "Lyon"}, "c-9")],
        usage=(120, 30),
        reasoning_tokens=12,
        chunk_chars=3,
    ),
    "reasoning with no reasoning tokens reported": lambda: text("Sunny.", reasoning="Let me think.", usage=(20, 9)),
    "tool calls interleaved, names and ids repeated": lambda: Reply(
        frames=sse(
            chunk({"role": "assistant", "content": None}),
            call(0, "", "get_weather", "a"),
            call(1, '{"ci', "get_weather", "b"),
            call(0, '{"city": '),
            call(1, 'ty": "Lyon"}'),
            call(0, '"Paris"}', "get_weather", "a"),
            chunk(finish="tool_calls"),
            usage(50, 20, prompt_tokens_details={"cached_tokens": 32}),
        )
    ),
    "`reasoning` as some servers name it, CRLF line ends, comments and other fields": lambda: Reply(
        frames=[
            b": keep-alive\r\n\r\n",
            b"event: message\r\nid: 1\r\n",
            *sse(
                chunk({"reasoning": "Hmm."}),
                chunk({"content": "Yes."}),
                chunk(finish="stop"),
                usage(5, 3),
                end="\r\n\r\n",
            ),
        ]
    ),
    "a finish reason litellm maps, a line that is not JSON, multibyte text split across writes": lambda: Reply(
        frames=[
            *sse(chunk({"content": "Ça va"}), done=False),
            b"data: not json\n\n",
            b'data: {"choices": [{"index": 0, "delta": {"content": "\xc3',
            b'\xa9t\xc3\xa9"}}]}\n\n',
            *sse(chunk(finish="eos"), usage(7, 4)),
        ]
    ),
    "a tool call's arguments sent as an object, an id never sent": lambda: Reply(
        frames=sse(
            chunk({"tool_calls": [{"index": 0, "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
            chunk(finish="tool_calls"),
            usage(9, 9),
        )
    ),
    "provider thinking blocks, merged by litellm": lambda: Reply(
        frames=sse(
            chunk({"thinking_blocks": [{"type": "thinking", "thinking": "Hm, ", "signature": ""}]}),
            chunk({"thinking_blocks": [{"type": "thinking", "thinking": "rain.", "signature": "sig"}]}),
            chunk({"content": "Take an umbrella."}, finish="stop"),
            usage(12, 6),
        )
    ),
    "no usage reported: litellm counts it": lambda: Reply(
        frames=sse(chunk({"content": "Counted by litellm, not by the server."}), chunk(finish="length"))
    ),
    "[DONE] with no finish reason before it": lambda: Reply(frames=sse(chunk({"content": "Whole."}))),
    "the same piece a hundred times": lambda: Reply(
        frames=sse(*[chunk({"content": "again "})] * 100, chunk(finish="stop"))
    ),
    "cut off after its finish reason, before its usage": lambda: Reply(
        frames=sse(chunk({"content": "All here."}), chunk(finish="stop"), done=False)
    ),
}


@pytest.mark.parametrize("case", list(STREAMS))
def test_the_answer_read_off_the_wire_is_the_answer_litellm_reads(
    llm_server: LlmServer, reads: Reads, case: str
) -> None:
    out = both_readings(llm_server, reads, STREAMS[case])
    assert out.get("turn"), out


def test_a_priced_model_costs_the_same_read_off_the_wire(reads: Reads) -> None:
    # a server of its own: the model's name is the scenario's, which other tests count requests of
    server = LlmServer().start()
    try:
        out = both_readings(server, reads, lambda: text("hello there friend", usage=(40, 12)), model="gpt-4o-mini")
    finally:
        server.stop()
    assert out["turn"]["usage"]["cost"] > 0


FAILURES: dict[str, Callable[[], Reply]] = {
    "an error event mid-stream": lambda: Reply(
        frames=sse(chunk({"content": "Half"}), {"error": {"message": "overloaded", "code": 503}})
    ),
    "an error event with a 4xx code": lambda: Reply(frames=sse({"error": {"message": "bad request", "code": 400}})),
    "a generation the server aborted": lambda: Reply(frames=sse(chunk({"content": "Half"}), chunk(finish="abort"))),
    "a stream that ends before any finish reason": lambda: Reply(frames=sse(chunk({"content": "Half"}), done=False)),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_stream_that_fails_fails_alike_off_the_wire(llm_server: LlmServer, reads: Reads, case: str) -> None:
    out = both_readings(llm_server, reads, FAILURES[case])
    assert out.get("failure"), out


def test_an_event_longer_than_the_bound_is_an_error_not_memory(llm_server: LlmServer, reads: Reads) -> None:
    huge = b"data: " + b'{"x": "' + b"a" * MAX_LINE + b'"}\n\n'
    out = seen(llm_server, Reply(frames=[*sse(chunk({"content": "Hi"}), done=False), huge]))
    assert reads.wire == 1
    code, transient, _, message = out["failure"]
    assert (code, transient) == ("server_error", True), "a transient failure, as a broken stream is"
    assert f"longer than {MAX_LINE:,} bytes" in message


def _fallback_with(reads: Reads, llm_server: LlmServer, **agent: Any) -> dict[str, Any]:
    ours = seen(llm_server, text("Read by litellm.", reasoning="Thinking.", usage=(9, 4)), **agent)
    assert reads.wire == 0, "litellm read it"
    return ours


def test_a_registered_litellm_callback_hears_every_chunk(
    llm_server: LlmServer, reads: Reads, monkeypatch: pytest.MonkeyPatch
) -> None:
    from litellm.integrations.custom_logger import CustomLogger

    litellm = ensure_litellm()
    heard: list[Any] = []

    class Listener(CustomLogger):  # type: ignore[misc]
        async def async_log_stream_event(self, kwargs: Any, response_obj: Any, start_time: Any, end_time: Any) -> None:
            heard.append(response_obj)

    # litellm copies a callback into its other lists at a call: every list is put back after
    for name in dir(litellm):
        if name.endswith(("_callback", "callbacks")) and "known" not in name and type(getattr(litellm, name)) is list:
            monkeypatch.setattr(litellm, name, [])
    litellm.callbacks = [Listener()]
    out = _fallback_with(reads, llm_server)
    assert out["turn"]["text"] == "Read by litellm."


def test_merged_reasoning_and_the_sdk_route_are_read_by_litellm(
    llm_server: LlmServer, reads: Reads, monkeypatch: pytest.MonkeyPatch
) -> None:
    merged = _fallback_with(reads, llm_server, modelParams={"merge_reasoning_content_in_choices": True})
    assert merged["turn"]["text"] == "<think>Thinking.</think>Read by litellm."
    monkeypatch.setenv(HTTP_ROUTE_VARIABLE, "false")
    assert _fallback_with(reads, llm_server)["turn"]["text"] == "Read by litellm."


def test_a_long_stream_read_less_often_still_shows_its_text_batch_by_batch(
    llm_server: LlmServer, reads: Reads, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `SLOW_AFTER` the reader waits a quarter of a batch interval between reads: the pieces
    still come in batches while the model answers, and the call ends soon after the stream."""
    import time

    monkeypatch.setattr(wire, "SLOW_AFTER", 0.0)
    answer = "".join(f"w{i:02d} " for i in range(60))
    spec = parse_agent({"slug": "t", "model": f"openai/{llm_server.scenario([])}", "apiBase": llm_server.url})
    name = spec.model.removeprefix("openai/")
    llm_server.script(name, [text(answer, chunk_chars=4, chunk_delay=0.02)])
    live = Recorder(interval=0.1)
    req = LlmRequest(agent=spec, messages=[{"role": "user", "content": "hi"}], tools=[], live=live)
    turn = LitellmPort(RetryPolicy(attempts=1, timeout=10)).complete(req)
    returned = time.monotonic()
    assert reads.wire == 1
    assert turn.text == answer == live.joined("text")
    assert len(live.writes) >= 5, "60 pieces over 1.2 s, in batches of 0.1 s"
    # a quarter interval (25 ms) after it came, with room for a loaded machine
    assert returned - llm_server.sent[name] < 0.5, "the end seen soon after it came"
