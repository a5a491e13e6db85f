"""The one-shot MCP client a runIsolated call runs inside the sandbox: it starts the server (a
child of its own, so confined with it), makes the one call, prints `{"result": CallToolResult}` or
`{"error": ...}` on stdout and stops the server."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from celery_agents.tools.mcp.pool import McpCallError, McpPool, Target


def main(request: dict[str, Any]) -> None:
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # nothing but the answer on the real stdout
    sys.stdout = sys.stderr
    t = request["target"]
    target = Target(
        key="oneshot",
        label=str(request.get("label") or "server"),
        argv=tuple(t.get("argv") or ()),
        env=tuple(sorted((t.get("env") or {}).items())),
        cwd=t.get("cwd"),
        url=t.get("url"),
        headers=tuple(sorted((request.get("headers") or {}).items())),
    )
    calls = McpPool()
    try:
        raw = calls.call(
            target,
            request["tool"],
            request.get("arguments") or {},
            request.get("meta") or {},
            float(request["timeout"]),
        )
        answer: dict[str, Any] = {"result": raw}
    except McpCallError as exc:
        answer = {"error": exc.message, "timed_out": exc.timed_out}
    out.write(json.dumps(answer, ensure_ascii=False))
    out.flush()
    calls.close(timeout=4.0)
