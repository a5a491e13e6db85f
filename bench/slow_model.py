"""A local OpenAI-compatible model server that answers every request after a fixed delay, holding
any number of connections at once (asyncio), for the benchmark's `slow_model` phase.

    python bench/slow_model.py [--delay 1.0] [--port 0]

Prints `{"url": "http://127.0.0.1:<port>/v1", "pid": ...}` on its first line once it listens.
Its answers follow the conversation, so a repeated request gets the same answer: a request whose
last message is a tool result, or that offers no tools, gets the final text; any other asks for one
call of the tool `lookup`. `GET /stats` reports the requests answered and the most ever in flight at once.
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
    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.answered = 0


def answer(body: dict[str, Any]) -> dict[str, Any]:
    messages = body.get("messages") or [{}]
    message: dict[str, Any]
    if messages[-1].get("role") == "tool" or not body.get("tools"):
        message, finish = {"role": "assistant", "content": "done"}, "stop"
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
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float, stats: Stats) -> None:
    """One keep-alive connection: HTTP/1.1 requests in turn, each answered after `delay`."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
            raw = await reader.readexactly(int(headers.get("content-length", "0") or 0))
            if method == "GET" and path.endswith("/stats"):
                payload: dict[str, Any] = {"answered": stats.answered, "max_in_flight": stats.max_in_flight}
            else:
                stats.in_flight += 1
                stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
                try:
                    await asyncio.sleep(delay)
                    payload = answer(json.loads(raw or b"{}"))
                finally:
                    stats.in_flight -= 1
                stats.answered += 1
            data = json.dumps(payload).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(data)}\r\n\r\n".encode()
                + data
            )
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(delay: float, port: int) -> None:
    stats = Stats()
    server = await asyncio.start_server(
        lambda r, w: handle(r, w, delay, stats), "127.0.0.1", port, backlog=4096, limit=1 << 22
    )
    bound = server.sockets[0].getsockname()[1]
    print(json.dumps({"url": f"http://127.0.0.1:{bound}/v1", "pid": os.getpid()}), flush=True)
    async with server:
        await server.serve_forever()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.delay, args.port))
    return 0


def lookup(q: str = "") -> dict[str, Any]:
    """The runSync python tool of the benchmark's slow-model agent: answers at once."""
    return {"q": q, "found": True}


if __name__ == "__main__":
    sys.exit(main())
