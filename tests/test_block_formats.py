"""GGUF block formats as stored (quantization "gguf"): kvloop's weights equal the `gguf`
package's dequantization of the same bytes exactly (float32 equality), for hand-built
blocks of every format and for every quantized tensor of the real Gemma 3 270M file; the
kernels over those layouts equal a reference matmul; "auto" resolves per checkpoint and
"none" stays the fp32 reference.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import pytest
import torch

from conftest import require_native_kernels, write_gguf
from kvloop import LLM, SamplingParams, kernels
from kvloop.engine.llm_engine import load_model, resolve_quantization
from kvloop.engine_flags import add_engine_flags
from kvloop.kernels.linear import linear_reference, native_linear, native_stack
from kvloop.loading.loader import load_checkpoint
from kvloop.models.attention import AttentionMetadata, PrefillSegment
from kvloop.models.linear import Linear
from kvloop.quant import BlockLinear, GroupWeights, StackedLinear
from kvloop.quant.layout import Q4, Q4F, Q8B, STORED, WIDE_ACTS_KINDS
from kvloop.quant.stored import (
    BLOCK_TYPES,
    STORED_KINDS,
    StoredRows,
    cat,
    decode,
    file_order,
    stored,
)

T = gguf.GGMLQuantizationType
# Byte offsets of each block's fp16 fields (d, and dmin / m where there is one).
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
              T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
# The kernel layout each format maps onto (fp16 scales where they are exact).
LAYOUTS = {T.Q4_0: Q4, T.Q4_1: Q4, T.Q5_0: Q8B, T.Q5_1: Q8B, T.Q8_0: Q8B, T.Q4_K: Q4F,
           T.Q5_K: Q8B, T.Q6_K: Q8B}
ACCEPTANCE = (T.Q4_K, T.Q5_0, T.Q6_K, T.Q5_K, T.Q8_0)


def random_blocks(kind: T, rows: int, cols: int, seed: int,
                  scale: float | None = None) -> np.ndarray:
    """Random bytes in `kind`'s block layout with valid (finite) fp16 fields: scales of
    mixed magnitudes and signs, subnormals included; [rows, bytes per row] uint8."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    n = raw.shape[0]
    for off in F16_FIELDS[kind]:
        mags = rng.choice([1e-7, 1e-5, 1e-3, 0.1, 1.0, 300.0], n) if scale is None else scale
        v = (rng.standard_normal(n) * mags).astype(np.float16)
        v[:3] = np.array([0.0, 6e-8, -65504.0], dtype=np.float16)[: min(3, n)]  # edges
        raw[:, off : off + 2] = v.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def oracle(raw: np.ndarray, kind: T, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, kind).reshape(rows, cols).copy())


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_hand_built_blocks_equal_gguf_exactly(kind: T) -> None:
    rows, cols = 12, 1024
    for seed in range(3):
        raw = random_blocks(kind, rows, cols, seed)
        ref = oracle(raw, kind, rows, cols)
        w = decode(raw, kind, rows, cols)
        lin = BlockLinear(w)
        assert lin.kind == LAYOUTS[kind] or lin.kind == Q4F  # fp16 may not hold -8d, m
        # The stored layout, decoded as the kernels decode it, is gguf's float32 exactly.
        assert torch.equal(lin.dequantize(), ref)
        assert torch.equal(w.dequantize(), ref)
        assert lin.equals(ref) and not lin.equals(ref + (ref == 0).float() * 1e-30 + ref * 1e-7)


@pytest.mark.parametrize("kind", [k for k in BLOCK_TYPES if k in gguf.quants._type_traits
                                  and k in (T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_1, T.Q5_1)],
                         ids=lambda k: k.name)
def test_blocks_from_gguf_quantize_equal_gguf_exactly(kind: T) -> None:
    # Blocks written by gguf's own quantizer, not by hand.
    rows, cols = 8, 512
    x = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf.quants.quantize(x, kind)
    assert torch.equal(BlockLinear(decode(raw, kind, rows, cols)).dequantize(),
                       oracle(raw, kind, rows, cols))


