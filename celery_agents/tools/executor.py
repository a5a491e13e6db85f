"""Executing one tool call of any kind, with the decorators its disposition names.

The scheduler's `ToolPort` for the runtime: `ToolRunner.run(agent, session_id, call)`. Failures of
the tool (bad arguments, non-zero exit, exceptions, timeouts) become failed outcomes whose text
goes to the model; they never raise.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from typing import Any

from celery_agents.model import AgentSpec, Disposition, ToolSpec, TrackedCall
from celery_agents.scheduler.policy import disposition_for
from celery_agents.scheduler.ports import CallOutcome
from celery_agents.tools.command import resolve_argv, run_process

DEFAULT_TIMEOUT = 300.0
OUTPUT_CAP = 1_000_000


def parse_output(text: str) -> Any:
    """Tool output: a JSON value when it parses as one, else the stripped text."""
    stripped = text.strip()
    if stripped[:1] in "{[\"" or stripped in ("true", "false", "null") or _is_number(stripped):
        try:
            return json.loads(stripped)
        except json.JSONDecodeError:
            pass
    return stripped


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def call_env(session_id: str, call: TrackedCall) -> dict[str, str]:
    return {
        "AGENTS_SESSION_ID": session_id,
        "AGENTS_CALL_ID": call.call_id,
        "AGENTS_IDEMPOTENCY_KEY": call.idempotency_key(session_id),
    }


def _truncate(value: Any, limit: int | None) -> tuple[Any, bool]:
    if limit is None:
        return value, False
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    data = text.encode()
    if len(data) <= limit:
        return value, False
    cut = data[:limit].decode(errors="ignore")
    return f"{cut}\n[truncated: the result was {len(data)} bytes, cut to {limit}]", True


class ToolRunner:
    """Runs calls in this process (runSync, runAsync) or in the sandbox (runIsolated)."""

    def __init__(self, isolated: bool = False) -> None:
        self.isolated = isolated
        self.executions = 0

    def run(self, agent: AgentSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        tool = agent.tool(call.tool)
        if tool is None:
            return CallOutcome(state="failed", error=f"there is no tool named {call.tool!r}", attempts=0)
        disp = disposition_for(agent, call.tool)
        attempts_allowed = 1 + (disp.retries or 0)
        outcome = CallOutcome(state="failed", error="not run", attempts=0)
        for attempt in range(1, attempts_allowed + 1):
            self.executions += 1
            outcome = self._once(agent, tool, disp, session_id, call)
            outcome.attempts = attempt
            if outcome.state == "completed" or not outcome.meta.get("retryable"):
                break
            time.sleep(min(30.0, 0.2 * (2 ** (attempt - 1))))
        if outcome.state == "completed":
            outcome.result, cut = _truncate(outcome.result, disp.truncate)
            if cut:
                outcome.meta["truncated"] = True
        return outcome

    def _once(self, agent: AgentSpec, tool: ToolSpec, disp: Disposition, session_id: str,
              call: TrackedCall) -> CallOutcome:
        timeout = disp.timeout_seconds or DEFAULT_TIMEOUT
        if tool.command:
            return self._command(agent, tool, timeout, session_id, call)
        if tool.python:
            return self._python(tool, session_id, call)
        return CallOutcome(state="failed", attempts=0,
                           error=f"{tool.name} is an external tool: only a completion through its token answers it")

    def _command(self, agent: AgentSpec, tool: ToolSpec, timeout: float, session_id: str,
                 call: TrackedCall) -> CallOutcome:
        argv = resolve_argv(list(tool.command or []), agent.base_dir)
        env = dict(os.environ)
        env.update(call_env(session_id, call))
        res = run_process(argv, json.dumps(call.arguments if call.arguments is not None else {}).encode(),
                          env=env, cwd=agent.base_dir if agent.base_dir and os.path.isdir(agent.base_dir) else None,
                          timeout=timeout, output_cap=OUTPUT_CAP)
        meta: dict[str, Any] = {}
        if res.timed_out:
            return CallOutcome(state="failed", error=f"the tool did not finish within {timeout:g} s and was killed",
                               duration_ms=res.duration_ms, exit_status=res.exit_status,
                               meta={"timed_out": True, "retryable": True})
        if res.exit_status != 0:
            err = res.stderr.decode(errors="replace").strip() or f"the tool exited with status {res.exit_status}"
            return CallOutcome(state="failed", error=err, duration_ms=res.duration_ms, exit_status=res.exit_status,
                               meta={"retryable": res.exit_status == 75})
        if res.stdout_truncated:
            meta["output_capped"] = True
        return CallOutcome(state="completed", result=parse_output(res.stdout.decode(errors="replace")),
                           duration_ms=res.duration_ms, exit_status=0, meta=meta)

    def _python(self, tool: ToolSpec, session_id: str, call: TrackedCall) -> CallOutcome:
        started = time.monotonic()
        module_name, _, func_name = (tool.python or "").partition(":")
        try:
            func = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            return CallOutcome(state="failed", error=f"cannot load {tool.python}: {exc}", attempts=0)
        args = call.arguments if isinstance(call.arguments, dict) else {}
        try:
            value = func(**args)
        except TypeError as exc:
            return CallOutcome(state="failed", error=f"bad arguments for {tool.name}: {exc}",
                               duration_ms=(time.monotonic() - started) * 1000)
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return CallOutcome(state="failed", error=tb, duration_ms=(time.monotonic() - started) * 1000,
                               meta={"retryable": bool(getattr(exc, "retryable", False))})
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        return CallOutcome(state="completed", result=value, duration_ms=(time.monotonic() - started) * 1000)
