"""The `agents` command: a thin typer layer over `celery_agents.Client`.

Every command takes `--json` (exactly one JSON document on stdout, human text on stderr);
without it a command's primary output goes to stdout and progress and diagnostics to stderr.
Session ids may be given as any unique prefix. Exit codes are the contract's: 0 ok,
1 unexpected, 2 invalid input, 3 not found, 4 wait timed out, 5 conflict, 130 interrupted.
Nothing here imports litellm: commands that call a model reach it through the client.
"""

import contextlib
import gc
import sys
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.core

from celery_agents.cli.lean import brief, go_brief, where
from celery_agents.errors import AgentsError, InvalidInput, RedisUnavailable

if TYPE_CHECKING:
    from celery_agents.client import Client
    from celery_agents.model import CompletionOutcome

_type_of = typer.core.TyperOption.display_type_rich


def _no_type_on_flags(self: typer.core.TyperOption, ctx: Any) -> str | None:
    # A flag takes no value: help shows no type for it (typer would print `<bool>`).
    return None if self.is_flag else _type_of(self, ctx)


typer.core.TyperOption.display_type_rich = _no_type_on_flags  # type: ignore[method-assign]

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Durable, step-wise LLM agent sessions on Celery workers with all state in Redis.",
)
session_app = typer.Typer(
    no_args_is_help=True,
    help="Operate sessions: start, send, step, resume, pause, pending, complete, approve, reject, extend, "
    "run-isolated, show, list, history, fork, rerun, cancel, logs, delete, purge. ID may be any unique "
    "prefix of a session id.",
)
app.add_typer(session_app, name="session")
limits_app = typer.Typer(
    no_args_is_help=True,
    help="Fleet-wide limits on model calls, per model or limitKey: set, list, delete.",
)
app.add_typer(limits_app, name="limits")

_ARGV: list[str] = []

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
WaitOpt = Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for the outcome, or return once enqueued.")]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        help="Stop waiting for the workers after SECONDS (exit 4; the work goes on). Inline, this process runs "
        "the steps to their end.",
        min=0,
    ),
]
InlineOpt = Annotated[bool, typer.Option("--inline", help="Run steps in this process instead of on the workers.")]
StepOpt = Annotated[bool, typer.Option("--step", help="Also run one step.")]
RunOpt = Annotated[bool, typer.Option("--run", help="Drive it until it completes or waits outside.")]
AgentOpt = Annotated[Path, typer.Option("--agent-file", "-a", help="The agent file (JSON): model, tools, policy.")]
PromptOpt = Annotated[
    list[str] | None, typer.Option("--prompt", "-p", help="Prompt text (repeatable).", metavar="TEXT")
]
FileOpt = Annotated[
    list[str] | None,
    typer.Option("--file", "-f", help="A text file appended to the prompt (repeatable; - for stdin).", metavar="FILE"),
]
MediaOpt = Annotated[
    list[str] | None,
    typer.Option("--media", "-m", help="An image or other file attached to the prompt (repeatable).", metavar="FILE"),
]
SessionArg = Annotated[str, typer.Argument(help="The session id, or any unique prefix of it.", metavar="ID")]
PriorityOpt = Annotated[
    int | None, typer.Option("--priority", help="0 (lowest) to 9: steps of higher ones go first (default 5).")
]
DigestOpt = Annotated[
    str | None, typer.Option("--digest", help="Refuse unless the pending call has this digest (from pending).")
]
LimitKeyArg = Annotated[str, typer.Argument(help="A model name as agent files write it, or a limitKey.", metavar="KEY")]


class Thinking(StrEnum):
    none = "none"
    stdout = "stdout"
    stderr = "stderr"


ThinkingOpt = Annotated[Thinking, typer.Option("--thinking", help="Where the model's reasoning is printed.")]


# -- plumbing ----------------------------------------------------------------------------------
def _fail(exc: AgentsError, as_json: bool) -> NoReturn:
    from celery_agents.cli import output

    if as_json:
        output.emit_json(exc.to_json())
    else:
        output.err.print(f"[red]error:[/] {output.escape(exc.message)}", markup=True, highlight=False)
    raise typer.Exit(exc.exit_code)


def _settings(as_json: bool) -> Any:
    """This environment's settings; a variable that does not fit (a malformed value, an
    `AGENTS_TOOL_ENV` naming a setting of the worker) is exit 2 naming it, not a traceback."""
    from celery_agents.config import Settings

    try:
        return Settings.from_env()
    except ValueError as exc:
        _fail(InvalidInput(str(exc)), as_json)


def _where(client: Any) -> str:
    """The Redis a command used, for error messages (the password redacted)."""
    return where(client.settings)


