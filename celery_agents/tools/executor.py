"""Executing one tool call of any kind, with the decorators its disposition names.

The scheduler's `ToolPort` for the runtime: `ToolRunner.run(agent, session_id, call)`. Arguments
are checked against the tool's schema first; then the call runs in the worker (runSync, runAsync)
or in the sandbox (`ToolRunner(isolated=True)`, runIsolated). Failures of the tool (bad arguments,
non-zero exit, exceptions, signals, timeouts) become failed outcomes whose text goes to the model;
they never raise.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any

from celery_agents.model import AgentSpec, TrackedCall, arguments_not_an_object
from celery_agents.model.agent import Limits, ToolSpec
from celery_agents.scheduler.policy import disposition_for
from celery_agents.scheduler.ports import CallOutcome
from celery_agents.tools.arguments import argument_problems
from celery_agents.tools.command import call_env, outcome_of, resolve_argv
from celery_agents.tools.decorators import apply_truncate, resolve_limits, with_retries
from celery_agents.tools.output import cut, split_media
from celery_agents.tools.process import run_process
from celery_agents.tools.python_call import CHILD_BOOTSTRAP, call_in_thread, child_request
from celery_agents.tools.sandbox import (
    DEFAULT_LIMITS,
    Sandbox,
    SandboxRun,
    SandboxUnavailable,
    python_install,
    python_paths,
)
from celery_agents.tools.toolbox import script_invocation

#: the execution timeout of a call whose disposition names none
DEFAULT_TIMEOUT = 300.0
OUTPUT_CAP = DEFAULT_LIMITS.output_bytes or 1_000_000


class ToolRunner:
    """Runs calls in this process (runSync, runAsync) or in the sandbox (runIsolated)."""

    def __init__(self, isolated: bool = False, sandbox: Sandbox | None = None) -> None:
        self.isolated = isolated
        self.executions = 0
        self._sandbox = sandbox

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox()
        return self._sandbox

    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        tool = agent.tool(call.tool)
        if tool is None:
            return CallOutcome(state="failed", attempts=0, error=agent.no_tool_named(call.tool))
        if tool.external:
            return CallOutcome(
                state="failed",
                attempts=0,
                error=f"{tool.name} is an external tool: only a completion through its token answers it",
            )
        args = {} if call.arguments is None else call.arguments
        problems = (
            argument_problems(tool.name, tool.parameters, args)
            if isinstance(args, dict)
            else arguments_not_an_object(tool.name)
        )
        if problems:
            return CallOutcome(state="failed", attempts=0, error=problems, meta={"invalid_arguments": True})
        disp = disposition_for(agent, call.tool)
        limits = resolve_limits(tool, disp, DEFAULT_LIMITS)
        timeout = disp.timeout_seconds or DEFAULT_TIMEOUT

        def once() -> CallOutcome:
            self.executions += 1
            try:
                return self._once(agent, tool, args, limits, timeout, session_id, call)
            except SandboxUnavailable as exc:
                return CallOutcome(state="failed", error=str(exc))
            except ValueError as exc:
                # A value the model chose that no program can receive (subprocess refuses NUL bytes
                # in argv and environment): the model is told, the session goes on.
                return CallOutcome(state="failed", error=_unstartable(exc))

        outcome = apply_truncate(with_retries(once, disp), disp.truncate)
        if self.isolated:
            outcome.meta.setdefault("isolation", "none")
        return outcome

    def _once(
        self,
        agent: AgentSpec,
        tool: ToolSpec,
        args: dict[str, Any],
        limits: Limits,
        timeout: float,
        session_id: str,
        call: TrackedCall,
    ) -> CallOutcome:
        if tool.python:
            return self._python(agent, tool, args, limits, timeout, session_id, call)
        if tool.mcp:
            return self._mcp(agent, tool, args, limits, timeout, session_id, call)
        invocation = _invocation(agent, tool, args, session_id, call)
        if isinstance(invocation, CallOutcome):
            return invocation
        if self.isolated:
            return self._sandboxed(agent, tool, invocation, limits, timeout, call)
        res = run_process(
            invocation.argv,
            invocation.stdin,
            env={**os.environ, **invocation.env},
            cwd=_folder(agent),
            timeout=timeout,
            output_cap=limits.output_bytes or OUTPUT_CAP,
        )
        return outcome_of(res, timeout=timeout, empty_result=tool.empty_result, media_type=tool.output_media_type)

    def _mcp(
        self,
        agent: AgentSpec,
        tool: ToolSpec,
        args: dict[str, Any],
        limits: Limits,
        timeout: float,
        session_id: str,
        call: TrackedCall,
    ) -> CallOutcome:
        from celery_agents.tools.mcp.calls import call_mcp

        sandbox = self.sandbox if self.isolated else None
        network = _network(tool, agent, call.tool)
        outcome, run = call_mcp(agent, tool, args, limits, timeout, session_id, call, sandbox, network)
        return outcome if run is None else _with_sandbox(outcome, run)

    def _sandboxed(
        self, agent: AgentSpec, tool: ToolSpec, inv: Invocation, limits: Limits, timeout: float, call: TrackedCall
    ) -> CallOutcome:
        # What the sandbox lets the run reach comes from the agent file, never from the
        # arguments the model chose.
        readable = [*python_install(), *([agent.base_dir] if agent.base_dir else [])]
        run = self.sandbox.run(
            inv.argv,
            inv.stdin,
            call_env=inv.env,
            env_names=tool.env,
            limits=limits,
            timeout=timeout,
            network=_network(tool, agent, call.tool),
            readable=readable,
            needs=_program_paths(inv.declared),
        )
        outcome = outcome_of(
            run.process,
            timeout=timeout,
            empty_result=tool.empty_result,
            media_type=tool.output_media_type,
            limits=limits,
        )
        return _with_sandbox(outcome, run)

    def _python(
        self,
        agent: AgentSpec,
        tool: ToolSpec,
        args: dict[str, Any],
        limits: Limits,
        timeout: float,
        session_id: str,
        call: TrackedCall,
    ) -> CallOutcome:
        spec = tool.python or ""
        cap = limits.output_bytes or OUTPUT_CAP
        if not self.isolated:
            started = time.monotonic()
            envelope = call_in_thread(spec, args, timeout, agent.base_dir)
            duration = (time.monotonic() - started) * 1000
            if envelope is None:
                return CallOutcome(
                    state="failed",
                    duration_ms=duration,
                    meta={"timed_out": True, "retryable": True},
                    error=(
                        f"the tool did not finish within {timeout:g} s (it runs inside the worker "
                        "and goes on in the background; runIsolated would have killed it)"
                    ),
                )
            return _outcome_of_envelope(envelope, duration, None, cap)
        paths = [*python_paths(), *([agent.base_dir] if agent.base_dir else [])]
        argv = [sys.executable, "-I", "-B", "-c", CHILD_BOOTSTRAP]
        run = self.sandbox.run(
            argv,
            child_request(spec, args, paths, cap),
            call_env=call_env(session_id, call),
            env_names=tool.env,
            limits=limits,
            timeout=timeout,
            network=_network(tool, agent, call.tool),
            needs=[sys.executable, *paths],
        )
        proc = run.process
        if proc.timed_out or proc.exit_status != 0:
            outcome = outcome_of(proc, timeout=timeout, limits=limits)
        else:
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
            outcome = _outcome_of_envelope(envelope, proc.duration_ms, proc.exit_status, cap)
        return _with_sandbox(outcome, run)


def _unstartable(exc: ValueError) -> str:
    if "null byte" in str(exc):
        return "the call could not start: an argument holds a NUL byte (\\u0000), which a program cannot receive"
    return f"the call could not start: {exc}"


def _with_sandbox(outcome: CallOutcome, run: SandboxRun) -> CallOutcome:
    """How the run was confined, in the meta; a run the kernel cut for memory fails, saying so
    (whatever its main process made of a killed child)."""
    outcome.meta.update(run.meta)
    why = run.out_of_memory
    if why:
        outcome.state = "failed"
        outcome.result, outcome.media = None, []
        outcome.error = why + (f"; {outcome.error}" if outcome.error else "")
    return outcome


def _outcome_of_envelope(
    envelope: dict[str, Any], duration_ms: float, exit_status: int | None, cap: int
) -> CallOutcome:
    if not envelope.get("ok"):
        meta: dict[str, Any] = {"retryable": bool(envelope.get("retryable"))}
        if envelope.get("kind") == "arguments":
            meta["invalid_arguments"] = True
        return CallOutcome(
            state="failed",
            error=str(envelope.get("error") or "the tool failed"),
            duration_ms=duration_ms,
            exit_status=exit_status,
            meta=meta,
        )
    meta = {}
    result, media = split_media(envelope.get("value"))
    if envelope.get("output_capped"):
        meta["output_capped"] = envelope["output_capped"]
    else:
        result, size = cut(result, cap)
        if size is not None:
            meta["output_capped"] = {"written": size, "cap": cap}
    return CallOutcome(
        state="completed", result=result, media=media, duration_ms=duration_ms, exit_status=exit_status, meta=meta
    )


def _folder(agent: AgentSpec) -> str | None:
    return agent.base_dir if agent.base_dir and os.path.isdir(agent.base_dir) else None


def _network(tool: ToolSpec, agent: AgentSpec, name: str) -> bool:
    """Whether an isolated run keeps the network: its rule's `network`, else the tool's."""
    chosen = disposition_for(agent, name).network
    return tool.network if chosen is None else chosen


def _program_paths(argv: list[str]) -> list[str]:
    """What a sandboxed command cannot run without: its program and the files its declared argv
    names (the agent file's, not the model's)."""
    found = shutil.which(argv[0]) if argv else None
    return [*([found] if found else []), *(a for a in argv if os.path.isabs(a) and os.path.exists(a))]


@dataclass(frozen=True)
class Invocation:
    """How a command or script tool is run: argv, what goes on stdin, the call's environment, and
    the programs the agent file declared (what an isolated run must be able to reach)."""

    argv: list[str]
    declared: list[str]
    stdin: bytes
    env: dict[str, str]


def _invocation(
    agent: AgentSpec, tool: ToolSpec, args: dict[str, Any], session_id: str, call: TrackedCall
) -> Invocation | CallOutcome:
    """A script tool (agents-exe toolbox) or a command tool's invocation; arguments the script's
    modes cannot take are a failed call."""
    if tool.script:
        script = resolve_argv([tool.script], agent.base_dir)[0]
        modes = list(tool.script_args) if tool.script_args is not None else None
        invocation = script_invocation(script, modes, args)
        if isinstance(invocation, str):
            return CallOutcome(state="failed", attempts=0, error=invocation, meta={"invalid_arguments": True})
        argv, stdin = invocation
        return Invocation(argv, [script], stdin, call_env(session_id, call, agents_exe=True))
    argv = resolve_argv(list(tool.command or []), agent.base_dir)
    return Invocation(argv, argv, json.dumps(args).encode(), call_env(session_id, call))
