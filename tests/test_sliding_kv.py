"""Sliding-window attention in the paged KV cache: KV cache groups (kv_cache.py) whose
sliding groups give back the blocks that slid out of the window.

Oracles: transformers' Gemma3ForCausalLM generate (which applies the window mask), kvloop
itself with one all-full group (every layer keeps every block; the window only restricts
what the sliding layers read, as before groups existed), and hand-counted block numbers.
The bound a sliding group holds to, for a step whose first query is at position c and
which runs n tokens, is the blocks of positions [c - W + 1, c + n):
    ceil((W - 1 + n) / block_size) + 1  (the window's start may fall inside a block).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import kvloop.engine.llm_engine as llm_engine
from conftest import write_tiny_gemma3
from kvloop import LLM, SamplingParams, kernels
from kvloop.engine.llm_engine import LLMEngine
from kvloop.kv_cache import KVCacheManager, blocks_for_sequence
from kvloop.loading.loader import load_checkpoint
from kvloop.models.attention import KVCacheGroup, kv_cache_groups
from kvloop.models.gemma3 import pattern_layer_types
from kvloop.params import SamplingParams as Params
from kvloop.request import Request
from kvloop.scheduler import Scheduler, SchedulerConfig
from test_model_parity import compare_greedy, hf_greedy


def bound(window: int, n: int, bs: int) -> int:
    """Most blocks a sliding group holds in a step of n tokens (see the module doc)."""
    return math.ceil((window - 1 + n) / bs) + 1


# -- the groups ---------------------------------------------------------------------------------


def test_groups_of_gemma3_270m_layout(tmp_path: Path) -> None:
    """18 layers, every 6th global: one full group (5, 11, 17) and five sliding groups of
    three; a config without sliding layers is one group of all layers."""
    c = load_checkpoint(write_tiny_gemma3(tmp_path / "m")).config
    c = replace(c, num_layers=18, layer_types=pattern_layer_types(18, 6), sliding_window=512)
    groups = kv_cache_groups(c)
    assert groups[0] == KVCacheGroup((5, 11, 17), None)
    assert [g.layers for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                             (14, 15, 16)]
    assert all(g.window == 512 for g in groups[1:])
    assert kv_cache_groups(replace(c, layer_types=())) == [KVCacheGroup(tuple(range(18)))]
    # 4,000 tokens, window 512, blocks of 16, decoding (one token a step): the goal's 30%.
    held = blocks_for_sequence(4000, 16, [g.window for g in groups], 1)
    assert held == 250 + 5 * 33
    assert held / (6 * 250) <= 0.30


# -- KVCacheManager with a sliding group (pure Python) -------------------------------------------

BS, W = 4, 8


def make_request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, Params(max_tokens=max_tokens))


def sliding_kv(num_blocks: int = 64, **kw: Any) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, watermark=0.0, group_windows=(None, W), **kw)


def step(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_full_blocks(req)


def test_decode_holds_only_the_window() -> None:
    """Token by token to 40: the full group holds every block, the sliding one at most the
    window's; what slid out is back in the pool and the table reads it as block 0."""
    kv = sliding_kv()
    req = make_request("r", list(range(40)))
    for t in range(40):
        step(kv, req, 1)
        full, sliding = kv.group_num_blocks("r")
        assert full == t // BS + 1
        assert sliding <= bound(W, 1, BS)
        assert kv.pool.num_free == 64 - full - sliding
    # Before computing position 40, keys from 33 on are needed: blocks 8 and 9 stay.
    assert kv.allocate(req, 1)
    assert kv.group_num_blocks("r") == [11, 3]
    assert kv.block_ids("r", 1)[:8] == [0] * 8
    kv.free("r")
    assert kv.pool.num_free == 64


def test_chunked_prefill_through_the_scheduler() -> None:
    """A 200-token prompt in chunks of 16 in a pool far smaller than 2 x 50 blocks: it is
    admitted (check_fits counts each group's blocks, not groups x tokens), prefills
    without preemption, and each step holds the bound."""
    kv = KVCacheManager(70, BS, watermark=0.0, group_windows=(None, W))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), kv)
    assert kv.blocks_needed(201, 16) == 51 + bound(W, 16, BS) <= 70
    req = make_request("r", list(range(200)), max_tokens=1)
    sched.add_request(req)
    while req.num_computed_tokens < 200:
        out = sched.schedule()
        assert out.num_preempted == 0
        sched.commit(out)
        assert kv.group_num_blocks("r")[1] <= bound(W, 16, BS)
    assert kv.group_num_blocks("r")[0] == 50
    # Twice as many tokens could not fit, and says so at add_request.
    with pytest.raises(Exception, match="KV blocks"):
        sched.add_request(make_request("long", list(range(400)), max_tokens=1))


