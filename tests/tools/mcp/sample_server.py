"""An MCP server written with the SDK, for the tests: run as `python sample_server.py` (stdio) or
`python sample_server.py http PORT` (Streamable HTTP).

Tools: `add` (structured result), `sleep` (answers after the seconds asked), `fail` (raises),
`crash` (exits mid-call), `image` (a PNG), `whoami` (its pid and parent's, the call's `_meta`, its
variables' names, the Authorization header over HTTP).
"""

from __future__ import annotations

import base64
import os
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

#: a 1x1 transparent PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)

server = MCPServer("sample", log_level="WARNING")


def _log(tool: str) -> None:
    """One line per call in $CALL_LOG, when the server may write it (not inside a sandbox)."""
    path = os.environ.get("CALL_LOG")
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(f"{tool} {os.getpid()}\n")
        except OSError:
            pass


@server.tool()
def add(a: int, b: int) -> int:
    """Adds two whole numbers."""
    _log("add")
    return a + b


@server.tool()
def sleep(seconds: float) -> str:
    """Sleeps for the given seconds, then says so."""
    _log("sleep")
    time.sleep(seconds)
    return f"slept {seconds:g} s"


@server.tool()
def fail(why: str) -> str:
    """Always fails, with the reason given."""
    _log("fail")
    raise ToolError(f"failed on purpose: {why}")


@server.tool()
def crash() -> str:
    """Exits the server in the middle of the call, saying why on stderr."""
    _log("crash")
    sys.stderr.write("crashing on purpose\n")
    sys.stderr.flush()
    os._exit(7)


@server.tool()
def image() -> Image:
    """A tiny PNG image."""
    _log("image")
    return Image(data=PNG, format="png")


@server.tool()
def whoami(ctx: Context) -> dict[str, Any]:
    """This server's process id, the request's _meta and its environment's names."""
    _log("whoami")
    meta = dict(ctx.request_context.meta or {})
    headers = dict(ctx.headers or {})
    return {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "meta": meta,
        "env": sorted(os.environ),
        "marker": os.environ.get("MARKER"),
        "authorization": headers.get("authorization"),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
