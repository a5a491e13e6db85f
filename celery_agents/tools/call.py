"""One execution of a tool call, as every kind of tool receives it.

`ToolRunner` (executor.py) checks a call, takes its limits, timeout and network from the verified
spec, and hands one frozen `ToolRun` to the `ToolSource` of the tool's kind (sources.py,
mcp/calls.py) together with the `Host` the call runs on: this process, or the sandbox.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from celery_agents.model import AgentSpec, CallOutcome
from celery_agents.model.agent import Limits, ToolSpec
from celery_agents.tools.sandbox import DEFAULT_LIMITS, Sandbox, SandboxRun

#: what is kept of a run's output when its limits name no `outputBytes`
OUTPUT_CAP = DEFAULT_LIMITS.output_bytes or 1_000_000


@dataclass(frozen=True)
class ToolRun:
    """A call of the verified spec's `tool` with the model's `arguments`, under the limits,
    timeout and network its disposition gives it."""

    agent: AgentSpec
    tool: ToolSpec
    arguments: dict[str, Any]
    limits: Limits
    #: seconds the run may take
    timeout: float
    #: whether a sandboxed run keeps the network: its rule's `network`, else the tool's
    network: bool
    session_id: str
    call_id: str
    #: the same for every delivery of the call: what a tool recognises a repeat by
    idempotency_key: str

    @property
    def output_cap(self) -> int:
        return self.limits.output_bytes or OUTPUT_CAP

    @property
    def folder(self) -> str | None:
        """The agent file's folder, where a command runs in the worker, when it exists here."""
        base = self.agent.base_dir
        return base if base and os.path.isdir(base) else None

    def variables(self, agents_exe: bool = False) -> dict[str, str]:
        """The call's environment variables; agents-exe executables also get the names they know."""
        env = {
            "AGENTS_SESSION_ID": self.session_id,
            "AGENTS_CALL_ID": self.call_id,
            "AGENTS_IDEMPOTENCY_KEY": self.idempotency_key,
        }
        if agents_exe:
            env["AGENT_SESSION_ID"] = self.session_id
            env["AGENT_CONVERSATION_ID"] = self.session_id
        return env


class Host(Protocol):
    """Where runs happen: in this process (runSync, runAsync), or in `sandbox` (runIsolated)."""

    @property
    def isolated(self) -> bool: ...

    @property
    def tool_env(self) -> tuple[str, ...]:
        """Names of variables every command tool here gets (AGENTS_TOOL_ENV)."""
        ...

    @property
    def sandbox(self) -> Sandbox: ...


class ToolSource(Protocol):
    """Runs the tools of one kind. Failures of the tool are failed outcomes, never exceptions
    (but `SandboxUnavailable`, and `ValueError` for a value no program can receive)."""

    def run(self, run: ToolRun, host: Host) -> CallOutcome: ...


def confined(outcome: CallOutcome, run: SandboxRun) -> CallOutcome:
    """How the run was confined, in the meta; a run the kernel cut for memory fails, saying so
    (whatever its main process made of a killed child)."""
    outcome.meta |= run.meta
    why = run.out_of_memory
    if why:
        outcome.state = "failed"
        outcome.result, outcome.media = None, []
        outcome.error = why + (f"; {outcome.error}" if outcome.error else "")
    return outcome