def test_prefix_hit_needs_only_the_window_before_it() -> None:
    """A hit keeps the full group's whole chain but, in the sliding group, only the window's
    blocks before the hit point: an evicted older sliding block costs nothing; an evicted
    one inside the window shortens the hit."""
    kv = sliding_kv(20)
    a = make_request("a", list(range(40)))
    step(kv, a, 40)  # one chunk: nothing slides out, all 10 + 10 blocks cached
    sliding_blocks = [kv.pool.blocks[b] for b in kv.block_ids("a", 1)]
    kv.free("a")

    def evict(block_id: int) -> None:
        """Move every other block behind it in the LRU queue, then take it. Free blocks
        holding nothing findable (an earlier evict's) are taken first (BlockPool.allocate):
        they are held aside meanwhile, which costs no cached contents."""
        for b in kv.pool.blocks:
            if b.block_id != block_id:
                kv.pool.acquire(b)
                kv.pool.release(b)
        hashless = {b.block_id for b in kv.pool.blocks if b.block_hash is None}
        held = []
        while (taken := kv.pool.allocate()).block_id != block_id:
            assert taken.block_id in hashless, "a cached block was taken before the one asked"
            held.append(taken)
        for t in [*held, taken]:
            kv.pool.release(t)

    evict(sliding_blocks[4].block_id)
    b = make_request("b", [*range(40), 99])
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 10  # block 4 lies before position 40's window (33..40)
    assert hit.groups[1] == [None] * 8 + sliding_blocks[8:10]

    evict(sliding_blocks[9].block_id)
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 9  # from position 36 on, the window 29..36 is blocks 7 and 8
    assert hit.groups[1] == [None] * 7 + sliding_blocks[7:9]
    b.num_computed_tokens = 36
    assert kv.allocate(b, 5, hit, admitting=True)
    assert kv.group_num_blocks("b") == [11, 4]


def test_fork_copies_the_shared_tail_in_every_group() -> None:
    """Beam fork: both groups' blocks shared; the first writer into the partial tail gets a
    copy in each group; dropped entries stay dropped in both tables."""
    kv = sliding_kv()
    p = make_request("p", list(range(30)))
    for _ in range(30):
        step(kv, p, 1)
    kv.fork("p", "c")
    c = make_request("c", list(range(30)))
    c.num_computed_tokens = 30
    assert kv.block_ids("c", 1) == kv.block_ids("p", 1)
    free = kv.pool.num_free
    assert kv.allocate(c, 1)
    copies = kv.take_copies()
    assert len(copies) == 2  # block 7 of each group
    assert kv.block_ids("c", 0)[7] != kv.block_ids("p", 0)[7]
    assert kv.block_ids("c", 1)[7] != kv.block_ids("p", 1)[7]
    assert kv.pool.num_free == free - 2
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_free == 64


def test_truncate_drops_rejected_drafts_in_every_group() -> None:
    """Speculative drafts: room for 6 more tokens, 2 accepted; both groups keep only the
    blocks of the committed tokens."""
    kv = sliding_kv()
    r = make_request("r", list(range(22)))
    for _ in range(22):
        step(kv, r, 1)
    assert kv.allocate(r, 6)  # 22 + 6 = 28 tokens: 7 blocks
    assert kv.group_num_blocks("r")[0] == 7
    kv.truncate("r", 24)
    full, sliding = kv.group_num_blocks("r")
    assert full == 6 and len(kv.block_ids("r", 1)) == 6 and sliding <= bound(W, 1, BS)
    kv.free("r")
    assert kv.pool.num_free == 64


# -- Gemma 3 end to end ----------------------------------------------------------------------------

KV = "64MiB"