@contextlib.contextmanager
def _command(as_json: bool, inline: bool = False) -> Iterator[Any]:
    """A client for the command; errors become the contract's exit codes and JSON errors."""
    from celery_agents.client import Client

    client = None
    try:
        client = Client(_settings(as_json), inline=True if inline else None)
        yield client
    except RedisUnavailable as exc:
        _fail(RedisUnavailable(f"{exc.message} — tried {_where(client)}"), as_json)
    except AgentsError as exc:
        _fail(exc, as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _prompt(media_max_bytes: int, prompts: list[str] | None, files: list[str] | None, media: list[str] | None) -> Any:
    from celery_agents.cli.prompt import build_query, ordered_parts

    parts = ordered_parts(_ARGV or sys.argv[1:], prompts or [], files or [], media or [])
    return build_query(parts, media_max_bytes)


def _print_view(
    view: Any,
    as_json: bool,
    thinking: Thinking = Thinking.none,
    answer_to_stdout: bool = False,
    progress: Any = None,
) -> None:
    """The session view on stdout; with `answer_to_stdout` (`run`) only the answer goes to
    stdout and the view, a summary, to stderr. An answer that streamed to stdout (`progress`) is
    not printed again: only what of it did not arrive."""
    from celery_agents.cli import output

    if as_json:
        output.emit_json(view.to_json())
        return
    if thinking != Thinking.none and view.state.value == "completed":
        _print_thinking(view, thinking)
    answer = view.response if view.state.value == "completed" else None
    rest = progress.rest_of(answer) if progress is not None and progress.stream and answer is not None else None
    if rest is not None:
        if rest:
            sys.stdout.write(output.printable(rest) + "\n")
            sys.stdout.flush()
        answer = None  # printed as it streamed
    output.render_view(
        view, output.err if answer_to_stdout else output.out, answer=not answer_to_stdout and answer is not None
    )
    if answer_to_stdout and answer is not None:
        sys.stdout.write(output.printable(answer) + "\n")
        sys.stdout.flush()


def _say_sent(view: Any) -> None:
    """What became of a message `send` sent, on stderr."""
    from celery_agents.cli.output import err

    if view.sent == "continued":
        err.print("the message continued the conversation: the session goes on, the message to its next model call")
    else:
        n = len(view.queued)
        waiting = f" ({n} message{'s' if n != 1 else ''} waiting)" if n else ""
        err.print(f"the message was queued for the next model call{waiting}")


def _exit_if_ended_badly(view: Any) -> None:
    """A command that advanced a session succeeds when it yielded or completed; one that ended
    failed or cancelled exits 5 (the view printed says why, in its `error`)."""
    if view.state.value in ("failed", "cancelled"):
        raise typer.Exit(5)


def _print_thinking(view: Any, thinking: Thinking) -> None:
    from celery_agents.cli.output import err, out, printable

    console = out if thinking == Thinking.stdout else err
    turns = view.turns or []
    for t in turns:
        if t.get("kind") == "LlmTurn" and t.get("reasoning"):
            console.print(f"[thinking] {printable(t['reasoning'])}", markup=False)


def _progress(as_json: bool, client: Any) -> Any:
    from celery_agents.cli.progress import Progress

    def tokens(session_id: str) -> dict[str, str]:
        found: dict[str, str] = client.tokens(session_id)
        return found

    if client.inline and any(a == "--timeout" or a.startswith("--timeout=") for a in _ARGV):
        from celery_agents.cli.output import err

        err.print(
            "note: --timeout bounds the wait for workers; here this process runs the steps to their end "
            "(Ctrl-C pauses the session)",
            markup=False,
            highlight=False,
        )
    # The answer streams to stdout on a terminal; with --json or into a pipe it is printed once, whole.
    stream = not as_json and sys.stdout.isatty()
    return Progress(lines=not as_json, tokens=tokens, queued=not client.inline, stream=stream)


def _queues_used(spec: Any) -> set[str]:
    """The queues a session of this agent may publish to: steps, and tools / isolated when its
    policy runs calls that way."""
    used = {"steps"}
    policy = spec.tool_call_policy
    if spec.mode != "asynchronous" or policy is None:
        return used
    for disposition in [policy.default, *(r.disposition for r in policy.rules)]:
        used |= {"runAsync": {"tools"}, "runIsolated": {"isolated"}}.get(disposition.tag, set())
    return used


def _warn_no_workers(client: Any, used: set[str]) -> None:
    """Say when no live worker consumes a queue this command's session will publish to."""
    if client.inline:
        return
    workers = client.live_workers()
    served = {q for w in workers for q in w.get("queues", [])}
    warnings = []
    if not workers:
        warnings.append("no worker is running: start one with `agents worker` (or use --inline)")
    else:
        for queue, what in (("steps", "steps"), ("tools", "runAsync calls"), ("isolated", "runIsolated calls")):
            if queue in used and queue not in served:
                hint = " (or run them here: agents session run-isolated ID)" if queue == "isolated" else ""
                warnings.append(f"no worker consumes the {queue} queue: {what} wait until one does{hint}")
    if warnings:
        from celery_agents.cli.output import err

        for w in warnings:
            err.print(f"[yellow]{w}[/]")


def _load_agent(client: Any, agent_file: Path) -> Any:
    """The agent file, validated and resolved; fields of agents-exe files that are not used here
    are named on stderr (they are ignored, not refused)."""
    spec = client.agent_spec(agent_file)
    if spec.ignored_fields:
        from celery_agents.cli.output import err, escape

        err.print(
            f"[yellow]warning:[/] {escape(str(agent_file))}: ignoring fields of agents-exe files that "
            f"celery-agents does not use: {escape(', '.join(spec.ignored_fields))}"
        )
    return spec


def _advance(
    as_json: bool,
    inline: bool,
    thinking: Thinking,
    action: Callable[[Any, Any, Any], Any],
    *,
    session_id: str | None = None,
    agent_file: Path | None = None,
    prompt: tuple[list[str] | None, list[str] | None, list[str] | None] | None = None,
    warn: bool = True,
    answer_to_stdout: bool = False,
) -> None:
    """A command that advances a session: build the prompt if any, run `action(client, spec or
    query, progress)`, print the view; exit 5 when the session ended failed or cancelled, 130
    on Ctrl-C after saying what became of the session."""
    with _command(as_json, inline) as client:
        spec = _load_agent(client, agent_file) if agent_file is not None else None
        query = _prompt(client.settings.media_max_bytes, *prompt) if prompt is not None else None
        if session_id is not None:
            session_id = client.resolve(session_id)
        if warn:
            agent = spec if spec is not None else client.agent_of(session_id)
            _warn_no_workers(client, _queues_used(agent))
        progress = _progress(as_json, client)
        progress.session_id = session_id
        try:
            with progress:
                view = action(client, _subject(spec, query, session_id), progress)
        except KeyboardInterrupt:
            _interrupted(client, progress.session_id, as_json)
        if thinking != Thinking.none or answer_to_stdout:
            view = client.view(view.session_id, detail=True)
        _print_view(view, as_json, thinking, answer_to_stdout=answer_to_stdout, progress=progress)
        if not as_json and view.sent is not None:
            _say_sent(view)
        if answer_to_stdout and not as_json:
            _summarise_failed_calls(view)
        _exit_if_ended_badly(view)


def _subject(spec: Any, query: Any, session_id: str | None) -> Any:
    """What an advancing command acts on: (agent, prompt), (session, message) or a session."""
    if spec is not None:
        return (spec, query)
    return (session_id, query) if query is not None else session_id


def _interrupted(client: Any, session_id: str | None, as_json: bool = False) -> NoReturn:
    """Ctrl-C while a command drove a session: say whether it goes on or was paused, and how to
    continue; with `--json`, the session's view as it is now is the one document on stdout (when
    Redis can still be read); exit 130."""
    from celery_agents.cli.output import err

    if session_id is None:
        raise typer.Exit(130)
    if as_json:
        try:
            _interrupted(client, session_id)
        finally:
            with contextlib.suppress(Exception):
                _print_view(client.view(session_id), True)
    try:
        paused = client.interrupted(session_id)
    except Exception:  # Redis gone as well: say what we know
        paused = client.inline
    if paused:
        err.print(
            f"interrupted: session {session_id} was paused (its step was not finished).\n"
            f"  continue it: agents session resume {session_id}"
        )
    else:
        err.print(
            f"interrupted: session {session_id} goes on: the workers drive it.\n"
            f"  follow it:   agents session logs {session_id} --follow\n"
            f"  see it:      agents session show {session_id}\n"
            f"  stop it:     agents session pause {session_id}"
        )
    raise typer.Exit(130)


def _summarise_failed_calls(view: Any) -> None:
    """A run whose tools failed says so (the model may have papered over it in its answer)."""
    from celery_agents.cli.output import err, escape

    failed = [c for c in (view.calls or []) if c.get("state") in ("failed", "expired")]
    if not failed:
        return
    err.print(f"[yellow]{len(failed)} tool call(s) failed[/] (agents session show {view.session_id}):")
    for c in failed:
        text = " ".join(str(c.get("error") or c.get("state")).split())
        err.print(f"  {escape(c.get('tool', '?'))}: {escape(text[:200])}")


# -- commands ----------------------------------------------------------------------------------
@app.command()
def run(
    agent_file: AgentOpt,
    prompt: PromptOpt = None,
    file: FileOpt = None,
    media: MediaOpt = None,
    thinking: ThinkingOpt = Thinking.none,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    priority: PriorityOpt = None,
) -> None:
    """Start a session and drive it until it completes or only outside work remains; print the answer."""
    _start(agent_file, (prompt, file, media), thinking, as_json, wait, timeout, inline, priority, run=True, answer=True)


@session_app.command("start")
def session_start(
    agent_file: AgentOpt,
    prompt: PromptOpt = None,
    file: FileOpt = None,
    media: MediaOpt = None,
    step: StepOpt = False,
    run_: RunOpt = False,
    thinking: ThinkingOpt = Thinking.none,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    priority: PriorityOpt = None,
) -> None:
    """Create a session from a prompt (the model is not called unless --step or --run)."""
    _start(agent_file, (prompt, file, media), thinking, as_json, wait, timeout, inline, priority, step=step, run=run_)


def _start(
    agent_file: Path,
    prompt: tuple[list[str] | None, list[str] | None, list[str] | None],
    thinking: Thinking,
    as_json: bool,
    wait: bool,
    timeout: float | None,
    inline: bool,
    priority: int | None,
    *,
    step: bool = False,
    run: bool = False,
    answer: bool = False,
) -> None:
    """`run` and `session start`: a new session, stepped or driven as asked; `answer`: its
    answer goes to stdout (`run`)."""
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, spec_query, progress: client.start(
            *spec_query,
            step=step,
            run=run,
            wait=wait,
            timeout=timeout,
            on_event=progress,
            on_created=progress.created,
            priority=priority,
        ),
        agent_file=agent_file,
        prompt=prompt,
        warn=step or run,
        answer_to_stdout=answer,
    )


