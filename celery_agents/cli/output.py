"""What the CLI prints: one JSON document on stdout with `--json`; otherwise a command's primary
output (the answer, the session view, tables) on stdout with whole ids, and progress and
diagnostics on stderr. Every piece of text that came from outside (a model, a tool, a completer)
goes through `printable` (or `escape`, on a rich console) before it reaches a terminal, so it
cannot move the cursor, clear the screen or retitle the window."""

from __future__ import annotations

import datetime
import json
import re
import sys
import time
from typing import TYPE_CHECKING, Any, cast

from celery_agents.model import CompletionOutcome, EventType, PendingCall, SessionView, VersionEntry
from celery_agents.model.admission import DEFAULT_PRIORITY, LimitUsage, Pause

if TYPE_CHECKING:
    from rich.console import Console

_consoles: dict[str, Any] = {}

# Piped output is never cut to a terminal's width: a table row keeps its whole session id.
_PIPE_WIDTH = 100_000


def __getattr__(name: str) -> Any:
    """`err` and `out`, rich consoles made on first use: `--json` commands never import rich."""
    if name not in ("err", "out"):
        raise AttributeError(name)
    if name not in _consoles:
        from rich.console import Console

        stream = sys.stderr if name == "err" else sys.stdout
        width = None if stream.isatty() else _PIPE_WIDTH
        _consoles[name] = Console(file=stream, highlight=False, soft_wrap=True, width=width)
    return _consoles[name]


def _console(console: Console | None) -> Console:
    return console if console is not None else __getattr__("out")


