"""Attention over a paged KV cache, and the per-step metadata that describes the batch.

The cache of one layer is a ``PagedKV`` (kvloop.quant.kv): a tensor ``[2, kv_heads,
num_slots, head_dim]`` (K then V) in the KV cache dtype (fp32, bf16, fp16, or int8 codes
with a scale per token per head), where ``num_slots = num_blocks * block_size`` and block
``b`` owns slots ``b*block_size ..``. Heads lead so that gathering a sequence's slots
yields ``[kv_heads, S, head_dim]`` already contiguous: SDPA's CPU kernels are many times
slower on strided K/V, so the layout is chosen to make the one gather per layer also the
only copy (a 16-bit or int8 cache is converted to fp32 as it is gathered).

A step's tokens are flattened (no padding): first one token per decoding sequence, then the
prompt chunks being prefilled. Decode rows are attended in one batched call; each prefill
chunk in its own call (causal within the chunk, over everything cached before it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F

from kvloop import kernels
from kvloop.config import ModelConfig
from kvloop.quant.kv import PagedKV


@dataclass
class PrefillSegment:
    q_start: int  # first row of this chunk in the step's flattened tokens
    q_len: int
    # Rows of the flattened [Hkv * slots, D] cache holding the whole context (cached prefix
    # + this chunk), head-major; None when the chunk is the whole context: then it attends
    # to its own fresh K/V and nothing is gathered.
    kv_index: torch.Tensor | None = None  # [Hkv * ctx_len] int64
    mask: torch.Tensor | None = None  # [q_len, ctx_len] bool, causal with the prefix offset


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step; built once by the runner, read by all layers."""

    num_decodes: int = 0  # rows [0, num_decodes) are one-token decode rows
    prefills: list[PrefillSegment] = field(default_factory=list)
    slot_mapping: torch.Tensor | None = None  # [T] int64 slot per new token; None: no cache
    # Rows of the flattened [Hkv * slots, D] cache for the decode rows, ordered so that one
    # index_select yields [B, Hkv, S, D] contiguous (padded rows point at row 0, masked).
    decode_kv_index: torch.Tensor | None = None  # [B * Hkv * S] int64
    decode_shape: tuple[int, int] = (0, 0)  # (B, S)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, S] float (0 / -inf); None: no padding
    # Decode rows for the native kernel, which reads the cache in place through the block
    # tables (no gather). When set, decode_kv_index is not used.
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] int64, padded
    decode_context_lens: torch.Tensor | None = None  # [B] int64, the new token included
    block_size: int = 0
    decode_window: int = 0  # > 0: the kernel's decode rows see only their last positions
    # KV cache groups (see KVCacheGroup): this metadata is group 0's; `groups` holds every
    # group's, and layer i reads `groups[layer_group[i]]`. Empty: one group, this one.
    groups: tuple[AttentionMetadata, ...] = ()
    layer_group: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.layer_group[layer]] if self.groups else self


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per sequence. Layer `layers[j]` keeps its K/V in
    cache tensor j, so a block id names the same memory for every layer of the group, and
    one pool of equal-sized blocks serves every group. A sliding group (`window` set) may
    drop blocks that slid out of the window; a full group (None) keeps them all."""

    layers: tuple[int, ...]
    window: int | None = None


def kv_cache_groups(config: ModelConfig) -> list[KVCacheGroup]:
    """The model's layers grouped by attention type, full groups first (group 0 is the
    table the native step and the prefix cache's chain follow).

    Every group has the same size, gcd(full layers, sliding layers), so that one block
    means the same bytes in every group: Gemma 3 270M's 3 global + 15 local layers make
    one full group and five sliding groups of three layers. A model without sliding
    layers is one group of all its layers, as if there were no groups."""
    layers = range(config.num_layers)
    full = [i for i in layers if not config.is_sliding(i)]
    sliding = [i for i in layers if config.is_sliding(i)]
    size = math.gcd(len(full), len(sliding))
    groups = [KVCacheGroup(tuple(full[k:k + size])) for k in range(0, len(full), size)]
    groups += [KVCacheGroup(tuple(sliding[k:k + size]), config.sliding_window)
               for k in range(0, len(sliding), size)]
    return groups


def map_groups(meta: AttentionMetadata,
               fn: Callable[[AttentionMetadata], AttentionMetadata]) -> AttentionMetadata:
    """`fn` applied to every KV cache group's metadata (the step's own is group 0's)."""
    if not meta.groups:
        return fn(meta)
    groups = tuple(fn(g) for g in meta.groups)
    return replace(groups[0], groups=groups, layer_group=meta.layer_group)


