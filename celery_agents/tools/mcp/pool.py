"""Connections to MCP servers, kept alive per process and shared by every call and session in it.

The SDK is asyncio; workers are synchronous. Each process runs one private event loop in a thread
of its own (started on first use, so a prefork pool process starts its own after the fork) and
keeps one connection per server identity (`McpServer.identity`): a stdio server is started once
and reused. A server whose output ends (it exited or was killed) is started again by the next
call; a call that runs past its timeout is cut off and its server retired (stopped once no other
call uses it), so a hung server never holds later calls. `close()` stops every server (worker
shutdown, interpreter exit).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import importlib.util
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from celery_agents.tools.cancel import cancelled

log = logging.getLogger(__name__)

T = TypeVar("T")

#: extra seconds the calling thread waits beyond a call's own timeout before giving up on the loop
_BACKSTOP = 10.0
#: how often a waiting call looks whether its session was cancelled
_POLL = 0.25
#: how much of a server's error output a failed call reports
_STDERR_TAIL = 2000
#: a connection idle this long is pinged before it is used (a server may have died meanwhile)
_IDLE_PING = 0.5
_PING_TIMEOUT = 5.0


class McpCallError(Exception):
    """A call that got no result: the server could not start, exited, timed out or refused."""

    def __init__(self, message: str, *, timed_out: bool = False, retryable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.timed_out = timed_out
        self.retryable = retryable


@dataclass(frozen=True)
class Target:
    """A server as this process reaches it: a command line, or a URL with its headers' values."""

    key: str
    label: str
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str | None = None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(eq=False)
class _Connection:
    target: Target
    loop: asyncio.AbstractEventLoop
    ready: asyncio.Future[Any] = field(init=False)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    in_flight: int = 0
    retired: bool = False
    #: loop time of its last answer
    last_used: float = 0.0
    errors: _ErrorTail | None = None

    def __post_init__(self) -> None:
        self.ready = self.loop.create_future()
        # A connection that never came up may have nobody left waiting for it: no warning then.
        self.ready.add_done_callback(lambda f: f.cancelled() or f.exception())

    def stderr_tail(self) -> str:
        return self.errors.text() if self.errors is not None else ""

    async def run(self) -> None:
        """Hold the connection open until stopped or the server's output ends."""
        from mcp import Client, Implementation

        try:
            client_info = Implementation(name="celery-agents", version="1")
            async with Client(self._transport(), cache=None, client_info=client_info) as client:
                if self.errors is not None:
                    self.errors.started()
                self.ready.set_result(client)
                waiters = [asyncio.ensure_future(self.stop.wait()), asyncio.ensure_future(self.closed.wait())]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
        except BaseException as exc:
            if not self.ready.done():
                # Callers waiting for it get an error they can report, even when it was stopped.
                failure = exc if isinstance(exc, Exception) else ConnectionAbortedError("stopped before it was ready")
                self.ready.set_exception(failure)
            elif not isinstance(exc, asyncio.CancelledError | Exception):
                raise
            else:
                log.debug("MCP server %s: connection ended: %r", self.target.label, exc)
        finally:
            self.closed.set()
            if self.errors is not None:
                self.errors.close()

    def _transport(self) -> Any:
        if self.target.url is not None:
            return _http_transport(self.target)
        self.errors = _ErrorTail(self.loop)
        return _watched(_stdio_transport(self.target, self.errors.writer), self.closed)


class _ErrorTail:
    """The end of a stdio server's error output, kept in memory for the message of a failed call
    (a server that writes a lot fills neither a disk nor the worker's log)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._read_fd, write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        #: the server's stderr; this process's copy is closed once the server has started
        self.writer: IO[bytes] | None = os.fdopen(write_fd, "wb", buffering=0)
        self._tail = bytearray()
        self._open = True
        loop.add_reader(self._read_fd, self._readable)

    def _readable(self) -> None:
        if self._drain():
            self.close()

    def _drain(self) -> bool:
        """Read what the pipe holds; True once the server's end is closed."""
        while True:
            try:
                chunk = os.read(self._read_fd, 65536)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not chunk:
                return True
            self._tail += chunk
            del self._tail[:-_STDERR_TAIL]

    def started(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def text(self) -> str:
        if self._open:
            self._drain()
        return self._tail.decode(errors="replace").strip()

    def close(self) -> None:
        if not self._open:
            return
        self._open = False
        self.started()
        self._drain()
        self._loop.remove_reader(self._read_fd)
        os.close(self._read_fd)


def _stdio_transport(target: Target, errlog: IO[bytes] | None) -> Any:
    from mcp.client.stdio import StdioServerParameters, stdio_client

    params = StdioServerParameters(
        command=target.argv[0], args=list(target.argv[1:]), env=dict(target.env), cwd=target.cwd
    )
    return stdio_client(params, errlog=errlog)  # type: ignore[arg-type]  # any binary file with a fileno


@contextlib.asynccontextmanager
async def _http_transport(target: Target) -> AsyncIterator[Any]:
    import httpx2
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers=dict(target.headers)) as http:
        assert isinstance(http, httpx2.AsyncClient)
        async with streamable_http_client(target.url or "", http_client=http) as streams:
            yield streams