def one_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference: every layer in one full group (all blocks kept, the window applied
    only to what sliding layers read)."""
    monkeypatch.setattr(llm_engine, "kv_cache_groups",
                        lambda c: [KVCacheGroup(tuple(range(c.num_layers)))])


def run_counting(engine: LLMEngine, prompt: list[int], params: SamplingParams,
                 window: int, chunk: int) -> tuple[list[int], list[list[int]]]:
    """Step the engine through one request, asserting each group's block count after
    every step; returns the tokens and the per-group counts of each step."""
    bs = engine.config.block_size
    rid = engine.add_request(None, prompt, params)
    counts: list[list[int]] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        req = engine.scheduler.requests.get(rid)
        if req is None:
            break
        per_group = engine.kv.group_num_blocks(rid)
        counts.append(per_group)
        assert per_group[0] == math.ceil(req.num_computed_tokens / bs)
        n = chunk if req.num_computed_tokens <= len(prompt) else 1
        assert all(k <= bound(window, n, bs) for k in per_group[1:])
        # stats: the one sequence's KV bytes, all groups' blocks
        st = engine.stats().kv
        assert st.seq_kv_bytes == (sum(per_group) * st.bytes_per_block,)
    return tokens, counts


@pytest.fixture(scope="module")
def long_gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    d = write_tiny_gemma3(tmp_path_factory.mktemp("gemma-512"), sliding_window=512,
                          max_position_embeddings=8192)
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def test_4000_token_sequence_holds_the_window_and_matches_transformers(
        long_gemma: tuple[Path, Any]) -> None:
    """The acceptance: 4,000 tokens, window 512, blocks of 16, 512-token chunks. The five
    sliding groups never hold more than the window needs, the whole sequence's KV ends
    under 30% of all-full attention, and the greedy tokens equal transformers'."""
    d, hf = long_gemma
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 320, (4000,), generator=g).tolist()
    want, logits = hf_greedy(hf, prompt, 6)
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              block_size=16, max_num_batched_tokens=512)
    engine = llm.engine
    assert [grp.window for grp in engine.kv_groups] == [None] + [512] * 5
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got, counts = run_counting(engine, prompt, params, 512, 512)
    assert compare_greedy(got, want, logits) == len(want)
    last = counts[-1]  # 4,005 tokens computed, the last decode's allocation
    assert last[0] == 251 and all(k <= bound(512, 1, 16) for k in last[1:])
    assert max(max(c[1:]) for c in counts) <= bound(512, 512, 16)
    full_attention_blocks = 6 * last[0]  # every layer keeping every position
    assert sum(last) / full_attention_blocks <= 0.30
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    d = write_tiny_gemma3(tmp_path_factory.mktemp("gemma-16"))  # window 16
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def greedy(llm: LLM, prompts: list[list[int]], n: int, **kw: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "gather"])
def test_mixed_batch_matches_transformers_and_the_all_full_cache(
        gemma: tuple[Path, Any], monkeypatch: pytest.MonkeyPatch, use_kernels: bool) -> None:
    """A batch of mixed lengths around the 16-token window, 24-token chunks, decoding past
    it, with decode attention in the C++ kernel (told the window) or gathered in PyTorch:
    the same tokens as transformers and as kvloop with every block kept."""
    d, hf = gemma
    prompts = prompts_of((3, 15, 16, 17, 40, 130), 4)
    refs = [hf_greedy(hf, ids, 30) for ids in prompts]
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              max_num_batched_tokens=24, use_kernels=use_kernels)
    assert llm.engine.runner.use_kernels == (use_kernels and kernels.available())
    got = greedy(llm, prompts, 30)
    for ours, (want, logits) in zip(got, refs, strict=True):
        assert compare_greedy(ours, want, logits) == len(want)
    one_group(monkeypatch)
    full = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              max_num_batched_tokens=24, use_kernels=use_kernels)
    assert len(full.engine.kv_groups) == 1
    assert greedy(full, prompts, 30) == got


