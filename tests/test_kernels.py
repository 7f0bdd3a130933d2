"""The native paged-attention kernel against its PyTorch reference and dense SDPA.

Every case builds dense per-sequence K/V first, scatters them into a paged cache through
shuffled block tables, and checks kernel == reference == dense attention. Unused cache
slots and padded table entries hold garbage, so any read of them shows up as NaN.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from conftest import require_native_kernels
from kvloop.kernels import build
from kvloop.kernels import paged_attention as pa
from kvloop.kernels.linear import F32, Q4, Q4F, Q8, Q8B, linear_reference, pack_q4, pack_q4f

ATOL = 1e-5
RTOL = 1e-4


@pytest.fixture(scope="module")
def kernel() -> None:
    require_native_kernels()


@dataclass
class Case:
    cache: torch.Tensor  # [2, Hkv, slots, D]
    tables: torch.Tensor  # [N, max_blocks]
    ctx: torch.Tensor  # [N] int64
    keys: list[torch.Tensor]  # per sequence [Hkv, ctx, D]
    values: list[torch.Tensor]
    block_size: int


def make_case(
    ctx_lens: list[int], Hkv: int, D: int, block_size: int, seed: int,
    garbage: float = float("nan"), table_dtype: torch.dtype = torch.long,
) -> Case:
    """Dense K/V per sequence, scattered into a cache through shuffled block tables.

    Unused slots (spare blocks, the tail of each last block) are filled with ``garbage``;
    padded table entries point far out of range (or at -1)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblocks = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(nblocks) + 3  # spare blocks nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # tables are non-contiguous and out of order
    max_blocks = max(nblocks) + 2  # padding columns beyond every sequence's blocks
    cache = torch.full((2, Hkv, num_blocks * block_size, D), garbage)
    tables = torch.full((len(ctx_lens), max_blocks), num_blocks + 1000, dtype=torch.long)
    tables[:, -1] = -1
    keys, values = [], []
    for i, c in enumerate(ctx_lens):
        own = [ids.pop() for _ in range(nblocks[i])]
        tables[i, : nblocks[i]] = torch.tensor(own)
        pos = torch.arange(c)
        slots = torch.tensor(own)[pos // block_size] * block_size + pos % block_size
        k = torch.randn(Hkv, c, D, generator=g)
        v = torch.randn(Hkv, c, D, generator=g)
        cache[0][:, slots] = k
        cache[1][:, slots] = v
        keys.append(k)
        values.append(v)
    return Case(cache, tables.to(table_dtype), torch.tensor(ctx_lens), keys, values, block_size)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [L, H, D] = the last L positions of k/v [Hkv, ctx, D]; causal. -> [L, H, D]"""
    L, ctx = q.shape[0], k.shape[1]
    mask = torch.ones(L, ctx, dtype=torch.bool).tril(diagonal=ctx - L)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


def ctx_lens_for(B: int, block_size: int, rng: random.Random) -> list[int]:
    # Single tokens, exact block multiples, one past a block, the longest, then random.
    special = [1, block_size, 2 * block_size, block_size + 1, 600, 37 * block_size - 1]
    lens = special[:B] if len(special) > B else special + [
        rng.randint(1, 600) for _ in range(B - len(special))
    ]
    rng.shuffle(lens)
    return lens


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("D", [64, 32])
@pytest.mark.parametrize(("H", "Hkv"), [(9, 3), (4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_decode_matches_reference_and_dense(
    kernel: None, B: int, H: int, Hkv: int, D: int, block_size: int
) -> None:
    seed = hash((B, H, Hkv, D, block_size)) % 10_000
    ctx = ctx_lens_for(B, block_size, random.Random(seed))
    case = make_case(ctx, Hkv, D, block_size, seed)
    q = torch.randn(B, H, D, generator=torch.Generator().manual_seed(seed))
    scale = D**-0.5

    out = pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, block_size, scale)
    ref = pa.paged_decode_attention_reference(
        q, case.cache, case.tables, case.ctx, block_size, scale
    )
    dense = torch.cat(
        [dense_attention(q[b : b + 1], case.keys[b], case.values[b], scale) for b in range(B)]
    )
    assert out.shape == (B, H, D)
    torch.testing.assert_close(ref, dense, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("garbage", [float("nan"), 1e30, -1e30, float("inf")])
def test_garbage_in_unused_slots_and_padding_is_never_read(kernel: None, garbage: float) -> None:
    ctx = [5, 16, 33, 1, 250]
    case = make_case(ctx, 3, 64, 16, seed=7, garbage=garbage)
    q = torch.randn(len(ctx), 9, 64)
    out = pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, 16, 0.125)
    assert torch.isfinite(out).all()
    dense = torch.cat(
        [dense_attention(q[b : b + 1], case.keys[b], case.values[b], 0.125)
         for b in range(len(ctx))]
    )
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL)


def test_nan_in_a_used_slot_propagates(kernel: None) -> None:
    # Garbage must not be read, but a real NaN in the context must not be hidden either.
    case = make_case([40, 40], 1, 64, 16, seed=9)
    pos = 17  # a used slot of sequence 1
    slot = int(case.tables[1, pos // 16]) * 16 + pos % 16
    case.cache[0, 0, slot, 3] = float("nan")
    out = pa.paged_decode_attention(torch.randn(2, 2, 64), case.cache, case.tables, case.ctx,
                                    16, 0.125)
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1]).all()


def test_works_under_inference_mode_into_a_slice(kernel: None) -> None:
    # How paged_attention uses it: inference tensors, result written into out[:n].
    case = make_case([30, 70], 3, 64, 16, seed=4)
    with torch.inference_mode():
        q = torch.randn(5, 9, 64)
        out = torch.zeros_like(q)
        out[:2] = pa.paged_decode_attention(q[:2], case.cache, case.tables, case.ctx, 16, 0.125)
    ref = pa.paged_decode_attention_reference(q[:2], case.cache, case.tables, case.ctx, 16, 0.125)
    torch.testing.assert_close(out[:2], ref, atol=ATOL, rtol=RTOL)
    assert not out[2:].any()


def test_int32_block_tables(kernel: None) -> None:
    case = make_case([17, 300, 64], 2, 64, 16, seed=3)
    q = torch.randn(3, 8, 64)
    a = pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, 16, 0.125)
    b = pa.paged_decode_attention(q, case.cache, case.tables.int(), case.ctx.int(), 16, 0.125)
    assert torch.equal(a, b)


@pytest.mark.parametrize(("H", "Hkv", "D"), [(20, 1, 20), (6, 2, 8), (4, 2, 128), (40, 2, 36)])
def test_odd_head_dims_and_big_groups(kernel: None, H: int, Hkv: int, D: int) -> None:
    # D not a multiple of 8/16 exercises the scalar tails; G > 16 splits a group.
    ctx = [1, 7, 100, 129]
    case = make_case(ctx, Hkv, D, 8, seed=H + D)
    q = torch.randn(len(ctx), H, D)
    out = pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, 8, D**-0.5)
    ref = pa.paged_decode_attention_reference(q, case.cache, case.tables, case.ctx, 8, D**-0.5)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_large_scores_are_stable(kernel: None) -> None:
    # Scores in the hundreds: the online softmax must subtract the running max.
    case = make_case([300, 45], 1, 32, 16, seed=11)
    q = 30 * torch.randn(2, 4, 32)
    out = pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, 16, 1.0)
    ref = pa.paged_decode_attention_reference(q, case.cache, case.tables, case.ctx, 16, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_result_does_not_depend_on_thread_count(kernel: None) -> None:
    # Items are split across threads by cost; each is computed the same way wherever it
    # runs, so the result is bitwise identical (3 threads oversubscribes on purpose).
    case = make_case([400, 3, 77, 512, 260, 1, 90], 3, 64, 16, seed=5)
    q = torch.randn(7, 9, 64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(pa.paged_decode_attention(q, case.cache, case.tables, case.ctx, 16, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(("L", "ctx"), [(1, 1), (5, 5), (7, 40), (33, 33), (40, 300), (64, 65)])
@pytest.mark.parametrize(("H", "Hkv"), [(9, 3), (4, 4), (20, 1)])
def test_prefill_chunk_over_cached_prefix(kernel: None, L: int, ctx: int, H: int, Hkv: int) -> None:
    case = make_case([ctx], Hkv, 64, 16, seed=L * ctx + H)
    q = torch.randn(L, H, 64)
    out = pa.paged_prefill_attention(q, case.cache, case.tables[0], ctx, 16, 0.125)
    ref = pa.paged_prefill_attention_reference(q, case.cache, case.tables[0], ctx, 16, 0.125)
    dense = dense_attention(q, case.keys[0], case.values[0], 0.125)
    torch.testing.assert_close(ref, dense, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=RTOL)


def test_varlen_mixes_decode_rows_and_prefill_chunks(kernel: None) -> None:
    # A step as the runner flattens it: decode rows first, then prefill chunks.
    ctx = [120, 1, 33, 200, 50]
    q_lens = [1, 1, 1, 25, 50]
    case = make_case(ctx, 3, 64, 16, seed=13)
    q = torch.randn(sum(q_lens), 9, 64)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    out = pa.paged_attention_varlen(q, case.cache, case.tables, starts, case.ctx, 16, 0.125)
    for n in range(len(ctx)):
        rows = slice(int(starts[n]), int(starts[n + 1]))
        dense = dense_attention(q[rows], case.keys[n], case.values[n], 0.125)
        torch.testing.assert_close(out[rows], dense, atol=ATOL, rtol=RTOL)


def test_empty_batch(kernel: None) -> None:
    case = make_case([4], 1, 16, 4, seed=0)
    q = torch.empty(0, 2, 16)
    out = pa.paged_decode_attention(q, case.cache, case.tables[:0], case.ctx[:0], 4, 0.25)
    assert out.shape == (0, 2, 16)


def test_bad_inputs_raise_instead_of_crashing(kernel: None) -> None:
    case = make_case([20, 10], 2, 32, 16, seed=1)
    q = torch.randn(2, 4, 32)
    bad = case.tables.clone()
    bad[1, 0] = 10_000  # a block id past the cache
    with pytest.raises(RuntimeError, match="out of range"):
        pa.paged_decode_attention(q, case.cache, bad, case.ctx, 16, 1.0)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        pa.paged_decode_attention(q, case.cache, case.tables, torch.tensor([20, 10_000]), 16, 1.0)
    with pytest.raises(RuntimeError, match="query rows"):
        pa.paged_decode_attention(q, case.cache, case.tables, torch.tensor([20, 0]), 16, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv heads"):
        pa.paged_decode_attention(torch.randn(2, 3, 32), case.cache, case.tables, case.ctx, 16, 1.0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        pa.paged_decode_attention(q.double(), case.cache, case.tables, case.ctx, 16, 1.0)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_other_isa_builds_match(kernel: None, isa: str) -> None:
    # The builds this CPU can run besides the one loaded (on an AVX-512 VNNI machine, the
    # AVX2 build other x86 CPUs get, and the plain loops of the rest): built explicitly
    # here and held to the same references.
    if isa not in build.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    if isa == build.native_module().compiled_isa():
        pytest.skip(f"the {isa} build is the loaded one, tested everywhere else")
    try:
        mod = build._build(isa)
    except Exception as e:  # pragma: no cover - depends on the toolchain
        pytest.fail(f"{isa} build failed: {e}")
    assert mod.compiled_isa() == isa
    assert mod.compiled_with_avx2() == (isa != "scalar")
    case = make_case([1, 16, 77, 300], 3, 36, 16, seed=2)
    q = torch.randn(4, 9, 36)
    out = mod.paged_attention_varlen(q, case.cache, case.tables, None, case.ctx, 16, 1 / 6, 0)
    ref = pa.paged_decode_attention_reference(q, case.cache, case.tables, case.ctx, 16, 1 / 6)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    # A sliding window of 40 (decode rows start mid-block).
    out = mod.paged_attention_varlen(q, case.cache, case.tables, None, case.ctx, 16, 1 / 6, 40)
    ref = pa.paged_decode_attention_reference(q, case.cache, case.tables, case.ctx, 16, 1 / 6,
                                              40)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    # The linear kernels, every weight kind, against the same references the loaded build
    # is tested with (tests/test_native.py): 1, 6 and 37 rows reach the single-row, 4-row
    # and tiled loops and their remainders.
    g = torch.Generator().manual_seed(3)
    N, K = 24, 96
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    s4 = (torch.rand(N, K // 32, generator=g) / 10).half().float()
    m4 = (torch.randn(N, K // 32, generator=g) / 10).half().float()
    q8 = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    s8 = torch.rand(N, generator=g) / 100
    # The block layouts of GGUF's formats as stored (kvloop.quant.layout): 4-bit with fp32
    # scale and min (Q4_K), 8-bit codes with fp16 / fp32 scales per 32 or 16, with mins.
    s32 = torch.rand(N, K // 32, generator=g) / 10
    s16 = torch.rand(N, K // 16, generator=g) / 10
    sm = torch.stack([s32, torch.randn(N, K // 32, generator=g) / 10], dim=1)
    kinds = [(F32, torch.randn(N, K, generator=g), None, False), (Q8, q8, s8, False),
             (Q8, q8, s8, True), (Q4, pack_q4(codes, s4, m4), None, False),
             (Q4F, pack_q4f(codes, s32, m4 * 1.1), None, False)]
    for sc in (s32.half(), s32, s16.half(), s16, sm, sm.half()):
        kinds += [(Q8B, q8, sc, False), (Q8B, q8, sc, True)]
    for kind, w, sc, fa in kinds:
        lin = mod.QLinear(kind, w, K, sc, None, fa)
        for M in (1, 6, 37):
            x = torch.randn(M, K, generator=g)
            ref = linear_reference(x, kind, w, K, sc, wide_acts=fa)
            torch.testing.assert_close(lin.forward(x), ref, atol=1e-4 * float(ref.abs().max()),
                                       rtol=0)


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the cached build decision for one test; restored afterwards."""
    monkeypatch.setattr(build, "_tried", False)
    monkeypatch.setattr(build, "_module", None)


def test_env_var_disables_kernels(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOP_NO_KERNELS", "1")

    def no_build(isa: str) -> None:
        raise AssertionError("must not build")

    monkeypatch.setattr(build, "_build", no_build)
    assert pa.available() is False
    with pytest.raises(RuntimeError, match="not available"):
        pa.paged_decode_attention(
            torch.zeros(1, 1, 8), torch.zeros(2, 1, 4, 8), torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 4, 1.0,
        )


def test_build_failure_falls_back_with_a_warning(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVLOOP_NO_KERNELS", raising=False)
    calls = []

    def broken(isa: str) -> None:
        calls.append(isa)
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(build, "_build", broken)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert pa.available() is False
        assert pa.available() is False
    assert len(calls) == 1  # tried once, not on every call
    assert "g++ not found" in caplog.text


def windowed_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   window: int) -> torch.Tensor:
    """dense_attention where position p sees only keys p - window + 1 .. p."""
    L, ctx = q.shape[0], k.shape[1]
    qpos = torch.arange(ctx - L, ctx)[:, None]
    kpos = torch.arange(ctx)[None, :]
    mask = (kpos <= qpos) & (kpos > qpos - window)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("window", [1, 5, 16, 40, 1000])
def test_sliding_window_never_reads_dropped_blocks(kernel: None, window: int,
                                                   block_size: int) -> None:
    """window > 0: decode rows and prefill chunks (one call) see only their last `window`
    positions, against dense attention with the window mask. The table entries of blocks
    before each sequence's first visible key point at a NaN-filled block, as a sliding KV
    cache group's dropped entries point at a block it does not own: any read shows."""
    ctx = [1, 7, 33, 100, 257, 64]
    rows = [1, 1, 5, 20, 40, 1]  # query rows per sequence: decodes and chunks
    D, H, Hkv = 32, 4, 2
    case = make_case(ctx, Hkv, D, block_size, seed=window * block_size)
    owned = set(case.tables[case.tables >= 0].tolist())
    spare = next(b for b in range(case.cache.shape[2] // block_size) if b not in owned)
    assert case.cache[:, :, spare * block_size].isnan().all()
    for i, (c, n) in enumerate(zip(ctx, rows, strict=True)):
        case.tables[i, : max(0, c - n - window + 1) // block_size] = spare
    g = torch.Generator().manual_seed(window)
    q = torch.randn(sum(rows), H, D, generator=g)
    qstart = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    out = pa.paged_attention_varlen(q, case.cache, case.tables, qstart, case.ctx,
                                    block_size, 0.2, window)
    assert not out.isnan().any()
    for i in range(len(ctx)):
        r = slice(int(qstart[i]), int(qstart[i + 1]))
        want = windowed_dense(q[r], case.keys[i], case.values[i], 0.2, window)
        torch.testing.assert_close(out[r], want, atol=ATOL, rtol=RTOL)
    # The decode entry point and the reference agree where the reference can read.
    dec = pa.paged_decode_attention(q[:2], case.cache, case.tables[:2], case.ctx[:2],
                                    block_size, 0.2, window)
    torch.testing.assert_close(dec, out[:2], atol=ATOL, rtol=RTOL)


def test_negative_window_is_refused(kernel: None) -> None:
    case = make_case([5], 1, 8, 4, seed=1)
    with pytest.raises(RuntimeError, match="window"):
        pa.paged_decode_attention(torch.randn(1, 1, 8), case.cache, case.tables, case.ctx, 4,
                                  1.0, -1)
