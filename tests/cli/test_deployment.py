"""The shipped deployment artefacts: docker-compose.yml (Redis with AOF, step/tool workers,
isolated workers, `agents serve`, Flower) names only commands, options and queues that exist,
publishes nothing beyond loopback, gives each service only the secrets it uses, keeps `.env` out
of the image, and Prometheus scrapes the ports the services listen on; the example agent files
for real providers load and differ from each other only in how the model is reached. Docker does
not run here: the files are parsed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest
import typer.main
import yaml

from celery_agents.cli.main import app
from celery_agents.errors import InvalidInput
from celery_agents.tasks.config import QUEUES
from celery_agents.tools.resolve import load_agent_file
from celery_agents.web.security import check_bind
from tests.cli.process import ROOT, agents, cli_env

COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
PROVIDERS = ("openai-agent.json", "anthropic-agent.json", "ollama-agent.json")
MODEL_KEYS = {"OPENAI_API_KEY", "ANTHROPIC_API_KEY"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return dict(compose["services"])


def _argv(service: dict[str, Any]) -> list[str]:
    entry = service.get("entrypoint") or []
    command = service.get("command") or []
    entry = entry.split() if isinstance(entry, str) else list(entry)
    command = command.split() if isinstance(command, str) else list(command)
    return entry + command


def _parse_agents(args: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse `agents ARGS` with the real CLI's parser, without running it; (command path, params)."""
    command: Any = typer.main.get_command(app)
    path = []
    while hasattr(command, "commands"):
        name, args = args[0], args[1:]
        assert name in command.commands, f"`agents {' '.join([*path, name])}` is not a command"
        command = command.commands[name]
        path.append(name)
    ctx = command.make_context(" ".join(["agents", *path]), list(args))
    return " ".join(path), ctx.params