def test_q5_0_rows_group_8_blocks_as_q5_k_lays_out_its_codes() -> None:
    """The kernels' Q5_0 rows (kvloop.quant.stored.kernel_order), checked against the
    codes gguf's dequantization gives with every d = 1 (w = q - 16): per 8 blocks of a row, their 8
    scales, a plane of fifth bits (byte l, bit j: element l of block j), then nibbles
    (byte 32c + l: element l of block 2c low, of block 2c + 1 high); blocks past the last
    8 as the file has them. 20 blocks a row: Gemma 3's width, two groups and 4 more."""
    rows, cols = 3, 640
    raw = random_blocks(T.Q5_0, rows, cols, 9, scale=0.01)
    w = stored(raw, T.Q5_0, rows, cols)
    assert isinstance(w, StoredRows)
    lay = w.raw.numpy()
    ones = raw.copy().reshape(rows, 20, 22)
    ones[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)  # d = 1: w = q - 16
    q = oracle(ones.reshape(rows, -1), T.Q5_0, rows, cols).numpy().astype(np.int64) + 16
    q = q.reshape(rows, 20, 32)
    assert q.min() >= 0 and q.max() <= 31
    for r in range(rows):
        for grp in range(2):
            g = lay[r, 176 * grp : 176 * (grp + 1)]
            blocks = range(8 * grp, 8 * grp + 8)
            assert np.array_equal(g[:16], raw[r].reshape(20, 22)[list(blocks), 0:2].reshape(-1))
            for j, bj in enumerate(blocks):
                assert np.array_equal((g[16:48] >> j) & 1, q[r, bj] >> 4)
            for c in range(4):
                lo, hi = q[r, 8 * grp + 2 * c] & 15, q[r, 8 * grp + 2 * c + 1] & 15
                assert np.array_equal(g[48 + 32 * c : 80 + 32 * c], lo | (hi << 4))
        assert np.array_equal(lay[r, 352:], raw[r, 352:])  # the last 4 blocks as stored


@pytest.mark.parametrize("kind", list(STORED_KINDS), ids=lambda k: k.name)
def test_stored_rows_are_the_file_bytes_and_gguf_values(kind: T) -> None:
    """Formats the kernels read as stored keep the file's bytes (reordered and stacked by
    rows; Q5_0's bits moved within rows, and back); their weights are gguf's float32
    exactly, in Python and as the kernel decodes."""
    rows, cols = 12, 768
    raw = random_blocks(kind, rows, cols, 4)
    w = stored(raw, kind, rows, cols)
    # the file's bytes (Q5_0's bits moved within each 8 blocks of a row: kernel_order)
    assert isinstance(w, StoredRows) and w.raw.shape == raw.shape
    assert np.array_equal(file_order(kind, w.raw.numpy()), raw)
    ref = oracle(raw, kind, rows, cols)
    lin = BlockLinear(w)
    assert lin.kind == STORED_KINDS[kind] and lin.weight_bytes == raw.nbytes
    assert torch.equal(lin.dequantize(), ref)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    assert torch.equal(w.rows(perm).dequantize(), ref[perm])
    ids = torch.tensor([3, 0, 11, 3])
    assert torch.equal(lin.rows(ids), ref[ids])  # an embedding lookup
    two = cat([w, stored(raw[:5], kind, 5, cols)])
    assert isinstance(two, StoredRows) and torch.equal(two.dequantize(), torch.cat([ref, ref[:5]]))
    if kernels.available():
        k, weight, K, sc, _ = lin.native_spec()
        assert torch.equal(native_linear(k, weight, K, sc).decoded(False), ref)


def test_fused_layer_of_mixed_formats_keeps_each_parts_blocks() -> None:
    """q/k as Q4_K blocks with v as Q6_K (half the layers of a Q4_K_M file), or q/k Q5_0
    with v Q8_0: no one layout holds them in their own bytes, so each keeps its blocks
    (q and k joined) in a stack whose weights, bias, kernel and fallback are the parts'."""
    for (fq, fv) in ((T.Q4_K, T.Q6_K), (T.Q5_0, T.Q8_0)):
        q, k, v = (random_blocks(f, r, 512, i) for i, (f, r) in
                   enumerate(((fq, 32), (fq, 16), (fv, 16))))
        w = cat([stored(q, fq, 32, 512), stored(k, fq, 16, 512), stored(v, fv, 16, 512)])
        assert isinstance(w, list) and [p.shape for p in w] == [(48, 512), (16, 512)]
        assert isinstance(w[0], StoredRows) and w[0].fmt == fq
        ref = torch.cat([oracle(q, fq, 32, 512), oracle(k, fq, 16, 512),
                         oracle(v, fv, 16, 512)])
        bias = torch.randn(64)
        # The bias arrives after the layer is built (load_weights copies Qwen2's q/k/v
        # biases into the fused layer's): the parts and their kernels must see it.
        lin = StackedLinear([BlockLinear(p) for p in w], torch.zeros(64))
        early = native_stack([native_linear(*b.native_spec()) for b in lin.blocks()]
                             ) if kernels.available() else None
        assert lin.bias is not None
        lin.bias.copy_(bias)
        assert lin.out_features == 64 and torch.equal(lin.dequantize(), ref)
        x = torch.randn(3, 512)
        dense = (x.double() @ ref.double().T + bias.double()).float()
        torch.testing.assert_close(lin(x), dense, rtol=0, atol=1e-5 * float(dense.abs().max()))
        if kernels.available():
            parts = [native_linear(*b.native_spec()[:4], b.bias) for b in lin.blocks()]
            stack = native_stack(parts)
            assert stack.out_features == 64 and stack.weight_bytes == sum(
                p.weight_bytes for p in parts)
            assert torch.equal(stack.decoded(False), ref)
            for M in (1, 5, 70):  # the block kernels, and the batched path when set
                xm = torch.randn(M, 512)
                want = torch.cat([p.forward(xm) for p in parts], dim=1)
                assert torch.equal(stack.forward(xm), want)
                assert early is not None and torch.equal(early.forward(xm), want)
            stack.set_batched_decode(16)
            assert all(p.batched_min_rows == 16 for p in parts)


