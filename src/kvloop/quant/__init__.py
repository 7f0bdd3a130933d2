"""Weight-only quantized linear layers: int8 (per-channel scales) and 4-bit (group-wise
scale and zero point), on PyTorch's CPU kernels. fp32 stays the reference path."""

from kvloop.quant.int4 import GROUP_SIZE, Int4Linear, Int4Weights
from kvloop.quant.int8 import Int8Linear

QUANTIZATIONS = ("none", "int8", "int4")

__all__ = ["GROUP_SIZE", "QUANTIZATIONS", "Int4Linear", "Int4Weights", "Int8Linear"]
