"""The floor of reading a streamed answer: CPU to parse and fold its events, in memory.

    python bench/probes/wire_fold.py [--tokens 500] [--rounds 200] [--json]

Builds the stream `bench/slow_model.py` sends for an answer of N tokens (one event per token, then
the finish reason and the usage: N + 2 events) and reads it as `llm/wire.py` does, with no network
and no Redis: `parse_ms`, orjson alone on every event's data; `fold_ms`, the SSE reader
(`llm/sse.py`), the fold into an `Answer` and the hand-over to a `Relay`, the body arriving in one
read (`one_read`) or in reads of 1,400 bytes, one TCP segment each (`segments`). Medians of
`--rounds` answers, ms of CPU per answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import orjson

from bench.slow_model import answer, stream_frames
from celery_agents.llm import wire
from celery_agents.llm.adapter import ensure_litellm
from celery_agents.llm.sse import data_lines
from celery_agents.llm.stream import Answer, Relay


def _body(tokens: int) -> bytes:
    whole = answer({"messages": [{"role": "user", "content": "hi"}], "stream": True}, tokens)
    # the server's frames carry HTTP's chunked encoding: each is `size\r\n data \r\n`
    return b"".join(f.split(b"\r\n", 1)[1][:-2] for f in stream_frames(whole)[:-1])


async def _fold(litellm: Any, reads: list[bytes]) -> Answer:
    got, relay, state = Answer(), Relay(8192, 0.2), wire._Fold(litellm, None)

    async def body() -> AsyncIterator[bytes]:
        for read in reads:
            yield read

    async for lines in data_lines(body()):
        for data in lines:
            state.event(data, got)
        state.hand_over(relay)
    return got


def measure(tokens: int, rounds: int) -> dict[str, Any]:
    litellm = ensure_litellm()
    body = _body(tokens)
    events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: {")]
    out: dict[str, Any] = {"tokens": tokens, "events": len(events), "bytes": len(body)}
    times = []
    for _ in range(rounds):
        started = time.process_time()
        for data in events:
            orjson.loads(data)
        times.append((time.process_time() - started) * 1000)
    out["parse_ms"] = round(statistics.median(times), 3)

    async def folds(reads: list[bytes]) -> float:
        times = []
        for _ in range(rounds):
            started = time.process_time()
            got = await _fold(litellm, reads)
            times.append((time.process_time() - started) * 1000)
        assert len(got.text) == tokens
        return statistics.median(times)

    for name, reads in (("one_read", [body]), ("segments", [body[i : i + 1400] for i in range(0, len(body), 1400)])):
        out[f"fold_ms_{name}"] = round(asyncio.run(folds(reads)), 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = measure(args.tokens, args.rounds)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