def test_layouts_are_compact_where_exact() -> None:
    # Q8_0 / Q5_0: 8-bit codes with fp16 scales per 32 (1.0625 bytes a weight); Q6_K: groups
    # of 16; Q4_K: 4-bit codes with fp32 scale and min (0.75 bytes a weight).
    def lay(kind: T) -> BlockLinear:
        return BlockLinear(decode(random_blocks(kind, 4, 512, 0, 0.01), kind, 4, 512))
    for kind in (T.Q8_0, T.Q5_0):
        lin = lay(kind)
        assert lin.scales is not None and lin.scales.dtype == torch.float16
        assert lin.weight_bytes == 4 * 512 + 4 * 16 * 2
    q6 = lay(T.Q6_K)
    assert q6.scales is not None and q6.scales.shape == (4, 32)
    assert lay(T.Q4_K).kind == Q4F and lay(T.Q4_K).weight_bytes == 4 * 16 * 24
    q5k = lay(T.Q5_K)
    assert q5k.scales is not None and q5k.scales.shape == (4, 2, 16)


def test_fused_parts_of_different_formats() -> None:
    # q (Q5_0), k (Q8_0), v (Q6_K): one 8-bit layout with groups of 16, exact for all.
    parts = [(T.Q5_0, 64), (T.Q8_0, 32), (T.Q6_K, 32)]
    raws = [(k, random_blocks(k, r, 512, i), r) for i, (k, r) in enumerate(parts)]
    w = GroupWeights.cat([decode(raw, k, r, 512) for k, raw, r in raws])
    assert w is not None and w.group == 16
    ref = torch.cat([oracle(raw, k, r, 512) for k, raw, r in raws])
    assert torch.equal(BlockLinear(w).dequantize(), ref)
    # Q4_K (4-bit, mins) with Q8_0: 8-bit codes, fp32 scales and mins per 32.
    a, b = random_blocks(T.Q4_K, 8, 512, 5), random_blocks(T.Q8_0, 8, 512, 6)
    w = GroupWeights.cat([decode(a, T.Q4_K, 8, 512), decode(b, T.Q8_0, 8, 512)])
    assert w is not None and w.bits == 8 and w.mins is not None
    assert torch.equal(BlockLinear(w).dequantize(),
                       torch.cat([oracle(a, T.Q4_K, 8, 512), oracle(b, T.Q8_0, 8, 512)]))
    # Mins with groups of 16 have no kernel layout: the caller keeps that layer fp32.
    c = random_blocks(T.Q6_K, 8, 512, 7)
    assert GroupWeights.cat([decode(a, T.Q4_K, 8, 512), decode(c, T.Q6_K, 8, 512)]) is None


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_kernel_matches_reference_matmul(kind: T) -> None:
    """The kernel = the exactly dequantized weights x its own int8 activations (fp64
    reference), within fp32 summation-order error; 8-bit layouts and Q6_K with int16
    activations too (the head's mode)."""
    require_native_kernels()
    rows, cols = 40, 768
    lin = BlockLinear(decode(random_blocks(kind, rows, cols, 3, 0.01), kind, rows, cols),
                      bias=torch.randn(rows))
    k, w, K, sc, bias = lin.native_spec()
    g = torch.Generator().manual_seed(0)
    if k not in WIDE_ACTS_KINDS:
        with pytest.raises(RuntimeError, match="option of int8 weights and Q6_K blocks"):
            native_linear(k, w, K, sc, bias, wide_acts=True)
    for fa in ((False, True) if k in WIDE_ACTS_KINDS else (False,)):
        nl = native_linear(k, w, K, sc, bias, wide_acts=fa)
        for M in (1, 3, 6, 37, 70):
            x = torch.randn(M, K, generator=g)
            ref = linear_reference(x, k, w, K, sc, bias, wide_acts=fa)
            torch.testing.assert_close(nl.forward(x), ref, rtol=0,
                                       atol=1e-5 * float(ref.abs().max()))
        # A plain reference with gguf's own weights: the kernel computes those weights.
        x = torch.randn(5, K, generator=g)
        dense = x.double() @ lin.dequantize().double().T + bias.double()
        err = (nl.forward(x).double() - dense).abs().max() / dense.abs().max()
        assert err < (1e-4 if fa else 0.05)  # int16 activations / int8 (~1% relative)
        # Below 4 activation rows several weight rows go at once, every pair the same
        # operations as in a batch of 4: the same bits.
        x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
        y4 = nl.forward(x)
        ref = linear_reference(x, k, w, K, sc, bias, wide_acts=fa)
        torch.testing.assert_close(y4, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))
        for M in (1, 2, 3):
            assert torch.equal(nl.forward(x[:M]), y4[:M]), (M, fa)


