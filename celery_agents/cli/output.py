"""What the CLI prints: one JSON document on stdout with `--json`, readable text on stderr otherwise
(and a command's main result, such as `run`'s answer, on stdout)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from celery_agents.model import CompletionOutcome, PendingCall, SessionView

if TYPE_CHECKING:
    from rich.console import Console

_consoles: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    """`err` and `out`, rich consoles made on first use: `--json` commands never import rich."""
    if name not in ("err", "out"):
        raise AttributeError(name)
    if name not in _consoles:
        from rich.console import Console

        _consoles[name] = Console(stderr=name == "err", highlight=False, soft_wrap=True)
    return _consoles[name]


def _console(console: Console | None) -> Console:
    return console if console is not None else __getattr__("err")


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


_STATE_STYLE = {
    "completed": "green",
    "failed": "red",
    "cancelled": "red",
    "waiting": "yellow",
    "running": "cyan",
    "queued": "cyan",
    "ready": "blue",
    "tools": "blue",
}


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _short(value: Any, limit: int = 160) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def state_text(state: str) -> str:
    return f"[{_STATE_STYLE.get(state, 'white')}]{state}[/]"


def render_pending(pending: list[PendingCall], console: Console | None = None) -> None:
    console = _console(console)
    if not pending:
        console.print("no pending calls")
        return
    for p in pending:
        line = f"• {escape(p.tool)}({escape(_short(p.arguments, 100))}) [dim]{p.disposition}, {p.state}[/]"
        if p.reason:
            line += f" [dim]— {escape(p.reason)}[/]"
        console.print(line)
        console.print(f"  session {p.session_id}  call {escape(p.call_id)}")
        if p.token:
            console.print(f"  token   [bold]{p.token}[/]  (expires {_when(p.expires_at)})")
            console.print(f"  complete it: agents session complete {p.token} RESULT_FILE")


def render_view(view: SessionView, console: Console | None = None, answer: bool = True) -> None:
    console = _console(console)
    console.print(
        f"session [bold]{view.session_id}[/] ({escape(view.agent)})  state {state_text(view.state.value)}"
        f"  head {view.head or '-'}  version {view.version}  steps {view.steps}  drive {view.drive}"
    )
    if view.pending:
        render_pending(view.pending, console)
    if view.error:
        console.print(f"[red]error ({view.error.code}):[/] {escape(view.error.message)}")
        console.print(f"  fix the cause, then: agents session resume {view.session_id}")
    if answer and view.response is not None and view.state.value == "completed":
        console.print(f"[green]answer:[/] {escape(view.response)}")
    elif view.state.value in ("ready", "tools") and view.drive == "manual":
        console.print(f"  next: agents session step {view.session_id}   (or resume to run it through)")


def render_turns(view: SessionView, console: Console | None = None, thinking: bool = True) -> None:
    console = _console(console)
    calls = {(c["batch"], c["call_id"]): c for c in (view.calls or [])}
    for i, turn in enumerate(view.turns or []):
        if turn["kind"] == "UserTurn":
            q = turn.get("query")
            if q:
                console.print(f"[bold blue]user:[/] {escape(q.get('text', ''))}")
                for m in q.get("media", []):
                    console.print(f"  [dim]attached {m.get('filename') or m['mime_type']}[/]")
            for r in turn.get("tool_responses", []):
                style = "red" if r.get("is_error") else "magenta"
                console.print(
                    f"[{style}]result[/] {escape(r['tool'])} {escape('[' + r['call_id'] + ']')}: "
                    f"{escape(_short(r.get('content'), 300))}"
                )
        else:
            if thinking and turn.get("reasoning"):
                console.print(f"[dim italic]thinking: {escape(turn['reasoning'])}[/]")
            if turn.get("text"):
                console.print(f"[bold green]model:[/] {escape(turn['text'])}")
            for c in turn.get("tool_calls", []):
                call = calls.get((i, c["id"]), {})
                extra = ""
                if call:
                    extra = f" [dim]{call.get('disposition')} → {call.get('state')}"
                    if call.get("duration_ms") is not None:
                        extra += f", {call['duration_ms']:.0f} ms"
                    if call.get("exit_status") is not None:
                        extra += f", exit {call['exit_status']}"
                    if call.get("attempts"):
                        extra += f", {call['attempts']} attempt(s)"
                    extra += "[/]"
                console.print(
                    f"[yellow]call[/] {escape(c['name'])}({escape(_short(c['arguments'], 200))})"
                    f" {escape('[' + c['id'] + ']')}{extra}"
                )
            u = turn.get("usage") or {}
            if u.get("total_tokens"):
                cost = f", ${u['cost']:.6f}" if u.get("cost") is not None else ""
                reasoning = f", {u['reasoning_tokens']} reasoning" if u.get("reasoning_tokens") else ""
                console.print(
                    f"  [dim]{turn.get('model', '')}: {u.get('prompt_tokens', 0)} in, "
                    f"{u.get('completion_tokens', 0)} out{reasoning}{cost}[/]"
                )
    u = view.usage
    if u.total_tokens:
        cost = f", ${u.cost:.6f}" if u.cost is not None else ""
        console.print(f"[dim]total: {u.total_tokens} tokens{cost}[/]")


def render_list(views: list[SessionView], console: Console | None = None) -> None:
    console = _console(console)
    if not views:
        console.print("no sessions")
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", box=None)
    for col in ("session", "agent", "state", "steps", "pending", "updated"):
        table.add_column(col, no_wrap=True)
    for v in views:
        table.add_row(
            v.session_id, v.agent, state_text(v.state.value), str(v.steps), str(len(v.pending)), _when(v.updated_at)
        )
    console.print(table)


def render_completion(outcome: CompletionOutcome, console: Console | None = None) -> None:
    console = _console(console)
    console.print(
        f"accepted: call {escape(outcome.call_id)} of session {outcome.session_id} is complete; "
        f"{outcome.remaining} call(s) still unfinished"
    )
    if outcome.woken:
        console.print("the session was woken and continues on its own")
    elif outcome.remaining == 0:
        console.print(f"next: agents session resume {outcome.session_id}  (or step)")


_EVENT_TEXT = {
    "session_started": "session started",
    "step_started": "step started",
    "step_committed": "step committed",
    "step_noop": "step: nothing to do yet",
    "step_skipped": "step skipped",
    "llm_called": "model answered",
    "tool_dispatched": "tool dispatched",
    "tool_finished": "tool finished",
    "token_created": "waiting for an outside result",
    "token_completed": "outside result received",
    "token_expired": "deadline passed",
    "token_rejected": "completion rejected",
    "completed": "session completed",
    "failed": "session failed",
    "paused": "paused",
    "resumed": "resumed",
    "cancelled": "cancelled",
}

_HIDDEN = {"id", "type", "at", "version"}


def event_line(e: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(e.get("at", 0))) + f".{int((e.get('at', 0) % 1) * 1000):03d}"
    detail = " ".join(f"{k}={_short(v, 80)}" for k, v in e.items() if k not in _HIDDEN and v not in ("", None, {}))
    return f"{stamp} v{e.get('version', 0)} {e.get('type')}: {_EVENT_TEXT.get(e.get('type', ''), '')} {detail}".rstrip()


class Progress:
    """Event lines and a spinner on stderr while a command waits (only on a terminal)."""

    def __init__(self, enabled: bool, thinking: str = "none") -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._status: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._status = _console(None).status("working…", spinner="dots")
            self._status.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)

    def __call__(self, e: dict[str, Any]) -> None:
        if not self.enabled:
            return
        _console(None).print(f"[dim]{escape(event_line(e))}[/]")
        if self._status is not None:
            self._status.update(_EVENT_TEXT.get(e.get("type", ""), "working") + "…")
