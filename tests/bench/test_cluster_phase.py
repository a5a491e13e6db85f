"""`bench/run.py --cluster`'s phase runs end to end on a local 3-primary Cluster it starts and
gives its keys (`cluster_steps_per_s` a number: no figure is judged on a shared machine)."""

from __future__ import annotations

import math
import uuid

import pytest

from bench.cluster_phase import bench_cluster
from bench.harness import Sizes
from bench.processes import Processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cluster_phase_measures_steps_on_a_cluster() -> None:
    sizes = Sizes(quick=True)
    sizes.warmup, sizes.throughput = 2, 40
    with Processes() as procs:
        out = bench_cluster(procs, f"bc{uuid.uuid4().hex[:6]}", 1, sizes)
    assert math.isfinite(out["cluster_steps_per_s"]) and out["cluster_steps_per_s"] > 0
    assert out["cluster_index_shards"] == 16 and out["cluster_shards_used"] > 1
    assert out["cluster_ack_replicas"] == 1