# --- the real Gemma 3 270M file ---------------------------------------------------------------


def test_real_gemma_tensors_equal_gguf_exactly(real_gemma_path: Path) -> None:
    reader = gguf.GGUFReader(real_gemma_path)
    seen: set[str] = set()
    for t in reader.tensors:
        if t.tensor_type not in BLOCK_TYPES:
            continue
        rows, cols = (int(d) for d in reversed(t.shape))
        lin = BlockLinear(stored(np.asarray(t.data), t.tensor_type, rows, cols))
        assert (lin.kind in STORED.values()) == (t.tensor_type in STORED_KINDS), t.name
        for r in range(0, rows, 16384):  # the 262144-row embedding in slices
            ref = torch.from_numpy(gguf.quants.dequantize(t.data[r : r + 16384], t.tensor_type))
            assert torch.equal(lin.dequantize(r, r + 16384), ref.view(-1, cols)), t.name
        seen.add(t.tensor_type.name)
    assert seen == {"Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_real_gemma_auto_runs_every_layer_as_stored(real_gemma_path: Path) -> None:
    llm = LLM(real_gemma_path, kv_cache_memory="64MiB")
    assert llm.engine.config.quantization == "gguf"
    model = llm.engine.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear | StackedLinear)
              and not any(m in s.parts for s in model.modules() if isinstance(s, StackedLinear))]
    assert len(layers) == 4 * model.config.num_layers + 1  # every layer and the head
    blocks = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert not [m for m in model.modules() if isinstance(m, Linear)]
    assert model.lm_head.kind == Q8B  # token_embd's Q8_0 blocks
    # Q5_0, Q4_K and Q6_K layers read their blocks as stored; fused q/k/v mixes Q5_0 and
    # Q8_0 in some layers: a stack of the two, the Q8_0 part (like the head) 8-bit codes.
    assert sum(isinstance(m, StackedLinear) for m in layers) == 9
    assert {m.kind for m in blocks} == {Q8B, STORED["Q5_0"], STORED["Q4_K"], STORED["Q6_K"]}
    # Close to the fp32 reference (int8-rounded activations are the only difference):
    # the last position's logits of a prompt, through the whole model.
    fp32 = LLM(real_gemma_path, kv_cache_memory="64MiB", quantization="none")
    assert fp32.engine.config.quantization == "none"
    ids = llm.tokenizer.encode("The capital of France is")
    ours, ref = last_logits(llm, ids), last_logits(fp32, ids)
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err < 0.05, err
    assert int(ours.argmax()) == int(ref.argmax())
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8


def all_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [len(ids), V]
    model = llm.engine.model
    with torch.inference_mode():
        meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))


def last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:  # [V]
    return all_logits(llm, ids)[-1]


# --- "auto" and "none" -------------------------------------------------------------------------
def test_auto_resolves_per_checkpoint(default_gguf: Path, tiny_model_dir: Path,
                                      tmp_path: Path) -> None:
    assert resolve_quantization("auto", load_checkpoint(default_gguf)) == "gguf"  # Q4_1
    assert resolve_quantization("auto", load_checkpoint(tiny_model_dir)) == "none"  # fp32
    for q in ("none", "int8", "int4", "gguf"):
        assert resolve_quantization(q, load_checkpoint(default_gguf)) == q


