"""ReplicaPool without Ray: in-process replicas (LocalReplicaClient) and replicas that fail
on cue, for the paths a real crash hits by chance. A replica lost before its request
produced anything is retried elsewhere; one lost mid-stream ends its request with
EngineDeadError (the server's 503); the router stops sending to a replica that is down."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvloop import LLM, SamplingParams
from kvloop.cluster.pool import ReplicaPool
from kvloop.cluster.replica import LocalReplicaClient
from kvloop.config import EngineConfig
from kvloop.engine.async_engine import AsyncEngine, EngineDeadError
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import KvloopError
from kvloop.scheduler import SchedulerStats

CONFIG = EngineConfig(kv_cache_memory="8MiB", num_threads=1)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@dataclass
class Dying:
    """A replica whose process dies after `after` items of each stream."""

    name: str
    inner: LocalReplicaClient
    after: int
    alive: bool = True

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams, priority: int) -> AsyncIterator[object]:
        stream = self.inner.generate(request_id, prompt, params, priority)
        try:
            k = 0
            async for item in stream:
                if k >= self.after:
                    self.alive = False
                    raise ConnectionError("the replica's process died")
                k += 1
                yield item
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def stats(self) -> SchedulerStats:
        if not self.alive:
            raise ConnectionError("down")
        return await self.inner.stats()


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[list[AsyncEngine]]:
    built = [AsyncEngine(LLMEngine(str(tiny_model_dir), CONFIG)) for _ in range(2)]
    for e in built:
        e.start()
    yield built
    for e in built:
        e.shutdown()


@pytest.fixture(scope="module")
def facts(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(str(tiny_model_dir), CONFIG)


@pytest.fixture(scope="module")
def want(tiny_model_dir: Path) -> list[int]:
    out = LLM(str(tiny_model_dir), kv_cache_memory="8MiB").generate([[5, 6, 7, 8]], GREEDY)
    return list(out[0].outputs[0].token_ids)


def _wait_free(engine: AsyncEngine) -> None:
    """Aborts land between engine steps: allow a moment."""
    deadline = time.monotonic() + 5
    while engine.stats().kv.num_used_blocks or engine.stats().num_running:
        assert time.monotonic() < deadline, "an aborted request still holds KV blocks"
        time.sleep(0.02)


async def _tokens(pool: ReplicaPool, rid: str) -> list[int]:
    stream = await pool.add_request(rid, [5, 6, 7, 8], GREEDY)
    outs = [o async for o in stream]
    return list(outs[-1].outputs[0].token_ids)


def test_lost_before_any_output_is_retried_on_another_replica(
        engines: list[AsyncEngine], facts: LLMEngine, want: list[int]) -> None:
    dying = Dying("r0", LocalReplicaClient("r0", engines[0]), after=1)  # after Accepted
    pool = ReplicaPool(facts, [dying, LocalReplicaClient("r1", engines[1])], "round_robin")

    async def main() -> list[list[int]]:
        got = [await _tokens(pool, "a")]  # round-robin sends it to r0 first
        got.append(await _tokens(pool, "b"))  # r0 is down: r1 only
        return got

    assert asyncio.run(main()) == [want, want]
    loads = {ld.name: ld for ld in pool.replica_loads()}
    assert not loads["r0"].up and loads["r1"].up
    assert (loads["r0"].routed, loads["r1"].routed) == (1, 2)
    _wait_free(engines[0])  # the lost attempt was aborted on its replica


def test_lost_mid_stream_ends_with_engine_dead(engines: list[AsyncEngine],
                                               facts: LLMEngine) -> None:
    dying = Dying("r0", LocalReplicaClient("r0", engines[0]), after=4)  # 3 outputs out
    pool = ReplicaPool(facts, [dying], "round_robin")

    async def main() -> None:
        stream = await pool.add_request("c", [5, 6, 7, 8], GREEDY)
        seen = 0
        with pytest.raises(EngineDeadError, match="replica r0 failed while this request ran"):
            async for _ in stream:
                seen += 1
        assert seen == 3
        with pytest.raises(EngineDeadError, match="no replica could take"):
            await pool.add_request("d", [5, 6, 7, 8], GREEDY)

    asyncio.run(main())
    assert not pool.healthy


def test_refusals_keep_their_type_and_abort_frees_blocks(engines: list[AsyncEngine],
                                                         facts: LLMEngine) -> None:
    pool = ReplicaPool(facts, [LocalReplicaClient("r0", engines[0])])

    async def main() -> None:
        with pytest.raises(KvloopError):  # the server's 400
            await pool.add_request("e", [5] * 100_000, GREEDY)
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = await pool.add_request("f", [5, 6, 7, 8], long)
        async for _ in stream:
            pool.abort("f")

    asyncio.run(main())
    _wait_free(engines[0])
