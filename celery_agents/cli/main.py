"""The `agents` command: a thin typer layer over `celery_agents.Client`.

Every command takes `--json` (exactly one JSON document on stdout, human text on stderr);
without it a command's primary output goes to stdout and progress and diagnostics to stderr.
Session ids may be given as any unique prefix. Exit codes are the contract's: 0 ok,
1 unexpected, 2 invalid input, 3 not found, 4 wait timed out, 5 conflict, 130 interrupted.
Nothing here imports litellm: commands that call a model reach it through the client.
"""

import contextlib
import sys
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import typer.core

from celery_agents.errors import AgentsError, InvalidInput, RedisUnavailable

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
    help="Operate sessions: start, step, resume, pause, pending, complete, run-isolated, show, list, cancel, "
    "logs, delete, purge. ID may be any unique prefix of a session id.",
)
app.add_typer(session_app, name="session")

_ARGV: list[str] = []

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
WaitOpt = Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for the outcome, or return once enqueued.")]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="Stop waiting after SECONDS (exit 4; the work goes on).", min=0)
]
InlineOpt = Annotated[bool, typer.Option("--inline", help="Run steps in this process instead of on the workers.")]
StepOpt = Annotated[bool, typer.Option("--step", help="Also run one step.")]
RunOpt = Annotated[bool, typer.Option("--run", help="Drive it until it completes or waits outside.")]
AgentOpt = Annotated[Path, typer.Option("--agent-file", "-a", help="The agent file (JSON): model, tools, policy.")]
PromptOpt = Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt text (repeatable).")]
FileOpt = Annotated[
    list[str] | None, typer.Option("--file", "-f", help="A text file appended to the prompt (repeatable; - for stdin).")
]
MediaOpt = Annotated[
    list[str] | None, typer.Option("--media", "-m", help="An image or other file attached to the prompt (repeatable).")
]
SessionArg = Annotated[str, typer.Argument(help="The session id, or any unique prefix of it.", metavar="ID")]


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


def _where(client: Any) -> str:
    """The Redis a command used, for error messages (the password redacted)."""
    import re

    s = client.settings
    place = re.sub(r"//([^@/]*)@", "//***@", s.redis_url) if s.redis_url else f"the embedded Redis under {s.home}"
    return f"{place} (prefix {s.prefix})"


def _import_redis() -> None:
    """Import redis-py with OpenTelemetry out of its sight. redis-py 8 imports OpenTelemetry's
    metrics API and SDK when they are installed (extra `otel`), for client metrics that stay off
    unless a program turns them on, which celery-agents never does; that import was ~40% of a CLI
    start (`agents session pending`). Hidden only while redis-py loads: tracing, if on, imports
    OpenTelemetry afterwards as usual."""
    if "redis" in sys.modules or "opentelemetry" in sys.modules:
        return
    sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # an import of it raises ImportError
    try:
        import redis  # noqa: F401
    finally:
        del sys.modules["opentelemetry"]


@contextlib.contextmanager
def _command(as_json: bool, inline: bool = False) -> Iterator[Any]:
    """A client for the command; errors become the contract's exit codes and JSON errors."""
    _import_redis()
    import redis

    from celery_agents.client import Client

    client = None
    try:
        client = Client(inline=True if inline else None)
        yield client
    except RedisUnavailable as exc:
        _fail(RedisUnavailable(f"{exc.message} — tried {_where(client)}"), as_json)
    except AgentsError as exc:
        _fail(exc, as_json)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        _fail(RedisUnavailable(f"cannot reach Redis at {_where(client)}: {exc}"), as_json)
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


