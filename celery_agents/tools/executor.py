"""Executing one tool call of any kind, with the decorators its disposition names.

The scheduler's `ToolPort` for the runtime: `ToolRunner.run(agent, session_id, call)`. Arguments
are checked against the tool's schema first; then the call, made one `ToolRun`, goes to the source
of its tool's kind (`sources.SOURCES`), in the worker (runSync, runAsync) or in the sandbox
(`ToolRunner(isolated=True)`, runIsolated). Failures of the tool (bad arguments, non-zero exit,
exceptions, signals, timeouts) become failed outcomes whose text goes to the model; they never
raise.
"""

from __future__ import annotations

from celery_agents.model import AgentSpec, CallMeta, CallOutcome, TrackedCall, arguments_not_an_object
from celery_agents.model.agent import ToolSpec
from celery_agents.model.policy import disposition_for
from celery_agents.tools.arguments import argument_problems
from celery_agents.tools.call import ToolRun
from celery_agents.tools.decorators import apply_truncate, resolve_limits, with_retries
from celery_agents.tools.sandbox import DEFAULT_LIMITS, Sandbox, SandboxUnavailable
from celery_agents.tools.sources import SOURCES

#: the execution timeout of a call whose disposition names none
DEFAULT_TIMEOUT = 300.0


class ToolRunner:
    """Runs calls in this process (runSync, runAsync) or in the sandbox (runIsolated)."""

    def __init__(self, isolated: bool = False, sandbox: Sandbox | None = None, tool_env: tuple[str, ...] = ()) -> None:
        """`tool_env`: names of variables every command tool here gets (AGENTS_TOOL_ENV)."""
        self.isolated = isolated
        self.tool_env = tool_env
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
        source = SOURCES.get(tool.kind)
        if source is None:  # an external tool: nothing here runs it
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
            return CallOutcome(state="failed", attempts=0, error=problems, meta=CallMeta(invalid_arguments=True))
        disp = disposition_for(agent, call.tool, args).applied()  # an approved gate runs under `then`
        run = ToolRun(
            agent,
            tool,
            args,
            limits=resolve_limits(tool, disp, DEFAULT_LIMITS),
            timeout=disp.timeout_seconds or DEFAULT_TIMEOUT,
            network=_network(tool, agent),
            session_id=session_id,
            call_id=call.call_id,
            idempotency_key=call.idempotency_key(session_id),
        )

        def once() -> CallOutcome:
            self.executions += 1
            try:
                return source.run(run, self)
            except SandboxUnavailable as exc:
                return CallOutcome(state="failed", error=str(exc))
            except ValueError as exc:
                # A value the model chose that no program can receive (subprocess refuses NUL bytes
                # in argv and environment): the model is told, the session goes on.
                return CallOutcome(state="failed", error=_unstartable(exc))

        outcome = apply_truncate(with_retries(once, disp), disp.truncate)
        if self.isolated and outcome.meta.isolation is None:
            outcome.meta |= CallMeta(isolation="none")
        return outcome


def _unstartable(exc: ValueError) -> str:
    if "null byte" in str(exc):
        return "the call could not start: an argument holds a NUL byte (\\u0000), which a program cannot receive"
    return f"the call could not start: {exc}"


def _network(tool: ToolSpec, agent: AgentSpec) -> bool:
    """Whether an isolated run keeps the network: its rule's `network`, else the tool's."""
    chosen = disposition_for(agent, tool.name).applied().network
    return tool.network if chosen is None else chosen
