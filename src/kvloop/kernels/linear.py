"""Native linear layers for decode-sized batches, their weight layouts, and references.

The kernels (``csrc/linear.cpp``) compute y = x W^T with W as fp32, int8 with one scale
per output channel, 4-bit codes in groups of 32 with an fp16 (Q4) or fp32 (Q4F) scale and
min each, or int8 codes with a scale per group of 16 or 32 and optionally a min (Q8B);
see kvloop.quant.layout.
Quantized weights take int8 activations, rounded per block of 32 values exactly as
``quantize_acts_reference`` does, or int16 ones (``wide_acts``: the output head, whose
logits int8 rounding would move) rounded as ``quantize_acts16_reference``; the
references below compute the same sums in plain PyTorch and are what the kernels are
tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from kvloop.kernels.build import native_module as _ext
from kvloop.quant.layout import (
    F32,
    GROUP,
    Q4,
    Q4F,
    Q8,
    Q8B,
    WIDE_ACTS_KINDS,
    dequantize_native,
    pack_q4,
    pack_q4f,
    unpack_q4,
)

__all__ = ["F32", "Q4", "Q4F", "Q8", "Q8B", "dequantize", "linear_reference", "native_linear",
           "pack_q4", "pack_q4f", "quantize_acts", "quantize_acts16_reference",
           "quantize_acts_reference",
           "unpack_q4"]

def quantize_acts_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] integer-valued fp32 in [-127, 127], d [M, K/32]): x ~= d * q."""
    M, K = x.shape
    g = x.float().view(M, K // GROUP, GROUP)
    d = g.abs().amax(dim=-1) / 127.0
    d = torch.where(d >= 1e-30, d, torch.zeros_like(d))  # as the kernel: tiny blocks are 0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(g * inv[..., None]).view(M, K), d


def quantize_acts16_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's activations (``wide_acts``): x [M, K] -> (q [M, K] integer-valued fp32 in
    [-32767, 32767], d [M, 1]): x ~= d * q, one scale per row."""
    x = x.float()
    d = x.abs().amax(dim=-1, keepdim=True) / 32767.0
    d = torch.where(d >= 1e-30, d, torch.zeros_like(d))
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(x * inv), d


def dequantize(kind: int, weight: torch.Tensor, in_features: int,
               scales: torch.Tensor | None = None) -> torch.Tensor:
    """The layout's weights as float64 [N, K]."""
    if kind == F32:
        return weight.double()
    # The fp32 weights (exact: see kvloop.quant.layout), widened.
    return dequantize_native(kind, weight, in_features, scales).double()


def linear_reference(x: torch.Tensor, kind: int, weight: torch.Tensor, in_features: int,
                     scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     wide_acts: bool = False, bf16: bool = False) -> torch.Tensor:
    """What the kernel computes, in float64 sums: [M, K] -> [M, N]. bf16: the batched path
    of a quantized layer (``set_batched_decode``): x and w rounded to bf16, the sum to
    bf16."""
    if bf16:
        w = dequantize(kind, weight, in_features, scales).to(torch.bfloat16).double()
        y = (x.to(torch.bfloat16).double() @ w.T).to(torch.bfloat16).double()
        return (y if bias is None else y + bias.double()).float()
    if kind == F32:
        y = x.double() @ weight.double().T
    else:
        if wide_acts:
            assert kind in WIDE_ACTS_KINDS
            q, d = quantize_acts16_reference(x)
            xd = q.double() * d.double()
        else:
            q, d = quantize_acts_reference(x)
            xd = (q.view(q.shape[0], -1, GROUP) * d[..., None]).view_as(q).double()
        y = xd @ dequantize(kind, weight, in_features, scales).T
    if bias is not None:
        y = y + bias.double()
    return y.float()


def native_linear(kind: int, weight: torch.Tensor, in_features: int,
                  scales: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  wide_acts: bool = False) -> Any:
    """A kernel-side linear layer (holds references to the tensors, no copies).
    wide_acts (the kinds in WIDE_ACTS_KINDS: Q8, Q8B, stored Q6_K): activations rounded to
    int16, one scale per row (2^-15 of the row's largest), instead of int8 per block of 32."""
    return _ext().QLinear(kind, weight, in_features, scales, bias, wide_acts)


def native_stack(parts: list[Any]) -> Any:
    """Kernel-side layers (native_linear) of one in_features stacked along the output: a
    fused layer whose parts keep layouts of their own."""
    return _ext().QLinear.stack(parts)


def quantize_acts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own activation rounding: (int8 [M, K], scales [M, K/32])."""
    q, d = _ext().quantize_acts(x)
    return q, d
