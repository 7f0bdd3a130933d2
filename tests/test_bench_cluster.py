"""benchmarks/bench_cluster.py: the router-overhead timing it prints for issue 17."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_cluster


def test_router_overhead_times_every_decision() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(96, 160))] for _ in range(6)]
    for routing in ("prefix", "round_robin"):
        cost = bench_cluster.router_overhead(prompts, 2, routing, concurrency=4, passes=3)
        assert cost.n == 18
        assert 0 < cost.p50_us <= cost.p99_us
        assert cost.mean_us > 0
