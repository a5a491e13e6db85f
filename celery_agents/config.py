"""Settings: every `AGENTS_*` variable, in one model read from the environment once, when asked.

`Settings` is a frozen dataclass: making one (`Settings(redis_url=...)`) reads nothing, and
`Settings.from_env()` reads each field's variable (named in the field's metadata) and validates
them with pydantic. Nothing reads the environment at import time. `AGENTS_REDIS_URL` unset means
the embedded local default: a redis-server started from the package with its data under
`AGENTS_HOME`, and steps run in the calling process. `docs/architecture.md` has the table of every
variable, checked against this model by tests/test_config.py.

pydantic-settings was measured for the reading (docs/architecture.md, "Settings"): importing it
adds ~170 ms (the least of 12 runs on a 2-core machine; argparse, dotenv and its cloud providers
come with it) to a CLI start of ~230 ms, so the few lines below read the variables and pydantic, already loaded by every
command, validates them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import AfterValidator, BeforeValidator, Field, TypeAdapter, ValidationError

#: the default of AGENTS_MAX_RESULT_BYTES and AGENTS_MAX_PROMPT_BYTES
ONE_MIB = 1024 * 1024
DEFAULT_HOME = "~/.local/share/celery-agents"


def env(name: str, meaning: str) -> dict[str, str]:
    """A field's metadata: the variable it is read from and what it means (for the docs' table)."""
    return {"env": name, "meaning": meaning}


def _expand(path: Path) -> Path:
    return path.expanduser()


def _lower(value: str) -> str:
    return value.lower()


def _flag(value: object) -> object:
    # Exactly "1" turns a flag on (as before this model existed); anything else leaves it off.
    return value == "1" if isinstance(value, str) else value


def _off_when_not_positive(days: float | None) -> float | None:
    return days if days is not None and days > 0 else None


def _lower_text(value: object) -> object:
    return value.strip().lower() if isinstance(value, str) else value


_SWITCH = {"on": "1", "true": "1", "yes": "1", "off": "0", "false": "0", "no": "0"}


def _switch(value: object) -> object:
    text = _lower_text(value)
    return _SWITCH.get(text, text) if isinstance(text, str) else text


def _names(value: object) -> object:
    """A comma-separated list of names as a tuple (blanks dropped)."""
    return tuple(n.strip() for n in value.split(",") if n.strip()) if isinstance(value, str) else value


def _tool_variables(names: tuple[str, ...]) -> tuple[str, ...]:
    for name in names:
        if not name.replace("_", "a").isalnum() or name[0].isdigit():
            raise ValueError(f"{name!r} is not the name of an environment variable")
        if name.upper().startswith("AGENTS_"):
            raise ValueError(f"{name} is a setting of the worker, never given to a tool")
    return names


def _networks(value: object) -> object:
    """Comma-separated CIDRs (a bare address is its own /32 or /128) as a tuple of networks."""
    if not isinstance(value, str):
        return value
    networks = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not an IP network (a CIDR such as 10.0.0.0/8, or an address)") from None
    return tuple(networks)


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Positive = Annotated[int, Field(gt=0)]
Choice = Annotated[str, AfterValidator(_lower)]


@dataclass(frozen=True)
class Settings:
    """Where state lives, how long things may take, and how far inputs may go."""

    redis_url: str | None = field(
        default=None, metadata=env("AGENTS_REDIS_URL", "Redis for session state (and the broker); unset: embedded")
    )
    broker_url: str | None = field(
        default=None, metadata=env("AGENTS_BROKER_URL", "the Celery broker, when not the state Redis")
    )
    prefix: str = field(default="agents", metadata=env("AGENTS_PREFIX", "the prefix of every Redis key"))
    home: Annotated[Path, AfterValidator(_expand)] = field(
        default_factory=lambda: Path(DEFAULT_HOME).expanduser(),
        metadata=env("AGENTS_HOME", "where the embedded Redis keeps its data"),
    )
    step_time_limit: float = field(
        default=600.0, metadata=env("AGENTS_STEP_TIME_LIMIT", "hard limit (s) of one step in a prefork worker")
    )
    tool_time_limit: float = field(
        default=900.0, metadata=env("AGENTS_TOOL_TIME_LIMIT", "hard limit (s) of one runAsync/runIsolated task")
    )
    visibility_timeout: float = field(
        default=3600.0,
        metadata=env("AGENTS_VISIBILITY_TIMEOUT", "the broker redelivers an unacknowledged message after this (s)"),
    )
    lease_seconds: float = field(
        default=30.0, metadata=env("AGENTS_LEASE_SECONDS", "how long a step or call holds its lease unrenewed (s)")
    )
    redis_outage_seconds: float = field(
        default=30.0,
        metadata=env(
            "AGENTS_REDIS_OUTAGE_SECONDS", "how long a worker waits out an unreachable Redis before it gives up (s)"
        ),
    )
    sweep_interval: float = field(
        default=1.0, metadata=env("AGENTS_SWEEP_INTERVAL", "how often workers sweep owed steps and deadlines (s)")
    )
    owed_grace: float = field(
        default=10.0,
        metadata=env("AGENTS_OWED_GRACE", "an owed step or call whose worker died is published again after this (s)"),
    )
    lost_grace: float = field(
        default=300.0,
        metadata=env("AGENTS_LOST_GRACE", "an owed step or call never picked up goes again after this (s)"),
    )
    clock_skew: float = field(
        default=10.0,
        metadata=env("AGENTS_CLOCK_SKEW", "clock skew tolerated between hosts when comparing publish times (s)"),
    )
    #: events kept per session (approximate cap of the stream); not an environment setting
    events_maxlen: int = 2000
    limits_burst: float = field(
        default=1.0,
        metadata=env("AGENTS_LIMITS_BURST", "seconds' worth of a rate limit's calls that may start at once"),
    )
    limits_refresh: float = field(
        default=1.0,
        metadata=env("AGENTS_LIMITS_REFRESH", "how long a worker trusts its copy of the fleet's limits (s)"),
    )
    restore_interval: float = field(
        default=10.0,
        metadata=env("AGENTS_RESTORE_INTERVAL", "how often the broker puts back messages past visibility (s)"),
    )
    max_result_bytes: Positive = field(
        default=ONE_MIB, metadata=env("AGENTS_MAX_RESULT_BYTES", "a larger result is refused or cut (bytes of JSON)")
    )
    max_prompt_bytes: Positive = field(
        default=ONE_MIB, metadata=env("AGENTS_MAX_PROMPT_BYTES", "a larger prompt is refused (bytes of its text)")
    )
    max_queued_messages: Positive = field(
        default=100,
        metadata=env("AGENTS_MAX_QUEUED_MESSAGES", "user messages that may wait for a session's next model call"),
    )
    media_max_bytes: int = field(
        default=20 * ONE_MIB, metadata=env("AGENTS_MEDIA_MAX_BYTES", "a larger --media attachment is refused (bytes)")
    )
    mcp_max_tools: Positive = field(
        default=256, metadata=env("AGENTS_MCP_MAX_TOOLS", "an MCP server listing more tools is refused at load")
    )
    mcp_max_description_bytes: Positive = field(
        default=4096,
        metadata=env("AGENTS_MCP_MAX_DESCRIPTION_BYTES", "an MCP tool with a longer description is refused (bytes)"),
    )
    mcp_max_schema_bytes: Positive = field(
        default=64 * 1024,
        metadata=env(
            "AGENTS_MCP_MAX_SCHEMA_BYTES", "an MCP tool with a larger input schema is refused (bytes of JSON)"
        ),
    )
    mcp_max_listing_bytes: Positive = field(
        default=256 * 1024,
        metadata=env(
            "AGENTS_MCP_MAX_LISTING_BYTES",
            "an MCP server whose descriptions and schemas come to more is refused (bytes)",
        ),
    )
    #: never stored, never printed (kept out of repr)
    spec_key: str | None = field(
        default=None, repr=False, metadata=env("AGENTS_SPEC_KEY", "signs stored agent specs (HMAC-SHA256)")
    )
    retention_days: Annotated[float | None, AfterValidator(_off_when_not_positive)] = field(
        default=None,
        metadata=env("AGENTS_RETENTION_DAYS", "finished sessions older than this (days) are deleted; unset: kept"),
    )
    allow_eviction: Annotated[bool, BeforeValidator(_flag)] = field(
        default=False, metadata=env("AGENTS_ALLOW_EVICTION", "1: run on a Redis whose maxmemory-policy may evict")
    )
    ack_fsync: Annotated[bool, BeforeValidator(_flag)] = field(
        default=False,
        metadata=env(
            "AGENTS_ACK_FSYNC", "1: start, send and complete return once Redis fsynced them (Redis ≥ 7.2: WAITAOF)"
        ),
    )
    ack_replicas: Annotated[int, Field(ge=0)] | None = field(
        default=None,
        metadata=env(
            "AGENTS_ACK_REPLICAS",
            "writes wait until this many replicas have them (WAIT); unset: 1 on Sentinel or a Cluster, else 0",
        ),
    )
    index_shards: Annotated[int, Field(ge=1, le=1024)] | None = field(
        default=None,
        metadata=env(
            "AGENTS_INDEX_SHARDS",
            "keys the global indexes are split into (one hash slot each); unset: 16 on a Cluster, else 1",
        ),
    )
    llm_attempts: Positive = field(
        default=4, metadata=env("AGENTS_LLM_ATTEMPTS", "attempts of one model call (transient failures)")
    )
    llm_backoff: float = field(
        default=1.0, metadata=env("AGENTS_LLM_BACKOFF", "first backoff between model attempts (s, doubled, jittered)")
    )
    llm_max_backoff: float = field(
        default=30.0, metadata=env("AGENTS_LLM_MAX_BACKOFF", "longest backoff between model attempts (s)")
    )
    llm_timeout: float = field(
        default=120.0, metadata=env("AGENTS_LLM_TIMEOUT", "a model call may take this long before it times out (s)")
    )
    stream_flush_ms: Positive = field(
        default=200,
        metadata=env(
            "AGENTS_STREAM_FLUSH_MS", "a streaming answer's text is written to the session's events this often (ms)"
        ),
    )
    sandbox_bwrap: Choice = field(
        default="auto", metadata=env("AGENTS_SANDBOX_BWRAP", "auto, off or require: bubblewrap for runIsolated")
    )
    sandbox_uid: Choice = field(
        default="auto", metadata=env("AGENTS_SANDBOX_UID", "auto, off or a uid: the user runIsolated calls run as")
    )
    sandbox_dir: str | None = field(
        default=None, metadata=env("AGENTS_SANDBOX_DIR", "where runIsolated temporary folders go")
    )
    sandbox_cgroup: Choice = field(
        default="auto", metadata=env("AGENTS_SANDBOX_CGROUP", "auto or off: a cgroup per runIsolated run")
    )
    tool_env: Annotated[tuple[str, ...], BeforeValidator(_names), AfterValidator(_tool_variables)] = field(
        default=(),
        metadata=env(
            "AGENTS_TOOL_ENV", "variables every command tool gets besides those its `env` names (comma-separated)"
        ),
    )
    #: never stored, never printed (kept out of repr)
    api_token: str | None = field(
        default=None,
        repr=False,
        metadata=env("AGENTS_API_TOKEN", "`agents serve` asks every request for it; unset: loopback addresses only"),
    )
    trusted_proxies: Annotated[tuple[IPNetwork, ...], BeforeValidator(_networks)] = field(
        default=(),
        metadata=env(
            "AGENTS_TRUSTED_PROXIES", "`agents serve` takes X-Forwarded-For from these only (comma-separated CIDRs)"
        ),
    )
    metrics_dir: Annotated[Path, AfterValidator(_expand)] | None = field(
        default=None,
        metadata=env(
            "AGENTS_METRICS_DIR",
            "where a worker's processes keep their step latency histogram (set by `--metrics-port`)",
        ),
    )
    log_format: Annotated[Literal["text", "json"], BeforeValidator(_lower_text)] = field(
        default="text", metadata=env("AGENTS_LOG_FORMAT", "text, or json: worker logs as one JSON object per line")
    )
    tracing: Annotated[Literal["auto", "1", "0"], BeforeValidator(_switch)] = field(
        default="auto", metadata=env("AGENTS_TRACING", "1 or 0: OpenTelemetry traces; auto: on with an OTLP endpoint")
    )
    otlp_endpoint: str | None = field(
        default=None, metadata=env("OTEL_EXPORTER_OTLP_ENDPOINT", "where traces go (OTLP/HTTP; extra `otel`)")
    )
    fault_pause: str = field(
        default="", metadata=env("AGENTS_FAULT_PAUSE", "chaos tests: the checkpoint a worker stops at")
    )
    fault_pause_seconds: float = field(
        default=600.0, metadata=env("AGENTS_FAULT_PAUSE_SECONDS", "chaos tests: how long it stops there (s)")
    )
    fault_clock_shift: float = field(
        default=0.0, metadata=env("AGENTS_FAULT_CLOCK_SHIFT", "chaos tests: the worker's wall clock is off by this (s)")
    )

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    @property
    def replicas_to_ack(self) -> int:
        """How many replicas each write waits for: `AGENTS_ACK_REPLICAS`, else 1 on Sentinel or a
        Cluster (a failover promotes a replica: one that has the write keeps it), else 0."""
        if self.ack_replicas is not None:
            return self.ack_replicas
        scheme = (self.redis_url or "").split("://", 1)[0].lower()
        return 1 if scheme in ("redis+sentinel", "rediss+sentinel") or self.cluster else 0

    @property
    def cluster(self) -> bool:
        """State lives on a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
        return (self.redis_url or "").split("://", 1)[0].lower() in ("redis+cluster", "rediss+cluster")

    @property
    def shards(self) -> int:
        """Keys each global index is split into: `AGENTS_INDEX_SHARDS`, else 16 on a Cluster, else 1."""
        if self.index_shards is not None:
            return self.index_shards
        return 16 if self.cluster else 1

    @property
    def tracing_on(self) -> bool:
        """Traces are kept: AGENTS_TRACING=1, or an OTLP endpoint unless AGENTS_TRACING=0."""
        return self.tracing == "1" or (self.tracing == "auto" and bool(self.otlp_endpoint))

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """The settings of this environment (a variable set to the empty string counts as unset);
        `overrides` win over it. A value that does not fit is refused naming its variable."""
        values = {name: _parse(name, variable) for name, (variable, _) in variables().items() if _read(variable)}
        for name, variable in (("redis_url", "AGENTS_REDIS_URL"), ("broker_url", "AGENTS_BROKER_URL")):
            if values.get(name):
                _check_url(variable, values[name])
        return cls(**{**values, **overrides})

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


