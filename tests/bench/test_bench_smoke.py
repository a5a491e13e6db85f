"""The benchmark runs end to end in its short form and prints every key of the contract.

No figure is judged here (CI machines are shared and noisy): only that each key is a number.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONTRACT_KEYS = (
    "bare_celery_tasks_per_s",
    "steps_per_s",
    "step_throughput_ratio",
    "bare_celery_roundtrip_p50_ms",
    "step_latency_p50_ms",
    "step_latency_ratio",
    "complete_to_step_p50_ms",
    "bytes_written_step_2",
    "bytes_written_step_200",
    "write_growth_ratio",
    "paused_session_bytes",
    "cli_pending_wall_ms",
    "naive_steps_per_s",
    "naive_step_p50_ms",
    "step_throughput_vs_naive",
    "step_latency_vs_naive",
    "cpu_per_step_vs_naive",
    "own_cpu_ms_per_step",
    "redis_commands_per_step",
    "slow_model_sessions",
    "slow_model_wall_s",
    "slow_model_steps_per_s",
    "slow_model_peak_rss_mb",
    "slow_model_max_in_flight",
    "slow_model_worker_cpu_ms_per_step",
    "step_latency_vs_naive_http",
    "limited_sessions",
    "limited_wall_s",
    "limited_429_failures",
    "limited_rate_vs_limit",
)
# Only when the `bench` extra is installed and a PostgreSQL server answers; else `dbos_skipped`.
DBOS_KEYS = ("dbos_steps_per_s", "dbos_step_p50_ms", "dbos_resume_p50_ms", "step_throughput_vs_dbos")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_quick_benchmark_prints_every_contract_key() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTS_")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    missing = [k for k in CONTRACT_KEYS if k not in result]
    assert not missing, f"missing keys: {missing}"
    for key in CONTRACT_KEYS:
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value), (key, value)
    assert result["step_latency_p99_ms"] >= result["step_latency_p50_ms"]
    assert result["bare_celery_roundtrip_p99_ms"] >= result["bare_celery_roundtrip_p50_ms"]
    # The bounds one model call sets are reported beside the ratios they bound.
    assert result["model_call_wall_p50_ms"] > 0 and result["model_call_cpu_ms"] > 0
    assert result["step_latency_ratio_floor"] > 1 and 0 < result["step_throughput_ratio_ceiling"] < 1
    # Both round trips were measured again with the model called over HTTP, and compared.
    for key in ("http_model_step_p50_ms", "http_model_naive_step_p50_ms", "step_latency_vs_naive_http"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result[key])
    # The slow-model phase ran every session's three steps against the 1 s model.
    assert result["slow_model_sessions"] == 100 and result["slow_model_max_in_flight"] >= 1
    # Beside it, the floor its calls set: a no-op task plus a third of two model calls and a tool call.
    parts = (result["slow_model_model_call_cpu_ms"], result["slow_model_tool_call_cpu_ms"])
    assert all(isinstance(v, float) and v > 0 for v in parts), parts
    assert result["slow_model_cpu_floor_ms_per_step"] > result["bare_celery_cpu_ms_per_task"]["worker"]
    assert result["slow_model_cpu_vs_floor"] > 0
    # The limited phase ran its sessions' two model calls each under the fleet limit.
    assert result["limited_sessions"] == 20 and result["limited_model_calls"] >= 40
    # The DBOS phase ran, or says why not (CI installs `.[dev]` without the `bench` extra).
    if "dbos_skipped" in result:
        assert isinstance(result["dbos_skipped"], str) and result["dbos_skipped"]
        assert not any(k in result for k in DBOS_KEYS)
        assert not any(g.startswith("step_throughput_vs_dbos") for g in result["goals_met"])
    else:
        for key in DBOS_KEYS:
            assert isinstance(result[key], float) and result[key] > 0, (key, result[key])
        assert "step_throughput_vs_dbos >= 1.5" in result["goals_met"]
