"""The kernel dispatch policy: every row-count threshold and CPU-feature choice that picks
a kernel, in one module, read once at load (a layer's layout) or per step (the runner).

The thresholds were measured on this project's machines (Zen 4 with AVX512-BF16, Zen 3 with
AVX2 + FMA, 2 cores); benchmarks/ holds the measurements. `KVLOOP_ISA` (the kernels' build,
kvloop.kernels.build) also steers the choices here, so an AVX-512 machine asked for the
avx2 build behaves as an AVX2-only one does.
"""

from __future__ import annotations

import os

import torch

# Decode batches of up to this many sequences run in the native whole-step decoder (and
# int4 layers' native kernels serve inputs of up to this many rows without a batched path).
NATIVE_MAX_ROWS = 64
# Prefill chunks up to this many tokens run in the native step. Its attention kernel
# (online softmax over paged K/V) beat the modules' SDPA on 512-token prompts, tied at
# 768 and 1024 and lost at 2048 (fp32 prefill here: 622 vs 549 tok/s at 512, 414 vs 476
# at 2048), so a step with a longer chunk stays on the modules.
NATIVE_MAX_PREFILL = 1024
# Quantized layers, batches from this many rows: weights decoded to bf16 and oneDNN's bf16
# GEMM (~2x the int8 kernels where AVX512-BF16 dot products exist: compute-bound steps).
BF16_MIN_ROWS = 16
# fp32 layers (and quantized ones without fast bf16): up to 64 rows the native kernels
# (measured faster than oneDNN/MKL there), from 65 on ATen's fp32 GEMM.
FP32_BATCHED_MIN_ROWS = 65


def kernel_isa_is_reduced() -> bool:
    """Whether KVLOOP_ISA asks for a build below AVX-512 (avx2, scalar)."""
    return os.environ.get("KVLOOP_ISA", "") in ("avx2", "scalar")


def bf16_gemm_fast() -> bool:
    """Whether this CPU has bf16 dot products (AVX512-BF16), which oneDNN's bf16 GEMM uses:
    ~2.3x the fp32 rate here. Without them bf16 is emulated, slower than the int8 kernels.
    False under KVLOOP_ISA=avx2/scalar, which stand for CPUs without them."""
    return bool(torch.cpu._is_avx512_bf16_supported()) and not kernel_isa_is_reduced()


def quantized_batched_path() -> tuple[int, bool]:
    """(min rows, bf16) of a quantized layer's batched path: the rows from which its
    weights are decoded for a GEMM instead of meeting the int8 kernels, and whether the
    GEMM runs in bf16 (else fp32)."""
    if bf16_gemm_fast():
        return BF16_MIN_ROWS, True
    return FP32_BATCHED_MIN_ROWS, False
