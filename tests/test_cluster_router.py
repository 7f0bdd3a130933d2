"""The router alone (no Ray): prefix affinity within a load bound, the shared block hashes,
and `--replicas 2` without Ray installed."""

from __future__ import annotations

import sys

import pytest

from kvloop.cluster.router import Candidate, PrefixRouter, RoundRobinRouter
from kvloop.cluster.stats import sum_stats
from kvloop.kv_cache import KVCacheStats, chain_hash, prompt_block_hashes
from kvloop.scheduler import SchedulerStats


def test_prompt_block_hashes_are_the_prefix_caches_chain() -> None:
    ids = list(range(40))
    hashes = prompt_block_hashes(ids, 16)
    assert len(hashes) == 2  # the last token never sits in a hashed block
    assert hashes[0] == chain_hash(None, tuple(ids[:16]))
    assert hashes[1] == chain_hash(hashes[0], tuple(ids[16:32]))
    assert prompt_block_hashes(list(range(33)), 16) == hashes
    assert len(prompt_block_hashes(list(range(32)), 16)) == 1
    assert prompt_block_hashes(ids, 16, max_blocks=1) == hashes[:1]


def _idle(n: int) -> list[Candidate]:
    return [Candidate(i, 0) for i in range(n)]


def test_prefix_router_sticks_to_the_replica_that_holds_the_prefix() -> None:
    router = PrefixRouter(2)
    a, b = [1, 2, 3], [7, 8, 9]
    first = router.choose(a, _idle(2))
    assert first is not None
    router.record(first, a)
    other = router.choose(b, [Candidate(first, 1), Candidate(1 - first, 0)])
    assert other == 1 - first  # a cold prefix goes to the less loaded replica
    router.record(other, b)
    for _ in range(5):
        assert router.choose([*a, 42], [Candidate(0, 1), Candidate(1, 1)]) == first
        assert router.choose(b, [Candidate(0, 1), Candidate(1, 1)]) == other


def test_prefix_router_bounds_the_load_of_a_hot_prefix() -> None:
    router = PrefixRouter(2, load_factor=1.5)
    router.record(0, [1, 2])
    # Replica 0 holds the prefix but already runs far more than its share: replica 1.
    assert router.choose([1, 2], [Candidate(0, 10), Candidate(1, 0)]) == 1
    assert router.choose([1, 2], [Candidate(0, 2), Candidate(1, 1)]) == 0


def test_prefix_router_forgets_a_restarted_replica_and_skips_down_ones() -> None:
    router = PrefixRouter(2)
    router.record(0, [5])
    router.forget(0)
    assert router.choose([5], [Candidate(0, 3), Candidate(1, 0)]) == 1
    assert router.choose([5], [Candidate(1, 0)]) == 1
    assert router.choose([5], []) is None


def test_round_robin_rotates_over_the_replicas_that_are_up() -> None:
    router = RoundRobinRouter(3)
    assert [router.choose([], _idle(3)) for _ in range(4)] == [0, 1, 2, 0]
    assert router.choose([], [Candidate(2, 0)]) == 2


def test_sum_stats_adds_the_replicas_up() -> None:
    def one(used: int, hits: int) -> SchedulerStats:
        return SchedulerStats(1, 2, KVCacheStats(10, 10 - used, 100, hits, 64, "fp32", (used,)),
                              3, accepted_per_step=(1, 2), num_steps=used * 10)

    total = sum_stats([one(4, 50), one(1, 10)])
    assert (total.num_running, total.num_waiting, total.num_preemptions) == (2, 4, 6)
    assert (total.kv.num_blocks, total.kv.num_used_blocks) == (20, 5)
    assert total.kv.prefix_hit_rate == pytest.approx(60 / 200)
    assert total.kv.seq_blocks == (4, 1) and total.accepted_per_step == (2, 4)
    assert total.num_steps == 50


def test_routing_a_long_prompt_takes_well_under_a_millisecond() -> None:
    """The router's own cost per request (hashing 32 blocks and choosing among 8), measured
    generously: a loaded CI machine must not fail it."""
    import time

    router = PrefixRouter(8)
    prompt = list(range(2000))
    candidates = [Candidate(i, i % 3) for i in range(8)]
    t0 = time.perf_counter()
    for _ in range(200):
        hashes = prompt_block_hashes(prompt, 16, 32)
        router.record(router.choose(hashes, candidates) or 0, hashes)
    per_request = (time.perf_counter() - t0) / 200
    assert per_request < 1e-3, per_request


def test_replicas_without_ray_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvloop.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", "--replicas", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "pip install 'kvloop[cluster]'" in err[0] and "--replicas" in err[0]


def test_replicas_flag_is_checked_before_anything_loads(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvloop.cli import main

    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
