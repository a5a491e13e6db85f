"""What a command that reads, prints and ends leaves out of its start, shared by the entry point
(`cli/entry.py`) and typer's commands (`cli/main.py`); imports neither."""

from __future__ import annotations

import gc
import os
from typing import Any

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
    from celery_agents.redis_urls import redact_url

    s = settings
    place = redact_url(s.redis_url) if s.redis_url else f"the embedded Redis under {s.home}"
    return f"{place} (prefix {s.prefix})"
