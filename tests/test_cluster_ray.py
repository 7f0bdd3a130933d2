"""Two engine replicas on a local Ray cluster behind one server (kvloop.cluster): the load
test of the server issue, prefix-aware routing against round-robin, and a replica killed
under load. Tiny random model, one thread per replica.

Ray's worker processes inherit this process's CPU affinity, so under `taskset` the whole
cluster stays on the cores the run was given. The tests run in file order: routing first,
while the replicas' pools hold nothing but cached prefixes (a pool that already holds free
blocks of other requests lets its cache outgrow the prefix-cache reserve), and the kill
test last, since it restarts a replica of the module's cluster.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from conftest import wait_until_idle  # noqa: E402
from kvloop import LLM, SamplingParams  # noqa: E402
from kvloop.cluster.pool import ReplicaPool  # noqa: E402
from kvloop.cluster.ray_serve import RayReplicaClient, deploy, undeploy  # noqa: E402
from kvloop.config import EngineConfig  # noqa: E402
from kvloop.engine.llm_engine import LLMEngine  # noqa: E402
from kvloop.server.app import ServerSettings, create_app  # noqa: E402
from kvloop.server.background import BackgroundServer  # noqa: E402
from test_server_load import (  # noqa: E402
    NUM_CLIENTS,
    NUM_REQUESTS,
    expect,
    make_jobs,
    run_load,
)

# Routing workload: 8 system prompts of 8 blocks, 16 requests each, in a shuffled order.
NUM_SYSTEM, PER_SYSTEM, SYSTEM_BLOCKS = 8, 16, 8
# Each replica's prefix cache keeps this many system prompts' blocks: a replica given half
# the prompts holds them all; one given all eight must keep evicting.
PROMPTS_PER_REPLICA_CACHE = 4.25


@dataclass
class Cluster:
    config: EngineConfig
    clients: list[RayReplicaClient]
    pool: ReplicaPool
    server: BackgroundServer
    model: str


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    model = str(tiny_model_dir)
    probe = LLMEngine(model, EngineConfig(kv_cache_memory="32MiB"))
    per_prompt = SYSTEM_BLOCKS * probe.kv_bytes_per_block
    config = EngineConfig(kv_cache_memory="32MiB", num_threads=1,
                          prefix_cache_memory=int(PROMPTS_PER_REPLICA_CACHE * per_prompt))
    del probe
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    try:
        clients = deploy(model, config, 2, max_waiting=256)
        pool = ReplicaPool(LLMEngine(model, config), clients)
        app = create_app(pool, ServerSettings(model_name="tiny"))
        with BackgroundServer(app) as server:
            yield Cluster(config, clients, pool, server, model)
        undeploy(clients)
    finally:
        serve.shutdown()
        ray.shutdown()


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics").text


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# --- routing -----------------------------------------------------------------------------------
def _routing_prompts(seed: int, block_size: int) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(2, 300) for _ in range(SYSTEM_BLOCKS * block_size)]
               for _ in range(NUM_SYSTEM)]
    prompts = [systems[k] + [rng.randrange(2, 300) for _ in range(4)]
               for k in range(NUM_SYSTEM) for _ in range(PER_SYSTEM)]
    rng.shuffle(prompts)
    return prompts


def _one_replica_hit_rate(model: str, config: EngineConfig, prompts: list[list[int]]) -> float:
    """The same requests, one at a time, on one engine with both replicas' prefix cache."""
    engine = LLMEngine(model, EngineConfig(kv_cache_memory=config.kv_cache_memory,
                                           prefix_cache_memory=2 * int(
                                               config.prefix_cache_memory)))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
        while engine.has_unfinished_requests():
            engine.step()
    return engine.stats().kv.prefix_hit_rate


async def _pool_hit_rate(cluster: Cluster, routing: str, prompts: list[list[int]]) -> float:
    """Hit rate over both replicas of this workload alone (their counters' increase)."""
    pool = ReplicaPool(cluster.pool.engine, cluster.clients, routing)  # type: ignore[arg-type]
    before = [await c.stats() for c in cluster.clients]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, ids in enumerate(prompts):
        stream = await pool.add_request(f"{routing}-{i}", ids, params)
        outs = [o async for o in stream]
        assert outs[-1].finished
    after = [await c.stats() for c in cluster.clients]
    hits = sum(a.kv.prefix_hits - b.kv.prefix_hits for a, b in zip(after, before, strict=True))
    queries = sum(a.kv.prefix_queries - b.kv.prefix_queries
                  for a, b in zip(after, before, strict=True))
    return hits / queries


def test_prefix_routing_keeps_one_replicas_hit_rate_round_robin_does_not(
        cluster: Cluster) -> None:
    bs = cluster.config.block_size
    # Each measurement has system prompts of its own: the others' are evicted first (LRU).
    single = _one_replica_hit_rate(cluster.model, cluster.config, _routing_prompts(1, bs))
    prefix = asyncio.run(_pool_hit_rate(cluster, "prefix", _routing_prompts(2, bs)))
    rr = asyncio.run(_pool_hit_rate(cluster, "round_robin", _routing_prompts(3, bs)))
    print(f"\nprefix-cache hit rate: one replica {single:.3f}, two replicas prefix-routed "
          f"{prefix:.3f} ({prefix / single:.0%}), round-robin {rr:.3f} ({rr / single:.0%})")
    assert single > 0.8
    assert prefix >= 0.9 * single
    assert rr <= 0.6 * single