def test_quantized_linears_reads_the_tensor_types(tmp_path: Path) -> None:
    from kvloop.loading.gguf import GGUFFile

    dense = write_gguf(tmp_path / "dense.gguf",
                       [("blk.0.attn_q.weight", np.zeros((8, 32), np.float32), None),
                        ("token_embd.weight", np.zeros((8, 32), np.float32), None)])
    assert GGUFFile(dense).quantized_linears() is False
    q8 = random_blocks(T.Q8_0, 8, 32, 0)
    stored = write_gguf(tmp_path / "q8.gguf",
                        [("blk.0.attn_q.weight", q8, T.Q8_0),
                         ("output_norm.weight", np.ones(32, np.float32), None)])
    assert GGUFFile(stored).quantized_linears() is True


def test_default_model_none_is_fp32_and_auto_is_its_blocks(default_gguf: Path) -> None:
    ckpt = load_checkpoint(default_gguf)
    dense = load_model(ckpt, pack=False, quantization="none")
    stored = load_model(ckpt, pack=False, quantization="auto")
    assert not any(isinstance(m, BlockLinear) for m in dense.modules())
    lin = {n: m for n, m in dense.named_modules() if isinstance(m, Linear)}
    blk = {n: m for n, m in stored.named_modules() if isinstance(m, BlockLinear)}
    assert set(lin) == set(blk) and len(blk) == 4 * ckpt.config.num_layers + 1
    for name, m in blk.items():
        # The fp32 reference's weights (gguf's dequantization) are the stored blocks'.
        assert m.equals(lin[name].weight.detach()), name
    # The fp32 reference is exactly gguf's dequantization of the file.
    reader = gguf.GGUFReader(default_gguf)
    t = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    assert torch.equal(cast(Any, dense.layers[3]).mlp.down_proj.weight.detach(), ref)


def test_engine_resolves_auto_for_stats(kv_default: Any) -> None:
    # kv_default asks for fp32 (the oracle's weights); LLM() with no options is "auto".
    assert kv_default.engine.config.quantization == "none"


def test_cli_flag_defaults_to_auto() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert p.parse_args([]).quantization == "auto"
    assert p.parse_args(["--quantization", "none"]).quantization == "none"
    assert p.parse_args(["--quantization", "gguf"]).quantization == "gguf"
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "q4_k"])


def test_batched_path_of_a_block_layer() -> None:
    """The prefill path (set_batched_decode): the exactly dequantized weights, a chunk of
    rows at a time in bf16, through ATen's GEMM, as for the other quantized kinds."""
    require_native_kernels()
    for kind in (T.Q4_K, T.Q6_K, T.Q5_0):
        lin = BlockLinear(decode(random_blocks(kind, 48, 512, 4, 0.01), kind, 48, 512))
        k, w, K, sc, _ = lin.native_spec()
        nl = native_linear(k, w, K, sc)
        nl.set_batched_decode(16)
        x = torch.randn(20, K)
        ref = linear_reference(x, k, w, K, sc, bf16=True)
        torch.testing.assert_close(nl.forward(x), ref, rtol=0,
                                   atol=1e-2 * float(ref.abs().max()))


def test_layers_without_an_exact_stored_layout_stay_fp32(default_gguf: Path) -> None:
    from kvloop.models import create_model
    from kvloop.models.quantize import quantize_model

    ckpt = load_checkpoint(default_gguf)
    model = create_model(ckpt.config)
    model.load_weights(ckpt.weights())
    source = dict(ckpt.block_weights())  # a mutable copy
    del source["model.layers.0.self_attn.k_proj.weight"]  # a part stored dense: no layout
    w = source["model.layers.1.mlp.down_proj.weight"]  # blocks of another shape
    w = w if isinstance(w, GroupWeights) else cast(Any, w).groups()  # Q4_1: Q4Rows
    source["model.layers.1.mlp.down_proj.weight"] = GroupWeights(
        w.codes[:-1], w.scales[:-1], None if w.mins is None else w.mins[:-1], w.group, w.bits)
    quantize_model(model, "gguf", block_source=source)
    layers = cast(Any, model.layers)
    assert isinstance(layers[0].self_attn.qkv_proj, Linear)
    assert isinstance(layers[1].mlp.down_proj, Linear)
    assert isinstance(layers[0].mlp.down_proj, BlockLinear)
    assert isinstance(layers[1].self_attn.qkv_proj, BlockLinear)
    assert isinstance(model.lm_head, BlockLinear)


