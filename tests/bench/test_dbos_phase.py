"""The benchmark's DBOS phase, alone and tiny, where DBOS (the `bench` extra) and a PostgreSQL
server are there: it must report the three contract keys as positive numbers and leave no
database behind. Without them, `bench_dbos` must say why instead of failing the run.
"""

from __future__ import annotations

import math
import uuid

import pytest

from bench.dbos_phase import bench_dbos, database_url, missing_dbos, reachable_server
from bench.harness import Sizes
from bench.processes import Processes

DBOS_KEYS = ("dbos_steps_per_s", "dbos_step_p50_ms", "dbos_resume_p50_ms")


def _unavailable() -> str | None:
    reason = missing_dbos()
    if reason is None:
        _, reason = reachable_server(database_url(None))
    return reason or None


def tiny_sizes() -> Sizes:
    sizes = Sizes(quick=True)
    sizes.warmup, sizes.latency, sizes.throughput, sizes.completions = 2, 5, 20, 3
    return sizes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_dbos_phase_reports_its_three_keys_as_positive_numbers() -> None:
    reason = _unavailable()
    if reason:
        pytest.skip(f"the DBOS phase cannot run here: {reason}")
    prefix = f"test{uuid.uuid4().hex[:8]}"
    with Processes() as procs:
        result = bench_dbos(procs, prefix, 1, tiny_sizes(), database_url(None))
    assert "dbos_skipped" not in result, result
    for key in DBOS_KEYS:
        value = result[key]
        assert isinstance(value, int | float) and not isinstance(value, bool), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert result["dbos_resume_samples"] == 3
    assert _database_gone(f"dbos_{prefix}")


def test_an_unreachable_server_skips_the_phase_with_a_reason() -> None:
    if missing_dbos():
        result = bench_dbos(None, "x", 1, tiny_sizes(), None)  # type: ignore[arg-type]
        assert result["dbos_skipped"].startswith("DBOS is not installed")
        return
    result = bench_dbos(None, "x", 1, tiny_sizes(), "postgresql://nobody@127.0.0.1:1/none")  # type: ignore[arg-type]
    assert list(result) == ["dbos_skipped"]
    assert "PostgreSQL cannot be reached" in result["dbos_skipped"]


def _database_gone(name: str) -> bool:
    import psycopg

    server, _ = reachable_server(database_url(None))
    assert server is not None
    with psycopg.connect(server) as conn:
        return conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None
