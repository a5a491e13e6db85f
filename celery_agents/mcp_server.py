"""`agents mcp-server`: celery-agents itself as an MCP server (stdio), so another assistant can
start durable sessions, read their state and pending calls, and complete continuation tokens.

Every tool is one `celery_agents.Client` operation and answers with the CLI's `--json` document:
`start_session` (the session view), `session_status` (the view; `detail` adds the transcript),
`pending` (`{"pending": [...]}`), `complete`, `approve` and `reject` (the completion document,
with its `decision`). A refused operation is a tool error whose text starts with the contract's
error code (`unknown_token: ...`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from celery_agents.client import Client
from celery_agents.errors import AgentsError, InvalidInput, WaitTimeout
from celery_agents.model import CompletionOutcome

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

T = TypeVar("T")

INSTRUCTIONS = (
    "Durable LLM agent sessions. start_session starts one from an agent file and a prompt and drives "
    "it until it completes or waits on outside work; pending lists calls waiting for a decision, each "
    "with a token; an approval gate (kind approval) is decided with approve (it runs, optionally with "
    "edited arguments, bound to the digest shown) or reject (it never runs); complete answers any "
    "deferred call with its result (or error text); session_status shows where a session is."
)


def _refusals_as_tool_errors(operation: Callable[..., T]) -> Callable[..., T]:
    """The contract's errors reach the calling model as tool errors naming their code."""

    @functools.wraps(operation)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        from mcp.server.mcpserver.exceptions import ToolError

        try:
            return operation(*args, **kwargs)
        except AgentsError as exc:
            raise ToolError(f"{exc.code}: {exc.message}") from None

    return wrapped


class SessionTools:
    """The operations behind the tools, over one client (thread-safe: each is a few Redis calls).
    Each method is a tool of the server (`TOOLS`): its name, parameters and docstring are what
    the calling model sees."""

    def __init__(self, client: Client, wait_seconds: float) -> None:
        self.client = client
        self.wait_seconds = wait_seconds

    def start_session(
        self, prompt: str, agent_file: str | None = None, agent: dict[str, Any] | None = None, run: bool = True
    ) -> dict[str, Any]:
        """Start a durable agent session from an agent file (path) or agent object and a prompt.
        With run (the default) it is driven until it completes or waits on outside work; the
        answer is the session view: state, pending calls (with tokens), response."""
        from celery_agents.model import read_agent

        if (agent_file is None) == (agent is None):
            which = "not both" if agent is not None else "one of them"
            raise InvalidInput(f"give agent_file (a path) or agent (the agent file's JSON object), {which}")
        spec: Any = agent_file
        if agent is not None:
            spec = read_agent(agent, "agent", base_dir=os.getcwd())
        elif agent_file is not None:
            spec = Path(agent_file).expanduser()
        try:
            view = self.client.start(spec, prompt, run=run, timeout=self.wait_seconds)
        except WaitTimeout as exc:
            # Still working: the assistant looks again with session_status.
            view = self.client.view(str(exc.details["session_id"]))
        return view.to_json()

    def session_status(self, session_id: str, detail: bool = False) -> dict[str, Any]:
        """The session view of a session (any unique prefix of its id); detail adds the transcript."""
        view = self.client.show(session_id, detail=detail)
        return view.to_json()

    def pending(self, session_id: str | None = None) -> dict[str, Any]:
        """Unfinished calls of one session, or of all: tool, arguments, reason, and the token of
        each deferred call; kind (approval or result), then and digest tell a gate from a plain defer."""
        return {"pending": [p.model_dump(mode="json") for p in self.client.pending(session_id)]}

    def complete(
        self, token: str, result: Any = None, error: str | None = None, by: str | None = None
    ) -> dict[str, Any]:
        """Complete a deferred call by its token: result (any JSON value) approves it with that
        result, error (text) fails it. A session driven automatically then continues by itself."""
        if error is not None and result is not None:
            raise InvalidInput("give result or error, not both")
        if error is None and result is None:
            raise InvalidInput("give the call's result (any JSON value), or error (text) to fail it")
        outcome = self.client.complete(token, error if error is not None else result, error=error is not None, by=by)
        return self._went_on(outcome)

    def approve(
        self,
        token: str,
        arguments: dict[str, Any] | None = None,
        digest: str | None = None,
        for_session: bool = False,
        by: str | None = None,
    ) -> dict[str, Any]:
        """Approve an approval gate (a pending call whose kind is approval) by its token: the call
        runs once, with arguments (a JSON object the tool takes) instead of the model's when given.
        digest: refused unless it is the pending call's (pass the one pending showed). for_session:
        later calls of the same tool in that session run without asking."""
        outcome = self.client.approve(token, arguments=arguments, digest=digest, for_session=for_session, by=by)
        return self._went_on(outcome)

    def reject(
        self, token: str, reason: str | None = None, digest: str | None = None, by: str | None = None
    ) -> dict[str, Any]:
        """Reject an approval gate by its token: the call never runs; the model is told
        `rejected: <reason>`. digest: refused unless it is the pending call's (pass the one
        pending showed)."""
        return self._went_on(self.client.reject(token, reason=reason, digest=digest, by=by))

    def _went_on(self, outcome: CompletionOutcome) -> dict[str, Any]:
        client = self.client
        if outcome.woken and client.inline and not client.live_workers():
            # No worker will take the woken session: drive it here, as the CLI's inline commands do.
            client.resume(outcome.session_id, timeout=self.wait_seconds)
        return outcome.model_dump(mode="json")


#: the server's tools, each a method of `SessionTools`
TOOLS = ("start_session", "session_status", "pending", "complete", "approve", "reject")


def _server_class() -> type[MCPServer]:
    """The SDK's server, whose refusals read as the contract's: `code: message`, without the SDK's
    `Error executing tool <name>: ` before them, and arguments that do not fit a tool's schema as
    `invalid_input` naming the fields (never the rejected values)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
    from pydantic import ValidationError

    class ContractServer(MCPServer):
        async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
            try:
                return await super().call_tool(name, arguments, context)
            except UnexpectedToolError:
                raise  # a crash: the SDK says only "Error executing tool <name>", nothing of it leaks
            except ToolError as exc:
                cause = exc.__cause__
                if isinstance(cause, ValidationError):
                    fields = sorted({".".join(str(p) for p in e["loc"]) or "arguments" for e in cause.errors()})
                    raise ToolError(f"invalid_input: these arguments do not fit {name}: {', '.join(fields)}") from cause
                if isinstance(cause, ToolError):
                    raise ToolError(str(cause)) from cause  # ours: already `code: message`
                raise

    return ContractServer


def build_server(tools: SessionTools) -> Any:
    """The MCP server with its six tools."""
    server = _server_class()("celery-agents", instructions=INSTRUCTIONS, log_level="WARNING")
    for name in TOOLS:
        server.tool()(_refusals_as_tool_errors(getattr(tools, name)))
    return server


def serve_stdio(wait_seconds: float = 120.0) -> None:
    """Serve over stdin/stdout until the client closes them."""
    import importlib.util

    if importlib.util.find_spec("mcp") is None:
        raise InvalidInput("agents mcp-server needs the MCP SDK: pip install 'celery-agents[mcp]'")
    with Client() as client:
        build_server(SessionTools(client, wait_seconds)).run("stdio")