def test_prefix_cache_hits_with_sliding_groups(gemma: tuple[Path, Any]) -> None:
    """Prompts sharing an 80-token head: the second round hits the cache in every group
    and gives transformers' tokens."""
    d, hf = gemma
    head = prompts_of((80,), 5)[0]
    prompts = [head + tail for tail in prompts_of((5, 21), 6)]
    refs = [hf_greedy(hf, ids, 20) for ids in prompts]
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    for _ in range(2):
        for ours, (want, logits) in zip(greedy(llm, prompts, 20), refs, strict=True):
            assert compare_greedy(ours, want, logits) == len(want)
    assert llm.engine.kv.stats().prefix_hits >= 2 * 80  # the shared blocks, each prompt
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_preempted_long_sequences_recompute_to_the_same_tokens(gemma: tuple[Path, Any]) -> None:
    """96 blocks of 8 KiB (one group's layer, the least the engine accepts): four
    300-token prompts with 40 new tokens (each then holding 22 full-group blocks and 2 in
    each of five sliding groups) outgrow it, are preempted and recomputed, and still
    give transformers' tokens."""
    d, hf = gemma
    prompts = prompts_of((300, 280, 320, 300), 7)
    refs = [hf_greedy(hf, ids, 40) for ids in prompts]
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=96 * 8192, max_num_batched_tokens=64)
    assert llm.engine.kv.pool.num_blocks == 96
    got = greedy(llm, prompts, 40)
    assert llm.engine.scheduler.num_preemptions > 0
    for ours, (want, logits) in zip(got, refs, strict=True):
        assert compare_greedy(ours, want, logits) == len(want)
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_beam_search_forks_per_group(gemma: tuple[Path, Any],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Beams fork mid-block past the window: the same beams and scores as with one
    all-full group."""
    d, _ = gemma
    prompts = prompts_of((37,), 8)
    params = SamplingParams(num_beams=3, max_tokens=24, num_return_sequences=3)
    got = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV).generate(prompts, params)[0].outputs
    one_group(monkeypatch)
    want = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV).generate(prompts, params)[0].outputs
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.score for c in got] == pytest.approx([c.score for c in want], abs=1e-4)


def test_speculative_drafts_truncate_per_group(gemma: tuple[Path, Any]) -> None:
    """n-gram drafts on a repetitive prompt (accepted and rejected ones): transformers'
    tokens, and every block back in the pool at the end."""
    d, hf = gemma
    prompt = (prompts_of((12,), 9)[0] * 6)[:70]
    want, logits = hf_greedy(hf, prompt, 40)
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              speculative="ngram", ngram_min=1, ngram_max=3)
    got = greedy(llm, [prompt], 40)[0]
    assert compare_greedy(got, want, logits) == len(want)
    assert llm.engine.scheduler.num_draft_tokens > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks


def test_llama_is_one_group(tiny_model_dir: Path) -> None:
    """No sliding layers: one group of every layer, block bytes over all layers, the pool
    sized as before."""
    llm = LLM(tiny_model_dir, kv_cache_memory=36 * 16 * 512, kv_cache_dtype="fp32")
    engine = llm.engine
    assert len(engine.kv_groups) == 1 and engine.kv.num_groups == 1
    assert engine.kv.pool.num_blocks == 36
    assert engine.kv.bytes_per_block == 16 * 512
    engine.add_request("r", [5, 6, 7] * 10, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the 30-token prompt (two blocks) and its first token
    assert engine.stats().kv.seq_blocks == (2,)
    assert engine.stats().kv.seq_kv_bytes == (2 * 16 * 512,)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv.seq_blocks == ()


def test_metrics_report_kv_bytes_per_sequence() -> None:
    """/metrics: the block size in bytes and a histogram of each sequence's KV bytes, from
    the stats snapshot (hand-computed: 3 and 17 blocks of 8 KiB)."""
    from prometheus_client import generate_latest

    from kvloop.kv_cache import KVCacheStats
    from kvloop.scheduler import SchedulerStats
    from kvloop.server.metrics import ServerMetrics

    kv = KVCacheStats(100, 80, bytes_per_block=8192, seq_blocks=(3, 17))
    assert kv.seq_kv_bytes == (24576, 139264)
    text = generate_latest(ServerMetrics(lambda: SchedulerStats(2, 0, kv, 0)).registry).decode()
    lines = set(text.splitlines())
    assert "kvloop_kv_cache_bytes_per_block 8192.0" in lines
    assert 'kvloop_kv_cache_bytes_per_sequence_bucket{le="65536"} 1.0' in lines
    assert 'kvloop_kv_cache_bytes_per_sequence_bucket{le="262144"} 2.0' in lines
    assert "kvloop_kv_cache_bytes_per_sequence_count 2.0" in lines
    assert "kvloop_kv_cache_bytes_per_sequence_sum 163840.0" in lines


def test_qwen_with_sliding_upper_layers_matches_transformers(tmp_path: Path) -> None:
    """A Llama-family model with full and sliding layers (Qwen2, use_sliding_window, window
    8, layer 0 full): three KV cache groups, transformers' greedy tokens with blocks of 4,
    chunked prefill and the cached prefix reused."""
    from test_families import TINY_FAMILIES, _edit_config, hf_model

    d = TINY_FAMILIES["qwen2"](tmp_path / "q", num_hidden_layers=3)
    _edit_config(d, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                 layer_types=None)
    prompts = [p + t for p in prompts_of((30,), 10) for t in prompts_of((5, 11), 11)]
    hf = hf_model(d)
    refs = [hf_greedy(hf, ids, 20) for ids in prompts]
    llm = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV,
              block_size=4, max_num_batched_tokens=12)
    assert [g.window for g in llm.engine.kv_groups] == [None, 8, 8]
    for _ in range(2):
        for ours, (want, logits) in zip(greedy(llm, prompts, 20), refs, strict=True):
            assert compare_greedy(ours, want, logits) == len(want)
    assert llm.engine.kv.stats().prefix_hits > 0