def test_fused_checkpoint_tensors_are_taken_whole(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Phi-3 stores q/k/v and gate/up fused (attn_qkv, ffn_up): its Q8_0 blocks of those
    are the fused layers' as they are, and compute what the fp32 reference does (to the
    int8 activation rounding)."""
    from conftest import write_tiny_phi3
    from test_families import convert_to_gguf

    add = gguf.GGUFWriter.add_tensor

    def add_q8(self: Any, name: str, t: np.ndarray, **kw: Any) -> None:
        # The converter's fp32 matrices stored as Q8_0 blocks, as a quantized file has them.
        if name.startswith("blk.") and t.ndim == 2 and kw.get("raw_dtype") is None:
            kw["raw_dtype"] = T.Q8_0
            t = gguf.quants.quantize(t.astype(np.float32), T.Q8_0)
        add(self, name, t, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_q8)
    path = convert_to_gguf(write_tiny_phi3(tmp_path / "phi3"), tmp_path / "p.gguf", "phi3")
    monkeypatch.undo()
    stored = LLM(path, kv_cache_memory="16MiB")
    assert stored.engine.config.quantization == "gguf"
    layer = cast(Any, stored.engine.model.layers[0])
    assert isinstance(layer.self_attn.qkv_proj, BlockLinear)
    assert isinstance(layer.mlp.gate_up_proj, BlockLinear)
    fp32 = LLM(path, kv_cache_memory="16MiB", quantization="none", pack_weights=False)
    assert isinstance(cast(Any, fp32.engine.model.layers[0]).self_attn.qkv_proj, Linear)
    assert layer.self_attn.qkv_proj.equals(
        cast(Any, fp32.engine.model.layers[0]).self_attn.qkv_proj.weight.detach())
    ids = [5, 17, 42, 7, 99, 3]
    ours, ref = last_logits(stored, ids), last_logits(fp32, ids)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 0.05


def test_fused_layer_of_mixed_formats_with_bias_loads(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2 with q/k stored as Q5_0 and v as Q8_0 (a Q4_K_M file's mix, in the formats
    gguf can write) and q/k/v biases: the fused layer is a stack of the parts, and the
    biases load_weights copies into it after it is built reach the parts' kernels."""
    from conftest import write_tiny_qwen2
    from test_families import convert_to_gguf

    add = gguf.GGUFWriter.add_tensor

    def add_mixed(self: Any, name: str, t: np.ndarray, **kw: Any) -> None:
        if name.startswith("blk.") and t.ndim == 2 and kw.get("raw_dtype") is None:
            kw["raw_dtype"] = T.Q5_0 if name.endswith(("attn_q.weight", "attn_k.weight")) \
                else T.Q8_0
            t = gguf.quants.quantize(t.astype(np.float32), kw["raw_dtype"])
        add(self, name, t, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_mixed)
    path = convert_to_gguf(write_tiny_qwen2(tmp_path / "qwen2"), tmp_path / "q.gguf", "qwen2")
    monkeypatch.undo()
    stored = LLM(path, kv_cache_memory="16MiB")
    qkv = cast(Any, stored.engine.model.layers[0]).self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear) and qkv.bias is not None
    assert float(qkv.bias.abs().max()) > 0  # the checkpoint's biases, loaded
    fp32 = LLM(path, kv_cache_memory="16MiB", quantization="none", pack_weights=False)
    ref_bias = cast(Any, fp32.engine.model.layers[0]).self_attn.qkv_proj.bias
    assert torch.equal(qkv.bias, ref_bias)
    ids = [5, 17, 42, 7, 99, 3]
    ours, ref = last_logits(stored, ids), last_logits(fp32, ids)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 0.05


