"""Commands that call no model never import litellm (seconds and hundreds of MB at import), nor
FastAPI (only `agents serve` needs it):
checked with `python -X importtime`, which lists every module a process imported on stderr.
`agents session pending --json` goes further (docs/performance.md, `cli_pending_wall_ms`): it
imports nothing that only steps, workers or human output use, and builds only the schemas of
the calls it lists."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from celery_agents.cli.lean import BRIEF_GC_THRESHOLD
from tests.cli.probe import write_probe_agent
from tests.cli.process import DEMO_AGENT, Run, agents, cli_env, ok
from tests.support.llm_server import LlmServer, calls, text


def imports(run: Run) -> list[str]:
    """The modules the process imported, from its `-X importtime` lines."""
    return [line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")]


def no_litellm(*args: str | Path, env: dict[str, str], stdin: str | None = None) -> Run:
    run = agents(*args, env=env, stdin=stdin, python_flags=("-X", "importtime"))
    assert run.returncode == 0, run.stdout + run.stderr[-300:]
    modules = imports(run)
    assert "celery_agents.cli" in modules  # (main runs as __main__)
    leaked = [m for m in modules if m.split(".")[0] in ("litellm", "openai", "tiktoken", "fastapi", "uvicorn")]
    assert not leaked, f"`agents {' '.join(map(str, args))}` imported {leaked[:5]}"
    return run


@pytest.mark.usefixtures("cli_worker")
def test_queue_mode_commands_without_a_model_call_never_import_litellm(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))
    sid, token = view["session_id"], view["pending"][0]["token"]
    no_litellm("session", "pending", "--json", env=qenv)
    no_litellm("session", "pending", sid, "--json", env=qenv)
    no_litellm("session", "show", sid, "--json", env=qenv)
    no_litellm("session", "list", "--json", env=qenv)
    no_litellm("session", "logs", sid, "--json", env=qenv)
    no_litellm("session", "pause", sid, "--json", env=qenv)
    no_litellm("session", "complete", token, "-", "--json", env=qenv, stdin="yes")
    other = no_litellm("session", "start", "--agent-file", agent, "-p", "hi", "--json", env=qenv).doc["session_id"]
    no_litellm("session", "step", other, "--no-wait", "--json", env=qenv)  # the worker calls the model
    third = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--json", env=qenv))["session_id"]
    no_litellm("session", "cancel", third, "--json", env=qenv)
    no_litellm("doctor", "--json", env=qenv)
    no_litellm("--help", env=qenv)


def test_embedded_commands_without_a_model_call_never_import_litellm(tmp_path: Path) -> None:
    env = cli_env(None, "agents", home=tmp_path / "home")
    sid = no_litellm("session", "start", "--agent-file", DEMO_AGENT, "-p", "hi", "--json", env=env).doc["session_id"]
    no_litellm("session", "pending", "--json", env=env)
    no_litellm("session", "show", sid, "--json", env=env)
    no_litellm("session", "list", "--json", env=env)
    no_litellm("session", "logs", sid, "--json", env=env)
    no_litellm("session", "cancel", sid, "--json", env=env)


#: what `agents session pending --json` must never import: Celery and its broker (it publishes
#: nothing), the model's client, agent-file validation, rich (no human output), OpenTelemetry
#: (redis-py imports it when installed unless the CLI hides it), and the step machinery
PENDING_NEVER_IMPORTS = (
    "celery",
    "kombu",
    "billiard",
    "litellm",
    "openai",
    "jsonschema",
    "rich",
    "opentelemetry",
    "fastapi",
    "uvicorn",
    "celery_agents.scheduler",
    "celery_agents.runtime",
    "celery_agents.tasks",
    "celery_agents.llm",
    "celery_agents.tools",
    # redis-py's asyncio client (redis/__init__.py imports it; a command that reads and ends
    # loads redis-py without it: celery_agents/redis_import.py)
    "redis.asyncio.client",
    "redis.asyncio.cluster",
    "redis.asyncio.connection",
)

#: The start-up budget of a read-only command with `--json` (docs/performance.md): the modules a
#: fresh interpreter holds once it ran (the interpreter's own ~70 included). Today ~426.
READ_ONLY_MODULES_BUDGET = 450

# Runs the command's own code in a fresh interpreter, then reports on stderr what it loaded.
_PENDING_PROBE = """
import json, sys
from celery_agents.cli.main import main
code = None
try:
    main(sys.argv[1:] or ["session", "pending", "--json"])
except SystemExit as exc:
    code = exc.code
