"""The counters are the fleet's: a deferred call completed through the CLI, the Python API, the HTTP
API or the completions stream, and a session run inline by the CLI, are counted in Redis by the
scripts that record them, and every `/metrics` (two `agents worker`s and an `agents serve`) serves
the same totals.

The session: the model asks for `approve` (defer) four times in one turn; each call is completed
by another front door; the woken step asks the model again, which answers in text.
"""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from tests.cli.probe import write_probe_agent
from tests.cli.process import DEMO_AGENT, agents, cli_env
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.metrics import parse_metrics
from tests.support.serve import Serve, free_port
from tests.support.workers import Worker, stop_all, worker_env

pytestmark = pytest.mark.slow

APPROVED = 'agents_tool_calls_total{disposition="defer",outcome="completed",tool="approve"}'
APPLIED = 'agents_completions_total{outcome="applied"}'
COMMITTED = 'agents_steps_total{outcome="committed"}'


@dataclass
class Targets:
    """Everything Prometheus would scrape: each worker's /metrics and serve's."""

    workers: list[int]
    serve: Serve
    token: str
    settings: Settings
    env: dict[str, str]

    def scrape(self) -> dict[str, dict[str, float]]:
        bodies = {f"worker:{p}": _get(f"http://127.0.0.1:{p}/metrics") for p in self.workers}
        bodies["serve"] = _get(f"{self.serve.url}/metrics", self.token)
        return {name: parse_metrics(body) for name, body in bodies.items()}


def _get(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as r:
        return str(r.read().decode())


def everywhere(scraped: dict[str, dict[str, float]], name: str) -> float:
    """The one value every target serves for `name` (it is the fleet's)."""
    values = {target: samples.get(name, 0.0) for target, samples in scraped.items()}
    assert len(set(values.values())) == 1, f"{name} differs between targets: {values}"
    return next(iter(values.values()))


@pytest.fixture(scope="module")
def targets(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    prefix = f"f{uuid.uuid4().hex[:10]}"
    home, logs = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("logs")
    env = worker_env(redis_url, prefix, home=home)
    ports = [free_port(), free_port()]
    workers = [
        Worker(env, queues=q, concurrency=1, log=logs / f"{q}.log", name=f"{q}-{prefix}@test",
               extra_args=["--metrics-port", str(port)])
        for q, port in zip(("steps", "tools,isolated"), ports, strict=True)
    ]  # fmt: skip
    token = f"tok-{uuid.uuid4().hex}"
    serve = Serve({**env, "AGENTS_API_TOKEN": token}, logs / "serve.log")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for w in workers:
            w.start()
        serve.start()
        for w in workers:
            w.wait_ready(client, prefix, timeout=120)
        serve.wait_ready()
        yield Targets(ports, serve, token, Settings(redis_url=redis_url, prefix=prefix, home=home), env)
    finally:
        serve.stop()
        stop_all(workers)


def test_completions_by_every_front_door_are_counted_and_served_alike_by_every_target(
    targets: Targets, llm_server: LlmServer, tmp_path: Path
) -> None:
    four = [("approve", {"x": door}) for door in ("cli", "python", "http", "stream")]
    scenario = llm_server.scenario([calls(*four, usage=(20, 4)), text("all approved", usage=(30, 2))])
    agent, _ = write_probe_agent(tmp_path, scenario, llm_server.url)
    with Client(targets.settings, inline=False) as client:
        sid = client.start(agent, "go", run=True, timeout=60).session_id
        pending = wait_for(lambda: (p := client.pending(sid)) and len(p) == 4 and p, 30, "the four deferred calls")
        cli_token, python_token, http_token, stream_token = (p.token for p in pending)
        before = targets.scrape()

        done = agents("session", "complete", cli_token, "-", "--json", stdin='"yes"', env=cli_env(
            targets.settings.redis_url, targets.settings.prefix, targets.settings.home))  # fmt: skip
        assert done.returncode == 0, done
        client.complete(python_token, "yes", by="python")
        reply = httpx.post(
            f"{targets.serve.url}/v1/continuations/{http_token}",
            json={"result": "yes", "by": "http"},
            headers={"Authorization": f"Bearer {targets.token}"},
            timeout=30,
        )
        assert reply.status_code == 200, reply.text
        client.store.client.xadd(client.store.keys.completions, {"token": stream_token, "result": '"yes"'})
        wait_for(lambda: client.show(sid).status.value == "completed", 60, "the session to complete")

    def served() -> dict[str, dict[str, float]] | None:
        scraped = targets.scrape()
        return scraped if min(s.get(COMMITTED, 0.0) for s in scraped.values()) >= 3 else None

    after = wait_for(served, 30, "the last step counted")
    assert everywhere(before, APPROVED) == 0 and everywhere(before, APPLIED) == 0
    assert everywhere(after, APPROVED) == 4
    assert everywhere(after, APPLIED) == 4
    # Three steps: the model asks, the calls are deferred, the last completion wakes its answer.
    assert everywhere(after, COMMITTED) == 3
    model = f"openai/{scenario}"
    assert everywhere(after, f'agents_model_calls_total{{model="{model}",outcome="ok"}}') == 2
    assert everywhere(after, f'agents_model_tokens_total{{kind="input",model="{model}"}}') == 50


def test_a_session_run_inline_by_the_cli_is_counted_for_the_fleet(targets: Targets) -> None:
    env = cli_env(targets.settings.redis_url, targets.settings.prefix, targets.settings.home)
    run = agents(
        "session", "start", "--agent-file", DEMO_AGENT, "-p", "What is the weather in Paris?",
        "--run", "--inline", "--json", env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run
    scraped = targets.scrape()
    # No worker calls this model or runs this tool: only the CLI's own steps can have counted them.
    assert everywhere(scraped, 'agents_model_calls_total{model="demo/weather",outcome="ok"}') >= 2
    for tool, disposition in (("get_weather", "runSync"), ("get_forecast", "runAsync")):
        key = f'agents_tool_calls_total{{disposition="{disposition}",outcome="completed",tool="{tool}"}}'
        assert everywhere(scraped, key) >= 1, key
