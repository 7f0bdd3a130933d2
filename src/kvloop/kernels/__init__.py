"""Native CPU kernels (paged attention, decode-sized linear layers, the whole decode step),
JIT-built on first use; every one has a pure-PyTorch fallback and reference.

``available()`` is the only gate callers need: False (after one logged warning) when the
build fails or ``KVLOOP_NO_KERNELS=1``, and the caller keeps its PyTorch path.
"""

from kvloop.kernels.build import available, native_module
from kvloop.kernels.linear import (
    linear_reference,
    native_linear,
    quantize_acts,
    quantize_acts_reference,
)
from kvloop.kernels.paged_attention import (
    paged_attention_varlen,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

__all__ = [
    "available",
    "linear_reference",
    "native_linear",
    "native_module",
    "paged_attention_varlen",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "quantize_acts",
    "quantize_acts_reference",
]
