"""The engine step is a transaction, and a failure stays with the requests it belongs to.

- A forward that raises (injected at a chosen step, after it has scribbled over the KV
  blocks it was writing) fails exactly the requests of that step, commits nothing of
  theirs, frees their blocks, and a later request sharing their prefix gets the same
  tokens as a cold engine (no half-written block is ever served as a prefix-cache hit).
- An error in one request's own work (here: its detokenizer) fails that request alone.
- The async engine's supervisor restarts a loop that raised anyway, and gives up (503)
  only when it keeps failing.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import inject_forward_failure
from kvloop.config import EngineConfig
from kvloop.engine.async_engine import (
    MAX_RESTARTS,
    AsyncEngine,
    EngineDeadError,
    RequestFailedError,
)
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError
from kvloop.params import SamplingParams

BS = 16
PREFIX = list(range(10, 10 + 3 * BS))  # three full blocks shared by the prompts below


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def make_engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine(str(model_dir), EngineConfig(kv_cache_memory="16MiB", block_size=BS, **kw))


def run_all(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def assert_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.kv.num_used_blocks == 0
    assert not engine.has_unfinished_requests()


def test_scheduling_alone_commits_nothing(tiny_model_dir):
    """Until the forward returns, a scheduled prompt has no progress and no cached block."""
    engine = make_engine(tiny_model_dir)
    engine.add_request("a", [*PREFIX, 7], greedy(2))
    sched = engine.scheduler.schedule()
    req = engine.scheduler.requests["a"]
    assert [s.num_tokens for s in sched.seqs] == [len(PREFIX) + 1]
    assert req.num_computed_tokens == 0 and req.metrics.positions_processed == 0
    assert engine.kv.find_cached_prefix(req) == []  # nothing hashed yet
    engine.scheduler.commit(sched)
    assert req.num_computed_tokens == len(PREFIX) + 1
    assert len(engine.kv.find_cached_prefix(req)) == 3


def test_failed_forward_fails_exactly_its_step_and_poisons_no_prefix(tiny_model_dir):
    cold = make_engine(tiny_model_dir)
    cold.add_request("probe", [*PREFIX, 99, 98], greedy(12))
    cold.add_request("c", [3, 4, 5], greedy(12))
    expected = run_all(cold)

    # Two seats: "a" and "b" run in the failing step, "c" waits for a seat and is not in it.
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    seen: list[set[str]] = []
    inject_forward_failure(engine, at_step=3, seen=seen)
    engine.add_request("a", [5, 6, 7], greedy(20))
    run_steps = [engine.step() for _ in range(2)]
    assert all(not o.finished for outs in run_steps for o in outs)
    engine.add_request("b", [*PREFIX, 1, 2], greedy(12))  # prefilled in the failing step
    engine.add_request("c", [3, 4, 5], greedy(12))
    failed = engine.step()
    assert seen[-1] == {"a", "b"}
    assert {o.request_id for o in failed} == {"a", "b"}
    for o in failed:
        assert o.finished and o.error and "injected forward failure" in o.error
        assert all(c.finish_reason == "error" for c in o.outputs)
    # Nothing of theirs was committed: no positions counted, all their blocks back.
    assert engine.total_positions == 3 + 1  # a's prefill and one decode only

    engine.add_request("probe", [*PREFIX, 99, 98], greedy(12))
    finals = run_all(engine)
    assert set(finals) == {"c", "probe"}
    # "c" never ran in the failed step and is untouched by it; the probe shares the failed
    # prompt's three blocks, and must not be served the garbage written into them.
    assert finals["c"].outputs[0].token_ids == expected["c"].outputs[0].token_ids
    assert finals["probe"].outputs[0].token_ids == expected["probe"].outputs[0].token_ids
    assert finals["probe"].metrics.num_cached_tokens == 0
    assert_idle(engine)


def test_error_in_one_requests_work_fails_it_alone(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    cold = make_engine(tiny_model_dir)
    cold.add_request("good", [5, 6, 7], greedy(10))
    expected = run_all(cold)["good"].outputs[0].token_ids

    engine.add_request("good", [5, 6, 7], greedy(10))
    engine.add_request("bad", [8, 9], greedy(10))
    engine.step()
    seq = engine._groups["bad"].seqs[0]

    def broken(token_id: int) -> str:
        raise OverflowError("detokenizer exploded")

    seq.detok.add = broken  # type: ignore[method-assign]
    finals = run_all(engine)
    assert finals["bad"].error and "detokenizer exploded" in finals["bad"].error
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert finals["good"].error is None
    assert finals["good"].outputs[0].token_ids == expected
    assert_idle(engine)


def test_error_in_a_beam_step_fails_that_search_alone(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request("beams", [5, 6, 7], SamplingParams(max_tokens=6, num_beams=2))
    engine.add_request("plain", [5, 6, 7], greedy(6))

    def broken(inputs):
        raise OverflowError("math range error")

    engine._groups["beams"].beam.step = broken  # type: ignore[union-attr,method-assign]
    finals = run_all(engine)
    assert finals["beams"].error and "math range error" in finals["beams"].error
    assert finals["plain"].error is None and len(finals["plain"].outputs[0].token_ids) == 6
    assert_idle(engine)


def test_out_of_vocabulary_stop_token_id_is_refused_at_add(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    vocab = engine.model_config.vocab_size
    with pytest.raises(InvalidParamsError, match="stop_token_ids") as info:
        engine.add_request("x", [5], SamplingParams(stop_token_ids=[vocab + 5], min_tokens=2))
    assert info.value.param == "stop_token_ids"
    assert not engine.has_unfinished_requests()


def test_empty_text_prompt_starts_from_bos(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    engine.add_request("empty", "", greedy(4))
    out = run_all(engine)["empty"]
    assert out.prompt_token_ids == [engine.tokenizer.bos_token_id]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(InvalidParamsError, match="empty"):
        engine.add_request("ids", [], greedy(4))


# -- the async engine's supervisor ----------------------------------------------------------------


async def _collect(aeng: AsyncEngine, rid: str, prompt, params) -> list:
    stream = await aeng.add_request(rid, prompt, params)
    return [out async for out in stream]


def test_async_forward_failure_fails_its_stream_and_engine_serves_on(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    inject_forward_failure(engine, at_step=2, seen=[])

    async def main() -> list:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            with pytest.raises(RequestFailedError, match="injected"):
                await _collect(aeng, "a", [5, 6, 7], greedy(8))
            assert aeng.healthy
            outs = await _collect(aeng, "b", [5, 6, 7], greedy(8))
            assert aeng.stats().kv.num_used_blocks == 0
            return outs
        finally:
            aeng.shutdown()

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8


def test_supervisor_restarts_a_failed_loop_then_gives_up(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    real_step = engine.step
    failures = {"left": 1}

    def step():
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("scheduler bug")
        return real_step()

    engine.step = step  # type: ignore[method-assign]

    async def main() -> None:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            # The loop fails once mid-request: that request fails, the loop restarts empty.
            with pytest.raises(RequestFailedError, match="restarted"):
                await _collect(aeng, "a", [5, 6, 7], greedy(4))
            assert aeng.healthy
            outs = await _collect(aeng, "b", [5, 6, 7], greedy(4))
            assert outs[-1].finished and outs[-1].error is None
            assert aeng.stats().kv.num_used_blocks == 0
            # A loop that keeps failing is declared dead: the restart after the first
            # failure counted, so MAX_RESTARTS - 1 more are allowed within the window.
            failures["left"] = 10**6
            for i in range(MAX_RESTARTS - 1):
                with pytest.raises(RequestFailedError):
                    await _collect(aeng, f"c{i}", [5, 6, 7], greedy(4))
            with pytest.raises(EngineDeadError):
                await _collect(aeng, "last", [5, 6, 7], greedy(4))
            assert not aeng.healthy
            with pytest.raises(EngineDeadError):
                await aeng.add_request("after", [5], greedy(2))
        finally:
            aeng.shutdown()

    asyncio.run(main())


def test_beam_step_failing_halfway_through_its_forks_leaks_nothing(tiny_model_dir):
    """The search fails after it forked a beam but before it listed it: that beam's blocks
    are freed with the rest."""
    engine = make_engine(tiny_model_dir)
    engine.add_request("beams", [5, 6, 7], SamplingParams(max_tokens=8, num_beams=4))
    real_new_seq = engine._new_seq
    calls = {"n": 0}

    def new_seq(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("fork failed")
        return real_new_seq(*args, **kw)

    engine._new_seq = new_seq  # type: ignore[method-assign]
    finals = run_all(engine)
    assert calls["n"] == 2
    assert finals["beams"].error and "fork failed" in finals["beams"].error
    assert_idle(engine)
    assert engine._seq_to_group == {}