#: keys a worker holds in its `Settings` only: once read, they leave its process environment, so
#: neither a python tool running in it nor any program started from it inherits them
WORKER_KEYS = ("AGENTS_SPEC_KEY", "AGENTS_API_TOKEN")


def forget_keys(environ: MutableMapping[str, str] = os.environ) -> None:
    """Remove `WORKER_KEYS` from `environ` (the settings read from it keep them)."""
    for variable in WORKER_KEYS:
        environ.pop(variable, None)


def variables() -> dict[str, tuple[str, str]]:
    """Each field read from the environment: field name -> (variable, meaning)."""
    return {f.name: (f.metadata["env"], f.metadata["meaning"]) for f in dataclasses.fields(Settings) if f.metadata}


def _read(variable: str) -> str | None:
    value = os.environ.get(variable)
    return None if value is None or not value.strip() else value


def _parse(name: str, variable: str) -> Any:
    """One variable's value as its field's type. Only the variables that are set are validated, one
    small adapter each (text needs none): a schema of the whole model would cost a CLI start
    ~100 ms, an adapter ~1 ms."""
    raw = os.environ[variable]
    if _TEXT.get(name):
        return raw
    try:
        return TypeAdapter(_hints()[name]).validate_python(raw)
    except ValidationError as exc:
        why = "; ".join(e["msg"] for e in exc.errors())
        raise ValueError(f"environment variable {variable}={raw!r}: {why}") from None