def _agents_command(service: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The `agents` command a service runs and its parameters; None for any other program."""
    argv = _argv(service)
    return _parse_agents(argv[1:]) if argv[:1] == ["agents"] else None


def _published(service: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(host address, host port, container port) of each port the service publishes."""
    found = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            found.append((str(port.get("host_ip", "0.0.0.0")), int(port["published"]), int(port["target"])))
            continue
        *outside, inside = str(port).split(":")
        host = outside[0] if len(outside) == 2 else "0.0.0.0"
        found.append((host, int(outside[-1] if outside else inside), int(inside.split("/")[0])))
    return found


def _dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` (relative to the build context) out of the context: the last
    pattern matching it or one of its folders decides (`!` takes back)."""
    parts = path.split("/")
    folders = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        body = pattern[1:] if pattern.startswith("!") else pattern
        regex = re.escape(body.strip("/")).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, folder) for folder in folders):
            ignored = not pattern.startswith("!")
    return ignored


def test_redis_keeps_every_write(services: dict[str, Any]) -> None:
    argv = _argv(services["redis"])
    assert argv[0] == "redis-server"
    settings = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("--")}
    assert settings["--appendonly"] == "yes"
    assert settings["--appendfsync"] == "everysec"
    assert settings["--maxmemory-policy"] == "noeviction"
    assert "redis-data:/data" in services["redis"]["volumes"]  # the AOF outlives the container


def test_redis_wants_a_password_for_every_user(services: dict[str, Any]) -> None:
    argv = _argv(services["redis"])
    users = " ".join(argv[argv.index("--user") :]).split("--user")
    assert [u.split()[:2] for u in users if u.strip()] == [["default", "off"], ["workers", "on"], ["completer", "on"]]
    example = (ROOT / ".env.example").read_text()
    for name in ("AGENTS_WORKERS_PASSWORD", "AGENTS_COMPLETER_PASSWORD", "AGENTS_SPEC_KEY"):
        assert f"{name}=\n" in example, f".env.example asks for {name}"


def test_every_agents_command_exists_with_its_options_and_queues(services: dict[str, Any]) -> None:
    consumed: set[str] = set()
    for name, service in services.items():
        argv = _argv(service)
        if not argv or argv[0] != "agents":
            continue
        path, params = _parse_agents(argv[1:])
        if path == "worker":
            queues = params["queues"].split(",")
            assert set(queues) <= set(QUEUES), f"service {name} names unknown queues {queues}"
            consumed |= set(queues)
        env = service.get("environment", {})
        assert re.match(
            r"^redis://workers:\$\{AGENTS_WORKERS_PASSWORD:\?[^}]*\}@redis:6379/", env["AGENTS_REDIS_URL"]
        ), name
        assert env["AGENTS_SPEC_KEY"].startswith("${AGENTS_SPEC_KEY:?"), (
            f"{name} signs specs with a key it must be given"
        )
    assert consumed == set(QUEUES), "every queue needs a worker"
    workers = [
        _parse_agents(_argv(s)[1:])[1]["queues"] for s in services.values() if _argv(s)[:2] == ["agents", "worker"]
    ]
    assert sorted(workers) == ["isolated", "steps,tools"]


def test_the_worker_command_runs(services: dict[str, Any]) -> None:
    env = cli_env("redis://127.0.0.1:1/0", "compose")
    for args in {tuple(_argv(s)[1:2]) for s in services.values() if _argv(s)[:1] == ["agents"]}:
        run = agents(*args, "--help", env=env)
        assert run.returncode == 0 and "Usage: agents" in run.stdout, str(run)
    bad = agents("worker", "--queues", "steps,nope", env=env)
    assert bad.returncode == 2 and "nope" in bad.stderr, str(bad)


def test_flower_finds_the_celery_app(services: dict[str, Any]) -> None:
    argv = _argv(services["flower"])
    assert argv[:3] == ["celery", "-A", "celery_agents.tasks"] and "flower" in argv
    env = cli_env("redis://redis:6379/0", "agents")
    probe = (
        "import celery_agents.tasks as t; from celery_agents.tasks.config import STEP_TASK; "
        "assert STEP_TASK in t.app.tasks; print(t.app.conf.broker_url)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "redis://redis:6379/0"


def test_provider_examples_load_and_differ_only_in_how_the_model_is_reached() -> None:
    how = {"model", "apiBase", "apiKeyEnv"}
    demo = json.loads((ROOT / "examples" / "demo-agent.json").read_text())
    loaded = {name: load_agent_file(ROOT / "examples" / name) for name in PROVIDERS}
    raw = {name: json.loads((ROOT / "examples" / name).read_text()) for name in PROVIDERS}
    rest = [{k: v for k, v in d.items() if k not in how} for d in raw.values()]
    assert all(r == rest[0] for r in rest)
    assert {k: v for k, v in demo.items() if k not in how | {"slug"}} == {
        k: v for k, v in rest[0].items() if k != "slug"
    }
    assert loaded["openai-agent.json"].model.startswith("openai/")
    assert loaded["openai-agent.json"].api_key_env == "OPENAI_API_KEY"
    assert loaded["anthropic-agent.json"].model.startswith("anthropic/")
    assert loaded["anthropic-agent.json"].api_key_env == "ANTHROPIC_API_KEY"
    assert loaded["ollama-agent.json"].api_base and loaded["ollama-agent.json"].api_key_env is None
    for spec in loaded.values():
        assert [t.name for t in spec.tools] == ["get_weather", "get_forecast", "book_table"]
        assert spec.base_dir == str((ROOT / "examples").resolve())


def test_every_published_port_is_bound_to_loopback(services: dict[str, Any]) -> None:
    published = {name: _published(s) for name, s in services.items() if s.get("ports")}
    assert {"serve", "flower", "prometheus", "grafana"} <= set(published)
    for name, ports in published.items():
        for host, _, _ in ports:
            assert host == "127.0.0.1", f"{name} publishes a port on {host}: publish it on 127.0.0.1 only"


def test_each_service_holds_only_the_secrets_it_uses(services: dict[str, Any]) -> None:
    for name, service in services.items():
        env = set(service.get("environment") or {})
        command = _agents_command(service)
        path, params = command if command is not None else ("", {})
        # Every agents command signs or verifies specs; nothing else reads the key.
        assert ("AGENTS_SPEC_KEY" in env) == (command is not None), name
        calls_models = name == "cli" or (path == "worker" and "steps" in params["queues"].split(","))
        assert bool(MODEL_KEYS & env) == calls_models, f"{name}: model keys only where models are called"
        assert ("AGENTS_API_TOKEN" in env) == (path == "serve"), name


def test_flower_listens_on_loopback_behind_a_password_holding_only_the_broker_url(services: dict[str, Any]) -> None:
    flower = services["flower"]
    env = flower["environment"]
    assert set(env) == {"AGENTS_REDIS_URL", "AGENTS_PREFIX", "FLOWER_BASIC_AUTH"}
    assert re.fullmatch(r"\w+:\$\{FLOWER_PASSWORD:\?[^}]*\}", env["FLOWER_BASIC_AUTH"]), env["FLOWER_BASIC_AUTH"]
    assert _published(flower) == [("127.0.0.1", 5555, 5555)]
    assert "FLOWER_PASSWORD=\n" in (ROOT / ".env.example").read_text()


def test_serve_is_published_on_loopback_and_asks_for_a_token_long_enough_for_its_address(
    services: dict[str, Any],
) -> None:
    command = _agents_command(services["serve"])
    assert command is not None and command[0] == "serve"
    host, port = command[1]["host"], command[1]["port"]
    assert (host, port) == ("0.0.0.0", 8765), "inside its container, where Docker forwards the published port"
    assert _published(services["serve"]) == [("127.0.0.1", 8765, 8765)]
    assert services["serve"]["environment"]["AGENTS_API_TOKEN"].startswith("${AGENTS_API_TOKEN:?")
    example = (ROOT / ".env.example").read_text()
    assert "AGENTS_API_TOKEN=\n" in example and "openssl rand -hex 32" in example
    check_bind(host, "0123456789abcdef" * 4)  # what `openssl rand -hex 32` makes: 64 characters
    with pytest.raises(InvalidInput):
        check_bind(host, "a" * 31)


def test_the_image_leaves_out_env_git_and_local_junk() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    left_out = [
        ".env",
        ".env.local",
        ".git/config",
        ".venv/bin/python",
        "venv/bin/python",
        "celery_agents/__pycache__/config.cpython-311.pyc",
        "tests/tools/__pycache__/x.pyc",
        ".mypy_cache/3.11/x.json",
        ".pytest_cache/v/cache/lastfailed",
        ".ruff_cache/x",
        ".benchmarks/x.json",
        "celery_agents.egg-info/PKG-INFO",
        "build/lib/x.py",
        "dist/x.whl",
    ]
    for path in left_out:
        assert _dockerignored(path, patterns), f"{path} would be copied into the image"
    for path in (
        "pyproject.toml",
        "README.md",
        "celery_agents/config.py",
        "examples/demo-agent.json",
        "deploy/prometheus.yml",
    ):
        assert not _dockerignored(path, patterns), f"{path} is needed in the image"


def test_prometheus_scrapes_the_port_each_service_serves_metrics_on(compose: dict[str, Any]) -> None:
    services = compose["services"]
    serving = {}
    for name, service in services.items():
        command = _agents_command(service)
        if command is not None and command[0] == "worker" and command[1]["metrics_port"]:
            serving[name] = command[1]["metrics_port"]
        if command is not None and command[0] == "serve":
            serving[name] = command[1]["port"]
    config = yaml.safe_load(PROMETHEUS.read_text())
    scraped: dict[tuple[str, int], dict[str, Any]] = {}
    for job in config["scrape_configs"]:
        for found in job.get("dns_sd_configs", []):
            scraped.update({(name, int(found["port"])): job for name in found["names"]})
        for found in job.get("static_configs", []):
            for target in found["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[(host, int(port))] = job
    assert set(scraped) == set(serving.items()), "every target is a port a service listens on, and the reverse"
    # serve's /metrics wants the API token: Prometheus reads it from a secret made from .env
    token = scraped[("serve", serving["serve"])]["authorization"]["credentials_file"]
    secret = token.removeprefix("/run/secrets/")
    assert secret in services["prometheus"]["secrets"]
    assert compose["secrets"][secret] == {"environment": "AGENTS_API_TOKEN"}


SENTINEL_COMPOSE = ROOT / "docker-compose.sentinel.yml"


def test_the_sentinel_file_keeps_the_base_redis_and_moves_every_service_to_sentinel(
    services: dict[str, Any],
) -> None:
    """docker-compose.sentinel.yml: each Redis server runs docker-compose.yml's redis command (its
    users and persistence) and more; every service of docker-compose.yml that reaches Redis goes
    through the sentinels; nothing of the set is published; .env.example asks for its passwords."""
    extra = dict(yaml.safe_load(SENTINEL_COMPOSE.read_text()))["services"]
    base = _argv(services["redis"])
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        assert _argv(extra[name])[: len(base)] == base, f"{name} runs docker-compose.yml's redis command first"
        assert "--masteruser" in _argv(extra[name]) and "--replica-announce-ip" in _argv(extra[name])
    assert [_argv(extra[n])[-3:] for n in ("redis-replica-1", "redis-replica-2")] == [
        ["--replicaof", "redis", "6379"]
    ] * 2
    reaching = {n for n, s in services.items() if "AGENTS_REDIS_URL" in (s.get("environment") or {})}
    moved = {n for n, s in extra.items() if "AGENTS_REDIS_URL" in (s.get("environment") or {})}
    assert moved == reaching
    for name in moved:
        url = extra[name]["environment"]["AGENTS_REDIS_URL"]
        assert re.fullmatch(
            r"redis\+sentinel://workers:\$\{AGENTS_WORKERS_PASSWORD:\?[^}]*\}@"
            r"sentinel-1:26379,sentinel-2:26379,sentinel-3:26379/agents-main/0",
            url,
        ), url
    monitors = {
        re.search(r"sentinel monitor (\S+) (\S+) (\d+) (\d+)", extra[n]["command"][2]).groups()
        for n in extra
        if n.startswith("sentinel")
    }  # type: ignore[union-attr]
    assert monitors == {("agents-main", "redis", "6379", "2")}
    assert not any(s.get("ports") for s in extra.values())
    example = (ROOT / ".env.example").read_text()
    for name in ("AGENTS_REPLICA_PASSWORD", "AGENTS_SENTINEL_PASSWORD"):
        assert f"{name}=\n" in example, f".env.example asks for {name}"