def test_200_requests_from_32_clients_on_two_replicas(cluster: Cluster) -> None:
    jobs = make_jobs(random.Random(0))
    expect(jobs, LLM(cluster.model, kv_cache_memory="32MiB"))
    results, elapsed = run_load(cluster.server.url, jobs, timeout=180)

    assert sorted(results) == list(range(NUM_REQUESTS))  # none lost
    ids = [r.id for r in results.values()]
    assert len(set(ids)) == len(ids), "a response id was given twice"
    for job in (j for j in jobs if not j.disconnect):
        res = results[job.i]
        assert res.status == 200, (job, res)
        assert res.usage is not None
        assert res.usage["prompt_tokens"] == job.want_prompt_tokens, job
        assert res.usage["completion_tokens"] == sum(job.want_tokens), job
        assert sum(res.logprob_tokens.values()) == job.want_logprob_tokens, job
        assert [res.texts[i] for i in range(job.n)] == job.want_text, job
        if job.stream:
            assert res.finish.get(-1) == "[DONE]"
    dropped = [j for j in jobs if j.disconnect]
    assert dropped and all(results[j.i].status == 200 for j in dropped)

    # Both replicas served, and every one of them is idle with all its KV blocks free.
    text = wait_until_idle(lambda: _metrics(cluster.server.url), timeout=30)
    aborted = _sample(text, 'kvloop_requests_finished_total{finish_reason="abort"}')
    assert aborted == len(dropped)
    for c in cluster.clients:
        label = f'{{replica="{c.name}"}}'
        assert _sample(text, f"kvloop_replica_up{label}") == 1
        assert _sample(text, f"kvloop_replica_requests_routed_total{label}") > 20, text
        assert _sample(text, f"kvloop_replica_kv_cache_blocks_used{label}") == 0
        stats = asyncio.run(c.stats())
        assert stats.kv.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    print(f"\n{NUM_REQUESTS} requests, {NUM_CLIENTS} clients, 2 replicas: {elapsed:.1f} s, "
          f"{len(dropped)} hung up")


# --- faults (last: it restarts a replica) -------------------------------------------------------
def test_replica_killed_under_load(cluster: Cluster) -> None:
    url = cluster.server.url
    victim = cluster.clients[0]
    old_pid = asyncio.run(victim.pid())
    outcomes: list[str] = []

    async def one(client: httpx.AsyncClient, i: int, stream: bool) -> None:
        # Long answers: still running when the kill lands, however fast the replicas decode.
        body = {"prompt": f"load {i}: the quick brown fox", "max_tokens": 1500,
                "ignore_eos": True, "temperature": 0.0, "stream": stream}
        if not stream:
            r = await client.post("/v1/completions", json=body)
            if r.status_code == 200:
                outcomes.append("ok")
            else:
                assert r.status_code == 503, r.text
                assert "replica" in r.json()["error"]["message"]
                outcomes.append("503")
            return
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code in (200, 503)
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", events[-3:]
        errors = [e for e in events if '"error"' in e]
        if errors:
            assert "replica" in errors[0] and "service_unavailable" in errors[0], errors[0]
            outcomes.append("stream error")
        else:
            outcomes.append("ok")

    async def load() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            tasks = [asyncio.create_task(one(client, i, i % 2 == 0)) for i in range(24)]
            deadline = time.monotonic() + 30
            while (await victim.stats()).num_running == 0:  # the kill must cut requests
                assert time.monotonic() < deadline, "no request ever ran on the victim"
                await asyncio.sleep(0.05)
            os.kill(old_pid, signal.SIGKILL)
            await asyncio.wait_for(asyncio.gather(*tasks), 90)  # nothing hangs

    asyncio.run(load())
    assert len(outcomes) == 24
    print(f"\noutcomes after the kill: {sorted(outcomes)}")
    # The victim's requests end in an explicit error (503, or an error event), never a hang.
    assert set(outcomes) - {"ok"}, outcomes

    # Ray Serve restarts it, the router sees it back and sends to it again.
    deadline = time.monotonic() + 60
    while True:
        text = _metrics(url)
        label = f'{{replica="{victim.name}"}}'
        if (_sample(text, f"kvloop_replica_up{label}") == 1
                and _sample(text, f"kvloop_replica_restarts_total{label}") >= 1):
            break
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    assert asyncio.run(victim.pid()) != old_pid
    routed_before = _sample(text, f"kvloop_replica_requests_routed_total{label}")

    async def later() -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            rs = await asyncio.gather(*(client.post("/v1/completions", json={
                "prompt": f"after {i}", "max_tokens": 8, "temperature": 0.0})
                for i in range(16)))
            return [r.status_code for r in rs]

    assert asyncio.run(later()) == [200] * 16
    text = wait_until_idle(lambda: _metrics(url), timeout=30)
    assert _sample(text, f"kvloop_replica_requests_routed_total{label}") > routed_before
