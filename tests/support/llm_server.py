"""A small OpenAI-compatible chat-completions server, scripted per scenario.

litellm reaches it through `apiBase` exactly as it reaches a real provider. The request's model
name picks the scenario (`"model": "openai/<scenario>"`), so one server in the test process serves
many tests and worker processes at once. Every request is recorded. A request with `"stream":
true` is answered as Server-Sent Events, as OpenAI streams: the reasoning, the text and each tool
call's arguments in pieces of `chunk_chars`, `chunk_delay` seconds apart, then the finish reason
and (with `stream_options.include_usage`) the usage; `streams` counts the streamed answers that
were cut off by their caller.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted answer: a message, or an HTTP error; optionally after a delay."""

    content: str | None = None
    tool_calls: list[tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], str]] = field(default_factory=list)
    reasoning: str | None = None
    usage: tuple[int, int] = (10, 5)
    reasoning_tokens: int = 0
    status: int = 200
    error_body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    raw_arguments: dict[int, str] = field(default_factory=dict)
    #: streamed: characters per piece, and the pause between pieces (s)
    chunk_chars: int = 4
    chunk_delay: float = 0.0
    #: streamed: these exact bytes, each one write of the body (no `[DONE]` added), instead of
    #: the chunks of the answer above
    frames: list[bytes] | None = None

    def body(self, model: str, turn: int) -> dict[str, Any]:
        calls = []
        for i, tc in enumerate(self.tool_calls):
            name, args = tc[0], tc[1]
            call_id = tc[2] if len(tc) > 2 else f"call_{turn}_{i}"  # type: ignore[misc]
            arguments = self.raw_arguments.get(i, json.dumps(args))
            calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if calls:
            message["tool_calls"] = calls
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        p, c = self.usage
        usage: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if self.reasoning_tokens:
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": usage,
        }

    def chunks(self, model: str, turn: int, usage: bool) -> list[dict[str, Any]]:
        """The answer as the chunks of a stream (`chat.completion.chunk` objects), in order."""
        whole = self.body(model, turn)
        message, base = whole["choices"][0]["message"], {k: whole[k] for k in ("id", "created", "model")}
        n = max(1, self.chunk_chars)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return {**base, "object": "chat.completion.chunk", "choices": [choice]}

        out = [chunk({"role": "assistant", "content": ""})]
        for key in ("reasoning_content", "content"):
            value = message.get(key) or ""
            out += [chunk({key: value[i : i + n]}) for i in range(0, len(value), n)]
        for i, call in enumerate(message.get("tool_calls") or []):
            head = {"index": i, "id": call["id"], "type": "function"}
            out.append(
                chunk({"tool_calls": [{**head, "function": {"name": call["function"]["name"], "arguments": ""}}]})
            )
            args = call["function"]["arguments"]
            out += [
                chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + n]}}]})
                for j in range(0, len(args), n)
            ]
        out.append(chunk({}, whole["choices"][0]["finish_reason"]))
        if usage:
            out.append({**base, "object": "chat.completion.chunk", "choices": [], "usage": whole["usage"]})
        return out


def text(content: str, **kw: Any) -> Reply:
    return Reply(content=content, **kw)


def calls(*tool_calls: tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], str], **kw: Any) -> Reply:
    return Reply(tool_calls=list(tool_calls), **kw)


def error(status: int, message: str = "scripted error", **kw: Any) -> Reply:
    return Reply(status=status, error_body={"error": {"message": message, "type": "scripted", "code": status}}, **kw)


