"""The shipped deployment artefacts: docker-compose.yml (Redis with AOF, step/tool workers,
isolated workers, Flower) names only commands, options and queues that exist, and the example
agent files for real providers load and differ from each other only in how the model is reached."""

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
from celery_agents.model import load_agent_file
from celery_agents.tasks.config import QUEUES
from tests.cli.process import ROOT, agents, cli_env

COMPOSE = ROOT / "docker-compose.yml"
PROVIDERS = ("openai-agent.json", "anthropic-agent.json", "ollama-agent.json")


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


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
