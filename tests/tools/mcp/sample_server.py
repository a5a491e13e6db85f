"""An MCP server written with the SDK, for the tests: run as `python sample_server.py` (stdio) or
`python sample_server.py http PORT` (Streamable HTTP).

Tools: `add` (structured result), `sleep` (answers after the seconds asked), `fail` (raises),
`crash` (exits mid-call), `image` (a PNG), `whoami` (its pid and parent's, the call's `_meta`, its
variables' names, the Authorization header over HTTP). `SAMPLE_TOOLS=add,sleep` lists only those.

A hostile server, for the listing's bounds, when its environment says so: `SAMPLE_EXTRA_TOOLS=N`
adds N tools, `SAMPLE_DESCRIPTION_BYTES=N` a tool `verbose` with an N-byte description,
`SAMPLE_SCHEMA_BYTES=N` a tool `wide` with an input schema of about N bytes,
`SAMPLE_NAME_LENGTH=N` a tool with an N-character name, `SAMPLE_ENDLESS_PAGES=1` a listing whose
pages never end (one new tool each).
"""

from __future__ import annotations

import base64
import os
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ListToolsResult, PaginatedRequestParams

#: a 1x1 transparent PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


class _Sample(MCPServer):
    async def _handle_list_tools(self, ctx: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        if not os.environ.get("SAMPLE_ENDLESS_PAGES"):
            listed = await super()._handle_list_tools(ctx, params)
            only = os.environ.get("SAMPLE_TOOLS")
            if only:
                listed = listed.model_copy(update={"tools": [t for t in listed.tools if t.name in only.split(",")]})
            return listed
        page = int(params.cursor or 0) if params is not None else 0
        tool = (await self.list_tools())[0].model_copy(update={"name": f"page_{page}"})
        return ListToolsResult(tools=[tool], next_cursor=str(page + 1))


server = _Sample("sample", log_level="WARNING")


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


def _echo(text: str) -> str:
    return text


def _hostile(env: dict[str, str]) -> None:
    for i in range(int(env.get("SAMPLE_EXTRA_TOOLS") or 0)):
        server.add_tool(_echo, name=f"extra_{i}", description=f"Extra tool number {i}.")
    if env.get("SAMPLE_DESCRIPTION_BYTES"):
        server.add_tool(_echo, name="verbose", description="d" * int(env["SAMPLE_DESCRIPTION_BYTES"]))
    if env.get("SAMPLE_SCHEMA_BYTES"):
        server.add_tool(_echo, name="wide", description="A tool with a wide schema.")
        fields = {
            f"field_{i}": {"type": "string", "description": "w" * 100}
            for i in range(int(env["SAMPLE_SCHEMA_BYTES"]) // 140)
        }
        server._tool_manager.get_tool("wide").parameters = {"type": "object", "properties": fields}
    if env.get("SAMPLE_NAME_LENGTH"):
        server.add_tool(_echo, name="n" * int(env["SAMPLE_NAME_LENGTH"]), description="A long name.")


_hostile(dict(os.environ))

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", port=int(sys.argv[2]))
    else:
        server.run()