#: the schemes of a Redis URL for state: one server, Sentinel, Cluster (`rediss…`: TLS)
STATE_SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")


def _check_url(variable: str, url: str) -> None:
    """A Redis URL of `variable` that cannot be one, refused naming it (a broker URL of another
    kind, `amqp://…`, is kombu's to judge)."""
    from urllib.parse import urlsplit

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    why = ""
    if variable == "AGENTS_REDIS_URL" and scheme not in STATE_SCHEMES:
        why = f"not a Redis URL: it starts with one of {', '.join(s + '://' for s in STATE_SCHEMES)}"
    elif scheme in ("redis", "rediss"):
        try:
            urlsplit(url).port  # noqa: B018 - raises on a port that is not a number (no host: localhost)
        except ValueError:
            # Not urllib's words: they quote the "port", which is a password holding a `/`.
            why = "Port could not be read as a number from 0 to 65535"
    elif scheme.endswith(("+sentinel", "+cluster")):
        from celery_agents.redis_urls import is_cluster_url, parse_cluster_url, parse_sentinel_url

        try:
            parse_cluster_url(url) if is_cluster_url(url) else parse_sentinel_url(url)
        except ValueError as exc:
            why = str(exc)
    if why:
        from celery_agents.redis_urls import redact_url

        shown = redact_url(url)
        raise ValueError(f"environment variable {variable}={shown!r}: {why}")


#: fields whose value is the variable's text as it is (their annotations, as written, say so)
_TEXT = {f.name: f.type in ("str", "str | None") for f in dataclasses.fields(Settings)}


@cache
def _hints() -> dict[str, Any]:
    return get_type_hints(Settings, include_extras=True)


def table() -> str:
    """The markdown table of every variable, its default and its meaning (docs/architecture.md
    holds it; tests/test_config.py checks it is this one)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    defaults = Settings()
    for name, (variable, meaning) in variables().items():
        rows.append(f"| `{variable}` | {_shown(name, getattr(defaults, name))} | {meaning} |")
    return "\n".join(rows)


def _shown(name: str, value: object) -> str:
    if name == "home":
        return f"`{DEFAULT_HOME}`"
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, bool):
        return "`1`" if value else "unset"
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"