@contextlib.asynccontextmanager
async def _watched(transport: Any, closed: asyncio.Event) -> AsyncIterator[Any]:
    """The transport's streams, with `closed` set as soon as the server's output ends: a server
    that died between calls is then started again instead of being written to."""
    import anyio

    async with transport as (read, write):
        send, receive = anyio.create_memory_object_stream[Any](0)

        async def relay() -> None:
            try:
                async with send:
                    async for item in read:
                        await send.send(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
            finally:
                closed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(relay)
            try:
                yield receive, write
            finally:
                tg.cancel_scope.cancel()


class McpPool:
    """This process's MCP connections and the event loop thread that holds them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid: int | None = None
        self._conns: dict[str, _Connection] = {}

    def forget(self) -> None:
        """In a forked child: the parent's loop thread and servers are not ours (nothing to stop)."""
        self._lock = threading.Lock()
        self._loop, self._pid, self._conns = None, None, {}

    # -- the loop ------------------------------------------------------------------------------
    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                # After a fork the parent's loop thread does not exist here: start afresh.
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="mcp-loop", daemon=True).start()
                self._loop, self._pid, self._conns = loop, os.getpid(), {}
            return self._loop

    def _wait(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop; a cancelled session stops waiting (and the call) at once."""
        if importlib.util.find_spec("mcp") is None:
            coro.close()
            raise McpCallError("MCP servers need the MCP SDK here: pip install 'celery-agents[mcp]'")
        future = asyncio.run_coroutine_threadsafe(coro, self._running_loop())
        give_up = time.monotonic() + timeout + _BACKSTOP
        while not future.done():
            concurrent.futures.wait([future], timeout=_POLL)
            if future.done():
                break
            if cancelled():
                future.cancel()
                raise McpCallError("the call was cancelled with its session")
            if time.monotonic() > give_up:
                future.cancel()
                raise McpCallError(f"no answer within {timeout:g} s", timed_out=True, retryable=True)
        try:
            return future.result()
        except McpCallError:
            raise
        except concurrent.futures.CancelledError:
            raise McpCallError("the call was stopped with its MCP server", retryable=True) from None
        except Exception as exc:  # a fault of ours or of the SDK: still only this call fails
            raise McpCallError(f"the MCP call failed: {exc!r}") from None

    # -- what callers use -----------------------------------------------------------------------
    def list_tools(self, target: Target, timeout: float, most: int) -> list[dict[str, Any]]:
        """The tools the server offers, as the server describes it (JSON). Paging stops once more
        than `most` are listed (the caller refuses such a server) or at a page that adds none."""
        return self._wait(self._guarded(target, timeout, _list_all, (most,)), timeout)

    def call(
        self, target: Target, tool: str, arguments: dict[str, Any], meta: dict[str, Any], timeout: float
    ) -> dict[str, Any]:
        """The server's `CallToolResult` as JSON; `McpCallError` when there is none."""
        return self._wait(self._guarded(target, timeout, _call_tool, (tool, arguments, meta)), timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stop every server this process started."""
        with self._lock:
            loop, mine = self._loop, self._pid == os.getpid()
        if loop is None or not mine or not loop.is_running():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close_all(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
        with self._lock:
            self._loop = None

    # -- on the loop ---------------------------------------------------------------------------
    async def _connection(self, target: Target, timeout: float) -> _Connection:
        """This process's open connection to `target`, started (and waited for) when there is none."""
        conn = self._conns.get(target.key)
        if conn is not None and (conn.closed.is_set() or conn.retired or not await self._answers(conn)):
            self._retire(conn)
            conn = None
        if conn is None:
            conn = _Connection(target, asyncio.get_running_loop())
            self._conns[target.key] = conn
            conn.task = asyncio.ensure_future(conn.run())
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), timeout)
        except TimeoutError:
            self._retire(conn)
            raise McpCallError(
                f"the MCP server {target.label} did not start within {timeout:g} s", timed_out=True, retryable=True
            ) from None
        except Exception as exc:
            self._retire(conn)
            raise McpCallError(_cannot_start(target, exc, conn.stderr_tail()), retryable=True) from None
        return conn

    async def _answers(self, conn: _Connection) -> bool:
        """Whether a connection that has been idle still reaches a live server. A server killed
        between calls may not have been noticed yet; a call sent to it would fail, a ping costs a
        round trip."""
        loop = asyncio.get_running_loop()
        if not conn.ready.done() or loop.time() - conn.last_used < _IDLE_PING:
            return True
        if conn.ready.cancelled() or conn.ready.exception() is not None:
            return False
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        try:
            # Any answer proves the server alive, an error too (servers of the 2026-07-28 protocol
            # no longer know ping).
            await asyncio.wait_for(conn.ready.result().session.send_ping(), _PING_TIMEOUT)
        except MCPError as exc:
            if exc.error.code == CONNECTION_CLOSED:
                return False
        except Exception:
            return False
        conn.last_used = loop.time()
        return True

    def _retire(self, conn: _Connection) -> None:
        """No new call uses `conn`; it is stopped once its calls in flight are done."""
        conn.retired = True
        if self._conns.get(conn.target.key) is conn:
            del self._conns[conn.target.key]
        if not conn.ready.done() and conn.task is not None:
            conn.task.cancel()
        elif conn.in_flight == 0:
            conn.stop.set()

    async def _guarded(self, target: Target, timeout: float, action: Any, args: tuple[Any, ...]) -> Any:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._connection(target, timeout)
        conn.in_flight += 1
        try:
            answer = await asyncio.wait_for(action(conn.ready.result(), *args), max(0.01, deadline - loop.time()))
            conn.last_used = loop.time()
            return answer
        except TimeoutError:
            self._retire(conn)
            raise McpCallError(
                f"the MCP server {target.label} did not answer within {timeout:g} s; the call was cut off "
                "and the server stopped (the next call starts it again)",
                timed_out=True,
                retryable=True,
            ) from None
        except MCPError as exc:
            if exc.error.code == CONNECTION_CLOSED or conn.closed.is_set():
                self._retire(conn)
                tail = conn.stderr_tail()
                what = "closed the connection" if target.url is not None else "exited"
                raise McpCallError(
                    f"the MCP server {target.label} {what} during the call"
                    + (f"; its last error output: {tail}" if tail else "")
                ) from None
            raise McpCallError(f"the MCP server {target.label} refused the call: {exc.error.message}") from None
        except Exception as exc:
            # Whatever else went wrong (a broken answer, a transport fault) fails this call only;
            # the connection may be in any state, so the next call gets a fresh one.
            self._retire(conn)
            raise McpCallError(f"the call to the MCP server {target.label} failed: {exc!r}") from None
        finally:
            conn.in_flight -= 1
            if conn.retired and conn.in_flight == 0:
                conn.stop.set()

    async def _close_all(self) -> None:
        conns = list(self._conns.values())
        self._conns = {}
        for conn in conns:
            self._retire(conn)
            conn.stop.set()
        tasks = [c.task for c in conns if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=8.0)


async def _list_all(client: Any, most: int) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools += [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in page.tools]
        cursor = page.next_cursor
        if not cursor or not page.tools or len(tools) > most:
            return tools


async def _call_tool(client: Any, tool: str, arguments: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments, meta=meta)
    dumped: dict[str, Any] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return dumped


def _cannot_start(target: Target, exc: BaseException, tail: str) -> str:
    why = str(exc) or type(exc).__name__
    if isinstance(exc, BaseExceptionGroup):
        why = "; ".join(str(e) or type(e).__name__ for e in exc.exceptions)
    return f"cannot reach the MCP server {target.label}: {why}" + (f"; its error output: {tail}" if tail else "")


_pool = McpPool()
atexit.register(_pool.close)
# A fork may happen while another thread holds the pool's lock: the child starts with a free one.
os.register_at_fork(after_in_child=_pool.forget)


def pool() -> McpPool:
    """The pool of this process."""
    return _pool