from celery_agents.model import AgentSpec, Disposition, LlmTurn, SessionHeader, SessionView, UserTurn
from celery_agents.model.admission import ModelLimit
from celery_agents.store.codec import STORED_TURN
models = (AgentSpec, Disposition, LlmTurn, SessionHeader, SessionView, UserTurn, ModelLimit)
built = [m.__name__ for m in models if m.__pydantic_complete__]
built += ["STORED_TURN"] if STORED_TURN.pydantic_complete else []
from celery_agents.store.scripts import script_source
scripts = script_source.cache_info().currsize
import gc
frozen, collector = gc.get_freeze_count(), gc.get_threshold()[0]
sys.stdout.flush()
sys.stderr.write(json.dumps({"code": code, "modules": sorted(sys.modules), "built": built, "scripts": scripts,
                             "frozen": frozen, "collector": collector}) + "\\n")
"""


@pytest.mark.usefixtures("cli_worker")
def test_pending_json_imports_only_what_listing_calls_needs(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))
    token = view["pending"][0]["token"]
    probe = subprocess.run(
        [sys.executable, "-c", _PENDING_PROBE], env=qenv, capture_output=True, text=True, timeout=90, check=True
    )
    report = json.loads(probe.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, probe.stderr
    assert token in {p["token"] for p in json.loads(probe.stdout)["pending"]}  # the listing was read and printed
    leaked = [m for m in report["modules"] if m.startswith(tuple(f"{n}." for n in PENDING_NEVER_IMPORTS))]
    leaked += [m for m in report["modules"] if m in PENDING_NEVER_IMPORTS]
    assert not leaked, f"`agents session pending --json` imported {leaked[:8]}"
    assert report["built"] == [], f"`agents session pending --json` built schemas it never uses: {report['built']}"
    assert report["scripts"] == 0, f"`agents session pending --json` made {report['scripts']} Lua scripts it never runs"
    # What the command made is left out of the interpreter's last collection at exit (50-80 ms).
    assert report["frozen"] > 10_000, report["frozen"]


@pytest.mark.usefixtures("cli_worker")
def test_read_only_commands_hold_the_start_up_budget(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    """`list`, `show`, `logs`, `history` and `pending` with `--json` read Redis and print: none
    imports Celery, the model's client, rich or the step machinery, and each stays within the
    module budget written down in docs/performance.md."""
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    sid = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))["session_id"]
    commands = (
        ["session", "pending", "--json"],
        ["session", "list", "--json"],
        ["session", "show", sid, "--json"],
        ["session", "logs", sid, "--json"],
        ["session", "history", sid, "--json"],
    )
    for argv in commands:
        probe = subprocess.run(
            [sys.executable, "-c", _PENDING_PROBE, *argv], env=qenv, capture_output=True, text=True, timeout=90
        )
        report = json.loads(probe.stderr.strip().splitlines()[-1])
        assert report["code"] in (0, None), (argv, probe.stderr[-500:])
        # It read the session and printed it.
        shown = {"logs": "session_started", "history": '"kind": "started"'}.get(argv[1], sid)
        assert shown in probe.stdout, (argv, probe.stdout[:300])
        modules = report["modules"]
        leaked = [
            m
            for m in modules
            if m in PENDING_NEVER_IMPORTS or m.startswith(tuple(f"{n}." for n in PENDING_NEVER_IMPORTS))
        ]
        assert not leaked, f"`agents {' '.join(argv)}` imported {leaked[:8]}"
        assert len(modules) <= READ_ONLY_MODULES_BUDGET, f"`agents {' '.join(argv)}` loaded {len(modules)} modules"
        # The cyclic collector runs seldom while it imports and runs (docs/performance.md).
        assert report["collector"] == BRIEF_GC_THRESHOLD, argv


def test_only_commands_that_read_and_end_start_lean() -> None:
    """The collector runs seldom only in a command that reads, prints and ends; one that follows
    a session, waits, serves or runs steps keeps Python's thresholds."""
    from celery_agents.cli.lean import brief as _brief

    assert _brief(["session", "pending", "--json"]) and _brief(["session", "pending", "--limit", "5"])
    assert _brief(["session", "logs", "abc", "--json"]) and _brief(["limits", "list"])
    assert not _brief(["session", "logs", "abc", "--follow"]) and not _brief(["session", "logs", "abc", "-F"])
    for argv in (["worker"], ["serve"], ["run", "-p", "x"], ["session", "start"], ["session", "resume", "abc"]):
        assert not _brief(argv), argv


_LEAN_REDIS = """
import sys
from celery_agents.redis_import import import_redis
import_redis(lean=True)
lean = "redis.asyncio.client" in sys.modules
otel = "opentelemetry" in sys.modules
import redis
client = redis.Redis()  # the synchronous client is whole
import redis.asyncio
print(lean, otel, redis.asyncio is sys.modules["redis.asyncio"], hasattr(redis.asyncio, "Redis"))
"""


def test_redis_py_loaded_lean_still_gives_its_asyncio_client_to_whoever_imports_it() -> None:
    run = subprocess.run([sys.executable, "-c", _LEAN_REDIS], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split() == ["False", "False", "True", "True"], run.stdout + run.stderr
