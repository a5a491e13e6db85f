"""The driver protocol and what both drivers share: the publisher of steps, the tool runners of
this process, and replaying a session's events to a caller's hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from celery_agents.config import Settings
from celery_agents.model import Lane, TrackedCall
from celery_agents.model.admission import DEFAULT_PRIORITY
from celery_agents.store import Finished, Store

if TYPE_CHECKING:
    from celery_agents.scheduler.ports import LlmPort, ToolPort
    from celery_agents.tasks.config import Dispatcher

EventHook = Callable[[dict[str, Any]], None]


class StepDriver(Protocol):
    """How steps run. The `Client` has checked and prepared the session; the driver advances it."""

    def step(
        self,
        session_id: str,
        version: int,
        *,
        after: str,
        wait: bool,
        timeout: float | None,
        on_event: EventHook | None,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        """Run exactly one step of `session_id` at `version`; events after `after` go to `on_event`."""

    def drive(
        self,
        session_id: str,
        version: int,
        *,
        after: str,
        publish: bool,
        wait: bool,
        timeout: float | None,
        on_event: EventHook | None,
        priority: int = DEFAULT_PRIORITY,
    ) -> None:
        """Advance a session in auto drive until it completes, fails, or only external work remains
        (`publish`: its next step is owed and nothing has asked for it yet)."""

    def wake(self, session_id: str, version: int, priority: int = DEFAULT_PRIORITY) -> None:
        """A call's outcome (a completion, an expiry, a finished call) says the session must go on."""

    def calls_ran(self, session_id: str, finished: list[Finished]) -> None:
        """This process ran some of the session's dispatched calls (`run-isolated`)."""

    def dispatched(self, session_id: str, call: TrackedCall) -> None:
        """A call became dispatched outside a step (a delegation a person approved): run it."""

    def catch_up(self) -> None:
        """Apply what only workers apply otherwise (the completions stream, when no worker runs)."""

    def interrupted(self, session_id: str) -> bool:
        """The command driving `session_id` was interrupted: True when the session was paused."""


class Publisher:
    """Publishes steps to the workers' queue; the Celery app is built on first use (a command that
    publishes nothing never imports Celery)."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._dispatcher: Dispatcher | None = None

    @property
    def dispatcher(self) -> Dispatcher:
        if self._dispatcher is None:
            from celery_agents.tasks.config import Dispatcher, make_app

            self._dispatcher = Dispatcher(make_app(self._settings, main="celery_agents_client"))
        return self._dispatcher

    def step(self, session_id: str, version: int, request: str, priority: int = DEFAULT_PRIORITY) -> None:
        self.dispatcher.step(session_id, version, request, priority=priority)


class LocalRunners:
    """The model and tool ports of this process, made on first use (litellm is imported only when a
    step runs here): `tools` for runSync/runAsync calls, `isolated` for runIsolated ones."""

    def __init__(
        self, llm: LlmPort | None = None, tools: ToolPort | None = None, tool_env: tuple[str, ...] = ()
    ) -> None:
        self._llm, self._tools = llm, tools
        self._tool_env = tool_env
        self._isolated: ToolPort | None = None

    @property
    def llm(self) -> LlmPort:
        if self._llm is None:
            from celery_agents.llm import LitellmPort

            self._llm = LitellmPort()
        return self._llm

    @property
    def tools(self) -> ToolPort:
        if self._tools is None:
            from celery_agents.tools import ToolRunner

            self._tools = ToolRunner(tool_env=self._tool_env)
        return self._tools

    @property
    def isolated(self) -> ToolPort:
        if self._isolated is None:
            from celery_agents.tools import ToolRunner

            self._isolated = ToolRunner(isolated=True)
        return self._isolated

    def for_lane(self, lane: Lane) -> ToolPort:
        return self.isolated if lane == "runIsolated" else self.tools


def lane_of(disposition: str) -> Lane:
    """The lane a dispatched call's record asks for (the tools lane for an approved delegation);
    `run_call` refuses it there unless the signed spec's policy agrees."""
    return "runIsolated" if disposition == "runIsolated" else "runAsync"


def replay(store: Store, session_id: str, after: str, on_event: EventHook | None) -> str:
    """Hand the session's events after `after` to `on_event`; the id of the last one handed."""
    if on_event is None:
        return after
    for e in store.read_events(session_id, after):
        on_event(e)
        after = e["id"]
    return after
