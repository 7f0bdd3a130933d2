"""Paged attention read straight from the block-table KV cache (C++ kernel + references).

The kernel (``csrc/paged_attention.cpp``) walks each sequence's blocks in place, so the
per-step gather of the whole context into ``[B, Hkv, S, D]`` disappears; each K/V row is
read once per GQA group, softmax is online in fp32. It is part of the one native
extension that ``kvloop.kernels.build`` builds and loads (see ``available``).

Cache layout (as in ``kvloop.models.attention``): ``[2, Hkv, num_slots, D]``, K then V,
slot = block_id * block_size + offset, in fp32, bf16, fp16 or int8; an int8 cache comes with
``kv_scales [2, Hkv, num_slots]`` fp16 (x = scale * code, kvloop.quant.kv). The kernel
converts each row to fp32 in registers as it reads it; for int8 it scales the dot product
(q . k = s_k * (q . codes)) and the softmax weight of each V row instead of every element,
and rotates the queries into the basis int8 keys are stored in (kvloop.quant.kv).
The K/V of the query tokens must already be in the cache when these are called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvloop.kernels.build import available, native_module
from kvloop.quant.kv import dequantize, hadamard, key_block

_ext = native_module
__all__ = ["available", "paged_attention_varlen", "paged_decode_attention",
           "paged_decode_attention_reference", "paged_prefill_attention",
           "paged_prefill_attention_reference"]


def paged_attention_varlen(
    q: torch.Tensor,  # [T, H, D] fp32
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32 / bf16 / fp16 / int8
    block_tables: torch.Tensor,  # [N, max_blocks] int32/int64, padded
    query_start: torch.Tensor | None,  # [N + 1] int64 row offsets into q; None: 1 row each
    context_lens: torch.Tensor,  # [N] int64, cached tokens including the query rows
    block_size: int,
    scale: float,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,  # [2, Hkv, slots] fp16, for an int8 cache
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H, D]
    """Decode rows and prefill chunks in one call.

    Sequence n owns rows ``query_start[n]:query_start[n+1]`` of q: the last L of its
    ``context_lens[n]`` positions. Row i of them sees keys ``0 .. ctx - L + i`` (causal);
    with ``window`` > 0 only the last ``window`` of those (a sliding-window layer), and
    table entries of blocks before the first visible key are never read. ``softcap`` > 0:
    scores = softcap * tanh(scores / softcap) before the softmax (Gemma 2).
    """
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_tables, query_start, context_lens, block_size, scale,
        window, kv_scales, softcap,
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D] fp32, one query token per sequence
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32 / bf16 / fp16 / int8
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded
    context_lens: torch.Tensor,  # [B] int64, >= 1
    block_size: int,
    scale: float,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,  # [2, Hkv, slots] fp16, for an int8 cache
) -> torch.Tensor:  # [B, H, D]
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_tables, None, context_lens, block_size, scale, window,
        kv_scales,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [L, H, D] fp32, the chunk's last L positions of the context
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D] fp32 / bf16 / fp16 / int8
    block_table: torch.Tensor,  # [max_blocks] int32/int64
    context_len: int,  # cached tokens including the chunk, >= L
    block_size: int,
    scale: float,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,  # [2, Hkv, slots] fp16, for an int8 cache
) -> torch.Tensor:  # [L, H, D]
    """One prefill chunk over its cached prefix, causal inside the chunk."""
    L = q.shape[0]
    return _ext().paged_attention_varlen(
        q.contiguous(), kv_cache, block_table.view(1, -1), torch.tensor([0, L]),
        torch.tensor([context_len]), block_size, scale, window, kv_scales,
    )


# ---- references: plain PyTorch, the kernel's oracle in tests ----
# They compute in q's dtype (float64 in the KV dtype tests) over the cache dequantized to
# it: the kernel's only intended difference from them is fp32 arithmetic.


def _context_kv(
    kv_cache: torch.Tensor, table: torch.Tensor, ctx: int, block_size: int,
    kv_scales: torch.Tensor | None, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [Hkv, ctx, D]
    pos = torch.arange(ctx)
    slots = table.long()[pos // block_size] * block_size + pos % block_size  # [ctx]
    kv = [dequantize(kv_cache[i][:, slots],
                     None if kv_scales is None else kv_scales[i][:, slots], dtype)
          for i in (0, 1)]
    if kv_scales is not None:  # int8 K is stored rotated (kvloop.quant.kv): undo it
        b = key_block(kv_cache.shape[-1])
        kv[0] = hadamard(kv[0], b) / b
    return kv[0], kv[1]


def paged_prefill_attention_reference(
    q: torch.Tensor,  # [L, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D]
    block_table: torch.Tensor,  # [max_blocks]
    context_len: int,
    block_size: int,
    scale: float,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,  # [2, Hkv, slots], for an int8 cache
) -> torch.Tensor:  # [L, H, D]
    L = q.shape[0]
    k, v = _context_kv(kv_cache, block_table, context_len, block_size, kv_scales,
                       q.dtype)  # [Hkv, ctx, D]
    keys = torch.arange(context_len)
    qpos = torch.arange(L)[:, None] + context_len - L  # [L, 1]
    mask = keys[None, :] <= qpos  # [L, ctx]
    if window > 0:
        mask &= keys[None, :] > qpos - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [1, H, L, D]
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def paged_decode_attention_reference(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, slots, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_lens: torch.Tensor,  # [B]
    block_size: int,
    scale: float,
    window: int = 0,
    kv_scales: torch.Tensor | None = None,  # [2, Hkv, slots], for an int8 cache
) -> torch.Tensor:  # [B, H, D]
    """Gather each row's context, then SDPA: one sequence at a time, so no padding mask
    (and no read of padded table entries) can leak into the result."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        out[b : b + 1] = paged_prefill_attention_reference(
            q[b : b + 1], kv_cache, block_tables[b], int(context_lens[b]), block_size, scale,
            window, kv_scales,
        )
    return out
