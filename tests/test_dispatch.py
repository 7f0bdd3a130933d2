"""The dispatch policy (kvloop.dispatch) and every kernel build it dispatches to, at the row
counts that cross its thresholds.

Each ISA build this CPU runs (scalar, avx2, avx512vnni) is loaded side by side, and every
weight layout goes through a layer set up as the policy for that class of CPU sets it (the
native kernels below the threshold, a GEMM over decoded weights from it), against the
float64 reference of what that path computes. KVLOOP_ISA=avx2 is also checked to hold the
libraries under torch to AVX2, and greedy batch invariance to hold on the avx2 build.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from conftest import require_native_kernels
from kvloop import dispatch
from kvloop.kernels import build
from kvloop.kernels.linear import (
    F32,
    Q4,
    Q8,
    dequantize,
    linear_reference,
    pack_q4,
    quantize_acts16_reference,
    quantize_acts_reference,
)
from kvloop.quant.layout import GroupWeights
from kvloop.quant.stored import STORED_KINDS, stored
from test_block_formats import F16_FIELDS, oracle, random_blocks
from test_native import LINEAR_RTOL, _gen, _layouts, assert_linear_close, q4_scales_mins

# Every row count either side of a threshold of any policy (16, 65), of the kernels' 4- and
# 8-row activation tiles, and of the runner's largest native batch (64), up to a prefill.
ROWS = (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 128, 512)
NEVER = 1 << 30  # a row count no batch reaches
LAYOUTS = ["f32", "q8", "q4", "q4f", "q8b-g16", "q8b-min-f32", "q8b-g32-f16"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _native_kernels() -> None:
    require_native_kernels()


def _policy_for(isa: str) -> dispatch.GemmPolicy:
    """The policy a CPU whose best build is `isa` runs (avx512vnni: this CPU's own)."""
    return dispatch.policy() if isa == "avx512vnni" else dispatch.FP32_POLICY


def _module(isa: str) -> Any:
    if isa not in build.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    if isa == build.native_module().compiled_isa():
        return build.native_module()
    return build._build(isa)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_every_path_matches_float64_at_threshold_rows(isa: str, layout: str) -> None:
    mod = _module(isa)
    p = _policy_for(isa)
    N, K = 136, 576  # 136: not a multiple of the kernels' row tiles
    g = _gen(len(layout) * 31 + len(isa))
    kind, w, sc = _layouts(N, K, g)[layout]
    bias = torch.randn(N, generator=g)
    lin = mod.QLinear(kind, w, K, sc, bias, False)
    min_rows = p.fp32_min_rows if kind == F32 else p.quantized_min_rows
    bf16 = kind != F32 and p.quantized_bf16
    # As models.native.attach_native_linears sets them: the int8 GEMM from its row count
    # at every size where the layer supports it, else the decoded-weights GEMM.
    if lin.gemm_supported:
        min_rows = NEVER
        lin.set_int8_gemm(p.int8_gemm_rows(lin.eight_bit_codes))
    else:
        lin.set_batched_decode(min_rows, bf16)
    dense = dequantize(kind, w, K, sc).double()
    for M in ROWS:
        x = torch.randn(M, K, generator=g)
        y = lin.forward(x)
        assert y.shape == (M, N)
        what = f"{isa} {layout} M={M}"
        kernels = min_rows > M  # the row kernels or the int8 GEMM: int8 activations
        if kernels or kind == F32:  # the kernels (fp32: exact sums either way)
            assert_linear_close(y, linear_reference(x, kind, w, K, sc, bias), what)
        elif bf16:  # decoded to bf16, oneDNN's bf16 GEMM
            ref = linear_reference(x, kind, w, K, sc, bias, bf16=True)
            torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-8 * float(ref.abs().max()),
                                       msg=lambda m, what=what: f"{what}: {m}")
        else:  # decoded to fp32: the GEMM sees the activations unrounded
            ref = (x.double() @ dense.T + bias.double()).float()
            torch.testing.assert_close(y, ref, rtol=0, atol=LINEAR_RTOL * float(ref.abs().max()),
                                       msg=lambda m, what=what: f"{what}: {m}")


