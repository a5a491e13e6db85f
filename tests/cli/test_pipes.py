"""The CLI in a pipe: primary output on stdout with whole ids, progress in words on stderr, any
unique prefix of a session id accepted, and text from a model, a tool or a completer never
reaching the terminal as control sequences."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from celery_agents.config import Settings
from celery_agents.model import UserQuery
from celery_agents.store import Store, client_for_url
from celery_agents.tools.resolve import parse_agent
from tests.cli.probe import write_probe_agent
from tests.cli.process import agents, check_error, ok
from tests.support.llm_server import LlmServer, Reply, calls, text

pytestmark = pytest.mark.usefixtures("cli_worker")

# What the terminal must never receive raw: clear screen, a window title (OSC), a bell, colours.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x1b[31mred\x9b"


def sync_then_answer(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text("the answer")
    return calls(("probe_sync", {"x": "1"}))


@pytest.fixture(scope="module")
def probe(llm_server: LlmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    agent, _ = write_probe_agent(
        tmp_path_factory.mktemp("pipes"), llm_server.scenario([sync_then_answer]), llm_server.url
    )
    return agent


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "workers"])
def test_run_prints_the_answer_on_stdout_and_progress_in_words_on_stderr(
    probe: Path, qenv: dict[str, str], inline: bool
) -> None:
    run = agents("run", "--agent-file", probe, "-p", "go", *(["--inline"] if inline else []), env=qenv)
    assert run.returncode == 0, str(run)
    assert run.stdout == "the answer\n", str(run)
    lines = [line for line in run.stderr.splitlines() if not line.startswith("no worker consumes")]
    assert lines[0].startswith("session ") and len(lines[0].split()[1]) == 32, str(run)  # the id comes first
    for expected in ("step 1: the model asked for 1 tool call", "probe_sync done in", "session completed"):
        assert any(expected in line for line in lines), f"{expected!r} missing:\n{run.stderr}"
    for internal in ("owner=", "from_version", "usage", "request=", "step_committed", "cli@"):
        assert internal not in run.stderr, f"raw event field {internal!r} shown:\n{run.stderr}"


def test_show_pending_and_list_write_to_stdout_with_whole_ids(probe: Path, qenv: dict[str, str]) -> None:
    narrow = {**qenv, "COLUMNS": "40"}
    view = ok(agents("session", "start", "--agent-file", probe, "-p", "hello", "--json", env=qenv))
    sid = view["session_id"]
    listed = agents("session", "list", "--limit", "200", env=narrow)
    assert listed.returncode == 0 and sid in listed.stdout.split(), str(listed)
    shown = agents("session", "show", sid, env=narrow)
    assert shown.returncode == 0 and sid in shown.stdout and "hello" in shown.stdout, str(shown)
    assert shown.stderr == "", str(shown)
    pending = agents("session", "pending", sid, env=narrow)
    assert pending.returncode == 0 and pending.stdout == "", str(pending)  # nothing pending: a note on stderr
    assert "no pending calls" in pending.stderr


@pytest.fixture
def store(redis_url: str, cli_prefix: str) -> Any:
    s = Store(client_for_url(redis_url), Settings(redis_url=redis_url, prefix=cli_prefix))
    yield s
    s.client.close()


def test_any_unique_prefix_of_a_session_id_is_accepted(store: Store, qenv: dict[str, str], tmp_path: Path) -> None:
    spec = parse_agent({"slug": "ids", "model": "demo/weather"})
    first = store.create_session(spec, UserQuery(text="one"), session_id="feedbeef" + "0" * 24).session_id
    second = store.create_session(spec, UserQuery(text="two"), session_id="feedbeef" + "1" * 24).session_id
    shown = ok(agents("session", "show", "feedbeef0", "--json", env=qenv))
    assert shown["session_id"] == first
    for command in (["session", "pending"], ["session", "logs"], ["session", "pause"], ["session", "cancel"]):
        run = agents(*command, "feedbeef1", "--json", env=qenv)
        assert run.returncode == 0, str(run)
    assert ok(agents("session", "show", second, "--json", env=qenv))["state"] == "cancelled"
    ambiguous = check_error(agents("session", "show", "feedbeef", "--json", env=qenv), "invalid_input")
    assert first in ambiguous["message"] and second in ambiguous["message"] and "ambiguous" in ambiguous["message"]
    check_error(agents("session", "show", "feedbeef2", "--json", env=qenv), "unknown_session")


# -- escaping -----------------------------------------------------------------------------------
_HOSTILE_TOOL = f"import sys; sys.stdout.write({HOSTILE!r}); sys.stderr.write({HOSTILE!r})"


def hostile_model(request: dict[str, Any]) -> Reply:
    if request["messages"][-1]["role"] == "tool":
        return text(f"model says {HOSTILE}", reasoning=f"thinking {HOSTILE}")
    offered = {t["function"]["name"] for t in request.get("tools", [])}
    return calls(("approve", {}) if "approve" in offered else ("noisy", {}))


def hostile_agent(folder: Path, scenario: str, api_base: str, *, deferred: bool) -> Path:
    tool: dict[str, Any] = (
        {"name": "approve", "external": True}
        if deferred
        else {"name": "noisy", "command": [sys.executable, "-c", _HOSTILE_TOOL]}
    )
    agent = folder / f"hostile-{deferred}.json"
    agent.write_text(
        json.dumps({"slug": "hostile", "model": f"openai/{scenario}", "apiBase": api_base, "tools": [tool]})
    )
    return agent


def assert_nothing_raw(name: str, run: Any) -> None:
    assert run.returncode == 0, str(run)
    for raw in ("\x1b", "\x07", "\x9b"):
        assert raw not in run.stdout + run.stderr, f"{name} printed {raw!r} raw:\n{run}"


def test_control_sequences_from_a_tool_a_model_or_a_completer_are_written_out(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([hostile_model])
    noisy = hostile_agent(tmp_path, scenario, llm_server.url, deferred=False)
    run = agents("run", "--agent-file", noisy, "-p", "go", "--thinking", "stderr", env=qenv)
    assert_nothing_raw("run", run)
    assert run.stdout == "model says \\x1b[2J\\x1b]0;owned\\x07\\x1b[31mred\\x9b\n", str(run)
    assert "thinking \\x1b[2J" in run.stderr
    sid = run.stderr.split()[1]
    show = agents("session", "show", sid, env=qenv)
    assert_nothing_raw("show", show)
    assert "\\x1b[2J" in show.stdout, show.stdout  # the tool's output, shown written out
    assert ok(agents("session", "show", sid, "--json", env=qenv))["response"] == f"model says {HOSTILE}"

    approve = hostile_agent(tmp_path, scenario, llm_server.url, deferred=True)
    started = ok(agents("session", "start", "--agent-file", approve, "-p", "go", "--run", "--json", env=qenv))
    assert_nothing_raw("pending", agents("session", "pending", started["session_id"], env=qenv))
    token = started["pending"][0]["token"]
    done = agents("session", "complete", token, "-", "--by", f"mallory{HOSTILE}", stdin="yes", env=qenv)
    assert_nothing_raw("complete", done)
    logs = agents("session", "logs", started["session_id"], env=qenv)
    assert_nothing_raw("logs", logs)
    assert "arrived by mallory\\x1b[2J\\x1b]0;owned" in logs.stdout, logs.stdout


def test_a_tool_module_printing_on_import_leaves_stdout_one_json_document(qenv: dict[str, str], tmp_path: Path) -> None:
    """Loading an agent file reads its python tools' signatures, importing their modules: what a
    module prints then (through `print` or straight to fd 1) goes to stderr, not into the JSON."""
    (tmp_path / "noisy_tools.py").write_text(
        "import os\nprint('print at import')\nos.write(1, b'fd write at import\\n')\n"
        "def greet(name: str) -> str:\n    '''Greet someone.'''\n    return 'hi ' + name\n"
    )
    agent = tmp_path / "agent.json"
    agent.write_text(
        json.dumps({"slug": "noisy", "model": "demo/echo", "tools": [{"name": "greet", "python": "noisy_tools:greet"}]})
    )
    run = agents("session", "start", "--agent-file", agent, "-p", "hi", "--json", env=qenv)
    assert run.returncode == 0, run
    assert run.doc["agent"] == "noisy"
    assert "print at import" in run.stderr and "fd write at import" in run.stderr