def _print_view(view: Any, as_json: bool, thinking: Thinking = Thinking.none, answer_to_stdout: bool = False) -> None:
    """The session view on stdout; with `answer_to_stdout` (`run`) only the answer goes to
    stdout and the view, a summary, to stderr."""
    from celery_agents.cli import output

    if as_json:
        output.emit_json(view.to_json())
        return
    if thinking != Thinking.none and view.state.value == "completed":
        _print_thinking(view, thinking)
    output.render_view(view, output.err if answer_to_stdout else output.out, answer=not answer_to_stdout)
    if answer_to_stdout and view.state.value == "completed" and view.response is not None:
        sys.stdout.write(output.printable(view.response) + "\n")
        sys.stdout.flush()


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
        return {p.call_id: p.token for p in client.store.pending_view(session_id) if p.token}

    return Progress(lines=not as_json, tokens=tokens, queued=not client.inline)


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
    workers = client.store.live_workers()
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


def _load_agent(agent_file: Path) -> Any:
    """The agent file, validated; fields of agents-exe files that are not used here are named
    on stderr (they are ignored, not refused)."""
    from celery_agents.model import load_agent_file

    spec = load_agent_file(agent_file)
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
        spec = _load_agent(agent_file) if agent_file is not None else None
        query = _prompt(client.settings.media_max_bytes, *prompt) if prompt is not None else None
        if session_id is not None:
            session_id = client.resolve(session_id)
        if warn:
            agent = spec if spec is not None else client.store.agent(client.store.header(session_id).agent_hash)
            _warn_no_workers(client, _queues_used(agent))
        progress = _progress(as_json, client)
        progress.session_id = session_id
        try:
            with progress:
                view = action(client, _subject(spec, query, session_id), progress)
        except KeyboardInterrupt:
            _interrupted(client, progress.session_id)
        if thinking != Thinking.none or answer_to_stdout:
            view = client.view(view.session_id, detail=True)
        _print_view(view, as_json, thinking, answer_to_stdout=answer_to_stdout)
        if answer_to_stdout and not as_json:
            _summarise_failed_calls(view)
        _exit_if_ended_badly(view)


def _subject(spec: Any, query: Any, session_id: str | None) -> Any:
    """What an advancing command acts on: (agent, prompt), (session, message) or a session."""
    if spec is not None:
        return (spec, query)
    return (session_id, query) if query is not None else session_id


