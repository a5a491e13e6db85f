"""Reading a Server-Sent-Events body: the `data` of each line, as bytes, with a bound on a line.

A streamed model answer arrives as `data: {json}` lines (one per event, as OpenAI-compatible
servers send them). Lines end at CRLF, LF or CR, as the SSE specification says (a bare CR too; a
CRLF split across two network reads is one line end). Each `data:` line is given as it comes, the
one space after the colon dropped, exactly as litellm reads such a stream line by line; so is a
line that is bare JSON (`{…}`, which litellm also parses); blank lines, comments and other fields
(`event:`, `id:`, `retry:`) are skipped. A line, and so an event, may be at most `MAX_LINE`
bytes: a server that sends more without a line end is an error (`EventTooLarge`), not memory
without bound.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

#: the longest line (one event's data) read: 1 MiB
MAX_LINE = 1 << 20


class EventTooLarge(ValueError):
    """A line of the event stream is longer than the reader's bound."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the model's event stream sent a line longer than {limit:,} bytes")
        self.limit = limit


def _field(line: bytes) -> bytes | None:
    if line.startswith(b"data:"):
        value = line[5:]
        return value[1:] if value.startswith(b" ") else value
    if line.startswith(b"{"):
        return line
    return None


async def data_lines(body: AsyncIterable[bytes], limit: int = MAX_LINE) -> AsyncIterator[list[bytes]]:
    """The data of the event lines of `body` (an HTTP response's bytes), in order: a list per read
    of `body`, of the lines that read completed (empty when it completed none)."""
    pending = b""
    async for chunk in body:
        if not chunk:
            continue
        data = pending + chunk if pending else chunk
        held = b""
        if b"\r" in data:
            if data.endswith(b"\r"):  # perhaps the first half of a CRLF: decided with the next read
                data, held = data[:-1], b"\r"
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = data.split(b"\n")
        pending = rest + held
        if len(pending) > limit:
            raise EventTooLarge(limit)
        values = []
        for line in lines:
            if not line:  # the blank line that ends each event
                continue
            if len(line) > limit:
                raise EventTooLarge(limit)
            value = _field(line)
            if value is not None:
                values.append(value)
        yield values
    value = _field(pending.rstrip(b"\r"))
    if value is not None:
        yield [value]