@session_app.command("send")
def session_send(
    session_id: SessionArg,
    prompt: PromptOpt = None,
    file: FileOpt = None,
    media: MediaOpt = None,
    step: StepOpt = False,
    run_: RunOpt = False,
    thinking: ThinkingOpt = Thinking.none,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    interrupt: Annotated[
        bool,
        typer.Option("--interrupt", help="Cancel a model call in flight; the next one takes the message."),
    ] = False,
) -> None:
    """Send a follow-up message: a completed session continues, a busy one gets it next.

    A waiting or running session gets it after the pending tool results, before the next model call.

    With --interrupt, a model answer in flight is dropped and asked again with the message.

    The dropped answer's usage is counted; tool calls running go on.
    """
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid_query, progress: client.send(
            *sid_query, step=step, run=run_, interrupt=interrupt, wait=wait, timeout=timeout, on_event=progress
        ),
        session_id=session_id,
        prompt=(prompt, file, media),
        warn=step or run_,
    )


@session_app.command("step")
def session_step(
    session_id: SessionArg,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    thinking: ThinkingOpt = Thinking.none,
) -> None:
    """Run exactly one step: call the model, or run the tool calls it asked for."""
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid, progress: client.step(sid, wait=wait, timeout=timeout, on_event=progress),
        session_id=session_id,
    )


