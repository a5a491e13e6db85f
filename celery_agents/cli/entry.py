"""The `agents` console script's entry point (also `python -m celery_agents.cli`).

Every command goes through typer (`cli/main.py`) except the two that other programs poll: `agents
session pending [ID] [--limit N] --json` (the calls waiting on a person or another system) and
`agents session show ID --json` (a session's state) are answered here without importing typer or
building the command tree (~25 ms of a ~280 ms command on a 2-core VM, docs/performance.md). They
print the same document and exit with the same codes as through typer; any other spelling of them
(`--help`, an option they do not know or given twice, a value typer would refuse or read
differently) goes through typer, which says what is wrong.

Commands that read, print and end also start lean (`cli/lean.py`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from celery_agents.cli.lean import go_brief, where

if TYPE_CHECKING:
    from celery_agents.client import Client
    from celery_agents.errors import AgentsError

#: `session pending`'s default `--limit` (as `cli/main.py` declares it)
PENDING_LIMIT = 1000
#: a `--limit` answered here: a positive number in plain digits (typer reads every other spelling)
_LIMIT = re.compile(r"[1-9][0-9]{0,8}")


def pending_request(args: list[str]) -> tuple[str | None, int] | None:
    """(session id or None, limit) when `args` are `session pending [ID] [--limit N] --json` in
    any order, each at most once, N in plain digits; else None (typer reads them)."""
    if args[:2] != ["session", "pending"]:
        return None
    session_id: str | None = None
    limit: int | None = None
    as_json = False
    rest = iter(args[2:])
    for arg in rest:
        if arg == "--json" and not as_json:
            as_json = True
        elif arg == "--limit" and limit is None:
            value = next(rest, "")
            if not _LIMIT.fullmatch(value):
                return None
            limit = int(value)
        elif arg.startswith("--limit=") and limit is None and _LIMIT.fullmatch(arg[8:]):
            limit = int(arg[8:])
        elif arg and not arg.startswith("-") and session_id is None:
            session_id = arg
        else:
            return None
    return (session_id, PENDING_LIMIT if limit is None else limit) if as_json else None


def show_request(args: list[str]) -> str | None:
    """The session id when `args` are `session show ID --json` in any order, each once; else None."""
    if args[:2] != ["session", "show"]:
        return None
    session_id: str | None = None
    as_json = False
    for arg in args[2:]:
        if arg == "--json" and not as_json:
            as_json = True
        elif arg and not arg.startswith("-") and session_id is None:
            session_id = arg
        else:
            return None
    return session_id if as_json else None


def _fail(exc: AgentsError) -> NoReturn:
    from celery_agents.cli.output import emit_json

    emit_json(exc.to_json())
    raise SystemExit(exc.exit_code)


def answer(read: Callable[[Client], Any]) -> NoReturn:
    """Print the document `read` makes of what a client reads, or the error, as `cli/main.py`
    `_command` does for a command with `--json` (printed before the client closes); then exit
    with the contract's code."""
    from celery_agents.cli.output import emit_json
    from celery_agents.client import Client
    from celery_agents.config import Settings
    from celery_agents.errors import AgentsError, InvalidInput, RedisUnavailable

    try:
        settings = Settings.from_env()
    except ValueError as exc:
        _fail(InvalidInput(str(exc)))
    client = None
    try:
        client = Client(settings)
        emit_json(read(client))
    except RedisUnavailable as exc:
        _fail(RedisUnavailable(f"{exc.message} — tried {where(settings)}"))
    except AgentsError as exc:
        _fail(exc)
    finally:
        if client is not None:
            with contextlib.suppress(Exception):  # closing what is gone already
                client.close()
    raise SystemExit(0)


def quick(args: list[str]) -> Callable[[Client], Any] | None:
    """What a command answered here reads (`answer`), or None: typer runs it."""
    listing = pending_request(args)
    if listing is not None:
        session_id, limit = listing
        return lambda client: {"pending": [p.model_dump(mode="json") for p in client.pending(session_id, limit=limit)]}
    shown = show_request(args)
    if shown is not None:
        return lambda client: client.show(shown).to_json()
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `agents` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    read = quick(args)
    if read is None:
        from celery_agents.cli.main import main as typer_main

        typer_main(args)
        return
    try:
        go_brief()
        answer(read)
    except KeyboardInterrupt:
        raise SystemExit(130) from None  # as typer ends a command Ctrl-C stopped: no traceback
    except BrokenPipeError:
        # The reader left (`| head`): exit 1 without a traceback, as typer does, and with nothing
        # left for the interpreter's last flush of stdout to fail on.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None
    finally:
        # As `cli/main.py` `main`: what the imports made is left out of the shutdown's collection.
        gc.freeze()
