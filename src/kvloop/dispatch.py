"""The kernel dispatch policy: every row-count threshold and CPU-feature choice that picks
a kernel, in one module, read once at load (a layer's layout) or per step (the runner).

The thresholds were measured on this project's machines (Zen 4 with AVX512-BF16, Zen 3 with
AVX2 + FMA, 2 cores); benchmarks/ holds the measurements. `KVLOOP_ISA` (the kernels' build,
kvloop.kernels.build) also steers the choices here, so an AVX-512 machine asked for the
avx2 build behaves as an AVX2-only one does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

# Decode batches of up to this many sequences run in the native whole-step decoder (and
# int4 layers' native kernels serve inputs of up to this many rows without a batched path).
NATIVE_MAX_ROWS = 64
# Prefill chunks up to this many tokens run in the native step. Its attention kernel
# (online softmax over paged K/V) beat the modules' SDPA on 512-token prompts, tied at
# 768 and 1024 and lost at 2048 (fp32 prefill here: 622 vs 549 tok/s at 512, 414 vs 476
# at 2048), so a step with a longer chunk stays on the modules.
NATIVE_MAX_PREFILL = 1024


@dataclass(frozen=True)
class GemmPolicy:
    """From which row count a layer's input goes to a GEMM instead of the native kernels,
    per weight format, on one class of CPU (benchmarks/bench_dispatch.py measures them)."""

    cpu: str  # the class of CPU it was measured on
    quantized_min_rows: int  # int8, 4-bit and GGUF-block layers: weights decoded per chunk
    quantized_bf16: bool  # that GEMM in bf16 (AVX512-BF16 dot products) rather than fp32
    fp32_min_rows: int  # fp32 layers: ATen's GEMM over the weight itself
    # Quantized layers the int8 GEMM takes (QLinear.gemm_supported: every format and the
    # head's int16 activations, but not both 8-bit codes and int16 activations without
    # VNNI) run in it from int8_gemm_min_rows rows (int8_gemm_min_rows_8bit for 8-bit
    # codes, which dot slower without VNNI), prefill included, instead of the row kernels
    # and of the decoded-weights GEMM (quantized_min_rows serves the layers it does not
    # take).
    int8_gemm_min_rows: int
    int8_gemm_min_rows_8bit: int

    def int8_gemm_rows(self, eight_bit_codes: bool) -> int:
        """The rows from which a layer with such codes runs in the int8 GEMM."""
        return self.int8_gemm_min_rows_8bit if eight_bit_codes else self.int8_gemm_min_rows


# The int8 GEMM against the other paths, one core, Llama-3.2-1B-shaped Q4_K_M and Q8_0
# layers (2048 -> 16384 Q4_K, 8192 -> 2048 Q6_K, Q8_0): at 8 rows it ties the row kernels
# on Q4_K and beats them on Q6_K and Q8_0 (1.2-1.5x); from 16 rows it is 1.4-2x both the
# row kernels and the bf16 GEMM over decoded weights (decoding alone costs what 8 rows of
# the GEMM do). So batches of 16 rows and more take it (from 8, the float summation order
# it brings moved the default model's int8 greedy chat replies in test_quant: near-ties).
# At prefill sizes it still leads: 512 rows of the same layers, 2 threads, 1.1-1.4x the
# bf16 GEMM (gate/up 84 vs 117 ms, down 45 vs 51 ms) and 1.2-1.5x the fp32 one on the avx2
# build. Its int8 activations cost no measured quality against the bf16 ones there:
# teacher-forced top-1 agreement with fp32 and perplexity are the same (test_quant,
# benchmarks/quant_quality.py); free-running greedy replies part from fp32's sooner, at
# near-ties, as any change of rounding makes them.
# AVX512-BF16 (Zen 4 here): the layers the GEMM does not take decoded to bf16, oneDNN's
# bf16 GEMM ~2x the row kernels' rate from 16 rows; fp32 layers: the native kernels up to
# 64 rows.
BF16_POLICY = GemmPolicy("AVX512-BF16", 16, True, 65, 16, 16)
# Without fast bf16 (AVX2 + FMA, or AVX-512 without BF16): decoded to fp32. The int8 GEMM
# on AVX2 (vpmaddubsw, int16 sums of up to 4 products for 4- to 6-bit codes), one core of
# a Zen 3, against the row kernels: Llama-3.2-1B-shaped layers (8192x2048, 2048x8192) at 8
# rows take 0.64-0.72x their time for Q4_K, 0.58-0.65x for Q6_K; the default model's int4
# layers (K = 576) 0.83-1.06x at 8 rows. 8-bit codes (two cores, weights from memory; the
# GEMM reads them where they are stored, without a copy): Q8_0 1B-shaped 0.79-0.87x at 8 rows,
# 0.76-0.78x at 16; the default model's int8 layers 0.97-1.11x at 8, 0.89-0.95x at 16,
# 0.85-0.91x at 32. So 4- to 6-bit codes from 8 rows, 8-bit ones from 16 (where the int8
# layers tie at 8).
FP32_POLICY = GemmPolicy("AVX2 + FMA", 65, False, 65, 8, 16)
# The AVX512-BF16 row threshold under the name the kernel tests use.
BF16_MIN_ROWS = BF16_POLICY.quantized_min_rows


def kernel_isa_is_reduced() -> bool:
    """Whether KVLOOP_ISA asks for a build below AVX-512 (avx2, scalar)."""
    return os.environ.get("KVLOOP_ISA", "") in ("avx2", "scalar")


def bf16_gemm_fast() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16), which oneDNN's bf16 GEMM uses:
    ~2.3x the fp32 rate here. Without them bf16 is emulated, slower than the int8 kernels.
    False under KVLOOP_ISA=avx2/scalar, which stand for CPUs without them."""
    return bool(torch.cpu._is_avx512_bf16_supported()) and not kernel_isa_is_reduced()


def policy() -> GemmPolicy:
    """The GEMM thresholds for this CPU (and KVLOOP_ISA)."""
    return BF16_POLICY if bf16_gemm_fast() else FP32_POLICY


def quantized_batched_path() -> tuple[int, bool]:
    """(min rows, bf16) of a quantized layer's batched path: the rows from which its
    weights are decoded for a GEMM instead of meeting the int8 kernels, and whether the
    GEMM runs in bf16 (else fp32)."""
    p = policy()
    return p.quantized_min_rows, p.quantized_bf16


def int8_gemm_min_rows(native: Any) -> int:
    """The rows from which a native quantized layer the int8 GEMM supports runs in it. A
    head's int16 activations take 8-bit codes' threshold whatever its codes: a Q6_K head
    (151936 x 1536, Zen 3, avx2, two threads) ran 8 rows in 37 ms on its row kernel against
    43 in the GEMM, 16 rows in 73 against 62."""
    return policy().int8_gemm_rows(bool(native.eight_bit_codes or native.wide_acts))


def has_batched_path(native: Any) -> bool:
    """Whether a native layer (kvloop.kernels.linear) runs large inputs in a GEMM (the int8
    one, or ATen's over decoded weights) rather than through the row kernels a row at a
    time."""
    return bool(native.gemm_min_rows > 0 or native.batched_min_rows > 0)


def fp32_batched_min_rows() -> int:
    """The rows from which an fp32 layer's input goes to ATen's GEMM."""
    return policy().fp32_min_rows