class HeldModel:
    """A scenario's reply that holds every model call until `released` is set, counting the calls
    it holds; answers "done" at once afterwards."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.holding = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        with self.lock:
            self.holding += 1
        self.released.wait(120)
        with self.lock:
            self.holding -= 1
        return text("done")


class _Server(ThreadingHTTPServer):
    # Hundreds of workers' threads connect at once: the default backlog of 5 would drop their SYNs
    # and hold them back for seconds of retransmission.
    request_queue_size = 1024


class LlmServer:
    """The server and its scripts. `script(name, [Reply, ...])` queues answers for one scenario;
    a scenario with no answer left repeats its last one, or echoes when it never had any."""

    def __init__(self) -> None:
        self._scripts: dict[str, deque[Reply | Callable[[dict[str, Any]], Reply]]] = defaultdict(deque)
        self._last: dict[str, Reply | Callable[[dict[str, Any]], Reply]] = {}
        self.requests: dict[str, list[dict[str, Any]]] = defaultdict(list)
        #: per scenario: streamed answers whose caller went away before their end
        self.cut: dict[str, int] = defaultdict(int)
        #: per scenario: when (monotonic) its last streamed answer was sent whole
        self.sent: dict[str, float] = {}
        self._lock = threading.Lock()
        self._httpd = _Server(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> LlmServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def scenario(self, replies: list[Reply | Callable[[dict[str, Any]], Reply]] | None = None) -> str:
        """A fresh scenario name with its scripted replies."""
        name = f"scn-{uuid.uuid4().hex[:10]}"
        self.script(name, replies or [])
        return name

    def script(self, name: str, replies: list[Reply | Callable[[dict[str, Any]], Reply]]) -> None:
        with self._lock:
            self._scripts[name].extend(replies)

    def count(self, name: str) -> int:
        with self._lock:
            return len(self.requests[name])

    def _next(self, name: str, body: dict[str, Any]) -> Reply:
        with self._lock:
            self.requests[name].append(body)
            queue = self._scripts[name]
            item = queue.popleft() if queue else self._last.get(name)
            if item is not None:
                self._last[name] = item
        if item is None:
            last = body["messages"][-1]
            return text(f"echo: {last.get('content')}")
        return item(body) if callable(item) else item

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                body["_authorization"] = self.headers.get("authorization")
                body["_x_api_key"] = self.headers.get("x-api-key")  # how Anthropic clients send keys
                body["_organization"] = self.headers.get("openai-organization")
                name = str(body.get("model", ""))
                turn = sum(1 for m in body.get("messages", []) if m.get("role") == "assistant")
                reply = server._next(name, body)
                if reply.delay:
                    time.sleep(reply.delay)
                if body.get("stream") and reply.status == 200:
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    frames = reply.frames
                    if frames is None:
                        chunks = reply.chunks(name, turn, usage)
                        frames = [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]
                    if not self._stream(frames, reply.chunk_delay):
                        with server._lock:
                            server.cut[name] += 1
                    else:
                        server.sent[name] = time.monotonic()
                    return
                payload = reply.error_body if reply.status != 200 else reply.body(name, turn)
                data = json.dumps(payload).encode()
                self.send_response(reply.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in reply.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the caller went away
                    self.wfile.write(data)

            def _stream(self, frames: list[bytes], pause: float) -> bool:
                """Send `frames` of Server-Sent Events (chunked encoding); False if the caller left."""
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for i, frame in enumerate(frames):
                        if i and pause:
                            time.sleep(pause)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(frame), frame))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                    return False
                return True

        return Handler


class RateLimitedModel:
    """A scenario's reply that enforces a provider's rate limit: at most `limit` requests in any
    `window` seconds (a sliding window), a 429 with `Retry-After` (the seconds until the oldest
    request of the window leaves it) beyond. An accepted request waits `delay` s, then gets
    `answer(body)` (default "done"). Records when each request was accepted, how many were
    refused, and the most in flight at once."""

    def __init__(
        self,
        limit: int,
        window: float,
        answer: Callable[[dict[str, Any]], Reply] | None = None,
        delay: float = 0.0,
    ) -> None:
        self.limit, self.window, self.delay = limit, window, delay
        self.answer = answer or (lambda body: text("done"))
        self.lock = threading.Lock()
        self.accepted: list[float] = []
        self.refused = 0
        self.refused_at: list[float] = []
        self.in_flight = 0
        self.most_in_flight = 0

    def __call__(self, body: dict[str, Any]) -> Reply:
        now = time.monotonic()
        with self.lock:
            recent = [t for t in self.accepted if t > now - self.window]
            if len(recent) >= self.limit:
                self.refused += 1
                self.refused_at.append(now)
                wait = max(0.05, recent[0] + self.window - now)
                return error(429, "rate limited", headers={"retry-after": f"{wait:.3f}"})
            self.accepted.append(now)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.delay:
                time.sleep(self.delay)
            return self.answer(body)
        finally:
            with self.lock:
                self.in_flight -= 1


class ClosedModel:
    """A scenario's reply that answers its first request with a 429 and `Retry-After: seconds`,
    and every request until those seconds have passed with the same; "done" after. Records when
    each request came, and which were refused."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.lock = threading.Lock()
        self.closed_until: float | None = None
        self.requests: list[tuple[float, bool]] = []

    def __call__(self, body: dict[str, Any]) -> Reply:
        now = time.monotonic()
        with self.lock:
            if self.closed_until is None:
                self.closed_until = now + self.seconds
            refused = now < self.closed_until
            self.requests.append((now, refused))
        if refused:
            return error(429, "slow down", headers={"retry-after": f"{self.closed_until - now:.3f}"})
        return text("done")

    @property
    def refused(self) -> int:
        with self.lock:
            return sum(1 for _, r in self.requests if r)
