"""`agents worker`'s processes: its Celery workers are forked from a zygote (tasks/supervisor.py);
one that dies is forked again and serves steps, and none outlives a SIGKILLed supervisor."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, text
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow


def living(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by whoever inherited it, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def descendants(pid: int) -> list[int]:
    """Every living descendant of `pid` (Linux /proc), zombies left out."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                kids.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def role_pids(log: Path) -> dict[str, int]:
    """The pid of each Celery worker, from the supervisor's line "worker NAME: steps (pid N), ..."."""
    line = next(x for x in log.read_text().splitlines() if "/supervisor] worker " in x)
    roles = line.rsplit(": ", 1)[1].split(", ")
    return {role.split(" (pid ")[0]: int(role.split(" (pid ")[1].rstrip(")")) for role in roles}


@pytest.fixture
def worker(redis_url: str, prefix: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Worker]:
    # A test of what the worker's processes import runs a fresh interpreter (`fork=False`): one
    # forked from the test run's launcher would have its imports (litellm) mapped already.
    fresh = request.node.get_closest_marker("fresh_interpreter") is not None
    name = f"procs-{uuid.uuid4().hex[:6]}@test"
    w = Worker(worker_env(redis_url, prefix), log=tmp_path / "worker.log", name=name, fork=not fresh)
    w.start()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        w.wait_ready(client, prefix)
        yield w
    finally:
        w.kill()
        client.close()


def test_a_killed_steps_process_is_forked_again_and_serves_the_next_step(
    worker: Worker, settings: Settings, llm_server: LlmServer, write_agent: Any
) -> None:
    assert worker.log is not None and worker.proc is not None
    steps = role_pids(worker.log)["steps"]
    os.kill(steps, signal.SIGKILL)
    wait_for(lambda: not living(steps), what="the steps process to be gone")
    scenario = llm_server.scenario([text("still here")])
    path = write_agent({"slug": "procs", "model": f"openai/{scenario}", "apiBase": llm_server.url})
    with Client(settings, inline=False) as api:
        view = api.start(path, "hi", run=True, wait=True, timeout=120)
    assert view.state.value == "completed" and view.response == "still here"
    assert worker.proc.poll() is None, "the supervisor stays"
    assert f"steps worker (pid {steps}) exited" in worker.log.read_text()


def test_no_process_of_a_worker_outlives_its_sigkilled_supervisor(worker: Worker) -> None:
    assert worker.proc is not None
    family = descendants(worker.proc.pid)
    # the zygote, the steps and tools Celery workers, the tool pool's processes
    assert len(family) >= 4, family
    os.kill(worker.proc.pid, signal.SIGKILL)  # the supervisor alone, not its process group
    wait_for(lambda: not any(living(p) for p in family), timeout=60, what=f"{family} to follow the supervisor")


@pytest.mark.fresh_interpreter
def test_the_tools_worker_and_its_pool_processes_hold_no_litellm(worker: Worker) -> None:
    """The tools worker calls no model: it is forked from a zygote of its own that never imports
    litellm, so neither it nor its pool processes map it (~150 MB of resident memory each)."""
    assert worker.log is not None

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()

    pids = role_pids(worker.log)
    assert "/litellm/" in maps(pids["steps"])
    tools = [pids["tools"], *descendants(pids["tools"])]
    assert len(tools) >= 2, tools  # the tools worker and its pool processes
    for pid in tools:
        assert "/litellm/" not in maps(pid), pid


def test_steps_processes_hand_the_gil_over_every_50_ms(worker: Worker) -> None:
    """A steps process's hundreds of threads give the GIL up at each wait; it is not forced off
    them every 5 ms (Python's default) on top of that (`STEP_SWITCH_INTERVAL`). The process says
    so when it is ready (a tool cannot ask it: tools run in processes of their own)."""
    pid = role_pids(worker.log)["steps"]
    said = wait_for(
        lambda: [x for x in worker.log.read_text().splitlines() if f"steps process {pid}: GIL switch interval" in x],
        what="the steps process to say its switch interval",
    )
    assert said[0].endswith("GIL switch interval 0.05 s"), said
