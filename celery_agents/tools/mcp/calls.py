"""One call of an MCP tool: from this process's connection to its server (runSync, runAsync), or
through a one-shot client started in the sandbox together with a stdio server (runIsolated).

The call's `_meta` carries `celery-agents/idempotencyKey` (stable across redeliveries of the same
call), `celery-agents/sessionId` and `celery-agents/callId`, so a server can recognise a repeat.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from celery_agents.model import CallMeta, CallOutcome
from celery_agents.model.agent import Limits
from celery_agents.tools.call import Host, ToolRun, confined
from celery_agents.tools.mcp.pool import McpCallError, Target, pool
from celery_agents.tools.mcp.results import outcome_of_result
from celery_agents.tools.mcp.servers import target_for
from celery_agents.tools.process import ProcessResult
from celery_agents.tools.sandbox import Sandbox, SandboxRun, program_paths, python_install, python_paths

#: what the one-shot client runs in the sandbox (`python -I -B -c ONESHOT_BOOTSTRAP`, request on stdin)
ONESHOT_BOOTSTRAP = (
    "import sys, json; request = json.loads(sys.stdin.buffer.read()); sys.path[:0] = request['path']; "
    "from celery_agents.tools.mcp.oneshot import main; main(request)"
)
#: seconds the sandbox allows past the call's timeout, for the one-shot client to stop its server
_TEARDOWN = 5.0


def call_meta(run: ToolRun) -> dict[str, Any]:
    return {
        "celery-agents/idempotencyKey": run.idempotency_key,
        "celery-agents/sessionId": run.session_id,
        "celery-agents/callId": run.call_id,
    }


def failed(exc: McpCallError, duration_ms: float | None = None) -> CallOutcome:
    meta = CallMeta(retryable=exc.retryable, timed_out=True) if exc.timed_out else CallMeta(retryable=exc.retryable)
    return CallOutcome(state="failed", error=exc.message, duration_ms=duration_ms, meta=meta)


class McpSource:
    """`mcp` tools: from this process's connection to the server, or through a one-shot client
    started in the sandbox together with a stdio server."""

    def run(self, run: ToolRun, host: Host) -> CallOutcome:
        outcome, sandboxed = call_mcp(run, host.sandbox if host.isolated else None)
        return outcome if sandboxed is None else confined(outcome, sandboxed)


def call_mcp(run: ToolRun, sandbox: Sandbox | None) -> tuple[CallOutcome, SandboxRun | None]:
    """The call's outcome, and how the sandbox ran it (None when it ran in this process)."""
    ref, tool = run.tool.mcp, run.tool
    server = run.agent.mcp_server(ref.server) if ref is not None else None
    if ref is None or server is None:
        return CallOutcome(state="failed", error=f"{tool.name}: its MCP server is not in the agent"), None
    cap = run.limits.output_bytes or 1_000_000
    started = time.monotonic()
    try:
        target = target_for(server, run.agent.base_dir)
        if sandbox is not None:
            return _isolated(sandbox, target, ref.tool, run)
        raw = pool().call(target, ref.tool, run.arguments, call_meta(run), run.timeout)
    except McpCallError as exc:
        return failed(exc, (time.monotonic() - started) * 1000), None
    return outcome_of_result(raw, cap, (time.monotonic() - started) * 1000), None


def _isolated(sandbox: Sandbox, target: Target, tool: str, run: ToolRun) -> tuple[CallOutcome, SandboxRun]:
    """Start the server and a one-shot client inside the sandbox, for this call only."""
    paths = python_paths()
    request = {
        "path": paths,
        # The server works in the run's own directory, as a sandboxed command does.
        "target": {"argv": list(target.argv), "env": dict(target.env), "cwd": None, "url": target.url},
        "headers": dict(target.headers),
        "label": target.label,
        "tool": tool,
        "arguments": run.arguments,
        "meta": call_meta(run),
        "timeout": run.timeout,
    }
    sandboxed = sandbox.run(
        [sys.executable, "-I", "-B", "-c", ONESHOT_BOOTSTRAP],
        json.dumps(request).encode(),
        call_env={},
        env_names=run.tool.env,
        limits=run.limits,
        timeout=run.timeout + _TEARDOWN,
        network=run.network,
        readable=[*python_install(), *([target.cwd] if target.cwd else [])],
        needs=[sys.executable, *paths, *program_paths(list(target.argv))],
    )
    return _answered(sandboxed.process, target, run.network, run.limits, run.timeout), sandboxed


def _answered(proc: ProcessResult, target: Target, network: bool, limits: Limits, timeout: float) -> CallOutcome:
    """The one-shot client's answer on stdout (a result or an error), else why there is none."""
    try:
        answer = json.loads(proc.stdout.decode(errors="replace"))
    except json.JSONDecodeError:
        answer = None
    if isinstance(answer, dict) and "error" in answer:
        text = str(answer["error"])
        if target.url is not None and not network:
            text += ' (a runIsolated call has no network unless its rule or server entry says "network": true)'
        return failed(McpCallError(text, timed_out=bool(answer.get("timed_out"))), proc.duration_ms)
    if isinstance(answer, dict) and isinstance(answer.get("result"), dict):
        return outcome_of_result(answer["result"], limits.output_bytes or 1_000_000, proc.duration_ms)
    from celery_agents.tools.command import outcome_of

    outcome = outcome_of(proc, timeout=timeout, limits=limits)
    if outcome.state != "completed":
        return outcome
    tail = proc.stderr.decode(errors="replace").strip()[-2000:]
    return CallOutcome(
        state="failed",
        error="the sandboxed MCP client gave no answer" + (f": {tail}" if tail else ""),
        duration_ms=proc.duration_ms,
    )
