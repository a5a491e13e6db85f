"""Fixtures for tool tests: a world-readable folder of tool programs, agents built around them,
one-call runs through `ToolRunner`, and a look at which processes are still alive."""

from __future__ import annotations

import os
import shutil
import stat
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from celery_agents.model import AgentSpec, CallOutcome, TrackedCall
from celery_agents.tools import Sandbox, SandboxConfig, ToolRunner
from celery_agents.tools.resolve import parse_agent
from celery_agents.tools.sandbox import SandboxUnavailable, reachable_by_others


def _reachable_python() -> str:
    """An interpreter a sandbox run under its own uid can start (pytest's may live under a 0700 home)."""
    if os.geteuid() != 0:
        return sys.executable
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if candidate and os.path.exists(candidate) and reachable_by_others(candidate):
            return candidate
    return sys.executable


PY = _reachable_python()


def write_program(folder: Path, name: str, source: str, executable: bool = False) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source).lstrip())
    path.chmod(0o755 if executable else 0o644)
    return path


def make_agent(
    tools: list[dict[str, Any]], rules: list[dict[str, Any]] | None = None, base_dir: str | None = None, **extra: Any
) -> AgentSpec:
    data: dict[str, Any] = {"slug": "tool-test", "model": "openai/none", "tools": tools, **extra}
    if rules is not None:
        data["toolCallPolicy"] = {"default": "runSync", "rules": rules}
        data.setdefault("executionMode", "asynchronous")
    return parse_agent(data, "<test agent>", base_dir=base_dir)


def run_tool(
    runner: ToolRunner,
    agent: AgentSpec,
    tool: str,
    arguments: Any = None,
    session_id: str = "s-test",
    call_id: str | None = None,
) -> CallOutcome:
    call = TrackedCall(
        call_id=call_id or f"call_{uuid.uuid4().hex[:8]}",
        tool=tool,
        arguments={} if arguments is None else arguments,
        batch=0,
        position=0,
        disposition="runSync",
    )
    return runner.run(agent, session_id, call)


def alive_with(marker: str) -> list[int]:
    """Pids whose command line contains `marker` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


def alive_as(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def bwrap_usable() -> bool:
    try:
        return Sandbox(SandboxConfig(bwrap="require")).bwrap() is not None
    except SandboxUnavailable:
        return False


@pytest.fixture(params=["namespaces", "bwrap"])
def level(request: pytest.FixtureRequest) -> str:
    """Each sandbox level: namespaces of its own without bubblewrap (+ own uid when root), and
    bubblewrap where it works."""
    if request.param == "bwrap" and not bwrap_usable():
        pytest.skip("bubblewrap (bwrap) is not installed or cannot create namespaces here")
    return str(request.param)


@pytest.fixture
def isolated(level: str) -> ToolRunner:
    return ToolRunner(isolated=True, sandbox=Sandbox(SandboxConfig(bwrap="require" if level == "bwrap" else "off")))


def is_executable(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IXUSR)
