"""4-bit weights in groups of 32 along the input, each group with a scale and a zero
point: w = scale * (q - 8) + zero, q in [0, 15] (PyTorch's tinygemm convention).

GGUF's Q4_1 blocks (w = d * q + m over 32 weights) map onto it exactly: scale = d,
zero = m + 8d; Q4_0 blocks (w = d * (q - 8)) with zero = 0. So those files load without
re-quantization. Other weights are quantized group-wise from fp32 (asymmetric min/max).

The layer holds one layout, the native kernels' (GGUF's Q4_1 block order, fp16 scale and
min per group: kvloop.quant.layout.pack_q4). Where the kernels are built, `native` runs
every forward: int8 activations at decode sizes, and for batches the weights decoded a
chunk at a time into a GEMM (kvloop.dispatch). Without the kernels, PyTorch's
`_weight_int4pack_mm_for_cpu` serves, over its own packing of the weights made on first
use (fast with bf16 activations, a scalar loop with fp32 ones: all linears of the default
model at batch 1, 5.2 vs 136 ms here, so activations go to bf16 for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvloop.dispatch import NATIVE_MAX_ROWS, has_batched_path
from kvloop.quant.layout import Q4, dequantize_q4, pack_q4, unpack_q4

GROUP_SIZE = 32


@dataclass
class Int4Weights:
    """Unpacked 4-bit codes of one [N, K] weight, group-wise along K."""

    codes: torch.Tensor  # [N, K] uint8 in [0, 15]
    scales: torch.Tensor  # [N, K / 32] fp32
    zeros: torch.Tensor  # [N, K / 32] fp32

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        s = self.scales.repeat_interleave(GROUP_SIZE, dim=1)
        z = self.zeros.repeat_interleave(GROUP_SIZE, dim=1)
        return (self.codes.float() - 8.0) * s + z

    @classmethod
    def cat(cls, parts: list[Int4Weights]) -> Int4Weights:
        """Stack along the output dimension (fused q/k/v or gate/up)."""
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                   torch.cat([p.zeros for p in parts]))

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> Int4Weights:
        """Asymmetric min/max quantization per group of 32."""
        N, K = weight.shape
        g = weight.float().view(N, K // GROUP_SIZE, GROUP_SIZE)
        # Scales and mins are rounded to fp16 first (the native kernels store them so, as
        # GGUF does) and the codes chosen against the rounded values.
        lo = g.amin(dim=-1).half().float()
        hi = g.amax(dim=-1)
        scales = ((hi - lo) / 15.0).clamp(min=2**-14).half().float()
        q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15)
        # w = lo + s * q = s * (q - 8) + (lo + 8 s)
        return cls(q.view(N, K).to(torch.uint8), scales, lo + 8.0 * scales)


class Int4Linear(nn.Module):
    native_packed: torch.Tensor

    def __init__(self, w: Int4Weights, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if w.codes.shape[1] % GROUP_SIZE:
            raise ValueError(f"int4 needs in_features divisible by {GROUP_SIZE}")
        # GGUF-style groups with an fp16 scale and min (w = s q + m): the one layout held.
        self._setup(pack_q4(w.codes, w.scales, w.zeros - 8.0 * w.scales), w.codes.shape[1],
                    bias)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, in_features: int,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        """A layer over weights already in the native layout (a layout cache's)."""
        if in_features % GROUP_SIZE or packed.dim() != 2 or packed.dtype != torch.uint8 \
                or packed.shape[1] != in_features // GROUP_SIZE * 20:
            raise ValueError(f"not a [N, {in_features // GROUP_SIZE * 20}] uint8 int4 layout")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(packed, in_features, bias)
        return layer

    def _setup(self, packed: torch.Tensor, in_features: int,
               bias: torch.Tensor | None) -> None:
        self.out_features, self.in_features = int(packed.shape[0]), int(in_features)
        self.register_buffer("native_packed", packed)
        self.bias = bias
        # The native kernel over these weights (kvloop.models.native sets it when the
        # kernels are built); PyTorch's kernel is the fallback.
        self.native: Any = None
        self._tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def weight_bytes(self) -> int:
        return self.native_packed.numel()

    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]:
        """(kind, weight, in_features, scales, bias) for ``kvloop.kernels.native_linear``."""
        return Q4, self.native_packed, self.in_features, None, self.bias

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32, as the native kernels decode it
        return dequantize_q4(self.native_packed, self.in_features)

    def _fallback_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """PyTorch's tinygemm packing of the same codes, made once, only where the native
        kernels are not built."""
        if self._tinygemm is None:
            codes, scales, mins = unpack_q4(self.native_packed, self.in_features)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            # [K / 32, N, 2]: (scale, zero) per group and output channel, w = s (q - 8) + z.
            sz = torch.stack([scales.t(), (mins + 8.0 * scales).t()], dim=-1)
            self._tinygemm = packed, sz.to(torch.bfloat16).contiguous()
        return self._tinygemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        native = self.native
        if native is not None and (x.shape[0] <= NATIVE_MAX_ROWS or has_batched_path(native)):
            return native.forward(x)  # type: ignore[no-any-return]
        packed, scales_zeros = self._fallback_weights()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), packed, GROUP_SIZE, scales_zeros)
        y = y.float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int4 g{GROUP_SIZE}"