def layer_metadata(
    meta: AttentionMetadata,
    positions: torch.Tensor,  # [T]
    sliding: Sequence[bool],  # per layer: whether it sees only the last `window` positions
    window: int | None,
    num_kv_heads: int,
    num_slots: int,
) -> list[AttentionMetadata]:
    """Each layer's metadata: its KV cache group's (meta.for_layer), windowed for sliding
    layers (sliding_window, built once per group)."""
    if window is None or not any(sliding):
        return [meta.for_layer(i) for i in range(len(sliding))] if meta.groups \
            else [meta] * len(sliding)
    windowed: dict[int, AttentionMetadata] = {}
    out = []
    for i, slides in enumerate(sliding):
        m = meta.for_layer(i)
        if slides:
            key = meta.layer_group[i] if meta.groups else -1
            if key not in windowed:
                windowed[key] = sliding_window(m, positions, window, num_kv_heads, num_slots)
            m = windowed[key]
        out.append(m)
    return out


def causal_prefix_mask(q_len: int, ctx_len: int) -> torch.Tensor:
    """[q_len, ctx_len] bool: query i (position ctx_len - q_len + i) sees keys up to its own."""
    offset = ctx_len - q_len
    rows = torch.arange(q_len).unsqueeze(1) + offset
    return torch.arange(ctx_len).unsqueeze(0) <= rows


def flat_kv_index(slots: torch.Tensor, num_kv_heads: int, num_slots: int) -> torch.Tensor:
    """[B, S] cache slots -> [B * Hkv * S] rows of the flattened [Hkv * slots, D] cache."""
    heads = torch.arange(num_kv_heads).view(1, -1, 1) * num_slots  # [1, Hkv, 1]
    return (heads + slots.unsqueeze(1)).reshape(-1)


def sliding_window(
    meta: AttentionMetadata,
    positions: torch.Tensor,  # [T] the step's positions
    window: int,
    num_kv_heads: int,
    num_slots: int,
) -> AttentionMetadata:
    """The step's metadata for a layer whose queries see only the last `window` positions
    (their own included: key k is seen from position q when q - window < k <= q, as in
    HF's sliding-window mask).

    Built once per step and shared by every sliding layer of a KV cache group. Decode
    rows on the native kernel pass it the window (it starts each row's walk at its first
    visible key); on the gather path they gather only their last `window` slots (padded
    rows masked). Prefill chunks gather only the keys their queries can see. So nothing
    reads a block before a query's window: a sliding group's dropped blocks (kv_cache.py)
    are never touched. Nothing changes where every context fits in the window."""
    out = replace(meta, prefills=[])
    n = meta.num_decodes
    if n:
        if meta.decode_block_tables is not None:
            out.decode_window = window
        elif meta.decode_kv_index is not None:
            B, S = meta.decode_shape
            if window < S:
                # Head 0's rows of the flattened cache are the slots themselves.
                slots = meta.decode_kv_index.view(B, num_kv_heads, S)[:, 0]  # [B, S]
                ctx = positions[:n] + 1  # a decode row is its sequence's last position

                def slot_of(p: torch.Tensor) -> torch.Tensor:
                    return slots.gather(1, p)

                _window_decode(out, ctx, window, num_kv_heads, num_slots, slot_of)
    for seg in meta.prefills:
        if seg.kv_index is None:  # the chunk is the whole context: its own K/V
            if seg.q_len <= window:
                out.prefills.append(seg)
                continue
            qpos = torch.arange(seg.q_len)
            mask = _window_mask(qpos, qpos, window)
            out.prefills.append(PrefillSegment(seg.q_start, seg.q_len, None, mask))
            continue
        ctx_len = seg.kv_index.shape[0] // num_kv_heads
        first_q = ctx_len - seg.q_len
        lo = max(0, first_q - window + 1)  # the oldest key any query of the chunk sees
        index = seg.kv_index.view(num_kv_heads, ctx_len)[:, lo:].reshape(-1)
        mask = _window_mask(torch.arange(first_q, ctx_len), torch.arange(lo, ctx_len), window)
        out.prefills.append(PrefillSegment(seg.q_start, seg.q_len, index, mask))
    return out


def _window_mask(qpos: torch.Tensor, kpos: torch.Tensor, window: int) -> torch.Tensor:
    """[Q, K] bool: causal, and no further back than `window` positions."""
    dist = qpos.unsqueeze(1) - kpos.unsqueeze(0)  # [Q, K]
    return (dist >= 0) & (dist < window)