@pytest.mark.parametrize("fmt", list(STORED_KINDS), ids=lambda f: f.name)
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_stored_blocks_match_gguf_float64_at_threshold_rows(isa: str, fmt: Any) -> None:
    """GGUF blocks the kernels read as stored (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1), on every build:
    decoded rows equal the `gguf` package's dequantization bit for bit, and each path (the
    block kernels below the policy's threshold, a GEMM over decoded rows from it) equals
    its float64 reference over gguf's weights at every threshold row count."""
    mod = _module(isa)
    p = _policy_for(isa)
    N, K = 136, 768  # three 256-weight super-blocks a row
    raw = random_blocks(fmt, N, K, seed=len(isa) + int(fmt), scale=0.01)
    _normal_scales(raw, fmt, seed=int(fmt))  # no edge values: a tolerance for every row
    w = stored(raw, fmt, N, K)
    kind, weight, _ = w.native()
    g = _gen(int(fmt) * 7 + len(isa))
    bias = torch.randn(N, generator=g)
    lin = mod.QLinear(kind, weight, K, None, bias, False)
    gguf_w = oracle(raw, fmt, N, K)  # float32, the package's own arithmetic
    assert torch.equal(lin.decoded(False), gguf_w), f"{isa} {fmt.name}: decoded rows"
    assert lin.weight_bytes == raw.nbytes + 4 * N  # the blocks as stored, and the bias
    dense = gguf_w.double()
    assert lin.gemm_supported  # 4- to 6-bit codes: every build
    min_rows = NEVER  # the int8 GEMM from its row count at every size, as models.native sets
    lin.set_int8_gemm(p.int8_gemm_rows(lin.eight_bit_codes))
    for M in ROWS:
        x = torch.randn(M, K, generator=g)
        y = lin.forward(x)
        what = f"{isa} {fmt.name} M={M}"
        if min_rows > M:  # the block kernels or the int8 GEMM: int8 activations
            q, d = quantize_acts_reference(x)
            xd = (q.view(M, -1, 32).double() * d.double()[..., None]).view(M, K)
            assert_linear_close(y, (xd @ dense.T + bias.double()).float(), what)
        elif p.quantized_bf16:
            xb, wb = x.to(torch.bfloat16).double(), dense.to(torch.bfloat16).double()
            ref = ((xb @ wb.T).to(torch.bfloat16).double() + bias.double()).float()
            torch.testing.assert_close(y, ref, rtol=2**-7, atol=2**-8 * float(ref.abs().max()),
                                       msg=lambda m, what=what: f"{what}: {m}")
        else:
            assert_linear_close(y, (x.double() @ dense.T + bias.double()).float(), what)


@pytest.mark.parametrize("fmt", list(STORED_KINDS), ids=lambda f: f.name)
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_stored_batch1_rows_equal_the_same_rows_in_a_batch(isa: str, fmt: Any) -> None:
    """At batch 1 the stored-block kernels take several weight rows at once (sharing the
    activation loads); in a batch each weight row meets several activation rows. A row's
    output must not depend on which: a sequence decodes to the same logits alone or beside
    others. Bit for bit, over output rows that fill no whole tile (70) and, for the
    32-weight blocks, a row of 20 blocks (640, Gemma 3's width)."""
    mod = _module(isa)
    q5 = (gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1)
    for K in (768, 640) if fmt in q5 else (768,):
        N = 70
        raw = random_blocks(fmt, N, K, seed=int(fmt) + K, scale=0.01)
        _normal_scales(raw, fmt, seed=int(fmt))
        kind, weight, _ = stored(raw, fmt, N, K).native()
        lin = mod.QLinear(kind, weight, K, None, None, False)
        lin.set_int8_gemm(NEVER)  # the row kernels at every batch size here
        x = torch.randn(1, K, generator=_gen(int(fmt) + K))
        alone = lin.forward(x)
        batch = lin.forward(x.expand(5, K).contiguous())  # 4 rows a tile, then 1
        for m in range(5):
            assert torch.equal(batch[m], alone[0]), f"{isa} {fmt.name} K={K} row {m}"
        dense = oracle(raw, fmt, N, K).double()
        q, d = quantize_acts_reference(x)
        xd = (q.view(1, -1, 32).double() * d.double()[..., None]).view(1, K)
        assert_linear_close(alone, (xd @ dense.T).float(), f"{isa} {fmt.name} K={K}")


# Row counts around the int8 GEMM's tiles (panels of 8 activation rows; of 16, in pairs,
# on AVX-512) and, at K = 16384, past its first chunk of panels (128 rows on either).
GEMM_ROWS = (8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 200)
GEMM_LAYOUTS = ["q8", "q4", "q4f", "q8b-g16", "q8b-min-f32", "q8b-g32-f16",
                *(f.name for f in STORED_KINDS)]