@session_app.command("resume")
def session_resume(
    session_id: SessionArg,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    thinking: ThinkingOpt = Thinking.none,
    grant: Annotated[
        str | None,
        typer.Option(
            "--grant",
            help="Raise the budget's limits first, e.g. tokens=5000,costUsd=0.5,modelCalls=10,toolCalls=20.",
        ),
    ] = None,
) -> None:
    """Drive the session until it completes or only outside work remains (a failed one is retried)."""
    from celery_agents.model.budget import parse_grant

    more = None
    if grant is not None:
        try:
            more = parse_grant(grant)
        except ValueError as exc:
            _fail(InvalidInput(f"--grant {grant!r}: {exc}"), as_json)
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid, progress: client.resume(sid, wait=wait, timeout=timeout, on_event=progress, grant=more),
        session_id=session_id,
    )


@session_app.command("pause")
def session_pause(session_id: SessionArg, as_json: JsonOpt = False) -> None:
    """Stop driving the session: no further step is enqueued until resume (a running step finishes)."""
    with _command(as_json) as client:
        _print_view(client.pause(session_id), as_json)


@session_app.command("pending")
def session_pending(
    session_id: Annotated[
        str | None, typer.Argument(help="A session id; all sessions if omitted.", metavar="ID")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most N calls (all sessions).", min=1)] = 1000,
    as_json: JsonOpt = False,
) -> None:
    """List unfinished calls (deferred ones with their tokens) of one session, or of all."""
    from celery_agents.cli.output import emit_json, render_pending

    with _command(as_json) as client:
        pending = client.pending(session_id, limit=limit)
        if as_json:
            emit_json({"pending": [p.model_dump(mode="json") for p in pending]})
        else:
            render_pending(pending)


def _print_completion(client: "Client", outcome: "CompletionOutcome", as_json: bool) -> None:
    """The document of `complete`, `approve` and `reject`, or what became of the call."""
    from celery_agents.cli.output import emit_json, render_completion

    if as_json:
        emit_json(outcome.model_dump(mode="json"))
    else:
        # A live worker continues a session the completion woke (an approved call runs there too).
        workers = (outcome.woken or outcome.delegated is not None) and bool(client.live_workers())
        render_completion(outcome, inline=client.inline, workers=workers)


@session_app.command("complete")
def session_complete(
    token: Annotated[str, typer.Argument(help="The continuation token.", metavar="TOKEN")],
    result_file: Annotated[
        str, typer.Argument(help="The result: a file holding JSON or text, or - for stdin.", metavar="RESULT_FILE|-")
    ],
    error: Annotated[bool, typer.Option("--error", help="Record the text as the call's error.")] = False,
    text: Annotated[bool, typer.Option("--text", help="Record the file as text even if it looks like JSON.")] = False,
    by: Annotated[str | None, typer.Option("--by", help="Who completes it (recorded).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Complete a deferred call with its result (JSON, or text).

    An auto-driven session then continues by itself. Tokens are listed by `agents session pending`.
    """
    from celery_agents.cli.prompt import check_token_shape, parse_result, read_result

    with _command(as_json) as client:
        check_token_shape(token)  # before a result is read from stdin (Client.complete checks it too)
        raw = read_result(result_file)
        max_bytes = client.settings.max_result_bytes
        value = raw.strip() if error or text else parse_result(raw, max_bytes, result_file)
        _print_completion(client, client.complete(token, value, error=error, by=by), as_json)


@session_app.command("approve")
def session_approve(
    token: Annotated[str, typer.Argument(help="The gate's continuation token.", metavar="TOKEN")],
    arguments: Annotated[
        str | None,
        typer.Option(
            "--arguments",
            help="Run with these arguments instead (a JSON object in a file, or - for stdin).",
            metavar="FILE|-",
        ),
    ] = None,
    digest: DigestOpt = None,
    for_session: Annotated[
        bool, typer.Option("--for-session", help="Also run later calls of this tool in the session without asking.")
    ] = False,
    by: Annotated[str | None, typer.Option("--by", help="Who decides (recorded).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve an approval gate: the call runs under its policy's `then`, once.

    Gates are the pending calls whose kind is `approval`.
    """
    from celery_agents.cli.prompt import check_token_shape, read_arguments

    with _command(as_json) as client:
        check_token_shape(token)
        edited = read_arguments(arguments) if arguments is not None else None
        outcome = client.approve(token, arguments=edited, digest=digest, for_session=for_session, by=by)
        _print_completion(client, outcome, as_json)


@session_app.command("reject")
def session_reject(
    token: Annotated[str, typer.Argument(help="The gate's continuation token.", metavar="TOKEN")],
    reason: Annotated[str | None, typer.Option("--reason", help="Why (the model is told).")] = None,
    digest: DigestOpt = None,
    by: Annotated[str | None, typer.Option("--by", help="Who decides (recorded).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Reject an approval gate: the call never runs; the model is told `rejected: REASON`."""
    with _command(as_json) as client:
        _print_completion(client, client.reject(token, reason=reason, digest=digest, by=by), as_json)


@session_app.command("extend")
def session_extend(
    token: Annotated[str, typer.Argument(help="The deferred call's continuation token.", metavar="TOKEN")],
    seconds: Annotated[float, typer.Option("--seconds", help="The new deadline: this many seconds from now.")],
    as_json: JsonOpt = False,
) -> None:
    """Move a deferred call's deadline to now + SECONDS (refused once it is decided or expired)."""
    from celery_agents.cli.output import emit_json, render_pending

    with _command(as_json) as client:
        pending = client.extend(token, seconds)
        if as_json:
            emit_json(pending.model_dump(mode="json"))
        else:
            render_pending([pending])


@session_app.command("run-isolated")
def session_run_isolated(session_id: SessionArg, as_json: JsonOpt = False) -> None:
    """Run the session's unfinished runIsolated calls in this process, sandboxed, and record them."""
    with _command(as_json) as client:
        if not client.isolated_waiting(session_id):
            from celery_agents.cli.output import err

            err.print("no runIsolated call of this session waits to run: nothing ran", highlight=False)
        _print_view(client.run_isolated(session_id), as_json)


@session_app.command("show")
def session_show(
    session_id: SessionArg,
    as_json: JsonOpt = False,
    thinking: Annotated[bool, typer.Option("--thinking/--no-thinking", help="Show the model's reasoning.")] = True,
) -> None:
    """Show a session: its state, turns (text, reasoning, tool calls and results), usage and cost."""
    from celery_agents.cli.output import emit_json, render_turns, render_view

    with _command(as_json) as client:
        view = client.show(session_id)
        if as_json:
            emit_json(view.to_json())
        else:
            render_turns(view, thinking=thinking)
            render_view(view)


@session_app.command("list")
def session_list(
    status: Annotated[
        str | None, typer.Option("--status", help="ready, tools, running, waiting, completed, failed or cancelled.")
    ] = None,
    limit: Annotated[int, typer.Option("--limit", help="At most N sessions, newest first.", min=1)] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, most recently updated first."""
    from celery_agents.cli.output import emit_json, render_list

    with _command(as_json) as client:
        views = client.list(status, limit)
        if as_json:
            emit_json({"sessions": [v.to_json() for v in views]})
        else:
            render_list(views)


@session_app.command("history")
def session_history(session_id: SessionArg, as_json: JsonOpt = False) -> None:
    """List the session's versions, oldest first: what each step did, the turns and state it left, when."""
    from celery_agents.cli.output import emit_json, render_history

    with _command(as_json) as client:
        versions = client.history(session_id)
        if as_json:
            emit_json({"versions": [v.model_dump(mode="json") for v in versions]})
        else:
            render_history(versions)


@session_app.command("fork")
def session_fork(
    session_id: SessionArg,
    at: Annotated[int | None, typer.Option("--at", help="The version to fork at (default: the latest).", min=1)] = None,
    agent_file: Annotated[
        Path | None, typer.Option("--agent-file", "-a", help="Bind the fork to this agent file instead.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make a new session whose transcript is this one's at a version; this one does not change.

    Deferred calls copied unfinished get tokens of the fork's; the origin's tokens stay the origin's.
    """
    with _command(as_json) as client:
        spec = _load_agent(client, agent_file) if agent_file is not None else None
        _print_view(client.fork(session_id, at=at, agent=spec), as_json)


@session_app.command("rerun")
def session_rerun(
    session_id: SessionArg,
    from_version: Annotated[int, typer.Option("--from", help="The version to rerun from.", min=1)],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would run and what would be reused; change nothing.")
    ] = False,
    fresh: Annotated[bool, typer.Option("--fresh", help="Run every tool call again, reusing nothing.")] = False,
    as_json: JsonOpt = False,
    wait: WaitOpt = True,
    timeout: TimeoutOpt = None,
    inline: InlineOpt = False,
    thinking: ThinkingOpt = Thinking.none,
) -> None:
    """Fork at a version and drive the fork.

    A call the origin ran after that version, same tool and arguments, reuses its result (not with --fresh).
    """
    if dry_run:
        from celery_agents.cli.output import emit_json, render_plan

        with _command(as_json, inline) as client:
            plan = client.rerun_plan(session_id, from_version=from_version, fresh=fresh)
            if as_json:
                emit_json(plan)
            else:
                render_plan(plan)
        return
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid, progress: client.rerun(
            sid, from_version=from_version, fresh=fresh, wait=wait, timeout=timeout, on_event=progress
        ),
        session_id=session_id,
    )


@session_app.command("cancel")
def session_cancel(session_id: SessionArg, as_json: JsonOpt = False) -> None:
    """Stop a session for good: unfinished calls cancelled, their tokens refused from now on."""
    with _command(as_json) as client:
        _print_view(client.cancel(session_id), as_json)


@session_app.command("logs")
def session_logs(
    session_id: SessionArg,
    follow: Annotated[
        bool, typer.Option("--follow", "-F", help="Keep printing new events until the session ends.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document per event, one per line.")] = False,
) -> None:
    """Print the session's events, one per line: time and what happened.

    With --json, one JSON document per event, one per line; --follow keeps printing until the session ends.
    """
    import json

    from celery_agents.cli.output import event_line

    with _command(as_json) as client:
        for e in client.events(session_id, follow=follow):
            if as_json:
                sys.stdout.write(json.dumps(e, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(event_line(e) + "\n")  # event_line writes control characters out
            sys.stdout.flush()


@session_app.command("delete")
def session_delete(
    session_ids: Annotated[list[str], typer.Argument(help="Session ids (or unique prefixes).", metavar="ID")],
    force: Annotated[bool, typer.Option("--force", help="Cancel an active session, then delete it.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete finished sessions: every key of each in Redis and its entries in every index.

    One still active (without --force) or unknown refuses them all: nothing is deleted.
    """
    from celery_agents.cli.output import emit_json, out

    with _command(as_json) as client:
        deleted = client.delete_all(session_ids, force=force)
        if as_json:
            emit_json({"deleted": deleted})
        else:
            for sid in deleted:
                out.print(f"deleted {sid}")


@session_app.command("purge")
def session_purge(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Age since the last update: 2w, 30d, 12h, 45m or 90s.", metavar="AGE")
    ],
    status: Annotated[
        str, typer.Option("--status", help="Finished states to purge, comma-separated.")
    ] = "completed,failed,cancelled",
    limit: Annotated[int | None, typer.Option("--limit", help="Delete at most N sessions.", min=1)] = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete finished sessions not updated for a while (AGENTS_RETENTION_DAYS does it on workers)."""
    from celery_agents.cli.output import emit_json, err, out
    from celery_agents.cli.prompt import parse_age

    with _command(as_json) as client:
        seconds = parse_age(older_than)
        deleted = client.purge([s.strip() for s in status.split(",") if s.strip()], seconds, limit)
        if as_json:
            emit_json({"deleted": deleted})
        else:
            for sid in deleted:
                out.print(f"deleted {sid}")
            err.print(f"{len(deleted)} session(s) deleted")


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option("--queues", "-Q", help="Queues to consume, comma-separated.")
    ] = "steps,tools,isolated",
    concurrency: Annotated[
        int, typer.Option("--concurrency", "-c", help="Processes for tool calls (tools, isolated queues).", min=1)
    ] = 2,
    step_threads: Annotated[
        int, typer.Option("--step-threads", help="Steps one steps process keeps in flight at once.", min=1)
    ] = 200,
    step_processes: Annotated[
        int | None,
        typer.Option("--step-processes", help="Processes for steps.", show_default="one per core, at most 8", min=1),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", "-n", help="Worker name (Celery hostname).")] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l", help="Log level.")] = "INFO",
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port", help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics.", min=0, max=65535
        ),
    ] = None,
    metrics_host: Annotated[
        str, typer.Option("--metrics-host", help="Address /metrics listens on (0.0.0.0 in a container).")
    ] = "127.0.0.1",
) -> None:
    """Run the workers for steps and tool calls (on the embedded Redis when AGENTS_REDIS_URL is unset).

    Steps wait on the model in threads (--step-threads per process, --step-processes processes).

    Tool calls run in a prefork pool of --concurrency processes; one process supervises them all.
    """
    import os
    import socket

    from celery_agents.tasks.config import QUEUES
    from celery_agents.tasks.supervisor import Supervisor, WorkerPlan, default_step_processes

    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in wanted if q not in QUEUES]
    if unknown or not wanted:
        _fail(InvalidInput(f"unknown queue(s): {', '.join(unknown) or '(none given)'}; use {', '.join(QUEUES)}"), False)
    from celery_agents.observe.logs import configure_root

    configure_root(_settings(False).log_format == "json", loglevel)
    plan = WorkerPlan(
        queues=wanted,
        name=name or f"agents-{os.getpid()}@{socket.gethostname()}",
        tool_processes=concurrency,
        step_processes=step_processes or default_step_processes(),
        step_threads=step_threads,
        loglevel=loglevel,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    try:
        code = Supervisor(plan).run()
    except RedisUnavailable as exc:  # the state Redis unreachable: refuse to start, naming it
        _fail(RedisUnavailable(f"{exc.message} — tried {where(_settings(False))}"), False)
    except AgentsError as exc:  # the state Redis unsafe, a port taken: refuse to start
        _fail(exc, False)
    raise typer.Exit(code)


@app.command("mcp-server")
def mcp_server(
    wait: Annotated[
        float, typer.Option("--wait", help="How long start_session waits for a session to settle (seconds).", min=0)
    ] = 120.0,
) -> None:
    """Serve celery-agents as an MCP server on stdio.

    Its tools: start_session, session_status, pending, complete, approve, reject.
    """
    from celery_agents.mcp_server import serve_stdio

    _settings(False)  # refused here, before the server starts
    try:
        serve_stdio(wait)
    except AgentsError as exc:
        _fail(exc, False)


@app.command()
def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (not loopback: an AGENTS_API_TOKEN of 32+ characters).")
    ] = ("127.0.0.1"),
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", min=0, max=65535)] = 8765,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l", help="Log level.")] = "info",
) -> None:
    """Serve the HTTP API (/v1, OpenAPI at /docs), the approvals page (/) and /metrics.

    With AGENTS_API_TOKEN set, every request needs `Authorization: Bearer <token>` (the page asks once).

    Without it, only a loopback address is served. X-Forwarded-For is believed from AGENTS_TRUSTED_PROXIES only.
    """
    from celery_agents.config import Settings
    from celery_agents.web.security import check_bind

    try:
        settings = Settings.from_env()
        check_bind(host, settings.api_token)
    except AgentsError as exc:
        _fail(exc, False)
    except ValueError as exc:  # a variable that does not parse, named in the message
        _fail(InvalidInput(str(exc)), False)
    import socket

    import uvicorn

    from celery_agents.web.app import create_app

    # Bound here, before the app starts: a port taken is said plainly (exit 2), not after a line
    # that says it serves.
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        _fail(InvalidInput(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host, --port)"), False)
    sys.stderr.write(f"serving http://{host}:{listener.getsockname()[1]}/ (API at /v1, docs at /docs)\n")
    # No proxy headers in uvicorn: the app takes X-Forwarded-For from AGENTS_TRUSTED_PROXIES only.
    config = uvicorn.Config(create_app(settings), log_level=loglevel.lower(), proxy_headers=False)
    uvicorn.Server(config).run(sockets=[listener])


@limits_app.command("set")
def limits_set(
    key: LimitKeyArg,
    rpm: Annotated[int | None, typer.Option("--rpm", help="Model calls started per minute.")] = None,
    tpm: Annotated[int | None, typer.Option("--tpm", help="Tokens per minute (estimated, then corrected).")] = None,
    concurrency: Annotated[int | None, typer.Option("--concurrency", help="Model calls in flight at once.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Limit the whole fleet's model calls under KEY (the kinds given; the others unlimited)."""
    from celery_agents.cli.output import emit_json, render_limit

    with _command(as_json) as client:
        usage = client.set_limit(key, rpm=rpm, tpm=tpm, concurrency=concurrency)
        if as_json:
            emit_json(usage.to_json())
        else:
            render_limit(usage)


@limits_app.command("list")
def limits_list(as_json: JsonOpt = False) -> None:
    """List the limits with this minute's use, calls in flight and waiting; and paused models."""
    from celery_agents.cli.output import emit_json, render_limits
    from celery_agents.model.admission import limits_json

    with _command(as_json) as client:
        usages, pauses = client.limits()
        if as_json:
            emit_json(limits_json(usages, pauses))
        else:
            render_limits(usages, pauses)


@limits_app.command("delete")
def limits_delete(key: LimitKeyArg, as_json: JsonOpt = False) -> None:
    """Remove KEY's limits; calls waiting for them go on at once."""
    from celery_agents.cli.output import emit_json, err

    with _command(as_json) as client:
        client.delete_limit(key)
        if as_json:
            emit_json({"key": key, "deleted": True})
        else:
            err.print(f"deleted the limits of {key}")


@app.command()
def doctor(
    as_json: JsonOpt = False,
    ack_rewound: Annotated[
        bool, typer.Option("--ack-rewound", help="Acknowledge the rewound sessions listed now: no longer an error.")
    ] = False,
) -> None:
    """Check Redis, persistence settings, workers, queues, owed steps and rejected completions."""
    from celery_agents.cli.doctor import render

    with _command(as_json) as client:
        report = client.doctor(ack_rewound=ack_rewound)
        if as_json:
            from celery_agents.cli.output import emit_json

            emit_json(report)
        else:
            render(report)
        if not report["ok"]:
            raise typer.Exit(1)


def _show_version(value: bool) -> None:
    if value:
        from celery_agents import __version__

        sys.stdout.write(f"agents (celery-agents) {__version__}\n")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the version and exit.", callback=_show_version, is_eager=True),
    ] = False,
) -> None:
    """Durable, step-wise LLM agent sessions on Celery workers with all state in Redis."""


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `agents` console script."""
    if brief(list(sys.argv[1:] if argv is None else argv)):
        go_brief()
    try:
        _main(argv)
    finally:
        # The process ends here. The interpreter's shutdown would run one last collection over
        # every object the imports made (pydantic's and typer's included): 50-80 ms of a
        # read-only command's ~330 on a 2-core VM. Frozen, they are left out of it; they are still
        # freed, and atexit handlers and `with` blocks ran or run as before.
        gc.freeze()


def _main(argv: list[str] | None) -> None:
    global _ARGV
    args = list(sys.argv[1:] if argv is None else argv)
    _ARGV = args
    as_json = "--json" in args
    try:
        rc = app(args=args, prog_name="agents", standalone_mode=False)
    except typer.Abort:
        raise SystemExit(130) from None
    except typer.TyperException as exc:
        # typer >= 0.29 vendors click: usage errors are typer's own ClickException, not click's.
        if as_json:
            from celery_agents.cli.output import emit_json

            emit_json(InvalidInput(exc.format_message()).to_json())
        elif hasattr(exc, "show"):
            exc.show()
        else:
            sys.stderr.write(f"Error: {exc.format_message()}\n")
        raise SystemExit(2) from None
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
