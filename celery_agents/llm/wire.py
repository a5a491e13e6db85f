"""A streamed answer of an OpenAI-compatible server read off the wire: its events folded straight
into the `Answer` and the `Relay`, without litellm's per-chunk objects.

litellm reads a stream as one `ModelResponseStream` per event, built, checked and copied by its
`CustomStreamWrapper`: ~0.34 ms of CPU an event, 170 ms for a 500-token answer sent a token an
event, against ~5 ms for the whole step asked unstreamed. On its HTTP route
(`EXPERIMENTAL_OPENAI_BASE_LLM_HTTP_HANDLER`, `llm/adapter.py`) the wrapper it returns holds the
HTTP response not yet read; here its bytes are read instead (`llm/sse.py`), each event parsed with
orjson and its delta folded: text, reasoning (`reasoning_content`, or `reasoning` as some servers
name it), tool calls by index (the last id and name given, arguments joined), usage, finish reason
(mapped as litellm maps it). litellm still builds and sends the request, authenticates, and maps a
failed status before the stream starts; a failure within the stream (an error event, an aborted
generation, a transport error, a stream that ends before any finish reason) is raised as
litellm's wrapper raises it, mapped by the wrapper itself. The cost is litellm's, priced once from
the answer's usage; an answer whose server reported no usage is counted by litellm from the
joined answer, as its stream builder counts it. Each network read's pieces reach the relay
together, and past half a second a stream is read a few times per batch interval, not per token.

Everything else takes litellm's own path (`readable` says None): another provider or another
route (the OpenAI SDK's), a litellm callback registered (it expects every chunk),
`merge_reasoning_content_in_choices`, post-call rules, a maximum streaming duration.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from celery_agents.llm.sse import data_lines
from celery_agents.llm.stream import Answer, Relay
from celery_agents.scheduler.ports import DeltaKind


def readable(litellm: Any, response: Any, heard: bool) -> Any | None:
    """The HTTP response (httpx, not yet read) under litellm's stream `response` when reading it
    here gives the session what litellm's wrapper would; None when litellm must read it.
    `heard`: some litellm callback listens."""
    from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper
    from litellm.llms.openai.chat.gpt_transformation import OpenAIChatCompletionStreamingHandler

    if heard or type(response) is not CustomStreamWrapper:
        return None
    source = response.completion_stream
    if type(source) is not OpenAIChatCompletionStreamingHandler:
        return None
    http = getattr(source, "http_response", None)
    if http is None or getattr(http, "is_stream_consumed", True) or response.custom_llm_provider != "openai":
        return None
    if response.merge_reasoning_content_in_choices or response.chunks or litellm.post_call_rules:
        return None
    if os.environ.get("LITELLM_MAX_STREAMING_DURATION_SECONDS"):
        return None
    if not isinstance(getattr(response, "_cached_model_name", None), str):
        return None
    return http


class _Fold:
    """The state of one stream's reading besides the answer: what litellm's wrapper checks."""

    def __init__(self, litellm: Any, response: Any) -> None:
        from litellm.litellm_core_utils.core_helpers import map_finish_reason
        from litellm.llms.openai.common_utils import OpenAIError

        self.litellm, self.response = litellm, response
        self.map_finish_reason = map_finish_reason
        self.error = OpenAIError
        self.usage: dict[str, Any] | None = None
        #: the pieces to show that the current read brought
        self.pieces: list[tuple[DeltaKind, str]] = []
        self.finished = False

    def hand_over(self, relay: Relay) -> None:
        """What one read brought, to the relay at once."""
        if self.pieces:
            relay.add_all(self.pieces)
            self.pieces = []
        else:
            relay.seen()

    def event(self, data: bytes, answer: Answer) -> None:
        if data[:1] != b"{" and data.strip() == b"[DONE]":  # litellm's end: "stop" if no reason came
            if answer.finish_reason is None:
                answer.finish_reason = "stop"
            self.finished = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            try:  # litellm reads the text decoded with replacement characters
                event = orjson.loads(data.decode("utf-8", "replace"))
            except orjson.JSONDecodeError:
                return  # litellm skips a line that is not JSON
        if type(event) is not dict or not event:
            return
        if event.get("error"):
            raise self.failure(event["error"])
        usage = event.get("usage")
        if usage is not None:
            self.usage = usage
        for choice in event.get("choices") or ():
            finish = choice.get("finish_reason")
            if finish == "abort":
                raise self.error(status_code=500, message="Upstream generation aborted (finish_reason=abort)")
            if choice.get("index"):  # only the first choice is asked for
                continue
            if finish:
                answer.finish_reason = self.map_finish_reason(finish)
                self.finished = True
            delta = choice.get("delta")
            if delta:
                self.delta(delta, answer, event)

    def failure(self, error: object) -> Exception:
        """An error event, raised as litellm raises it."""
        if not isinstance(error, dict):
            return self.error(status_code=500, message=str(error))
        message, code = error.get("message"), error.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        text = message if isinstance(message, str) else orjson.dumps(error).decode()
        return self.error(status_code=status, message=text)

    def delta(self, delta: dict[str, Any], answer: Answer, event: dict[str, Any]) -> None:
        content = delta.get("content")
        text = content if content and type(content) is str else None
        if text is not None and len(delta) == 1:  # a piece of text, as most events are
            answer.text.append(text)
            self.pieces.append(("text", text))
            return
        reasoning = delta["reasoning"] if "reasoning" in delta else delta.get("reasoning_content")
        if reasoning and type(reasoning) is str:
            answer.reasoning.append(reasoning)
            self.pieces.append(("reasoning", reasoning))
        if text is not None:
            answer.text.append(text)
            self.pieces.append(("text", text))
        for tc in delta.get("tool_calls") or ():
            call = answer.call(int(tc.get("index") or 0))
            if tc.get("id"):
                call.id = tc["id"]
            fn = tc.get("function")
            if fn:
                if fn.get("name"):
                    call.name = fn["name"]
                arguments = fn.get("arguments")
                if arguments:  # an object is sent on as JSON, the way litellm writes it
                    call.arguments.append(arguments if type(arguments) is str else json.dumps(arguments))
        if delta.get("thinking_blocks"):  # merged by litellm from its own chunks
            answer.thinking = True
            answer.chunks.append(self.response.completion_stream.chunk_parser(event))

    def finish(self, answer: Answer) -> None:
        """The answer's model, usage and cost, as litellm's wrapper gives them at the end."""
        answer.model = self.response._cached_model_name
        built = self.built(answer)
        answer.usage = built.usage
        cost = self.response.logging_obj.response_cost_calculator(result=built)
        if isinstance(cost, (int, float)) and not isinstance(cost, bool):
            answer.cost = float(cost)

    def built(self, answer: Answer) -> Any:
        """The whole answer as a litellm `ModelResponse`: with the usage the server reported, or,
        when it reported none, litellm's stream builder's count of the joined answer."""
        litellm = self.litellm
        if self.usage is not None:
            return litellm.ModelResponse(model=answer.model, usage=litellm.Usage(**self.usage))
        whole = {
            "content": "".join(answer.text) or None,
            "reasoning_content": "".join(answer.reasoning) or None,
            "tool_calls": [
                {
                    "index": i,
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": "".join(c.arguments)},
                }
                for i, c in sorted(answer.calls.items())
            ]
            or None,
        }
        chunk = litellm.ModelResponseStream(
            model=answer.model,
            choices=[
                {
                    "index": 0,
                    "delta": {k: v for k, v in whole.items() if v is not None},
                    "finish_reason": answer.finish_reason,
                }
            ],
        )
        built = litellm.stream_chunk_builder(
            chunks=[chunk], messages=self.response.messages, count_prompt_tokens=self.response.count_prompt_tokens
        )
        return litellm.ModelResponse(model=answer.model, usage=built.usage)


#: a stream that has lasted this long (s) is read at most four times per batch interval, and at
#: least every `SLOWEST_READ` s (its end is seen that much later at most)
SLOW_AFTER, SLOWEST_READ = 0.5, 0.05


async def _unhurried(body: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """`body`'s reads, spaced once the stream has lasted `SLOW_AFTER`: a model sending a token
    every few ms costs a wake of the loop's reader per token, and its pieces are shown once per
    batch interval anyway. While the reader waits, what arrives is kept in the connection's
    buffer and read at once (a fifth less CPU for a 500-token answer at 50 tokens a second, in
    one process); a stream's end is seen at most `SLOWEST_READ` later."""
    started, pause = time.monotonic(), min(interval / 4, SLOWEST_READ)
    async for chunk in body:
        yield chunk
        if time.monotonic() - started > SLOW_AFTER:
            await asyncio.sleep(pause)


async def fold(litellm: Any, response: Any, http: Any, answer: Answer, relay: Relay) -> None:
    """Read the stream `response` (its HTTP response `http`, from `readable`) into `answer`, its
    pieces into `relay`; raise what litellm's wrapper would raise for a failed stream."""
    import httpx

    state = _Fold(litellm, response)
    try:
        try:
            async for lines in data_lines(_unhurried(http.aiter_bytes(), relay.interval)):
                for data in lines:
                    state.event(data, answer)
                state.hand_over(relay)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            if not state.finished:  # litellm keeps an answer cut off after its finish reason
                raise
        if not state.finished:
            raise response._stream_eof_error()
        state.finish(answer)
    except Exception as exc:
        await response.aclose()
        response._handle_stream_fallback_error(exc)
    finally:
        await response.aclose()