def _gemm_layer(mod: Any, layout: str, N: int, K: int, g: torch.Generator,
                wide: bool = False) -> tuple[Any, Any]:
    """(native layer with a bias, the bias) in one of GEMM_LAYOUTS; wide: int16
    activations (the 8-bit layouts and Q6_K only)."""
    bias = torch.randn(N, generator=g)
    if layout in _layouts(8, 32, g):
        kind, w, sc = _layouts(N, K, g)[layout]
        return mod.QLinear(kind, w, K, sc, bias, wide), bias
    fmt = next(f for f in STORED_KINDS if f.name == layout)
    raw = random_blocks(fmt, N, K, seed=int(fmt), scale=0.01)
    _normal_scales(raw, fmt, seed=int(fmt))
    kind, weight, _ = stored(raw, fmt, N, K).native()
    return mod.QLinear(kind, weight, K, None, bias, wide), bias


def _gemm_against_row_kernels(lin: Any, x: torch.Tensor, what: str) -> torch.Tensor:
    """lin's output on x through the int8 GEMM, checked against its row kernels (the same
    integer sums in another float order); returns the GEMM's."""
    lin.set_int8_gemm(0)
    rows = lin.forward(x)
    lin.set_int8_gemm(8)
    y = lin.forward(x)
    torch.testing.assert_close(y, rows, rtol=1e-5, atol=1e-5 * float(rows.abs().max()),
                               msg=lambda m: f"{what}: {m}")
    return y


@pytest.mark.parametrize("layout", GEMM_LAYOUTS)
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_int8_gemm_equals_the_row_kernels(isa: str, layout: str) -> None:
    """The int8 GEMM computes what the row kernels do (the same int8 activations, the
    same integer dot products, the sums in another order): against them and the float64
    reference, at every tile edge, with a tail of weight rows (N = 13: tiles of 4) and a
    batch past one chunk of activation panels. 8-bit codes on the avx2 build dot with
    signed activations (vpmaddubsw cannot take them with the +128 offset)."""
    mod = _module(isa)
    N, K = 13, 16384
    g = _gen(len(layout) * 17 + len(isa))
    lin, bias = _gemm_layer(mod, layout, N, K, g)
    assert lin.gemm_supported
    dense = lin.decoded(False).double()
    for M in GEMM_ROWS:
        x = torch.randn(M, K, generator=g)
        what = f"{isa} {layout} M={M}"
        y = _gemm_against_row_kernels(lin, x, what)
        q, d = quantize_acts_reference(x)
        xd = (q.view(M, -1, 32).double() * d.double()[..., None]).view(M, K)
        assert_linear_close(y, (xd @ dense.T + bias.double()).float(), what)


# Each stored format's code bytes (quants and high bits: every byte but the scales).
CODE_BYTES = {"Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192), "Q5_0": (2, 22),
              "Q5_1": (4, 24)}


