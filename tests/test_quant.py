"""Weight-only quantization: exact GGUF 4-bit loading, kernels against dequantized
references, and end-to-end quality against fp32 on the default model."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvloop.loading.gguf import GGUFFile, _unpack_q4
from kvloop.quant import GROUP_SIZE, Int4Linear, Int4Weights, Int8Linear


def test_q4_1_block_unpacks_to_scale_and_zero_by_hand():
    """One Q4_1 block: d=0.5, m=-1, codes 0..15 then 15..0: w = d*q + m exactly."""
    codes = list(range(16)) + list(range(15, -1, -1))
    packed = bytes((codes[j] & 0xF) | (codes[j + 16] << 4) for j in range(16))
    raw = np.frombuffer(np.float16(0.5).tobytes() + np.float16(-1.0).tobytes() + packed,
                        dtype=np.uint8)
    q, scale, zero = _unpack_q4(raw, with_min=True)
    assert q[0].tolist() == codes
    w = Int4Weights(torch.from_numpy(q), torch.from_numpy(scale)[:, None],
                    torch.from_numpy(zero)[:, None]).dequantize()
    assert w[0].tolist() == [0.5 * c - 1.0 for c in codes]


def test_q4_0_block_has_zero_point_zero():
    raw = np.frombuffer(np.float16(2.0).tobytes() + bytes([0x8F] * 16), dtype=np.uint8)
    q, scale, zero = _unpack_q4(raw, with_min=False)
    w = Int4Weights(torch.from_numpy(q), torch.from_numpy(scale)[:, None],
                    torch.from_numpy(zero)[:, None]).dequantize()
    assert w[0, :16].tolist() == [2.0 * (15 - 8)] * 16 and w[0, 16:].tolist() == [0.0] * 16


@pytest.mark.slow
def test_gguf_int4_codes_equal_the_dequantized_weights(default_gguf):
    """Every Q4_1 tensor of the default model, taken as codes, equals gguf's dequantization
    (un-permuted Q/K included): no re-quantization."""
    f = GGUFFile(default_gguf)
    cfg = f.config()
    raw = f.int4_weights(cfg)
    dense = dict(f.tensors(cfg))
    assert len(raw) == 210
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(raw[name].dequantize(), dense[name])


def test_int4_linear_matches_its_dequantized_weight():
    torch.manual_seed(0)
    w = torch.randn(96, 4 * GROUP_SIZE)
    q = Int4Weights.from_dense(w)
    deq = q.dequantize()
    # Min/max quantization: every weight within half a step of its group's scale.
    step = q.scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    x = torch.randn(5, 4 * GROUP_SIZE)
    ref = x @ deq.t()
    out = Int4Linear(q)(x)
    # bf16 activations: about 3 significant digits.
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_int8_linear_matches_its_dequantized_weight():
    torch.manual_seed(1)
    w = torch.randn(64, 80)
    lin = Int8Linear.from_dense(w)
    assert ((lin.dequantize() - w).abs() <= lin.scales.float()[:, None] / 2 + 1e-3).all()
    x = torch.randn(3, 80)
    ref = x @ lin.dequantize().t()
    assert torch.allclose(lin(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.slow
def test_quantized_models_stay_close_to_fp32():
    """int8 and int4 against fp32: perplexity within 5%, small mean logit error and KL
    divergence, and, teacher-forced, the same most likely next token at nearly every
    position of a text (prefill and decode paths) and of fp32's greedy chat replies
    (figures in BENCHMARKS.md). Not free-running greedy agreement: one near-tie early in a
    reply moves every later token, so any change of rounding (bf16 or int8 activations, a
    summation order) swings it from 32 of 32 tokens to 0 on some prompt."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from quant_quality import evaluate

    ref = evaluate("none")
    for mode, max_err in (("int8", 0.5), ("int4", 0.2)):
        r = evaluate(mode, ref)
        what = (mode, {k: r[k] for k in ("ppl", "logit_err", "kld", "top1", "decode_top1",
                                          "reply_top1", "agree")})
        assert abs(r["ppl"] / ref["ppl"] - 1) < 0.05, what
        assert abs(r["decode_ppl"] / ref["decode_ppl"] - 1) < 0.05, what
        assert r["logit_err"] < max_err and r["decode_logit_err"] < max_err, what
        assert r["kld"] < 0.01, what
        assert min(r["top1"], r["decode_top1"]) >= 0.97 and r["reply_top1"] >= 0.95, what
        assert r["bytes"] < ref["bytes"] / 3.5  # the point: far fewer bytes per step
