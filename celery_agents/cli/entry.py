"""The `agents` console script's entry point (also `python -m celery_agents.cli`).

Every command goes through typer (`cli/main.py`) except the one other programs poll: `agents
session pending [ID] [--limit N] --json`, the calls waiting on a person or another system, is
answered here without importing typer or building the command tree (~40 ms of its ~280 on a 2-core
VM, docs/performance.md). It prints the same document and exits with the same codes as through
typer; any other spelling of it (`--help`, an option it does not know, a value typer would
refuse or read differently) goes through typer, which says what is wrong.

Commands that read, print and end also start lean (`go_brief`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from celery_agents.errors import AgentsError

#: commands that read, print and end (with none of `_FOLLOWS`): `go_brief`
_BRIEF = frozenset(
    {
        ("session", "pending"),
        ("session", "show"),
        ("session", "list"),
        ("session", "history"),
        ("session", "logs"),
        ("limits", "list"),
    }
)
_FOLLOWS = frozenset({"--follow", "-F"})
#: the youngest generation's threshold of the collector during such a command (Python's is 700)
BRIEF_GC_THRESHOLD = 100_000
#: `session pending`'s default `--limit` (as `cli/main.py` declares it)
PENDING_LIMIT = 1000
#: a `--limit` answered here: a positive number in plain digits (typer reads every other spelling)
_LIMIT = re.compile(r"[1-9][0-9]{0,8}")


def brief(args: list[str]) -> bool:
    """`args` name a command of `_BRIEF`, not following anything."""
    words = tuple(a for a in args if not a.startswith("-"))[:2]
    return words in _BRIEF and not _FOLLOWS & set(args)


def go_brief() -> None:
    """What a command that reads and ends does not need, left out of its start (~12% of it,
    docs/performance.md): the cyclic garbage collector walking the objects of every import again
    and again while they load (it runs once per `BRIEF_GC_THRESHOLD` new objects instead of 700,
    so that a command that drives a woken session inline still collects); pydantic's search of
    every installed package for plugins; redis-py's asyncio client."""
    gc.set_threshold(BRIEF_GC_THRESHOLD)
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from celery_agents.redis_import import import_redis

    import_redis(lean=True)


def where(settings: Any) -> str:
    """The Redis of `settings`, for error messages (the password redacted)."""
    s = settings
    place = re.sub(r"//([^@/]*)@", "//***@", s.redis_url) if s.redis_url else f"the embedded Redis under {s.home}"
    return f"{place} (prefix {s.prefix})"


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


def _fail(exc: AgentsError) -> NoReturn:
    from celery_agents.cli.output import emit_json

    emit_json(exc.to_json())
    raise SystemExit(exc.exit_code)


def pending(session_id: str | None, limit: int) -> NoReturn:
    """`agents session pending [ID] --limit N --json`, as `cli/main.py` `session_pending` runs it."""
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
        calls = client.pending(session_id, limit=limit)
    except RedisUnavailable as exc:
        _fail(RedisUnavailable(f"{exc.message} — tried {where(settings)}"))
    except AgentsError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    finally:
        if client is not None:
            with contextlib.suppress(Exception):  # closing what is gone already
                client.close()
    emit_json({"pending": [p.model_dump(mode="json") for p in calls]})
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `agents` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    quick = pending_request(args)
    if quick is None:
        from celery_agents.cli.main import main as typer_main

        typer_main(args)
        return
    go_brief()
    try:
        pending(*quick)
    finally:
        # As `cli/main.py` `main`: what the imports made is left out of the shutdown's collection.
        gc.freeze()
