"""The `agents` command: a thin typer layer over `celery_agents.Client`.

Every command takes `--json` (exactly one JSON document on stdout, human text on stderr) and exits
with the contract's codes: 0 ok, 1 unexpected, 2 invalid input, 3 not found, 4 wait timed out,
5 conflict. Nothing here imports litellm: commands that call a model reach it through the client.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from celery_agents.errors import AgentsError, InvalidInput, RedisUnavailable

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Durable, step-wise LLM agent sessions on Celery workers with all state in Redis.",
)
session_app = typer.Typer(
    no_args_is_help=True,
    help="Operate sessions: start, step, resume, pause, pending, complete, show, list, cancel, logs.",
)
app.add_typer(session_app, name="session")

_ARGV: list[str] = []

JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
WaitOpt = Annotated[bool, typer.Option("--wait/--no-wait", help="Wait for the outcome, or return once enqueued.")]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="Stop waiting after SECONDS (exit 4; the work goes on).", min=0)
]
InlineOpt = Annotated[bool, typer.Option("--inline", help="Run steps in this process instead of on the workers.")]
AgentOpt = Annotated[Path, typer.Option("--agent-file", "-a", help="The agent file (JSON): model, tools, policy.")]
PromptOpt = Annotated[list[str] | None, typer.Option("--prompt", "-p", help="Prompt text (repeatable).")]
FileOpt = Annotated[
    list[str] | None, typer.Option("--file", "-f", help="A text file appended to the prompt (repeatable; - for stdin).")
]
MediaOpt = Annotated[
    list[str] | None, typer.Option("--media", "-m", help="An image or other file attached to the prompt (repeatable).")
]
SessionArg = Annotated[str, typer.Argument(help="The session id.", metavar="ID")]


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


@contextlib.contextmanager
def _command(as_json: bool, inline: bool = False) -> Iterator[Any]:
    """A client for the command; errors become the contract's exit codes and JSON errors."""
    import redis

    from celery_agents.client import Client

    client = None
    try:
        client = Client(inline=True if inline else None)
        yield client
    except AgentsError as exc:
        _fail(exc, as_json)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        _fail(RedisUnavailable(f"cannot reach Redis: {exc}"), as_json)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finally:
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()


def _prompt(prompts: list[str] | None, files: list[str] | None, media: list[str] | None) -> Any:
    from celery_agents.cli.prompt import build_query, ordered_parts

    return build_query(ordered_parts(_ARGV or sys.argv[1:], prompts or [], files or [], media or []))


def _print_view(view: Any, as_json: bool, thinking: Thinking = Thinking.none, answer_to_stdout: bool = False) -> None:
    from celery_agents.cli import output

    if as_json:
        output.emit_json(view.to_json())
        return
    if thinking != Thinking.none and view.state.value == "completed":
        _print_thinking(view, thinking)
    output.render_view(view, answer=not answer_to_stdout)
    if answer_to_stdout and view.state.value == "completed" and view.response is not None:
        output.out.print(view.response, markup=False)


def _exit_if_ended_badly(view: Any) -> None:
    """A command that advanced a session succeeds when it yielded or completed; one that ended
    failed or cancelled exits 5 (the view printed says why, in its `error`)."""
    if view.state.value in ("failed", "cancelled"):
        raise typer.Exit(5)


def _print_thinking(view: Any, thinking: Thinking) -> None:
    from celery_agents.cli.output import err, out

    console = out if thinking == Thinking.stdout else err
    turns = view.turns or []
    for t in turns:
        if t.get("kind") == "LlmTurn" and t.get("reasoning"):
            console.print(f"[thinking] {t['reasoning']}", markup=False)


def _progress(as_json: bool) -> Any:
    from celery_agents.cli.output import Progress

    return Progress(enabled=True)


def _warn_no_workers(client: Any) -> None:
    if client.inline:
        return
    workers = client.store.live_workers()
    served = {q for w in workers for q in w.get("queues", [])}
    warnings = []
    if not workers:
        warnings.append("no worker is running: start one with `agents worker` (or use --inline)")
    else:
        for queue, what in (("steps", "steps"), ("tools", "runAsync calls"), ("isolated", "runIsolated calls")):
            if queue not in served:
                hint = " (or run them here: agents session run-isolated ID)" if queue == "isolated" else ""
                warnings.append(f"no worker consumes the {queue} queue: {what} wait until one does{hint}")
    if warnings:
        from celery_agents.cli.output import err

        for w in warnings:
            err.print(f"[yellow]{w}[/]")


