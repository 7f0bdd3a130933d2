"""Linear layers: y = x W^T (+ b), with the weight in the layout the fastest kernel wants.

`F.linear` (MKL) is the reference. On x86 CPUs oneDNN's prepacked layout reads the same
bytes much faster at decode's small batches (measured here, all 30 layers plus the head
at batch 1: 48 ms with F.linear, 28 ms prepacked), so `pack()` switches to it when
available. Quantized variants live in `kvloop.quant`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvloop.quant.layout import F32


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # Uninitialised: overwritten by the loader.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Reorder the weight for oneDNN and drop the dense one: one layout held (the
        modules' forward reads this one; the native decoder reads dense weights, so a model
        it runs is never packed)."""
        if self.packed is not None or not onednn_available():
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]:
        """(kind, weight, in_features, scales, bias) for ``kvloop.kernels.native_linear``."""
        if self.weight.numel() == 0:
            raise RuntimeError("the dense weight was dropped by pack()")
        return F32, self.weight.detach(), self.in_features, None, self.bias

    @property
    def weight_bytes(self) -> int:
        """Bytes a forward pass reads for the weight (and bias)."""
        n = self.in_features * self.out_features * 4
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        kind = "onednn" if self.packed is not None else "dense"
        return f"{self.in_features} -> {self.out_features}, {kind}"
