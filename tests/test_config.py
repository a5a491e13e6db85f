"""Settings: every `AGENTS_*` variable is a field of one model, read when asked (never at import),
and the table in docs/architecture.md is the model's."""

from __future__ import annotations

import subprocess
import sys
from ipaddress import ip_network
from pathlib import Path

import pytest

from celery_agents.config import Settings, table, variables

DOCS = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

#: a value of each variable's type that is not its default, and the field's value it gives
SET = {
    "AGENTS_REDIS_URL": ("redis://h:1/2", "redis://h:1/2"),
    "AGENTS_BROKER_URL": ("amqp://b", "amqp://b"),
    "AGENTS_PREFIX": ("p1", "p1"),
    "AGENTS_HOME": ("/tmp/agents-home", Path("/tmp/agents-home")),
    "AGENTS_STEP_TIME_LIMIT": ("61", 61.0),
    "AGENTS_TOOL_TIME_LIMIT": ("62", 62.0),
    "AGENTS_VISIBILITY_TIMEOUT": ("63", 63.0),
    "AGENTS_LEASE_SECONDS": ("2.5", 2.5),
    "AGENTS_REDIS_OUTAGE_SECONDS": ("12.5", 12.5),
    "AGENTS_SWEEP_INTERVAL": ("0.2", 0.2),
    "AGENTS_OWED_GRACE": ("3", 3.0),
    "AGENTS_LOST_GRACE": ("4", 4.0),
    "AGENTS_CLOCK_SKEW": ("5", 5.0),
    "AGENTS_LIMITS_BURST": ("0.1", 0.1),
    "AGENTS_LIMITS_REFRESH": ("0.25", 0.25),
    "AGENTS_RESTORE_INTERVAL": ("6", 6.0),
    "AGENTS_MAX_RESULT_BYTES": ("100", 100),
    "AGENTS_MAX_PROMPT_BYTES": ("200", 200),
    "AGENTS_MAX_QUEUED_MESSAGES": ("7", 7),
    "AGENTS_MEDIA_MAX_BYTES": ("300", 300),
    "AGENTS_MCP_MAX_TOOLS": ("10", 10),
    "AGENTS_MCP_MAX_DESCRIPTION_BYTES": ("11", 11),
    "AGENTS_MCP_MAX_SCHEMA_BYTES": ("12", 12),
    "AGENTS_MCP_MAX_LISTING_BYTES": ("13", 13),
    "AGENTS_SPEC_KEY": ("k" * 32, "k" * 32),
    "AGENTS_RETENTION_DAYS": ("7", 7.0),
    "AGENTS_ALLOW_EVICTION": ("1", True),
    "AGENTS_ACK_FSYNC": ("1", True),
    "AGENTS_ACK_REPLICAS": ("2", 2),
    "AGENTS_LLM_ATTEMPTS": ("2", 2),
    "AGENTS_LLM_BACKOFF": ("0.5", 0.5),
    "AGENTS_LLM_MAX_BACKOFF": ("9", 9.0),
    "AGENTS_LLM_TIMEOUT": ("8", 8.0),
    "AGENTS_STREAM_FLUSH_MS": ("50", 50),
    "AGENTS_SANDBOX_BWRAP": ("REQUIRE", "require"),
    "AGENTS_SANDBOX_UID": ("off", "off"),
    "AGENTS_SANDBOX_DIR": ("/tmp/boxes", "/tmp/boxes"),
    "AGENTS_SANDBOX_CGROUP": ("off", "off"),
    "AGENTS_TOOL_ENV": ("GITHUB_TOKEN, PIP_INDEX_URL", ("GITHUB_TOKEN", "PIP_INDEX_URL")),
    "AGENTS_API_TOKEN": ("t" * 32, "t" * 32),
    "AGENTS_TRUSTED_PROXIES": (
        "10.0.0.0/8, ::1,192.168.1.1",
        tuple(map(ip_network, ["10.0.0.0/8", "::1", "192.168.1.1"])),
    ),
    "AGENTS_INDEX_SHARDS": ("4", 4),
    "AGENTS_FAULT_PAUSE": ("after_commit", "after_commit"),
    "AGENTS_FAULT_PAUSE_SECONDS": ("1", 1.0),
    "AGENTS_FAULT_CLOCK_SHIFT": ("-3600", -3600.0),
    "AGENTS_METRICS_DIR": ("/tmp/m", Path("/tmp/m")),
    "AGENTS_LOG_FORMAT": ("JSON", "json"),
    "AGENTS_TRACING": ("on", "1"),
    "OTEL_EXPORTER_OTLP_ENDPOINT": ("http://127.0.0.1:4318", "http://127.0.0.1:4318"),
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable, _ in variables().values():
        monkeypatch.delenv(variable, raising=False)


def test_every_variable_is_read_into_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sorted(v for v, _ in variables().values()) == sorted(SET)
    for variable, (raw, _) in SET.items():
        monkeypatch.setenv(variable, raw)
    read = Settings.from_env()
    got = {variable: getattr(read, name) for name, (variable, _) in variables().items()}
    assert got == {variable: value for variable, (_, value) in SET.items()}


def test_an_unset_or_empty_environment_gives_the_documented_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTS_OWED_GRACE", "  ")
    monkeypatch.setenv("AGENTS_PREFIX", "")
    assert Settings.from_env() == Settings()
    assert Settings().embedded and Settings().home == Path("~/.local/share/celery-agents").expanduser()


def test_a_value_that_does_not_fit_is_refused_naming_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTS_OWED_GRACE", "soon")
    with pytest.raises(ValueError, match="AGENTS_OWED_GRACE='soon'"):
        Settings.from_env()
    monkeypatch.setenv("AGENTS_OWED_GRACE", "1")
    monkeypatch.setenv("AGENTS_MAX_RESULT_BYTES", "0")
    with pytest.raises(ValueError, match=r"AGENTS_MAX_RESULT_BYTES='0'.*greater than 0"):
        Settings.from_env()
    monkeypatch.setenv("AGENTS_MAX_RESULT_BYTES", "1")
    monkeypatch.setenv("AGENTS_TRUSTED_PROXIES", "10.0.0.0/8, 300.1.2.3")
    with pytest.raises(ValueError, match=r"AGENTS_TRUSTED_PROXIES=.*'300.1.2.3' is not an IP network"):
        Settings.from_env()


@pytest.mark.parametrize(
    ("variable", "url", "why"),
    [
        ("AGENTS_REDIS_URL", "127.0.0.1:6379", "not a Redis URL: it starts with one of redis://"),
        ("AGENTS_REDIS_URL", "bogus://x", "not a Redis URL"),
        ("AGENTS_REDIS_URL", "redis://:secret@127.0.0.1:notaport/0", r"\*\*\*@127.0.0.1:notaport/0'.*Port could not"),
        ("AGENTS_REDIS_URL", "redis+sentinel://127.0.0.1:26379", "invalid Sentinel URL: no MASTER"),
        ("AGENTS_REDIS_URL", "redis+cluster://", "Cluster"),
        ("AGENTS_BROKER_URL", "redis://127.0.0.1:x", "Port could not"),
        ("AGENTS_BROKER_URL", "redis+sentinel://", "invalid Sentinel URL"),
    ],
)
def test_a_redis_url_that_cannot_be_one_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, url: str, why: str
) -> None:
    """Not redis-py's error from deep inside the first command (a traceback in the CLI), and
    never the password."""
    monkeypatch.setenv(variable, url)
    with pytest.raises(ValueError, match=f"{variable}=.*{why}") as refused:
        Settings.from_env()
    assert "secret" not in str(refused.value)


