"""Settings read from the environment, in one place.

`AGENTS_REDIS_URL` unset means the embedded local default: a redis-server started from the
package with its data under `AGENTS_HOME`, and steps run in the calling process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


def _int_env(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a whole number") from exc
    if value <= 0:
        raise ValueError(f"environment variable {name}={raw!r} must be positive")
    return value


#: the default of AGENTS_MAX_RESULT_BYTES and AGENTS_MAX_PROMPT_BYTES
ONE_MIB = 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """Where state lives and how long things may take."""

    redis_url: str | None = None
    broker_url: str | None = None
    prefix: str = "agents"
    home: Path = field(default_factory=lambda: Path("~/.local/share/celery-agents").expanduser())
    #: hard limit of one step (LLM call + inline tools); the soft limit is a bit shorter
    step_time_limit: float = 600.0
    #: hard limit of one runAsync / runIsolated tool task
    tool_time_limit: float = 900.0
    #: the broker redelivers an unacknowledged message after this long: it must exceed every limit
    visibility_timeout: float = 3600.0
    #: how long a step holds its session lease before another worker may take over
    lease_seconds: float = 30.0
    #: how often worker services sweep owed steps, deadlines and lapsed leases
    sweep_interval: float = 1.0
    #: a step or call whose worker died (lease lapsed) is published again after this long
    owed_grace: float = 10.0
    #: an owed step or call never picked up is published again after this long even while its
    #: queue is busy (sooner when the queue is empty)
    lost_grace: float = 300.0
    #: clock skew tolerated between hosts when the sweeper compares publish times
    skew_margin: float = 10.0
    #: events kept per session (approximate cap of the stream)
    events_maxlen: int = 2000
    #: how often (seconds) the broker puts back messages unacknowledged past the visibility timeout
    restore_interval: float = 10.0
    #: a result (completion, or a tool's answer) larger than this is refused or cut (bytes of JSON)
    max_result_bytes: int = ONE_MIB
    #: a prompt larger than this is refused (bytes of its text)
    max_prompt_bytes: int = ONE_MIB
    #: user messages that may wait for a session's next model call (`session send`)
    max_queued_messages: int = 100
    #: signs stored agent specs; workers run nothing of a spec that does not verify. Never stored,
    #: never printed (kept out of repr).
    spec_key: str | None = field(default=None, repr=False)
    #: finished sessions (completed, failed, cancelled) not updated for this many days are deleted
    #: by the workers, a few per sweep; None keeps them forever
    retention_days: float | None = None
    #: AGENTS_ALLOW_EVICTION=1: run on a Redis whose maxmemory-policy may evict keys
    allow_eviction: bool = False
    #: AGENTS_API_TOKEN: `agents serve` asks every request for it (`Authorization: Bearer`); unset,
    #: it serves loopback addresses only. Never stored, never printed.
    api_token: str | None = field(default=None, repr=False)

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = os.environ
        home = env.get("AGENTS_HOME")
        s = cls(
            redis_url=env.get("AGENTS_REDIS_URL") or None,
            broker_url=env.get("AGENTS_BROKER_URL") or None,
            prefix=env.get("AGENTS_PREFIX") or "agents",
            home=Path(home).expanduser() if home else Path("~/.local/share/celery-agents").expanduser(),
            step_time_limit=_float_env("AGENTS_STEP_TIME_LIMIT", 600.0),
            tool_time_limit=_float_env("AGENTS_TOOL_TIME_LIMIT", 900.0),
            visibility_timeout=_float_env("AGENTS_VISIBILITY_TIMEOUT", 3600.0),
            lease_seconds=_float_env("AGENTS_LEASE_SECONDS", 30.0),
            sweep_interval=_float_env("AGENTS_SWEEP_INTERVAL", 1.0),
            owed_grace=_float_env("AGENTS_OWED_GRACE", 10.0),
            lost_grace=_float_env("AGENTS_LOST_GRACE", 300.0),
            skew_margin=_float_env("AGENTS_CLOCK_SKEW", 10.0),
            restore_interval=_float_env("AGENTS_RESTORE_INTERVAL", 10.0),
            max_result_bytes=_int_env("AGENTS_MAX_RESULT_BYTES", ONE_MIB),
            max_prompt_bytes=_int_env("AGENTS_MAX_PROMPT_BYTES", ONE_MIB),
            spec_key=env.get("AGENTS_SPEC_KEY") or None,
            retention_days=max(_float_env("AGENTS_RETENTION_DAYS", 0.0), 0.0) or None,
            allow_eviction=env.get("AGENTS_ALLOW_EVICTION") == "1",
            api_token=env.get("AGENTS_API_TOKEN") or None,
        )
        return replace(s, **overrides) if overrides else s  # type: ignore[arg-type]
