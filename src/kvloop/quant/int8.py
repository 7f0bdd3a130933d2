"""int8 weights with one fp scale per output channel: w = scale[n] * q[n, k].

Where kvloop's native kernels are built, `native` holds one over these weights and every
forward uses it (int8 activations per block of 32, see kvloop.kernels.linear; measured
faster than PyTorch's kernel here at every row count, prefill included). On CPUs with
bf16 dot products it also holds a bf16 copy of the weights, and batches of 16 rows or
more (prefill, large decode batches: compute-bound) go through oneDNN's bf16 GEMM
instead (kvloop.models.native.attach_native_linears). Otherwise
PyTorch's `_weight_int8pack_mm` runs, vectorized on AVX2 only with bf16 activations
(all linears of the default model at batch 1: 11.5 ms with bf16, 66 ms with fp32), so
activations are rounded to bf16 for it and the result returned in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvloop.quant.layout import Q8


class Int8Linear(nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())  # [N, K] int8
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())  # [N]
        self.bias = bias
        # The native kernel over these weights (kvloop.models.native sets it when the
        # kernels are built); PyTorch's kernel is the fallback.
        self.native: Any = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   rows: int = 4096) -> Int8Linear:
        """Symmetric per-channel absmax quantization of an fp32 [N, K] weight, `rows` rows
        at a time (a vocabulary-sized head's temporaries stay a few MB, not 4x its size)."""
        N = weight.shape[0]
        q = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(N)
        for r in range(0, N, rows):
            w = weight[r : r + rows].float()
            s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [rows]
            # The kernel multiplies by bf16 scales: quantize against exactly those, rounded
            # up (bf16 keeps 8 bits) so that no weight falls outside [-127, 127].
            s = (s * (1 + 2**-8)).to(torch.bfloat16).float()
            q[r : r + rows] = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
            scales[r : r + rows] = s
        return cls(q, scales, bias)

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2

    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]:
        """(kind, weight, in_features, scales, bias) for ``kvloop.kernels.native_linear``."""
        # The (bf16-valued) scales in fp32, as the native kernels take them.
        return Q8, self.qweight, self.in_features, self.scales.float(), self.bias

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.native is not None:
            return self.native.forward(x)  # type: ignore[no-any-return]
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales)
        y = y.float()
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, int8 per-channel"