# C0 and C1 controls (but newline and tab), DEL, and the bidirectional overrides that reorder text.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character written out (`ESC` becomes `\\x1b`): what a model, a
    tool or a completer wrote is shown, never obeyed by the terminal. Used by every human
    renderer (through `escape` on rich consoles)."""
    return _CONTROL.sub(_visible, text)


def escape(text: str) -> str:
    """Outside text made safe for a rich console: controls written out, markup escaped."""
    from rich.markup import escape as rich_escape

    return rich_escape(printable(text))


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
    text = printable(" ".join(text.split()))
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
        err_console().print("no pending calls")
        return
    for p in pending:
        line = f"• {escape(p.tool)}({escape(_short(p.arguments, 100))}) [dim]{p.disposition}, {p.state}[/]"
        if p.reason:
            line += f" [dim]— {escape(p.reason)}[/]"
        console.print(line)
        console.print(f"  session {p.session_id}  call {escape(p.call_id)}")
        if p.token:
            console.print(f"  token   [bold]{p.token}[/]  (expires {_when(p.expires_at)})")
            if p.kind == "approval":
                console.print(f"  a gate: approved, it runs {p.then}  digest {p.digest}")
                console.print(f"  decide: agents session approve {p.token} --digest {p.digest}")
                console.print(f"      or: agents session reject {p.token} --digest {p.digest} --reason TEXT")
            else:
                console.print(f"  complete it: agents session complete {p.token} RESULT_FILE")


def _spend_text(view: SessionView) -> str:
    """What the session spent (its sub-agents included), each against its limit where it has one."""
    return "  ".join(f"{kind} {text}" for kind, text, _ in view.spend_rows())


def render_view(view: SessionView, console: Console | None = None, answer: bool = True) -> None:
    console = _console(console)
    console.print(
        f"session [bold]{view.session_id}[/] ({escape(view.agent)})  state {state_text(view.state.value)}"
        f"  head {view.head or '-'}  version {view.version}  steps {view.steps}  drive {view.drive}"
    )
    if view.parent:
        console.print(f"  parent {view.parent}")
    if view.children:
        console.print(f"  children {' '.join(view.children)}")
    if view.pending:
        render_pending(view.pending, console)
    if view.budget is not None or not view.spent.nothing:
        console.print(f"  spent {_spend_text(view)}")
    if view.throttled_until:
        console.print(
            f"  throttled until {view.throttled_until}: a fleet limit holds its model call (agents limits list), "
            "or a budget above it its next call while sub-agents spend it at once"
        )
    if view.priority != DEFAULT_PRIORITY:
        console.print(f"  priority {view.priority}")
    if view.queued:
        console.print(f"  queued for the next model call: {len(view.queued)} message(s)")
        for q in view.queued:
            media = f" [dim](+{q.media} attachments)[/]" if q.media else ""
            console.print(f"    • {escape(_short(q.text, 120))}{media}")
    if view.error:
        console.print(f"[red]error ({view.error.code}):[/] {escape(view.error.message)}")
        if view.error.code != "budget_exceeded":  # its message says how to go on
            console.print(f"  fix the cause, then: agents session resume {view.session_id}")
    if answer and view.response is not None and view.state.value == "completed":
        console.print(f"[green]answer:[/] {escape(view.response)}")
    elif view.state.owes_step and view.drive == "manual":
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
                    console.print(f"  [dim]attached {escape(m.get('filename') or m['mime_type'])}[/]")
            for r in turn.get("tool_responses", []):
                # Said in words too: without colours (a pipe, a log) an error reads as one.
                style, label = ("red", "error") if r.get("is_error") else ("magenta", "result")
                console.print(
                    f"[{style}]{label}[/] {escape(r['tool'])} {escape('[' + r['call_id'] + ']')}: "
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
                    f"  [dim]{escape(turn.get('model', ''))}: {u.get('prompt_tokens', 0)} in, "
                    f"{u.get('completion_tokens', 0)} out{reasoning}{cost}[/]"
                )
    u = view.usage
    if u.total_tokens:
        cost = f", ${u.cost:.6f}" if u.cost is not None else ""
        console.print(f"[dim]total: {u.total_tokens} tokens{cost}[/]")


def render_list(views: list[SessionView], console: Console | None = None) -> None:
    console = _console(console)
    if not views:
        err_console().print("no sessions")
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", box=None)
    # The id is never cut: it is what the next command takes.
    table.add_column("session", no_wrap=True, min_width=max(len(v.session_id) for v in views))
    for col in ("agent", "state", "steps", "pending", "updated"):
        table.add_column(col, overflow="fold")
    for v in views:
        table.add_row(
            v.session_id,
            escape(v.agent),
            state_text(v.state.value),
            str(v.steps),
            str(len(v.pending)),
            _when(v.updated_at),
        )
    console.print(table)


def render_history(versions: list[VersionEntry], console: Console | None = None) -> None:
    console = _console(console)
    if not versions:
        err_console().print("no versions recorded")
        return
    from rich.table import Table

    table = Table(show_header=True, header_style="bold", box=None)
    for col in ("version", "turns", "state", "when"):
        table.add_column(col, no_wrap=True)
    table.add_column("what it did", overflow="fold")
    for v in versions:
        table.add_row(str(v.version), str(v.turns), state_text(v.state), _when(v.at), escape(v.summary))
    console.print(table)


def render_plan(plan: dict[str, list[dict[str, Any]]], console: Console | None = None) -> None:
    """What a rerun would do with the calls recorded at its version (`rerun --dry-run`)."""
    console = _console(console)
    rows = [("would run", r) for r in plan["would_run"]] + [("reused", r) for r in plan["reused"]]
    if not rows:
        console.print("no tool calls recorded at that version: a rerun begins with the model")
        return
    for what, r in rows:
        args = json.dumps(r["arguments"], ensure_ascii=False)
        console.print(f"{what:<9}  {escape(r['tool'])}({escape(_short(args))})  {r['disposition']}")


def err_console() -> Console:
    """The console for progress and diagnostics (stderr)."""
    return cast("Console", __getattr__("err"))


def render_completion(
    outcome: CompletionOutcome, *, inline: bool, workers: bool, console: Console | None = None
) -> None:
    """`workers`: a live worker takes the step a woken session is owed; `inline`: this command's
    mode (no worker expected: nothing runs the session until a command drives it)."""
    console = _console(console)
    done = {"approved": "approved: it runs now", "edited": "approved with the edited arguments: it runs now"}
    console.print(
        f"accepted: call {escape(outcome.call_id)} of session {outcome.session_id} "
        f"{done.get(outcome.decision or '', outcome.decision or 'is complete')}; "
        f"{outcome.remaining} call(s) still unfinished"
    )
    if outcome.woken and workers:
        console.print("the session was woken: a worker continues it")
    elif outcome.woken and not inline:
        console.print(
            "the session's next step is queued, but no worker is running: start one with `agents worker`, "
            f"or run it here with `agents session resume {outcome.session_id} --inline`"
        )
    elif outcome.woken:
        console.print(f"no worker runs here: continue the session with `agents session resume {outcome.session_id}`")
    elif outcome.remaining == 0:
        console.print(f"next: agents session resume {outcome.session_id}  (or step)")


def _seconds(ms: Any) -> str:
    return f" in {float(ms) / 1000:.1f} s" if isinstance(ms, int | float) else ""


def event_text(e: dict[str, Any]) -> str | None:
    """What an event means to a person, in one line; None for the bookkeeping nobody needs to
    read (a skipped duplicate step, a step that found nothing to do). Outside text is printable."""
    kind, version = e.get("type", ""), e.get("version", 0)
    tool = printable(str(e.get("tool", "")))
    if kind == EventType.SESSION_STARTED:
        return f"session started ({printable(str(e.get('agent', '')))}, {e.get('drive', 'manual')} drive)"
    if kind == EventType.STEP_STARTED:
        return f"step {version} started"
    if kind == EventType.LLM_CALLED:
        n = int(e.get("tool_calls") or 0)
        tokens = (e.get("usage") or {}).get("total_tokens")
        used = f", {tokens} tokens" if tokens else ""
        asked = f"asked for {n} tool call{'s' if n != 1 else ''}" if n else "answered"
        # Emitted by the commit, which already carries the step's new version.
        return f"step {max(int(version) - 1, 1)}: the model {asked}{used}"
    if kind in (EventType.TEXT_DELTA, EventType.REASONING_DELTA):
        # One line per event: the text's own line breaks are written out.
        piece = printable(str(e.get("text", ""))).replace("\n", "\\n")
        return f"the model {'writes' if kind == EventType.TEXT_DELTA else 'thinks'}: {piece}"
    if kind == EventType.MODEL_INTERRUPTED:
        tokens = (e.get("usage") or {}).get("total_tokens")
        used = f", {tokens} tokens" if tokens else ""
        dropped = int(e.get("dropped_chars") or 0)
        step = max(int(version) - 1, 1)
        return f"step {step}: the model was interrupted by a new message ({dropped} characters dropped{used})"
    if kind == EventType.TOOL_DISPATCHED:
        return f"{tool} queued ({e.get('disposition', '')})"  # a worker takes it: no event says when
    if kind == EventType.TOOL_FINISHED:
        state = e.get("state", "")
        word = "done" if state == "completed" else state
        return f"{tool} {word}{_seconds(e.get('duration_ms'))}"
    if kind == EventType.TOKEN_CREATED:
        reason = f": {printable(str(e['reason']))}" if e.get("reason") else ""
        return f"waiting on a person for {tool}{reason}"
    if kind == EventType.TOKEN_COMPLETED:
        by = f" by {printable(str(e['by']))}" if e.get("by") else ""
        what = "an outside error" if e.get("error") else "an outside result"
        return f"{what} arrived{by}"
    if kind == EventType.TOKEN_EXPIRED:
        return f"call {printable(str(e.get('call_id', '')))}: its deadline passed without a result"
    if kind == EventType.TOKEN_REJECTED:
        by = f" from {printable(str(e['by']))}" if e.get("by") else ""
        return f"a completion{by} was refused: token {printable(str(e.get('reason', '')))}"
    if kind == EventType.COMPLETED:
        return "session completed"
    if kind == EventType.FAILED:
        return f"session failed: {printable(str(e.get('message', '')))}"
    if kind in (EventType.PAUSED, EventType.RESUMED, EventType.CANCELLED):
        return f"session {kind}"
    return None


def event_line(e: dict[str, Any]) -> str:
    """One line of `session logs`: the time and what happened (every event, printable)."""
    at = float(e.get("at", 0))
    stamp = time.strftime("%H:%M:%S", time.localtime(at)) + f".{int((at % 1) * 1000):03d}"
    text = event_text(e)
    if text is None:
        detail = " ".join(f"{k}={_short(v, 80)}" for k, v in e.items() if k not in _HIDDEN and v not in ("", None, {}))
        text = f"{printable(str(e.get('type', '')))} {detail}".rstrip()
    return f"{stamp} v{e.get('version', 0)} {text}"


_HIDDEN = {"id", "type", "at", "version"}


def render_limits(usages: list[LimitUsage], pauses: list[Pause]) -> None:
    """`limits list`: one line per KEY (its limits, this minute's use, calls in flight and waiting),
    then the models paused now."""
    if not usages and not pauses:
        __getattr__("err").print("no limits are set (agents limits set KEY --rpm N ...)")
        return
    for u in usages:
        render_limit(u)
    for p in pauses:
        until = datetime.datetime.fromtimestamp(p.until, tz=datetime.UTC).isoformat(timespec="seconds")
        _console(None).print(f"{escape(p.model)}  paused until {until} (a 429 with Retry-After)")


def render_limit(u: LimitUsage) -> None:
    limit = u.limit
    kinds = [f"{k} {v}" for k, v in (("rpm", limit.rpm), ("tpm", limit.tpm), ("concurrency", limit.concurrency)) if v]
    use = f"this minute {u.requests_this_minute} calls, {u.tokens_this_minute} tokens"
    if limit.concurrency:
        use += f"; in flight {u.in_flight}, waiting {u.waiting}"
    if u.booked_seconds:
        use += f"; next start in {u.booked_seconds:.1f} s"
    _console(None).print(f"{escape(u.key)}  {', '.join(kinds)}  ({use})")
