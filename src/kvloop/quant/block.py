"""A linear layer over a checkpoint's own quantized blocks ("as stored"): GGUF's Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K tensors, mapped without re-quantization onto
a native kernel layout whose weights, computed as the kernels read them, equal the `gguf`
package's dequantization bit for bit: the blocks as they lie (kvloop.quant.stored.
StoredRows: Q4_K, Q5_K, Q6_K, Q5_0, Q5_1) or their codes and group scales
(kvloop.quant.layout.GroupWeights.native).

The native kernel (`native`, set by kvloop.models when the kernels are built) runs every
forward. Without it the layer falls back to a dense fp32 matmul over the dequantized
weights, built once on first use: correct, but with fp32's memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from kvloop.quant.layout import Q4, Q4F, Q8B, STORED, GroupWeights, dequantize_native

if TYPE_CHECKING:
    from kvloop.quant.stored import Q4Rows, StoredRows

_NAMES = {Q4: "4-bit fp16 g32", Q4F: "4-bit fp32 g32", Q8B: "8-bit",
          **{kind: f"{name} blocks" for name, kind in STORED.items()}}


class BlockLinear(nn.Module):
    weight_q: torch.Tensor
    scales: torch.Tensor | None

    def __init__(self, w: GroupWeights | StoredRows | Q4Rows, bias: torch.Tensor | None = None,
                 source: str = "") -> None:
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.kind, weight, scales = w.native()
        self.register_buffer("weight_q", weight)
        self.register_buffer("scales", scales)
        self.bias = bias
        self.source = source  # the stored format(s), for extra_repr and stats
        self.native: Any = None
        self._dense: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        n = self.weight_q.numel() * self.weight_q.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def native_spec(self) -> tuple[int, torch.Tensor, int, torch.Tensor | None,
                                   torch.Tensor | None]:
        """(kind, weight, in_features, scales, bias) for ``kvloop.kernels.native_linear``."""
        return self.kind, self.weight_q, self.in_features, self.scales, self.bias

    def dequantize(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows r0..r1 of the weights as the native kernels decode them: [r1 - r0, K] fp32."""
        sl = slice(r0, r1)
        return dequantize_native(self.kind, self.weight_q[sl], self.in_features,
                                 None if self.scales is None else self.scales[sl])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, K] fp32
        """Rows `ids` of the weights, decoded (an embedding lookup in a checkpoint's blocks:
        exactly the values the fp32 table would hold)."""
        return dequantize_native(self.kind, self.weight_q[ids], self.in_features,
                                 None if self.scales is None else self.scales[ids])

    def equals(self, weight: torch.Tensor, rows: int = 4096) -> bool:
        """Whether these weights are `weight` [N, K] bit for bit (checked in row chunks, so
        that a vocabulary-sized head needs no second fp32 copy)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            return False
        return all(torch.equal(self.dequantize(r, r + rows), weight[r : r + rows])
                   for r in range(0, self.out_features, rows))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.native is not None:
            return self.native.forward(x.float().contiguous())  # type: ignore[no-any-return]
        if self._dense is None:
            self._dense = self.dequantize()
        y = x.float() @ self._dense.T
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        src = f" from {self.source}" if self.source else ""
        return f"{self.in_features} -> {self.out_features}, {_NAMES[self.kind]}{src}"


class StackedLinear(nn.Module):
    """A fused layer (q/k/v, gate/up) whose checkpoint parts are stored in formats no one
    layout holds exactly (q/k as Q4_K blocks with v as Q6_K, as Q4_K_M files store half
    their layers), or holds only at more bytes (Q5_0 with Q8_0 as 8-bit codes): each part
    a BlockLinear over its own blocks (and its slice of the bias), the output theirs side
    by side. The parts count their own bytes (weight_bytes); the native kernel is a stack
    of theirs (kvloop.kernels.linear.native_stack).

    bias [N]: the whole layer's, whose row slices become the parts' biases (views: a bias
    copied in later, as load_weights does for Qwen2's q/k/v, reaches the parts and their
    kernels)."""

    def __init__(self, parts: list[BlockLinear], bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = bias
        if bias is not None:
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} rows")
            for p, b in zip(parts, bias.split([p.out_features for p in parts]), strict=True):
                p.bias = b
        self.native: Any = None

    def blocks(self) -> list[BlockLinear]:
        return [cast(BlockLinear, p) for p in self.parts]

    def dequantize(self) -> torch.Tensor:  # [N, K] fp32
        return torch.cat([p.dequantize() for p in self.blocks()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, K] -> [T, N]
        if self.native is not None:
            return self.native.forward(x.float().contiguous())  # type: ignore[no-any-return]
        return torch.cat([p(x) for p in self.blocks()], dim=-1)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {len(self.parts)} parts"
