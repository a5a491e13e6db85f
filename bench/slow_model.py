"""A local OpenAI-compatible model server that answers every request after a fixed delay, holding
any number of connections at once (asyncio), for the benchmark's `slow_model` phase; with
`--limit N --window S`, a provider's rate limit too (the `limited` phase): beyond N requests in any
S seconds it answers 429 with `Retry-After`.

    python bench/slow_model.py [--delay 1.0] [--port 0] [--tokens N [--token-ms T]] [--limit N --window S]

Prints `{"url": "http://127.0.0.1:<port>/v1", "pid": ...}` on its first line once it listens.
Its answers follow the conversation, so a repeated request gets the same answer: a request whose
last message is a tool result, or that offers no tools, gets the final text; any other asks for one
call of the tool `lookup`. `GET /stats` reports the requests answered, the most ever in flight at
once, the requests refused with a 429, and when the first and the last answered one came (this
process's monotonic clock, seconds).
With `--tokens N` the final text is N words (`w1 w2 …`, a token each) instead of "done"; a request
with `"stream": true` is answered as Server-Sent Events, as OpenAI streams: one chunk per token,
then the finish reason and the usage (`bench/probes/stream_cost.py`); with `--token-ms T`, a chunk
every T ms, as a model making tokens at that rate, and a whole answer after N times T ms, when such a
model would have made all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from typing import Any

TOOL = "lookup"


class Stats:
    def __init__(self, limit: int = 0, window: float = 0.0) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.answered = 0
        self.limit, self.window = limit, window
        self.accepted: list[float] = []
        self.refused = 0

    def refuse(self) -> float | None:
        """Seconds to ask again after when this request is beyond the rate limit, else None (and
        the request counts against it)."""
        if not self.limit:
            return None
        now = time.monotonic()
        recent = [t for t in self.accepted[-self.limit :] if t > now - self.window]
        if len(recent) >= self.limit:
            self.refused += 1
            return max(0.05, recent[0] + self.window - now)
        self.accepted.append(now)
        return None

    def document(self) -> dict[str, Any]:
        return {
            "answered": self.answered,
            "max_in_flight": self.max_in_flight,
            "refused": self.refused,
            "first_at": self.accepted[0] if self.accepted else None,
            "last_at": self.accepted[-1] if self.accepted else None,
        }


def answer(body: dict[str, Any], tokens: int = 0) -> dict[str, Any]:
    messages = body.get("messages") or [{}]
    message: dict[str, Any]
    if messages[-1].get("role") == "tool" or not body.get("tools"):
        content = " ".join(f"w{i}" for i in range(1, tokens + 1)) if tokens else "done"
        message, finish = {"role": "assistant", "content": content}, "stop"
    else:
        call = {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function"}
        call["function"] = {"name": TOOL, "arguments": json.dumps({"q": "x"})}
        message, finish = {"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls"
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": str(body.get("model", "slow")),
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": tokens or 5, "total_tokens": 10 + (tokens or 5)},
    }


def stream_frames(whole: dict[str, Any]) -> list[bytes]:
    """An answer as the pieces of a streamed reply's body (chunked encoding): one chunk per word of
    its text (each tool call whole), the finish reason, the usage, `[DONE]`, the end."""
    message, finish = whole["choices"][0]["message"], whole["choices"][0]["finish_reason"]
    base = {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"], "model": whole["model"]}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    words = (message.get("content") or "").split(" ")
    deltas += [{"content": w if i == 0 else " " + w} for i, w in enumerate(words) if message.get("content")]
    deltas += [{"tool_calls": [{"index": i, **c}]} for i, c in enumerate(message.get("tool_calls") or [])]
    chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({**base, "choices": [], "usage": whole["usage"]})
    frames = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
    return [b"%x\r\n%s\r\n" % (len(frame), frame) for frame in frames] + [b"0\r\n\r\n"]


async def send_stream(writer: asyncio.StreamWriter, pieces: list[bytes], token_s: float) -> None:
    """A streamed reply: at once, or a piece every `token_s` seconds (a model making tokens)."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    if not token_s:
        writer.write(b"".join(pieces))
        await writer.drain()
        return
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(token_s)


async def handle(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    delay: float,
    stats: Stats,
    tokens: int = 0,
    token_s: float = 0.0,
) -> None:
    """One keep-alive connection: HTTP/1.1 requests in turn, each answered after `delay`."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
            raw = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            status, extra = "200 OK", ""
            wait = None if method == "GET" else stats.refuse()
            if method == "GET" and path.endswith("/stats"):
                payload: dict[str, Any] = stats.document()
            elif wait is not None:
                status, extra = "429 Too Many Requests", f"retry-after: {wait:.3f}\r\n"
                payload = {"error": {"message": "rate limited", "type": "rate_limit", "code": 429}}
            else:
                stats.in_flight += 1
                stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
                try:
                    await asyncio.sleep(delay)
                    body = json.loads(raw or b"{}")
                    payload = answer(body, tokens)
                finally:
                    stats.in_flight -= 1
                stats.answered += 1
                if body.get("stream"):
                    await send_stream(writer, stream_frames(payload), token_s)
                    continue
                if token_s:  # asked whole, the answer is sent once all its tokens are made
                    await asyncio.sleep(tokens * token_s)
            data = json.dumps(payload).encode()
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}".encode()
                + f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(
    delay: float, port: int, tokens: int = 0, limit: int = 0, window: float = 0.0, token_s: float = 0.0
) -> None:
    stats = Stats(limit, window)
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, delay, stats, tokens, token_s), "127.0.0.1", port, backlog=4096, limit=1 << 22
    )
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"url": f"http://127.0.0.1:{bound}/v1", "pid": os.getpid()}), flush=True)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=0, help="the final text is this many words")
    parser.add_argument("--limit", type=int, default=0, help="answer 429 beyond this many requests per window")
    parser.add_argument("--window", type=float, default=60.0, help="the rate limit's window (s)")
    parser.add_argument("--token-ms", type=float, default=0.0, help="a streamed answer: this long between chunks")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.delay, args.port, args.tokens, args.limit, args.window, args.token_ms / 1000))
    return 0


def lookup(q: str = "") -> dict[str, Any]:
    """The runSync python tool of the benchmark's slow-model agent: answers at once."""
    return {"q": q, "found": True}


if __name__ == "__main__":
    sys.exit(main())
