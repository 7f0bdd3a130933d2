"""Continuous batching over the paged KV cache: results do not depend on the batch.

Each request's greedy tokens are identical whether it runs alone (the single-sequence
path: one request at a time) or among 31 others; with prefix caching on or off; with
chunked prefill at a small chunk size; and when a tiny KV budget forces preemptions.
"""

from __future__ import annotations

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.engine.llm_engine import LLMEngine

N_REQUESTS = 32


def make_workload(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    more = torch.randint(1, 401, (N_REQUESTS - 8,), generator=g).tolist()
    lengths = [1, 2, 3, 400, 17, 250, 64, 5, *more]
    # A shared head on some prompts, so prefix caching has something to find.
    head = torch.randint(2, vocab, (48,), generator=g).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        body = torch.randint(2, vocab, (n,), generator=g).tolist()
        prompts.append((head + body)[:n] if i % 3 == 0 else body)
    outs = torch.randint(1, 40, (N_REQUESTS,), generator=g).tolist()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0)
              for m in outs]
    return prompts, params


@pytest.fixture(scope="module")
def workload(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="64MiB")
    prompts, params = make_workload(llm.engine.model_config.vocab_size)
    alone = [llm.generate([p], sp)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]
    return prompts, params, alone


def run_batch(model_dir, prompts, params, **engine_options):
    llm = LLM(str(model_dir), **engine_options)
    outs = llm.generate(prompts, params)
    return llm.engine, [o.outputs[0] for o in outs]


def assert_same_tokens(alone, batched) -> float:
    """Token ids equal; returns the largest logprob difference (reported, not asserted)."""
    worst = 0.0
    for i, (a, b) in enumerate(zip(alone, batched, strict=True)):
        assert a.token_ids == b.token_ids, f"request {i} differs"
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    return worst


@pytest.mark.parametrize("options", [
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 24},  # chunked prefill: prompts of up to 400 in 24-token chunks
], ids=["prefix-cache-on", "prefix-cache-off", "chunked-prefill-24"])
def test_batch_invariance(tiny_model_dir, workload, options):
    prompts, params, alone = workload
    engine, batched = run_batch(tiny_model_dir, prompts, params, kv_cache_memory="64MiB",
                                **options)
    worst = assert_same_tokens(alone, batched)
    print(f"{options}: max |logprob alone - batched| = {worst:.2e}")
    assert engine.num_steps < sum(len(b.token_ids) for b in batched)  # it did batch
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_batch_invariance_under_preemption(tiny_model_dir, workload):
    prompts, params, alone = workload
    # 2 layers * 2 kv heads * 16 dims * 2 (K,V) * 4 bytes (fp32: "auto" beside fp32 weights)
    # = 512 bytes per slot: 36 blocks of 16.
    engine, batched = run_batch(tiny_model_dir, prompts, params, kv_cache_memory=36 * 16 * 512,
                                max_num_batched_tokens=128)
    assert engine.kv.pool.num_blocks == 36
    assert engine.scheduler.num_preemptions > 0
    assert_same_tokens(alone, batched)
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_prefix_cache_hits_on_shared_system_prompt(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="64MiB")
    g = torch.Generator().manual_seed(3)
    system = torch.randint(2, 320, (256,), generator=g).tolist()
    first = system + torch.randint(2, 320, (20,), generator=g).tolist()
    second = system + torch.randint(2, 320, (30,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = llm.generate([first], params)[0]
    assert a.metrics.num_cached_tokens == 0
    b = llm.generate([second], params)[0]
    assert b.metrics.num_cached_tokens == 256  # 16 full blocks of the system prompt
    assert b.metrics.positions_processed == len(second) - 256 + 3
    stats = llm.engine.stats()
    assert stats.kv.prefix_hits == 256
    # The same answer as without the cache.
    cold = LLM(str(tiny_model_dir), kv_cache_memory="64MiB", enable_prefix_caching=False)
    assert cold.generate([second], params)[0].outputs[0].token_ids == b.outputs[0].token_ids


def test_n_samples_share_prompt_blocks_and_are_reproducible(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="64MiB", enable_prefix_caching=False)
    engine: LLMEngine = llm.engine
    prompt = torch.randint(2, 320, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=20, ignore_eos=True)
    rid = engine.add_request(None, prompt, params)
    engine.step()  # prefill of the one parent, four first tokens, three forks
    seqs = engine._groups[rid].seqs
    assert len(seqs) == 4
    tables = [engine.kv.block_ids(s.request_id) for s in seqs]
    # 100 prompt tokens = 6 full blocks + 1 partial: the full ones are shared by all four.
    assert all(t[:6] == tables[0][:6] for t in tables)
    assert all(engine.kv.pool.blocks[b].ref_count == 4 for b in tables[0][:6])
    used_with_sharing = engine.kv.pool.num_blocks - engine.kv.pool.num_free
    assert used_with_sharing == 7  # not 4 * 7: the prompt is held once
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.finished)
    samples = [c.token_ids for c in outs[0].outputs]
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1
    again = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
    assert again == samples
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_beams_share_prompt_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="64MiB", enable_prefix_caching=False)
    engine = llm.engine
    prompt = torch.randint(2, 320, (96,), generator=torch.Generator().manual_seed(6)).tolist()
    params = SamplingParams(num_beams=4, max_tokens=12, early_stopping=True)
    rid = engine.add_request(None, prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        group = engine._groups.get(rid)
        if group is not None and len(group.seqs) == 4:
            tables = [engine.kv.block_ids(s.request_id) for s in group.seqs]
            # The 6 prompt blocks are held once, by all four beams.
            assert all(t[:6] == tables[0][:6] for t in tables)
            peak = max(peak, engine.kv.pool.num_blocks - engine.kv.pool.num_free)
    # 4 beams, each with its own generated block(s), plus the shared prompt: far below
    # the 4 * 7 = 28 blocks four private copies of the prompt would need.
    assert 0 < peak <= 6 + 4 * 1
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


def test_beam_search_runs_beside_other_requests(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory="64MiB")
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (30, 70, 5)]
    beam = SamplingParams(num_beams=3, max_tokens=10, num_return_sequences=3)
    greedy = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    alone_beam = llm.generate([prompts[0]], beam)[0].outputs
    alone_greedy = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts[1:]]
    mixed = llm.generate(prompts, [beam, greedy, greedy])
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in alone_beam]
    assert [c.score for c in mixed[0].outputs] == pytest.approx([c.score for c in alone_beam])
    assert [m.outputs[0].token_ids for m in mixed[1:]] == alone_greedy
