"""Native CPU kernels, JIT-built on first use; every one has a pure-PyTorch fallback.

``available()`` is the only gate callers need: False (after one logged warning) when the
build fails or ``KVLOOP_NO_KERNELS=1``, and the caller keeps its PyTorch path.
"""

from kvloop.kernels.paged_attention import (
    available,
    paged_attention_varlen,
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

__all__ = [
    "available",
    "paged_attention_varlen",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]
