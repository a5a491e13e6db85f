"""Importing redis-py with less of it: OpenTelemetry out of its sight always, and for a command
that reads and ends (`agents session pending`...) its asyncio client too.

redis-py 8 imports OpenTelemetry's metrics API and SDK when they are installed (extra `otel`), for
client metrics that stay off unless a program turns them on, which celery-agents never does; that
import was ~40% of a CLI start. Hidden only while redis-py loads: tracing, if on, imports
OpenTelemetry afterwards as usual.

`redis/__init__.py` also imports `redis.asyncio` (its client, cluster and sentinel modules), which
nothing of a synchronous command uses: ~10 ms of its start. `lean=True` loads redis-py with a
stand-in for that package's `__init__` (its submodules still load from its folder, as
`redis.commands` needs one of them) and takes the stand-in away after, so that a later
`import redis.asyncio` loads the real package and puts it in its place.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types


def import_redis(lean: bool = False) -> None:
    """Import redis-py (once per process; later calls do nothing)."""
    if "redis" in sys.modules:
        return
    hidden = "opentelemetry" not in sys.modules
    if hidden:
        sys.modules["opentelemetry"] = None  # type: ignore[assignment]  # an import of it raises ImportError
    stand_in = _asyncio_stand_in() if lean else None
    try:
        import redis  # noqa: F401
    finally:
        if hidden:
            del sys.modules["opentelemetry"]
        if stand_in is not None and sys.modules.get("redis.asyncio") is stand_in:
            del sys.modules["redis.asyncio"]


def _asyncio_stand_in() -> types.ModuleType | None:
    """An empty package in the place of `redis.asyncio`, over its folder; None where redis-py has
    no such folder (then it is imported whole)."""
    spec = importlib.util.find_spec("redis")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = os.path.join(folders[0], "asyncio") if folders else ""
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        return None
    stand_in = types.ModuleType("redis.asyncio")
    stand_in.__path__ = [folder]
    stand_in.__package__ = "redis.asyncio"
    sys.modules["redis.asyncio"] = stand_in
    return stand_in