def test_a_q6_k_head_is_held_as_stored_with_int16_activations(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M file's head: the tied embedding's Q6_K blocks are the head as they are
    (6.6 bits a weight where codes and scales took 10), with the head's int16 activations
    (stored_blocks.cpp's rows_q6k_wide; from 16 rows the GEMM's pairs). Its logits are the
    fp32 model's over the same weights to that rounding, at one row and at 20, and greedy
    tokens are the same."""
    require_native_kernels()
    from conftest import write_tiny_model
    from test_families import convert_to_gguf

    add = gguf.GGUFWriter.add_tensor
    vocab, hidden = 320, 256

    def add_q6_k_table(self: Any, name: str, t: np.ndarray, **kw: Any) -> None:
        if name == "token_embd.weight":  # random Q6_K blocks, d ~ 2e-4: weights up to ~0.8
            t = random_blocks(T.Q6_K, vocab, hidden, seed=5)
            d = (np.random.default_rng(6).uniform(1e-4, 3e-4, t.size // 210))
            t.reshape(-1, 210)[:, 208:210] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
            kw["raw_dtype"] = T.Q6_K
        add(self, name, t, **kw)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_q6_k_table)
    hf = write_tiny_model(tmp_path / "llama", hidden_size=hidden, tie_word_embeddings=True,
                          vocab_size=vocab)
    path = convert_to_gguf(hf, tmp_path / "q6k.gguf", "llama")
    monkeypatch.undo()
    stored = LLM(path, kv_cache_memory="16MiB", quantization="gguf")
    model = cast(Any, stored.engine.model)
    head = model.lm_head
    assert isinstance(head, BlockLinear) and head.native_spec()[0] == STORED["Q6_K"]
    assert head.native.wide_acts and model.embed_stored is head  # held once, as stored
    assert head.weight_bytes == vocab * hidden // 256 * 210
    fp32 = LLM(path, kv_cache_memory="16MiB", quantization="none", pack_weights=False)
    for ids in ([5, 17, 42], list(range(3, 23))):
        ours, ref = all_logits(stored, ids), all_logits(fp32, ids)
        assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-3, len(ids)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 17, 42, 7], [99, 3, 250]]
    assert ([o.outputs[0].token_ids for o in stored.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in fp32.generate(prompts, params)])


def test_no_architecture_transforms_a_stored_matrix() -> None:
    """use_stored_blocks takes a 2-D tensor's blocks as the layer's weights without
    comparing them with the loader's fp32 tensor: that holds only while every
    architecture's gguf_tensor hook leaves 2-D tensors as stored (Gemma's rewrites norms,
    which are 1-D and never blocks)."""
    from kvloop.models.registry import ARCHITECTURES

    w = np.random.default_rng(0).standard_normal((8, 32)).astype(np.float32)
    for arch in ARCHITECTURES.values():
        names = [*arch.gguf_global_names.values(),
                 *(f"model.layers.0.{n}" for n in arch.gguf_layer_names.values())]
        for name in names:
            if name.endswith("norm.weight"):
                continue
            assert np.array_equal(arch.gguf_tensor(name, w.copy()), w), (arch.name, name)


@pytest.mark.parametrize("mode", ["gguf", "int4"])
def test_stored_layers_are_built_before_loading_and_never_dequantized(
        default_gguf: Path, mode: str) -> None:
    """load_model builds the layers whose stored codes are their layout first (and the
    embedding table as its blocks) and asks the loader only for the other tensors (no
    fp32 copy of those ever exists); the model computes what the same quantization
    applied after a full fp32 load computes."""
    from kvloop.engine.llm_engine import load_model
    from kvloop.models import AttentionMetadata, PrefillSegment, create_model
    from kvloop.models.quantize import quantize_model, use_stored_embedding

    ckpt = load_checkpoint(default_gguf)
    stream = ckpt.weights
    asked: list[str] = []

    def spy(skip: Any = ()) -> Any:
        for name, w in stream(skip):
            asked.append(name)
            yield name, w

    ckpt.weights = spy
    model = load_model(ckpt, pack=False, quantization=mode)
    linears = [n for n in asked if n.endswith("_proj.weight")]
    assert not linears, linears[:3]  # every decoder layer came from its stored codes
    # The lookup table is its stored blocks too, and the tied head is that table (held once).
    assert "model.embed_tokens.weight" not in asked and model.embed_stored is not None
    assert model.embed_tokens.numel() == 0
    assert model.embed_stored is model.lm_head

    ref = create_model(ckpt.config)
    taken = use_stored_embedding(ref, ckpt.block_weights())  # the head, as in the load
    ref.load_weights(stream(taken), preloaded=taken)
    quantize_model(ref, mode, ckpt.int4_weights() if mode == "int4" else None,
                   ckpt.block_weights() if mode == "gguf" else None)
    ids = torch.tensor([1, 504, 3458, 314, 253, 2205, 30])
    meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(len(ids)), meta))
        want = ref.compute_logits(ref(ids, torch.arange(len(ids)), meta))
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_large_tensors_are_read_in_slices_of_rows(kind: T,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`stored` reads a tensor a slice of rows at a time (here ~1 KiB: 3-7 rows) into the
    result's own memory: the same weights as gguf's dequantization, and the slices' byte
    ranges, as reported to `done` (the loader drops those pages of its map), cover the
    tensor once, in order. Blocks kept as stored decode to codes in slices as well."""
    import kvloop.quant.stored as stored_module

    monkeypatch.setattr(stored_module, "SLICE_BYTES", 1024)
    rows, cols = 23, 256
    raw = random_blocks(kind, rows, cols, seed=int(kind))
    spans: list[tuple[int, int]] = []
    w = stored(raw, kind, rows, cols, done=lambda lo, hi: spans.append((lo, hi)))
    assert torch.equal(BlockLinear(w).dequantize(), oracle(raw, kind, rows, cols))
    if isinstance(w, StoredRows):  # a K-quant head's codes, decoded in slices too
        assert torch.equal(w.groups().dequantize(), oracle(raw, kind, rows, cols))
    assert spans[0][0] == 0 and spans[-1][1] == raw.nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert len(spans) > 1 or kind == T.Q4_1  # Q4_1 rows are moved whole (Q4Rows)


