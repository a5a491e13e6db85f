"""Metrics, traces and logs of real workers: one session with an inline, an async and a deferred
call, run by two `agents worker`s (one for steps, one for tools), scraped and traced.

The session: the model asks for `probe_sync` (runSync), `probe_async` (runAsync, on the tools
worker) and `approve` (defer); once the async call is done, a completer XADDs the completion to
the stream; the woken step asks the model again, which answers in text.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from celery_agents import Client
from celery_agents.config import Settings
from tests.cli.probe import write_probe_agent
from tests.e2e.conftest import wait_for
from tests.support.llm_server import LlmServer, calls, text
from tests.support.metrics import parse_metrics
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.ports import free_port
from tests.support.workers import Worker, worker_env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def scrape(port: int) -> dict[str, float]:
    """A worker's `/metrics` (`tests.support.metrics.parse_metrics`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def total(samples: list[dict[str, float]], name: str) -> float:
    """A series summed over the workers (0 when none has it): a worker's own (the histogram)."""
    return sum(s.get(name, 0.0) for s in samples)


def fleet_total(samples: list[dict[str, float]], name: str) -> float:
    """A counter of the fleet, which every worker serves whole (from Redis): the same in each."""
    values = {s.get(name, 0.0) for s in samples}
    assert len(values) == 1, f"{name} differs between the workers: {values}"
    return values.pop()


@dataclass
class Fleet:
    steps: Worker
    tools: Worker
    steps_port: int
    tools_port: int
    otlp: OtlpReceiver
    settings: Settings
    home: Path

    def scrape(self) -> list[dict[str, float]]:
        return [scrape(self.steps_port), scrape(self.tools_port)]


