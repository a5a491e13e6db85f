"""`agents session pending [ID] [--limit N] --json` and `agents session show ID --json` are
answered without typer (`cli/entry.py`): the same document and exit code as through typer for
every spelling they take, typer for every other, and neither typer nor click imported on the way."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_agents.cli.entry import PENDING_LIMIT, pending_request, quick, show_request
from tests.cli.probe import write_probe_agent
from tests.cli.process import agents, cli_env, ok
from tests.support.llm_server import LlmServer, calls, text
from tests.support.ports import free_port

#: runs the command through typer (`cli/main.py` `main`), as every command ran before
_THROUGH_TYPER = "import sys; from celery_agents.cli.main import main; main(sys.argv[1:])"


def _through_typer(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    run = subprocess.run([sys.executable, "-c", _THROUGH_TYPER, *argv], env=env, capture_output=True, text=True)
    return run.returncode, run.stdout


def _as_users_run_it(argv: list[str], env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *flags, "-m", "celery_agents.cli", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)


def test_the_spellings_answered_without_typer() -> None:
    assert pending_request(["session", "pending", "--json"]) == (None, PENDING_LIMIT)
    assert pending_request(["session", "pending", "abc", "--json"]) == ("abc", PENDING_LIMIT)
    assert pending_request(["session", "pending", "--json", "abc"]) == ("abc", PENDING_LIMIT)
    assert pending_request(["session", "pending", "--limit", "5", "--json"]) == (None, 5)
    assert pending_request(["session", "pending", "--json", "--limit=7", "ab"]) == ("ab", 7)
    assert show_request(["session", "show", "abc", "--json"]) == "abc"
    assert show_request(["session", "show", "--json", "abc"]) == "abc"


@pytest.mark.parametrize(
    "argv",
    [
        ["session", "pending"],  # human output: rich, through typer
        ["session", "pending", "--help", "--json"],
        ["session", "pending", "--json", "--json"],
        ["session", "pending", "a", "b", "--json"],  # typer says what is wrong
        ["session", "pending", "--limit", "0", "--json"],  # below typer's minimum
        ["session", "pending", "--limit", "-1", "--json"],
        ["session", "pending", "--limit", "5_0", "--json"],  # int() would read it, click perhaps not
        ["session", "pending", "--limit", " 5", "--json"],
        ["session", "pending", "--limit", "--json"],
        ["session", "pending", "--limit=", "--json"],
        ["session", "pending", "--limit", "5", "--limit", "6", "--json"],
        ["session", "pending", "-", "--json"],
        ["session", "pending", "", "--json"],
        ["session", "pending", "--", "x", "--json"],
        ["session", "pending", "--jso", "--json"],
        ["--version", "session", "pending", "--json"],
        ["session", "show", "--json"],  # typer says the ID is missing
        ["session", "show", "abc"],
        ["session", "show", "abc", "--json", "--no-thinking"],
        ["session", "show", "abc", "def", "--json"],
        ["session", "show", "abc", "--json", "--json"],
        ["session", "show", "abc", "--help", "--json"],
        ["session", "list", "--json"],
        ["session", "logs", "abc", "--json"],
    ],
)
def test_every_other_spelling_goes_through_typer(argv: list[str]) -> None:
    assert quick(argv) is None


@pytest.mark.usefixtures("cli_worker")
def test_the_same_document_and_exit_code_as_through_typer(
    llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path
) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"}), ("approve", {"x": "2"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))
    sid = view["session_id"]
    assert len(view["pending"]) == 2
    down = cli_env(f"redis://127.0.0.1:{free_port()}/0", "nothing")
    bad = {**qenv, "AGENTS_LEASE_SECONDS": "soon"}  # a setting that does not parse: exit 2
    cases = [
        (["session", "pending", "--json"], qenv),
        (["session", "pending", sid, "--json"], qenv),
        (["session", "pending", "--json", sid[:10]], qenv),  # a unique prefix
        (["session", "pending", sid, "--limit", "1", "--json"], qenv),
        (["session", "pending", "--limit=1", "--json"], qenv),
        (["session", "pending", "s-nosuch", "--json"], qenv),  # not found: 3
        (["session", "pending", "--json"], down),  # Redis unreachable
        (["session", "pending", "--json"], bad),
        (["session", "show", sid, "--json"], qenv),
        (["session", "show", "--json", sid[:10]], qenv),
        (["session", "show", "s-nosuch", "--json"], qenv),
        (["session", "show", sid, "--json"], down),
    ]
    seen_codes = set()
    for argv, env in cases:
        assert quick(argv) is not None, argv
        run = _as_users_run_it(argv, env)
        code, out = _through_typer(argv, env)
        assert (run.returncode, run.stdout) == (code, out), (argv, run.stderr[-500:])
        doc = json.loads(run.stdout)
        seen_codes.add(run.returncode)
        if run.returncode == 0 and argv[1] == "pending":
            assert all(p["session_id"] == sid for p in doc["pending"] if argv[2:3] == [sid])
        elif run.returncode == 0:
            assert doc["session_id"] == sid and doc["state"] == "waiting", doc
    assert {0, 2, 3} <= seen_codes and len(seen_codes) >= 4, seen_codes  # listed, refused, not found, down
    one = json.loads(_as_users_run_it(["session", "pending", sid, "--limit", "1", "--json"], qenv).stdout)
    assert len(one["pending"]) == 1 and one["pending"][0]["token"] in {p["token"] for p in view["pending"]}


@pytest.mark.usefixtures("cli_worker")
def test_they_import_neither_typer_nor_click(llm_server: LlmServer, qenv: dict[str, str], tmp_path: Path) -> None:
    scenario = llm_server.scenario([calls(("approve", {"x": "1"})), text("ok")])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    view = ok(agents("session", "start", "--agent-file", agent, "-p", "hi", "--run", "--json", env=qenv))
    token, sid = view["pending"][0]["token"], view["session_id"]
    for argv in (["session", "pending", "--json"], ["session", "show", sid, "--json"]):
        run = _as_users_run_it(argv, qenv, "-X", "importtime")
        assert run.returncode == 0, run.stderr[-500:]
        assert token in run.stdout  # what was read was printed
        lines = run.stderr.splitlines()
        modules = [line.rsplit("|", 1)[1].strip() for line in lines if line.startswith("import time:")]
        assert "celery_agents.client" in modules
        leaked = [m for m in modules if m.split(".")[0] in ("typer", "click", "rich", "celery", "litellm")]
        assert not leaked, (argv, leaked[:8])


@pytest.mark.usefixtures("cli_worker")
def test_a_reader_that_left_ends_it_as_typer_would(qenv: dict[str, str]) -> None:
    """`agents session pending --json | head -c0`: exit 1 and no traceback, on both paths."""
    outcomes = []
    for command in (
        [sys.executable, "-m", "celery_agents.cli", "session", "pending", "--json"],
        [sys.executable, "-c", _THROUGH_TYPER, "session", "pending", "--json"],
    ):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first byte
        try:
            run = subprocess.run(command, env=qenv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=90)
        finally:
            os.close(write)
        outcomes.append((run.returncode, run.stderr))
    assert outcomes[0] == outcomes[1] == (1, ""), outcomes


def test_ctrl_c_ends_it_with_130_and_no_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_agents.cli import entry

    def interrupted(read: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "answer", interrupted)
    monkeypatch.setattr(entry, "go_brief", lambda: None)
    try:
        with pytest.raises(SystemExit) as ended:
            entry.main(["session", "pending", "--json"])
    finally:
        gc.unfreeze()  # what `main` froze for its process's exit: this one goes on
    assert ended.value.code == 130


@pytest.mark.parametrize(
    "url",
    [
        "redis://user:se@cret@127.0.0.1:{port}/0",  # an `@` in the password, unescaped
        "redis://:cret/x@127.0.0.1:{port}/0",  # a `/`: urllib reads `cret` as the port
        "redis://:secret@127.0.0.1:{port}/0?password=secret",
    ],
)
def test_an_unreachable_redis_is_named_without_its_password(url: str) -> None:
    """The error of a Redis that does not answer names where it was tried, never the password,
    on either path (and a refused URL's message neither)."""
    env = cli_env(url.format(port=free_port()), "nothing")
    for run in (
        _as_users_run_it(["session", "pending", "--json"], env),
        _as_users_run_it(["session", "list", "--json"], env),
    ):
        assert run.returncode != 0 and run.stdout, run.stderr[-300:]
        error = json.loads(run.stdout)["error"]
        assert "127.0.0.1" in error["message"] and "***" in error["message"], error
        assert "cret" not in run.stdout + run.stderr, error