def test_urls_of_every_documented_form_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    for url in (
        "redis://127.0.0.1:6379/0",
        "rediss://user:pw@host/1",
        "redis://localhost",
        "unix:///run/redis.sock?db=2",
        "redis+sentinel://:pw@10.0.0.1:26379,10.0.0.2/mymaster/0",
        "redis+cluster://10.0.0.1:7000,10.0.0.2:7001",
    ):
        monkeypatch.setenv("AGENTS_REDIS_URL", url)
        assert Settings.from_env().redis_url == url
    monkeypatch.setenv("AGENTS_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
    assert Settings.from_env().broker_url == "amqp://guest:guest@127.0.0.1:5672//"


def test_only_exactly_1_allows_eviction_and_no_retention_is_kept_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTS_ALLOW_EVICTION", "yes")
    monkeypatch.setenv("AGENTS_RETENTION_DAYS", "-2")
    read = Settings.from_env()
    assert (read.allow_eviction, read.retention_days) == (False, None)


def test_overrides_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTS_PREFIX", "from-env")
    assert Settings.from_env(prefix="given").prefix == "given"


def test_importing_the_cli_and_the_worker_app_reads_no_variable() -> None:
    """A variable that would not parse breaks nothing until settings are read."""
    bad = {variable: "not a number" for variable, _ in variables().values()}
    code = "import celery_agents.cli.main, celery_agents.cli.prompt, celery_agents.tasks.celery_app"
    run = subprocess.run([sys.executable, "-c", code], env={**_base_env(), **bad}, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}


def test_the_architecture_page_holds_the_table_of_every_variable() -> None:
    assert table() in DOCS.read_text(), (
        "docs/architecture.md's settings table is not the model's: paste "
        "`python -c 'from celery_agents.config import table; print(table())'`"
    )


def test_an_agents_tool_env_naming_a_setting_of_the_worker_refuses_to_start(tmp_path: Path) -> None:
    """AGENTS_TOOL_ENV passes variables to every tool: naming an `AGENTS_*` one (the Redis URL, the
    spec key) stops the worker, the CLI and `serve` at once, exit 2, naming it."""
    from tests.cli.process import agents, cli_env

    env = cli_env(None, "toolenv", tmp_path, AGENTS_TOOL_ENV="GITHUB_TOKEN, AGENTS_SPEC_KEY")
    for command in (["worker", "--queues", "tools"], ["session", "list", "--json"], ["serve", "--port", "1"]):
        run = agents(*command, env=env, timeout=60)
        assert run.returncode == 2, run
        said = run.stdout + run.stderr
        assert "AGENTS_SPEC_KEY is a setting of the worker, never given to a tool" in said, run
        assert "Traceback" not in said
