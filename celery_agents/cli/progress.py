"""What a person sees on stderr while a command advances a session: the session id at once, then
what happens in words (step n, the model thinking, tool X running / done in 1.2 s, waiting on a
person for `book_table` with its token) — a live status line on a terminal, plain lines otherwise.
Never raw internal events: `session logs --json` is there for those."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from celery_agents.cli.output import err_console, escape, event_text, printable
from celery_agents.model import STEP_OWING_STATES, EventType

#: For a session id, its deferred calls' tokens by call id (looked up when a token is created).
TokenLookup = Callable[[str], dict[str, str]]

# Events that change nothing a person follows: steps that found nothing to do, duplicates skipped.
_QUIET = {
    EventType.STEP_COMMITTED,
    EventType.STEP_NOOP,
    EventType.STEP_SKIPPED,
    EventType.STEP_STARTED,
    EventType.SESSION_STARTED,
}


class Progress:
    """A hook for `Client` (`on_created`, `on_event`); a context manager around the wait.

    `live`: a spinner with a status line (terminal), lines printed above it; otherwise one plain
    line per event that matters. `lines=False` keeps only the live status (under `--json`)."""

    def __init__(
        self,
        *,
        live: bool | None = None,
        lines: bool = True,
        tokens: TokenLookup | None = None,
        queued: bool = False,
    ) -> None:
        self.live = sys.stderr.isatty() if live is None else live
        self.lines = lines
        self.tokens = tokens
        #: steps go to workers: until one starts the step, the status says it waits for one
        self.queued = queued
        self.session_id: str | None = None
        self._status: Any = None
        self._next = "working…"

    # -- the context -------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        if self.live:
            self._status = err_console().status(self._next, spinner="dots")
            self._status.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
            self._status = None

    # -- hooks -------------------------------------------------------------------------------
    def created(self, session_id: str) -> None:
        """A new session exists: say its id before anything else happens (Ctrl-C needs it)."""
        self.session_id = session_id
        self._say(f"session {session_id}")
        self._next = "step 1: the model is thinking…"
        self._update(self._waiting(1))

    def __call__(self, e: dict[str, Any]) -> None:
        kind, version = e.get("type", ""), e.get("version", 0)
        status = self._next
        if kind == EventType.STEP_COMMITTED:
            # What the next step will do, from the state this one left.
            state = str(e.get("state"))
            self._next = {
                "ready": f"step {version}: the model is thinking…",
                "tools": f"step {version}: running the tools the model asked for…",
            }.get(state, "waiting for the calls still running…")
            status = self._waiting(version) if state in STEP_OWING_STATES else self._next
        text = event_text(e)
        if text is None or kind in _QUIET:
            self._update(status)
            return
        if kind == EventType.TOKEN_CREATED:
            text += self._token_hint(str(e.get("call_id", "")))
        self._say(text)
        if kind == EventType.TOOL_DISPATCHED:
            self._update(f"waiting for {printable(str(e.get('tool', '')))}…")
        elif kind == EventType.TOKEN_CREATED:
            self._update(text)
        else:
            self._update(self._next)

    def _waiting(self, step: int) -> str:
        """Status while a step is due: on workers, until one takes it, that is what we wait for."""
        return f"step {step}: waiting for a worker…" if self.queued else self._next

    # -- printing ----------------------------------------------------------------------------
    def _token_hint(self, call_id: str) -> str:
        if self.tokens is None or self.session_id is None:
            return ""
        try:
            token = self.tokens(self.session_id).get(call_id)
        except Exception:  # a hint only: never let it break the wait
            return ""
        return f" (token {token})" if token else ""

    def _say(self, text: str) -> None:
        if not self.lines:
            return
        if self.live:
            err_console().print(f"[dim]·[/] {escape(text)}")
        else:
            sys.stderr.write(printable(text) + "\n")
            sys.stderr.flush()

    def _update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(escape(text))