def _interrupted(client: Any, session_id: str | None) -> NoReturn:
    """Ctrl-C while a command drove a session: say whether it goes on or was paused, and how to
    continue; exit 130."""
    from celery_agents.cli.output import err

    if session_id is None:
        raise typer.Exit(130)
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
) -> None:
    """Start a session and drive it until it completes or only outside work remains; print the answer."""
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, spec_query, progress: client.start(
            *spec_query, run=True, wait=wait, timeout=timeout, on_event=progress, on_created=progress.created
        ),
        agent_file=agent_file,
        prompt=(prompt, file, media),
        answer_to_stdout=True,
    )


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
) -> None:
    """Create a session from a prompt (the model is not called unless --step or --run)."""
    if step and run_:
        _fail(InvalidInput("choose --step or --run, not both"), as_json)
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, spec_query, progress: client.start(
            *spec_query, step=step, run=run_, wait=wait, timeout=timeout, on_event=progress, on_created=progress.created
        ),
        agent_file=agent_file,
        prompt=(prompt, file, media),
        warn=step or run_,
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
) -> None:
    """Send a follow-up message: continue a completed session, or queue it for a waiting or running
    one (delivered after the pending tool results, before the next model call)."""
    if step and run_:
        _fail(InvalidInput("choose --step or --run, not both"), as_json)
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid_query, progress: client.send(
            *sid_query, step=step, run=run_, wait=wait, timeout=timeout, on_event=progress
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
) -> None:
    """Drive the session until it completes or only outside work remains (a failed one is retried)."""
    _advance(
        as_json,
        inline,
        thinking,
        lambda client, sid, progress: client.resume(sid, wait=wait, timeout=timeout, on_event=progress),
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
    """Complete a deferred call with its result (JSON, or text); an auto-driven session then
    continues by itself. Tokens are listed by `agents session pending`."""
    from celery_agents.cli.output import emit_json, render_completion
    from celery_agents.cli.prompt import check_token_shape, parse_result, read_result

    with _command(as_json) as client:
        check_token_shape(token)
        raw = read_result(result_file)
        max_bytes = client.settings.max_result_bytes
        value = raw.strip() if error or text else parse_result(raw, max_bytes, result_file)
        outcome = client.complete(token, value, error=error, by=by)
        if as_json:
            emit_json(outcome.model_dump(mode="json"))
        else:
            workers = outcome.woken and bool(client.store.live_workers())
            render_completion(outcome, inline=client.inline, workers=workers)


@session_app.command("run-isolated")
def session_run_isolated(session_id: SessionArg, as_json: JsonOpt = False) -> None:
    """Run the session's unfinished runIsolated calls in this process, sandboxed, and record them."""
    with _command(as_json) as client:
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
    as_json: JsonOpt = False,
) -> None:
    """Print the session's events, one per line: time and what happened (with --json, one JSON
    document per event, one per line). --follow keeps printing until the session ends."""
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
    session_ids: Annotated[list[str], typer.Argument(help="Session ids (or unique prefixes).", metavar="ID...")],
    force: Annotated[bool, typer.Option("--force", help="Cancel an active session, then delete it.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Delete finished sessions: every key of each in Redis and its entries in every index."""
    from celery_agents.cli.output import emit_json, out

    with _command(as_json) as client:
        deleted = [client.delete(sid, force=force) for sid in session_ids]
        if as_json:
            emit_json({"deleted": deleted})
        else:
            for sid in deleted:
                out.print(f"deleted {sid}")


@session_app.command("purge")
def session_purge(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Age since the last update: 30d, 12h, 45m or 90s.", metavar="AGE")
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

    Steps wait on the model in threads (--step-threads per process, --step-processes processes);
    tool calls run in a prefork pool of --concurrency processes. One process supervises them all."""
    import os
    import socket

    from celery_agents.tasks.config import QUEUES
    from celery_agents.tasks.supervisor import Supervisor, WorkerPlan, default_step_processes

    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in wanted if q not in QUEUES]
    if unknown or not wanted:
        _fail(InvalidInput(f"unknown queue(s): {', '.join(unknown) or '(none given)'}; use {', '.join(QUEUES)}"), False)
    from celery_agents.config import Settings
    from celery_agents.observe.logs import configure_root

    configure_root(Settings.from_env().log_format == "json", loglevel)
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
    except AgentsError as exc:  # the state Redis unreachable or unsafe: refuse to start
        _fail(exc, False)
    raise typer.Exit(code)


@app.command("mcp-server")
def mcp_server(
    wait: Annotated[
        float, typer.Option("--wait", help="How long start_session waits for a session to settle (seconds).", min=0)
    ] = 120.0,
) -> None:
    """Serve celery-agents as an MCP server on stdio: start_session, session_status, pending, complete."""
    from celery_agents.mcp_server import serve_stdio

    try:
        serve_stdio(wait)
    except AgentsError as exc:
        _fail(exc, False)


@app.command()
def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (not loopback: AGENTS_API_TOKEN needed).")
    ] = ("127.0.0.1"),
    port: Annotated[int, typer.Option("--port", help="Port to listen on.", min=0, max=65535)] = 8765,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l", help="Log level.")] = "info",
) -> None:
    """Serve the HTTP API (/v1, OpenAPI at /docs), the approvals page (/) and /metrics.

    With AGENTS_API_TOKEN set every request needs `Authorization: Bearer <token>` (the page asks
    for it once); without it only a loopback address is served."""
    from celery_agents.config import Settings
    from celery_agents.web.security import check_bind

    try:
        settings = Settings.from_env()
        check_bind(host, settings.api_token)
    except AgentsError as exc:
        _fail(exc, False)
    import uvicorn

    from celery_agents.web.app import create_app

    sys.stderr.write(f"serving http://{host}:{port}/ (API at /v1, docs at /docs)\n")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=loglevel.lower())


@app.command()
def doctor(as_json: JsonOpt = False) -> None:
    """Check Redis, persistence settings, workers, queues, owed steps and rejected completions."""
    from celery_agents.cli.doctor import diagnose, render

    with _command(as_json) as client:
        report = diagnose(client)
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