def _window_decode(
    meta: AttentionMetadata,
    ctx: torch.Tensor,  # [B] context lengths, the decode token included
    window: int,
    num_kv_heads: int,
    num_slots: int,
    slot_of: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Point the decode rows of `meta` at the last `window` positions of each context."""
    B = ctx.shape[0]
    W = min(window, int(ctx.max()))
    pos = (ctx - window).clamp(min=0).unsqueeze(1) + torch.arange(W)  # [B, W]
    valid = pos < ctx.unsqueeze(1)  # short contexts: fewer than W positions
    slots = slot_of(torch.where(valid, pos, 0))  # padding reads position 0, masked
    meta.decode_block_tables = meta.decode_context_lens = None
    meta.decode_kv_index = flat_kv_index(slots, num_kv_heads, num_slots)
    meta.decode_shape = (B, W)
    meta.decode_mask = None if bool(valid.all()) else torch.zeros(B, 1, 1, W).masked_fill_(
        ~valid.view(B, 1, 1, W), float("-inf"))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: PagedKV | None,  # [2, Hkv, slots, D] in the cache's dtype
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,  # Gemma 2: scores = softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [T, H, D]
    """Softcapped attention has no kernel: its decode rows must come as a gather index
    (kvloop.models.gemma2.without_decode_kernel), and it runs softcapped_sdpa.

    With a 16-bit or int8 cache, every query sees K/V as stored (rounded), its own chunk's
    included (PagedKV.write), as the native kernels do. An int8 cache's keys are stored
    rotated: SDPA then takes the queries rotated alike (the kernel rotates its own)."""
    sdpa: Callable[..., torch.Tensor] = F.scaled_dot_product_attention
    if softcap is not None:
        sdpa = partial(softcapped_sdpa, softcap=softcap)
    if kv_cache is not None and meta.slot_mapping is not None:
        k, v = kv_cache.write(meta.slot_mapping, k, v)
    qs_all = q if kv_cache is None else kv_cache.rotate_queries(q)  # q itself unless int8

    out = torch.empty_like(q)
    n = meta.num_decodes
    if n and meta.decode_block_tables is not None:
        assert kv_cache is not None and meta.decode_context_lens is not None
        assert softcap is None, "the decode kernel does not softcap"
        out[:n] = kernels.paged_decode_attention(
            q[:n], kv_cache.data, meta.decode_block_tables, meta.decode_context_lens,
            meta.block_size, scale, meta.decode_window, kv_cache.scales)  # [B, H, D]
    elif n:
        assert kv_cache is not None and meta.decode_kv_index is not None
        B, S = meta.decode_shape
        keys = kv_cache.gather(0, meta.decode_kv_index, B, S)  # [B, Hkv, S, D] fp32
        values = kv_cache.gather(1, meta.decode_kv_index, B, S)
        o = sdpa(
            qs_all[:n].unsqueeze(2), keys, values,  # q: [B, H, 1, D]
            attn_mask=meta.decode_mask, scale=scale, enable_gqa=True,
        )
        out[:n] = o.squeeze(2)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qs = qs_all[rows].transpose(0, 1).contiguous().unsqueeze(0)  # [1, H, L, D]
        if seg.kv_index is None:
            ks = k[rows].transpose(0, 1).contiguous().unsqueeze(0)  # [1, Hkv, L, D]
            vs = v[rows].transpose(0, 1).contiguous().unsqueeze(0)
            # A mask here only where a sliding window cuts the chunk (see sliding_window).
            o = sdpa(
                qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale,
                enable_gqa=True,
            )
        else:
            assert kv_cache is not None
            ctx = seg.kv_index.shape[0] // kv_cache.num_kv_heads
            ks = kv_cache.gather(0, seg.kv_index, 1, ctx)  # [1, Hkv, ctx, D] fp32
            vs = kv_cache.gather(1, seg.kv_index, 1, ctx)
            o = sdpa(qs, ks, vs, attn_mask=seg.mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def softcapped_sdpa(
    q: torch.Tensor,  # [B, H, L, D]
    k: torch.Tensor,  # [B, Hkv, S, D]
    v: torch.Tensor,  # [B, Hkv, S, D]
    attn_mask: torch.Tensor | None = None,  # [L, S] bool (True: seen) or additive float
    is_causal: bool = False,
    scale: float = 1.0,
    enable_gqa: bool = True,
    *,
    softcap: float,
) -> torch.Tensor:  # [B, H, L, D]
    """scaled_dot_product_attention's arguments, with Gemma 2's softcapping of the scores
    (HF's eager order: scale, cap, then the mask, softmax in fp32). SDPA cannot cap."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, L, S]
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        L, S = scores.shape[-2:]
        attn_mask = torch.ones(L, S, dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask)
    return scores.softmax(-1) @ v