def test_stored_blocks_decode_each_tensor_once_and_codes_are_int8(
        default_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading as stored decodes every block tensor once: asking whether a name is there
    decodes nothing (Mapping's own `in` looked the item up, and the load decoded every
    layer twice); codes are int8, half of int16's memory for the largest table."""
    import kvloop.loading.gguf as gguf_module

    decoded: list[tuple[int, int]] = []

    def counted(raw: Any, kind: Any, rows: int, cols: int, done: Any = None) -> Any:
        decoded.append((rows, cols))
        return stored(raw, kind, rows, cols, done)

    monkeypatch.setattr(gguf_module, "stored", counted)
    checkpoint = load_checkpoint(default_gguf)
    blocks = checkpoint.block_weights()
    assert "model.embed_tokens.weight" in blocks and "nope" not in blocks and decoded == []
    w = blocks["model.embed_tokens.weight"]
    assert isinstance(w, GroupWeights)  # Q8_0
    assert w.codes.dtype == torch.int8 and len(decoded) == 1
    decoded.clear()
    load_model(checkpoint, quantization="gguf")
    assert len(decoded) == len(blocks)  # each stored tensor once (the tied table included)


def test_q4_1_rows_are_the_repacked_layout_byte_for_byte() -> None:
    """Q4_1 tensors are read straight into the Q4 layout (Q4Rows: bytes moved, no decode
    or re-pack): the same kernel bytes as decoding them and packing the codes (the path
    before), alone, row-permuted and fused, and gguf's float32 values exactly; a block
    with a NaN scale still takes the decode path (fp32 scales, as before)."""
    from kvloop.quant.stored import Q4Rows

    rows, cols = 12, 1024
    for seed in range(3):
        raw = random_blocks(T.Q4_1, rows, cols, seed)
        w = stored(raw, T.Q4_1, rows, cols)
        assert isinstance(w, Q4Rows)
        old = decode(raw, T.Q4_1, rows, cols)
        kind, packed, scales = BlockLinear(w).kind, *w.native()[1:]
        okind, opacked, oscales = old.native()
        assert kind == okind == Q4 and scales is None and oscales is None
        assert packed.dtype == opacked.dtype and torch.equal(packed, opacked)
        assert torch.equal(w.dequantize(), oracle(raw, T.Q4_1, rows, cols))
        g = w.groups()
        assert all(torch.equal(a, b) for a, b in ((g.codes, old.codes), (g.scales, old.scales),
                                                  (g.mins, old.mins)))
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(w.rows(perm).native()[1], old.rows(perm).native()[1])
        other = random_blocks(T.Q4_1, 5, cols, seed + 10)
        fused = cat([w, stored(other, T.Q4_1, 5, cols)])
        ofused = GroupWeights.cat([old, decode(other, T.Q4_1, 5, cols)])
        assert isinstance(fused, Q4Rows) and ofused is not None
        assert torch.equal(fused.native()[1], ofused.native()[1])
        q8 = random_blocks(T.Q8_0, 5, cols, seed)
        mixed = cat([w, stored(q8, T.Q8_0, 5, cols)])
        omixed = GroupWeights.cat([old, decode(q8, T.Q8_0, 5, cols)])
        assert isinstance(mixed, GroupWeights) and omixed is not None
        assert all(torch.equal(a, b) for a, b in zip(mixed.native()[1:], omixed.native()[1:],
                                                      strict=True)
                   if a is not None)
    raw = random_blocks(T.Q4_1, rows, cols, 0)
    raw[1, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    w = stored(raw, T.Q4_1, rows, cols)
    assert isinstance(w, GroupWeights) and BlockLinear(w).kind == Q4F