@pytest.fixture(scope="module")
def fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    prefix = f"o{uuid.uuid4().hex[:10]}"
    home = tmp_path_factory.mktemp("home")
    logs = tmp_path_factory.mktemp("logs")
    otlp = OtlpReceiver().start()
    env = worker_env(
        redis_url,
        prefix,
        home=home,
        AGENTS_LOG_FORMAT="json",
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    ports = free_port(), free_port()
    workers = [
        Worker(
            env,
            queues=q,
            concurrency=1,
            log=logs / f"{q}.log",
            name=f"{q}-{prefix}@test",
            extra_args=["--metrics-port", str(port)],
        )
        for q, port in zip(("steps", "tools"), ports, strict=True)
    ]
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(client, prefix, timeout=120)
        yield Fleet(workers[0], workers[1], *ports, otlp, Settings(redis_url=redis_url, prefix=prefix, home=home), home)
    finally:
        for w in workers:
            w.stop()
        otlp.stop()


@dataclass
class Run:
    session_id: str
    model: str
    waiting: list[dict[str, float]]
    done: list[dict[str, float]]
    deferred_at: float
    completed_at: float


@pytest.fixture(scope="module")
def run(fleet: Fleet, llm_server: LlmServer, tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("agent")
    scenario = llm_server.scenario(
        [
            calls(("probe_sync", {"x": "a"}), ("probe_async", {"x": "b"}), ("approve", {"x": "c"}), usage=(30, 7)),
            text("all done", usage=(50, 3)),
        ]
    )
    agent, counter = write_probe_agent(folder, scenario, llm_server.url)
    with Client(fleet.settings, inline=False) as client:
        view = client.start(agent, "go", run=True, timeout=60)
        sid = view.session_id
        deferred_at = time.time()
        wait_for(lambda: "probe_async" in counter.read_text(), 60, "the async call")
        pending = wait_for(lambda: [p for p in client.pending(sid) if p.tool == "approve"], 30, "the deferred call")

        def async_done() -> bool:
            return all(p.tool == "approve" for p in client.pending(sid))

        wait_for(async_done, 60, "the async call's outcome")
        waiting = fleet.scrape()
        client.store.client.xadd(
            client.store.keys.completions, {"token": pending[0].token, "result": '"yes"', "by": "tester"}
        )
        completed_at = time.time()
        wait_for(lambda: client.show(sid).status == "completed", 60, "the session to complete")

    # Counters land when each task ends: wait until every worker serves the last step counted.
    def counted() -> list[dict[str, float]] | None:
        samples = fleet.scrape()
        committed = [s.get('agents_steps_total{outcome="committed"}', 0.0) for s in samples]
        timed = total(samples, "agents_step_seconds_count")  # observed once the step has returned
        return samples if min(committed) >= 3 and timed >= 3 else None

    done = wait_for(counted, 30, "the steps counted")
    return Run(sid, f"openai/{scenario}", waiting, done, deferred_at, completed_at)


def test_metrics_count_the_steps_model_calls_tokens_and_tool_calls_of_a_run(run: Run) -> None:
    m, done = run.model, run.done
    # Three steps commit: the model's calls, the async result folded in, the final answer.
    assert fleet_total(done, 'agents_steps_total{outcome="committed"}') == 3
    assert total(done, "agents_step_seconds_count") >= 3
    assert fleet_total(done, f'agents_model_calls_total{{model="{m}",outcome="ok"}}') == 2
    assert fleet_total(done, f'agents_model_tokens_total{{kind="input",model="{m}"}}') == 80
    assert fleet_total(done, f'agents_model_tokens_total{{kind="output",model="{m}"}}') == 10
    for tool, disposition in (("probe_sync", "runSync"), ("probe_async", "runAsync"), ("approve", "defer")):
        key = f'agents_tool_calls_total{{disposition="{disposition}",outcome="completed",tool="{tool}"}}'
        assert fleet_total(done, key) == 1, key
    assert fleet_total(done, 'agents_completions_total{outcome="applied"}') == 1


def test_gauges_show_the_deferred_call_waiting_then_nothing(run: Run, fleet: Fleet) -> None:
    # Each worker reads the same Redis: take one worker's view.
    waiting, done = run.waiting[0], run.done[0]
    assert waiting['agents_pending_calls{disposition="defer"}'] == 1
    assert waiting["agents_oldest_pending_call_seconds"] > 0
    assert done['agents_pending_calls{disposition="defer"}'] == 0
    assert done['agents_queue_depth{queue="steps"}'] == 0
    assert done["agents_redis_up"] == 1
    # The consumer acknowledges (deletes) an entry just after applying it and waking the session,
    # so the session's last step may be counted a moment before: the entry leaves soon, not never.
    wait_for(lambda: scrape(fleet.steps_port)["agents_completions_waiting"] == 0, 10, "the applied completion to leave")


def node(worker: Worker) -> str:
    return worker.name.split("@")[0]


def node_of(span: ReceivedSpan) -> str:
    """The `agents worker` whose Celery worker (`<node>-steps0@host`, `<node>-tools@host`) made the span."""
    return str(span.attributes["agents.worker"]).split("@")[0].rsplit("-", 1)[0]


def test_every_series_the_grafana_dashboard_plots_is_served(run: Run) -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "celery-agents.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    plotted = {name for expr in exprs for name in re.findall(r"agents_[a-z_]+", expr)}
    served = {key.split("{")[0] for samples in run.done for key in samples}
    assert plotted - {"agents_sessions"} <= served  # agents_sessions: `agents serve`'s


def spans_by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_ns)


def test_one_session_is_one_trace_across_both_workers_and_the_deferred_completion(fleet: Fleet, run: Run) -> None:
    def committed(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        # A late or swept duplicate copy of a step may add a span that commits nothing.
        return [s for s in spans_by_name(spans, "agents.step") if s.attributes["agents.outcome"] == "committed"]

    def complete_trace() -> list[ReceivedSpan] | None:
        spans = fleet.otlp.of_session(run.session_id)
        return spans if len(committed(spans)) == 3 and spans_by_name(spans, "agents.token_wait") else None

    spans = wait_for(complete_trace, 30, "the session's spans")
    assert len({s.trace_id for s in spans}) == 1
    by_id = {s.span_id: s for s in spans}
    # Step 1 asks the model; step 2 (published by step 1: its child) runs the calls; step 3 is woken.
    first, calling, woken = committed(spans)
    assert first.parent_id == "" and node_of(first) == node(fleet.steps)
    assert calling.parent_id == first.span_id
    chats = spans_by_name(spans, f"chat {run.model}")
    assert [c.parent_id for c in chats] == [first.span_id, woken.span_id]
    assert chats[0].attributes["gen_ai.usage.input_tokens"] == 30
    assert chats[0].attributes["gen_ai.usage.output_tokens"] == 7
    assert chats[0].attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    inline = spans_by_name(spans, "execute_tool probe_sync")[0]
    assert by_id[inline.parent_id] is calling
    # The async call ran on the other worker, as a child of the step that dispatched it.
    task = spans_by_name(spans, "agents.call_task")[0]
    assert task.parent_id == calling.span_id and node_of(task) == node(fleet.tools)
    tool = spans_by_name(spans, "execute_tool probe_async")[0]
    assert tool.parent_id == task.span_id and tool.attributes["agents.disposition"] == "runAsync"
    # The wait runs from the deferral to the completion, under the step that deferred the call,
    # and the step the completion woke is its child.
    wait = spans_by_name(spans, "agents.token_wait")[0]
    assert wait.parent_id == calling.span_id
    assert wait.attributes["agents.completed_by"] == "tester"
    assert wait.start_ns <= run.deferred_at * 1e9 + 1e9 and wait.end_ns >= run.completed_at * 1e9 - 1e9
    assert woken.parent_id == wait.span_id


def test_json_logs_name_the_session_and_step_version(fleet: Fleet, run: Run) -> None:
    lines = [json.loads(line) for line in (fleet.steps.log or Path()).read_text().splitlines() if line.startswith("{")]
    assert lines, "the steps worker wrote no JSON lines"
    about = [rec for rec in lines if rec.get("session_id") == run.session_id]
    assert about and all("version" in rec for rec in about)
    assert not [line for line in (fleet.steps.log or Path()).read_text().splitlines() if re.search(r"LiteLLM", line)]
