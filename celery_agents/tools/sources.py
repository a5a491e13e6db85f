"""The source of each kind of tool, chosen by the tool's kind (`SOURCES`).

- `command`: the agent file's argv, the arguments as JSON on stdin (command.py).
- `script`: an agents-exe executable from a toolbox, its arguments passed as its `describe` said
  (toolbox.py).
- `python`: a `module:function`, called in a child forked by the worker process's fork server with
  the allow-listed environment, or in a child interpreter in the sandbox (python_call.py).
- `mcp`: a tool of an MCP server (mcp/calls.py).

An `external` tool has no source: nothing runs it, a completion through its token answers it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from celery_agents.model import CallMeta, CallOutcome
from celery_agents.model.agent import Limits, ToolKind
from celery_agents.tools.call import Host, ToolRun, ToolSource, confined
from celery_agents.tools.command import TOOL_ENV, outcome_of, resolve_argv, tool_environment
from celery_agents.tools.forkserver import fork_call
from celery_agents.tools.mcp.calls import McpSource
from celery_agents.tools.output import cut, split_media
from celery_agents.tools.process import ProcessResult, run_process, supervise
from celery_agents.tools.python_call import CHILD_BOOTSTRAP, child_request
from celery_agents.tools.sandbox import program_paths, python_install, python_paths
from celery_agents.tools.toolbox import script_invocation

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Invocation:
    """How a command or script tool is run: argv, what goes on stdin, the call's environment, and
    the programs the agent file declared (what an isolated run must be able to reach)."""

    argv: list[str]
    declared: list[str]
    stdin: bytes
    env: dict[str, str]


class CommandSource:
    """`command` tools: in the worker with its allow-listed environment, or in the sandbox."""

    def invocation(self, run: ToolRun) -> Invocation | CallOutcome:
        argv = resolve_argv(list(run.tool.command or []), run.agent.base_dir)
        return Invocation(argv, argv, json.dumps(run.arguments).encode(), run.variables())

    def run(self, run: ToolRun, host: Host) -> CallOutcome:
        invocation = self.invocation(run)
        if isinstance(invocation, CallOutcome):
            return invocation
        tool = run.tool
        if host.isolated:
            return self._sandboxed(run, invocation, host)
        res = run_process(
            invocation.argv,
            invocation.stdin,
            env=tool_environment(invocation.env, tool.env, host.tool_env),
            cwd=run.folder,
            timeout=run.timeout,
            output_cap=run.output_cap,
        )
        return outcome_of(res, timeout=run.timeout, empty_result=tool.empty_result, media_type=tool.output_media_type)

    def _sandboxed(self, run: ToolRun, inv: Invocation, host: Host) -> CallOutcome:
        # What the sandbox lets the run reach comes from the agent file, never from the
        # arguments the model chose.
        readable = [*python_install(), *([run.agent.base_dir] if run.agent.base_dir else [])]
        sandboxed = host.sandbox.run(
            inv.argv,
            inv.stdin,
            call_env=inv.env,
            env_names=run.tool.env,
            limits=run.limits,
            timeout=run.timeout,
            network=run.network,
            readable=readable,
            needs=program_paths(inv.declared),
        )
        outcome = outcome_of(
            sandboxed.process,
            timeout=run.timeout,
            empty_result=run.tool.empty_result,
            media_type=run.tool.output_media_type,
            limits=run.limits,
        )
        return confined(outcome, sandboxed)


class ScriptSource(CommandSource):
    """`script` tools (agents-exe executables): run as commands; arguments the script's modes
    cannot take are a failed call."""

    def invocation(self, run: ToolRun) -> Invocation | CallOutcome:
        script = resolve_argv([run.tool.script or ""], run.agent.base_dir)[0]
        modes = list(run.tool.script_args) if run.tool.script_args is not None else None
        invocation = script_invocation(script, modes, run.arguments)
        if isinstance(invocation, str):
            return CallOutcome(state="failed", attempts=0, error=invocation, meta=CallMeta(invalid_arguments=True))
        argv, stdin = invocation
        return Invocation(argv, [script], stdin, run.variables(agents_exe=True))


class PythonSource:
    """`python` tools: in a child process of their own, forked by the fork server (runSync,
    runAsync) or started in the sandbox (runIsolated)."""

    def run(self, run: ToolRun, host: Host) -> CallOutcome:
        spec, base_dir = run.tool.python or "", run.agent.base_dir
        paths = [*python_paths(), *([base_dir] if base_dir else [])]
        if not host.isolated:
            env = tool_environment(run.variables(), run.tool.env, host.tool_env)
            own = {k: v for k, v in tool_environment({}, run.tool.env, host.tool_env).items() if k not in TOOL_ENV}
            return _child_outcome(_in_a_child(run, spec, paths, env, own), run, None)
        sandboxed = host.sandbox.run(
            [sys.executable, "-I", "-B", "-c", CHILD_BOOTSTRAP],
            child_request(spec, run.arguments, paths, run.output_cap),
            call_env=run.variables(),
            env_names=run.tool.env,
            limits=run.limits,
            timeout=run.timeout,
            network=run.network,
            needs=[sys.executable, *paths],
        )
        return confined(_child_outcome(sandboxed.process, run, run.limits), sandboxed)


def _in_a_child(
    run: ToolRun, spec: str, paths: list[str], env: dict[str, str], tool_env: dict[str, str]
) -> ProcessResult:
    """A runSync/runAsync call in a child forked by this process's fork server of the tool's
    module (which has the tool's own variables `tool_env`) or its plain one, with the call's
    environment and working directory; in a fresh interpreter when no fork server can start."""
    started = time.monotonic()
    try:
        forked = fork_call(spec, paths, tool_env, run.folder, run.timeout)
    except OSError as exc:
        log.warning("python tools run in fresh interpreters: the fork server cannot start (%s)", exc)
        request = child_request(spec, run.arguments, paths, run.output_cap)
        argv = [sys.executable, "-I", "-B", "-c", CHILD_BOOTSTRAP]
        return run_process(argv, request, env=env, cwd=run.folder, timeout=run.timeout, output_cap=run.output_cap)
    request = child_request(spec, run.arguments, paths, run.output_cap, env=env, cwd=run.folder)
    return supervise(forked, request, started, timeout=run.timeout, output_cap=run.output_cap)


def _child_outcome(proc: ProcessResult, run: ToolRun, limits: Limits | None) -> CallOutcome:
    """The call's outcome from its child interpreter: how it ended, else its envelope."""
    if proc.timed_out or proc.exit_status != 0:
        return outcome_of(proc, timeout=run.timeout, limits=limits)
    try:
        envelope = json.loads(proc.stdout.decode(errors="replace"))
    except json.JSONDecodeError:
        envelope = {
            "ok": False,
            "kind": "exception",
            "retryable": False,
            "error": "the tool's answer was cut or unreadable: "
            + (proc.stderr.decode(errors="replace").strip()[-2000:] or "no error output"),
        }
    return _outcome_of_envelope(envelope, proc.duration_ms, proc.exit_status, run.output_cap)


def _outcome_of_envelope(
    envelope: dict[str, Any], duration_ms: float, exit_status: int | None, cap: int
) -> CallOutcome:
    if not envelope.get("ok"):
        retryable = bool(envelope.get("retryable"))
        return CallOutcome(
            state="failed",
            error=str(envelope.get("error") or "the tool failed"),
            duration_ms=duration_ms,
            exit_status=exit_status,
            meta=CallMeta(retryable=retryable, invalid_arguments=True)
            if envelope.get("kind") == "arguments"
            else CallMeta(retryable=retryable),
        )
    meta = CallMeta()
    result, media = split_media(envelope.get("value"))
    if envelope.get("output_capped"):
        meta = CallMeta(output_capped=envelope["output_capped"])
    else:
        result, size = cut(result, cap)
        if size is not None:
            meta = CallMeta(output_capped={"written": size, "cap": cap})
    return CallOutcome(
        state="completed", result=result, media=media, duration_ms=duration_ms, exit_status=exit_status, meta=meta
    )


#: the source of each kind of tool that runs (`ToolSpec.kind`)
SOURCES: dict[ToolKind, ToolSource] = {
    "command": CommandSource(),
    "script": ScriptSource(),
    "python": PythonSource(),
    "mcp": McpSource(),
}
