"""Weight-only quantized linear layers: int8 (per-channel scales), 4-bit (group-wise
scale and zero point), and a checkpoint's own blocks as stored ("gguf"); fp32 stays the
reference path."""

from kvloop.quant.block import BlockLinear, StackedLinear
from kvloop.quant.int4 import GROUP_SIZE, Int4Linear, Int4Weights
from kvloop.quant.int8 import Int8Linear
from kvloop.quant.layout import GroupWeights

# "auto" is resolved at load time (kvloop.engine: "gguf" for a GGUF file with quantized
# linear tensors, else "none"); the others name what the linear layers compute with.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")

__all__ = ["GROUP_SIZE", "QUANTIZATIONS", "BlockLinear", "GroupWeights", "Int4Linear",
           "Int4Weights", "Int8Linear", "StackedLinear"]
