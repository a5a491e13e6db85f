"""With no metrics port and no tracing, celery-agents loads neither prometheus-client nor the
OpenTelemetry SDK's tracing and exporters. (redis-py 8 and litellm import OpenTelemetry's API and
metrics parts themselves whenever the package is installed: theirs, not ours.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.cli.process import DEMO_AGENT, agents, cli_env
from tests.cli.test_fast_start import imports

OURS = ("celery_agents.observe.tracing", "celery_agents.observe.metrics", "celery_agents.observe.series")


def test_a_session_run_with_observability_off_loads_none_of_its_modules(tmp_path: Path) -> None:
    env = cli_env(None, "agents", home=tmp_path / "home")
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    run = agents(
        "session", "start", "--agent-file", DEMO_AGENT, "-p", "What is the weather in Paris?", "--run", "--json",
        env=env, python_flags=("-X", "importtime"),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr[-500:]
    modules = imports(run)
    assert "celery_agents.observe" in modules and "litellm" in modules  # the step and its model call ran here
    leaked = [m for m in modules if m in OURS or m.startswith("prometheus_client")]
    assert not leaked, leaked[:5]


def test_the_worker_code_and_its_hooks_load_no_tracer_and_no_metrics_when_both_are_off() -> None:
    code = """
import sys
from types import SimpleNamespace
import celery_agents.tasks.celery_app
from celery_agents import observe
from celery_agents.config import Settings
from celery_agents.model import TrackedCall
observe.setup(Settings())
with observe.step(SimpleNamespace(hostname="w@h"), "s1", 1):
    call = TrackedCall(call_id="c", tool="t", batch=1, position=0, disposition="runSync")
    with observe.tool_call(None, call):
        pass
    observe.stamp_deferred([call])
ours = ("opentelemetry.sdk.trace", "opentelemetry.exporter", "prometheus_client", "celery_agents.observe.tracing")
print(sorted(m for m in sys.modules if m.startswith(ours)))
"""
    env = {k: v for k, v in cli_env(None, "agents").items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    assert out.stdout.strip() == "[]"
