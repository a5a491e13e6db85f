"""What a person sees on stderr while a command advances a session: the session id at once, then
what happens in words (step n, the model thinking, tool X running / done in 1.2 s, waiting on a
person for `book_table` with its token) — a live status line on a terminal, plain lines otherwise.
Never raw internal events: `session logs --json` is there for those.

With `stream` (stdout is a terminal, no `--json`), the model's text goes to stdout as it streams
(`text_delta` events); `printed` is then what of the last model answer was printed, so the command
prints only what is missing of the final answer (nothing, mostly), never the answer twice."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from celery_agents.cli.output import err_console, escape, event_text, printable
from celery_agents.model import DELTA_EVENTS, STEP_OWING_STATES, EventType

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
        stream: bool = False,
    ) -> None:
        self.live = sys.stderr.isatty() if live is None else live
        self.lines = lines
        self.tokens = tokens
        #: steps go to workers: until one starts the step, the status says it waits for one
        self.queued = queued
        #: the model's text goes to stdout as it streams
        self.stream = stream
        self.session_id: str | None = None
        self._status: Any = None
        self._next = "working…"
        #: the text printed of the model answer streaming now, and whether it is all there
        self._current = ""
        self._intact = True
        #: stdout is in the middle of a line of streamed text
        self._midline = False
        #: what was printed of the last model answer that ended (None: nothing, or not all of it)
        self.printed: str | None = None
        #: the stream id of the last delta seen
        self._delta_id = "0-0"

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
        if kind in DELTA_EVENTS:
            self._delta(e)
            return
        if kind == EventType.LLM_CALLED:
            self._answer_ended(kept=True)
        elif kind == EventType.MODEL_INTERRUPTED or (kind == EventType.STEP_STARTED and self._after_delta(e)):
            # A step that starts after the answer streaming now began: that answer's step died.
            self._answer_ended(kept=False)
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

    # -- the answer as it streams ----------------------------------------------------------
    def _after_delta(self, e: dict[str, Any]) -> bool:
        """`e` was written after the last delta seen (an inline step hands its deltas while it runs,
        before the events it wrote earlier are handed on)."""
        return _order(str(e.get("id", ""))) > _order(self._delta_id)

    def _delta(self, e: dict[str, Any]) -> None:
        text, offset = str(e.get("text", "")), int(e.get("offset", 0) or 0)
        if e.get("id"):
            self._delta_id = str(e["id"])
        reasoning = e.get("type") == EventType.REASONING_DELTA
        if reasoning or not self.stream:  # the status line shows the latest words
            tail = " ".join(text.split())[-60:]
            doing = "is thinking" if reasoning else "writes"
            self._update(f"the model {doing}: {tail}" if tail else self._next)
            return
        if offset < len(self._current):  # the answer starts again (its attempt failed, or its worker died)
            self._answer_ended(kept=False)
        if offset > len(self._current):  # pieces missed (written and gone before they were read)
            self._intact = False
            self._current += " " * (offset - len(self._current))
            self._write(" … ")
        self._current += text
        self._write(text)

    def _write(self, text: str) -> None:
        if self._status is not None:
            self._status.stop()
        sys.stdout.write(printable(text))
        sys.stdout.flush()
        self._midline = not text.endswith("\n")

    def _end_line(self) -> None:
        if self._midline:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self._midline = False
        if self._status is not None:
            self._status.start()

    def _answer_ended(self, *, kept: bool) -> None:
        """The answer streaming now ended: committed (`kept`), or dropped (interrupted, restarted)."""
        if not self.stream:
            return
        streamed = bool(self._current)
        self.printed = self._current if kept and self._intact else None
        self._current, self._intact = "", True
        if streamed:
            self._end_line()
            if not kept:
                self._say("(that answer was dropped: the model is asked again)")

    def rest_of(self, answer: str) -> str | None:
        """What is still to print of `answer` (the session's response) after what streamed: ""
        when all of it did, None when nothing of it streamed whole (print it as usual)."""
        if self.printed is None or not self.printed or not answer.startswith(self.printed):
            return None
        return answer[len(self.printed) :]

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
        if self._midline:  # a line of streamed text ends before a line of progress
            self._end_line()
        if self.live:
            err_console().print(f"[dim]·[/] {escape(text)}")
        else:
            sys.stderr.write(printable(text) + "\n")
            sys.stderr.flush()

    def _update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(escape(text))


def _order(event_id: str) -> tuple[int, int]:
    """A stream id as a sortable pair (an id missing or malformed sorts first)."""
    ms, _, seq = event_id.partition("-")
    return (int(ms), int(seq)) if ms.isdigit() and seq.isdigit() else (0, 0)