def _advance(
    as_json: bool,
    inline: bool,
    thinking: Thinking,
    action: Callable[[Any, Any, Any], Any],
    *,
    prompt: tuple[list[str] | None, list[str] | None, list[str] | None] | None = None,
    warn: bool = True,
    answer_to_stdout: bool = False,
) -> None:
    """A command that advances a session: build the prompt if any, run `action(client, query,
    progress)`, print the view; exit 5 when the session ended failed or cancelled."""
    with _command(as_json, inline) as client:
        query = _prompt(*prompt) if prompt is not None else None
        if warn:
            _warn_no_workers(client)
        with _progress(as_json) as progress:
            view = action(client, query, progress)
        if thinking != Thinking.none:
            view = client.view(view.session_id, detail=True)
        _print_view(view, as_json, thinking, answer_to_stdout=answer_to_stdout)
        _exit_if_ended_badly(view)


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
        lambda client, query, progress: client.start(
            agent_file, query, run=True, wait=wait, timeout=timeout, on_event=progress
        ),
        prompt=(prompt, file, media),
        answer_to_stdout=True,
    )


@session_app.command("start")
def session_start(
    agent_file: AgentOpt,
    prompt: PromptOpt = None,
    file: FileOpt = None,
    media: MediaOpt = None,
    step: Annotated[bool, typer.Option("--step", help="Also run one step.")] = False,
    run_: Annotated[bool, typer.Option("--run", help="Drive it until it completes or waits outside.")] = False,
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
        lambda client, query, progress: client.start(
            agent_file, query, step=step, run=run_, wait=wait, timeout=timeout, on_event=progress
        ),
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
        lambda client, _, progress: client.step(session_id, wait=wait, timeout=timeout, on_event=progress),
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
        lambda client, _, progress: client.resume(session_id, wait=wait, timeout=timeout, on_event=progress),
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
    by: Annotated[str | None, typer.Option("--by", help="Who completes it (recorded).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Complete a deferred call with its result; an auto-driven session then continues by itself."""
    from celery_agents.cli.output import emit_json, render_completion
    from celery_agents.cli.prompt import parse_result, read_result

    with _command(as_json) as client:
        raw = read_result(result_file)
        outcome = client.complete(token, raw.strip() if error else parse_result(raw), error=error, by=by)
        if as_json:
            emit_json(outcome.model_dump(mode="json"))
        else:
            render_completion(outcome)


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
        str | None, typer.Option("--status", help="ready, tools, waiting, completed, failed or cancelled.")
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
    follow: Annotated[bool, typer.Option("--follow", "-F", help="Keep printing new events.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Print the session's events, one per line (JSON lines with --json)."""
    import json

    from celery_agents.cli.output import event_line

    with _command(as_json) as client:
        for e in client.events(session_id, follow=follow):
            if as_json:
                sys.stdout.write(json.dumps(e, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(event_line(e) + "\n")
            sys.stdout.flush()


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option("--queues", "-Q", help="Queues to consume, comma-separated.")
    ] = "steps,tools,isolated",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", help="Worker processes.", min=1)] = 2,
    name: Annotated[str | None, typer.Option("--name", "-n", help="Worker name (Celery hostname).")] = None,
    loglevel: Annotated[str, typer.Option("--loglevel", "-l", help="Log level.")] = "INFO",
) -> None:
    """Run a Celery worker for steps and tool calls (on the embedded Redis when AGENTS_REDIS_URL is unset)."""
    from celery_agents.tasks.config import QUEUES, worker_argv

    wanted = [q.strip() for q in queues.split(",") if q.strip()]
    unknown = [q for q in wanted if q not in QUEUES]
    if unknown or not wanted:
        _fail(InvalidInput(f"unknown queue(s): {', '.join(unknown) or '(none given)'}; use {', '.join(QUEUES)}"), False)
    from celery_agents.tasks import app as celery_app

    argv = worker_argv(wanted, concurrency, loglevel, name)
    celery_app.worker_main(argv)


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