def _extreme_layer(mod: Any, layout: str, N: int, K: int, top: bool,
                   g: torch.Generator) -> tuple[Any, torch.Tensor]:
    """(native layer with a bias, the bias) in `layout`, every code at the top (`top`) or
    the bottom of its range: 4-bit 15 or 0, Q6_K's u - 32 31 or -32, 8-bit 127 or -128."""
    bias = torch.randn(N, generator=g)
    if layout == "q4":
        codes = torch.full((N, K), 15 if top else 0, dtype=torch.uint8)
        w = pack_q4(codes, *q4_scales_mins(N, K, g))
        return mod.QLinear(Q4, w, K, None, bias, False), bias
    if layout == "q4f":  # 4-bit codes, fp32 scales and mins per 32
        c = torch.full((N, K), 15 if top else 0, dtype=torch.int16)
        gw = GroupWeights(c, torch.rand(N, K // 32, generator=g) * 0.01 + 1e-3,
                          -torch.rand(N, K // 32, generator=g) * 0.1, 32, 4)
    elif layout == "q8b-g16":  # 8-bit codes, fp16 scales per 16
        c = torch.full((N, K), 127 if top else -128, dtype=torch.int16)
        gw = GroupWeights(c, (torch.rand(N, K // 16, generator=g) * 0.01).half().float(),
                          None, 16, 8)
    elif layout == "q8":
        w = torch.full((N, K), 127 if top else -128, dtype=torch.int8)
        sc = torch.rand(N, generator=g) * 0.02 + 1e-3
        return mod.QLinear(Q8, w, K, sc, bias, False), bias
    else:
        fmt = next(f for f in STORED_KINDS if f.name == layout)
        raw = random_blocks(fmt, N, K, seed=int(fmt), scale=0.01)
        _normal_scales(raw, fmt, seed=int(fmt))
        lo, hi = CODE_BYTES[layout]
        raw.reshape(-1, gguf.GGML_QUANT_SIZES[fmt][1])[:, lo:hi] = 0xFF if top else 0
        kind, weight, _ = stored(raw, fmt, N, K).native()
        return mod.QLinear(kind, weight, K, None, bias, False), bias
    kind, w, sc = gw.native()
    return mod.QLinear(kind, w, K, sc, bias, False), bias


@pytest.mark.parametrize("top", [True, False], ids=["top", "bottom"])
@pytest.mark.parametrize("layout", ["q4", "q4f", "q8", "q8b-g16", *CODE_BYTES])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_int8_gemm_at_the_extremes_of_codes_and_activations(isa: str, layout: str,
                                                            top: bool) -> None:
    """Every code at an end of its format's range against activations of |q| = 127 (q +
    128 = 255 or 1 in the offset panels): the largest int16 sums vpmaddubsw's path adds
    up (gemm.cpp's int16_sums, bounded per format by its largest |code|), which would
    overflow if a bound were wrong. Against the row kernels and the float64 reference."""
    mod = _module(isa)
    N, K = 13, 512
    g = _gen(len(layout) * 11 + len(isa) + top)
    lin, bias = _extreme_layer(mod, layout, N, K, top, g)
    assert lin.gemm_supported
    dense = lin.decoded(False).double()
    for M in (16, 33):
        # Each row one value throughout (every group's q = +-127), signs and sizes mixed.
        sign = torch.tensor([1.0, -1.0] * M)[:M]
        x = (sign * torch.linspace(0.5, 4.0, M))[:, None].expand(M, K).contiguous()
        what = f"{isa} {layout} {'top' if top else 'bottom'} M={M}"
        y = _gemm_against_row_kernels(lin, x, what)
        q, d = quantize_acts_reference(x)
        assert int(q.abs().min()) == 127
        xd = (q.view(M, -1, 32).double() * d.double()[..., None]).view(M, K)
        assert_linear_close(y, (xd @ dense.T + bias.double()).float(), what)


@pytest.mark.parametrize("layout", ["q8", "q8b-g16", "q8b-min-f32", "q8b-g32-f16", "Q6_K"])
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_int8_gemm_with_int16_activations_equals_the_head_kernel(isa: str, layout: str) -> None:
    """A head's int16 activations (wide_acts) in the GEMM, equal to the head's row kernel
    and to the float64 reference over the int16 activations: as their low and high bytes
    in two panels, the sums recombined exactly; on the avx2 build, whose vpmaddubsw cannot
    take 8-bit codes against those bytes, as int16 pairs against the codes widened
    (gemm_pairs), and Q6_K blocks (a Q4_K_M file's head) so too."""
    mod = _module(isa)
    N, K = 13, 4096
    g = _gen(len(layout) * 5 + len(isa))
    lin, bias = _gemm_layer(mod, layout, N, K, g, wide=True)
    assert lin.wide_acts and lin.gemm_supported
    assert lin.gemm_pairs == (isa == "avx2")
    dense = lin.decoded(False).double()
    for M in GEMM_ROWS:
        x = torch.randn(M, K, generator=g) * 3
        what = f"{isa} {layout} M={M}"
        y = _gemm_against_row_kernels(lin, x, what)
        q, d = quantize_acts16_reference(x)
        xd = q.double() * d.double()
        assert_linear_close(y, (xd @ dense.T + bias.double()).float(), what)


def test_int8_gemm_runs_a_stack_of_formats() -> None:
    """A fused layer of mixed formats (Q4_K rows over Q6_K rows, as Q4_K_M files store q/k
    and v) runs each part in the GEMM into its columns."""
    mod = build.native_module()
    g = _gen(3)
    a, _ = _gemm_layer(mod, "Q4_K", 12, 512, g)
    b, _ = _gemm_layer(mod, "Q6_K", 5, 512, g)
    stack = mod.QLinear.stack([a, b])
    assert stack.gemm_supported
    x = torch.randn(20, 512, generator=g)
    rows = stack.forward(x)
    stack.set_int8_gemm(8)
    assert a.gemm_min_rows == b.gemm_min_rows == 8
    y = stack.forward(x)
    torch.testing.assert_close(y, rows, rtol=1e-5, atol=1e-5 * float(rows.abs().max()))
    torch.testing.assert_close(y[:, 12:], b.forward(x))
    with pytest.raises(RuntimeError, match="min_rows"):
        stack.set_int8_gemm(-1)


def _normal_scales(raw: Any, fmt: Any, seed: int) -> None:
    """Every block's fp16 fields (d, dmin / m) ~ N(0, 0.01), in place."""
    import gguf
    import numpy as np

    _, size = gguf.GGML_QUANT_SIZES[fmt]
    b = raw.reshape(-1, size)
    rng = np.random.default_rng(seed)
    for off in F16_FIELDS[fmt]:
        v = (rng.standard_normal(b.shape[0]) * 0.01).astype(np.float16)
        b[:, off : off + 2] = v.view(np.uint8).reshape(-1, 2)


def test_policy_is_per_cpu_class() -> None:
    """AVX512-BF16 sends quantized batches of 16+ rows to a bf16 GEMM; without it (or under
    KVLOOP_ISA=avx2) they go to an fp32 GEMM from the measured AVX2 crossover."""
    if dispatch.bf16_gemm_fast():
        assert dispatch.policy() == dispatch.BF16_POLICY
    else:
        assert dispatch.policy() == dispatch.FP32_POLICY
    assert not dispatch.FP32_POLICY.quantized_bf16 and dispatch.BF16_POLICY.quantized_bf16
    for p in (dispatch.BF16_POLICY, dispatch.FP32_POLICY):
        assert 1 <= p.quantized_min_rows <= 1024 and 1 <= p.fp32_min_rows <= 1024
        assert 1 <= p.int8_gemm_min_rows <= p.int8_gemm_min_rows_8bit <= 64


def _run(code: str, isa: str) -> str:
    env = {**os.environ, "KVLOOP_ISA": isa, "PYTHONPATH": str(ROOT / "src")}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_kvloop_isa_avx2_holds_the_libraries_to_avx2() -> None:
    """An AVX-512 machine under KVLOOP_ISA=avx2 runs what an AVX2-only one does: ATen's
    vector code, oneDNN and MKL capped at AVX2, no bf16 GEMM, the avx2 kernel build."""
    if "avx2" not in build.cpu_isas():
        pytest.skip("this CPU has no AVX2")
    out = _run("import kvloop, os, torch\n"
               "from kvloop import dispatch\n"
               "from kvloop.kernels import build\n"
               "print(torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA'],"
               " os.environ['MKL_ENABLE_INSTRUCTIONS'], dispatch.bf16_gemm_fast(),"
               " build.kernel_isa(), dispatch.policy().cpu)", "avx2")
    assert out.split(maxsplit=5) == ["AVX2", "AVX2", "AVX2", "False", "avx2",
                                     dispatch.FP32_POLICY.cpu + "\n"]


@pytest.mark.slow
def test_greedy_batch_invariance_on_the_avx2_build(tiny_model_dir: Path) -> None:
    """fp32 greedy tokens of each prompt alone equal those in a batch of 24 (native decode
    steps and GEMM-sized prefills mixed), on the avx2 build with the AVX2 policy, as the
    default build's own tests check (test_batching.py)."""
    if "avx2" not in build.cpu_isas():
        pytest.skip("this CPU has no AVX2")
    code = f"""
import torch
from kvloop import LLM, SamplingParams
from kvloop.kernels import build
assert build.native_module().compiled_isa() == "avx2"
llm = LLM({str(tiny_model_dir)!r}, quantization="none", kv_cache_dtype="fp32")
assert llm.engine.runner.decoder is not None
g = torch.Generator().manual_seed(0)
lens = [1, 5, 17, 40, 70, 100] * 4
prompts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in lens]
p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
alone = [llm.generate([q], p)[0].outputs[0].token_ids for q in prompts]
batch = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
print(sum(a == b for a, b in zip(alone, batch)), len(prompts))
"""
    same, total = _run(code, "avx2").split()
    assert same == total == "24"
