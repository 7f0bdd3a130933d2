"""Logits processors: small batched functions over ``[B, V]`` logits, one row per sequence.

Every function is pure: it returns a new tensor and never writes into its input, so the sampler
can still read the caller's raw logits for log-probs after processing. Per-row parameters come as
``[B]`` tensors whose neutral value (penalty 1, presence/frequency 0, temperature 1, top_k 0,
top_p 1, min_p 0) leaves that row exactly as it was, so one call serves a batch in which only
some rows use a control. The sampler skips a function entirely when no row uses it.

Semantics follow Hugging Face transformers' logits processors (``TopKLogitsWarper`` keeps ties
at the k-th value, ``TopPLogitsWarper`` drops tokens whose ascending cumulative probability is
``<= 1 - top_p``, ``MinPLogitsWarper`` compares with ``min_p * max_prob``) and OpenAI's for the
presence/frequency penalties. Every filter keeps the most likely token, so a row never ends up
with nothing to sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_NEG_INF = float("-inf")


def token_counts(
    ids_per_row: Sequence[Sequence[int]], vocab_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """How often each token id occurs in each row's id list: ``[B, V]``.

    Ids outside ``[0, vocab_size)`` are dropped: a token the model cannot emit (an embedding
    table larger than the output head) has no logit to penalise.
    """
    counts = torch.zeros(len(ids_per_row), vocab_size, dtype=dtype)  # [B, V]
    lengths = [len(ids) for ids in ids_per_row]
    if sum(lengths) == 0:
        return counts
    cols = torch.as_tensor([t for ids in ids_per_row for t in ids], dtype=torch.long)  # [N]
    rows = torch.repeat_interleave(torch.arange(len(ids_per_row)), torch.as_tensor(lengths))
    ok = (cols >= 0) & (cols < vocab_size)
    rows, cols = rows[ok], cols[ok]
    counts.index_put_((rows, cols), torch.ones(rows.numel(), dtype=dtype), accumulate=True)
    return counts


def unpack_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, W] int32 bitmasks (bit t % 32 of word t // 32 set: token t allowed) -> [B, V]
    bool. numpy's unpackbits over the little-endian bytes: ~10 us for a 49k vocabulary,
    where shifting int32 words in torch took ~40."""
    packed = bits.contiguous().numpy().view(np.uint8)  # [B, 4W], bit t % 8 of byte t // 8
    unpacked = np.unpackbits(packed, axis=-1, count=vocab_size, bitorder="little")  # [B, V]
    return torch.from_numpy(unpacked).view(torch.bool)


def apply_allowed_mask(
    logits: torch.Tensor, row_idx: torch.Tensor, bits: torch.Tensor
) -> torch.Tensor:
    """Set to -inf every token that rows ``row_idx`` do not allow.

    row_idx: ``[M]`` int64; bits: ``[M, W]`` int32 bitmasks (see unpack_bitmask). One
    ``where`` per masked row writes the output directly (no gather and scatter of rows).
    A row whose mask allows every token (free text inside a JSON string) is left alone:
    the masking pass costs ~1 ms per 32 rows of a 49k vocabulary here."""
    V = logits.shape[-1]
    full_words = V // 32
    tail = V % 32
    everything = (bits[:, :full_words] == -1).all(dim=1)  # [M]
    if tail:
        want = (1 << tail) - 1
        everything &= (bits[:, full_words] & want) == want
    if bool(everything.any()):
        keep = ~everything
        if not bool(keep.any()):
            return logits
        row_idx, bits = row_idx[keep], bits[keep]
    allowed = unpack_bitmask(bits, V)  # [M, V]
    neg_inf = logits.new_full((), _NEG_INF)
    if row_idx.numel() == logits.shape[0] and bool(
            (row_idx == torch.arange(logits.shape[0])).all()):
        return torch.where(allowed, logits, neg_inf)
    out = logits.clone()
    for j, r in enumerate(row_idx.tolist()):
        torch.where(allowed[j], logits[r], neg_inf, out=out[r])
    return out


def apply_logit_bias(
    logits: torch.Tensor, row_idx: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Add ``bias[n]`` to ``logits[row_idx[n], token_ids[n]]`` (sparse: a few ids per row).

    row_idx, token_ids: ``[N]`` int64; bias: ``[N]`` float. Ids must lie in ``[0, V)``.
    """
    return logits.index_put((row_idx, token_ids), bias.to(logits.dtype), accumulate=True)


def apply_min_tokens(
    logits: torch.Tensor, row_idx: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Ban ``token_ids[n]`` in row ``row_idx[n]`` (set to -inf).

    The engine decides what to ban: EOS and stop ids while a request is under ``min_tokens``.
    Ids outside ``[0, V)`` are ignored, since the model cannot produce them anyway.
    """
    ok = (token_ids >= 0) & (token_ids < logits.shape[-1])
    ninf = torch.full((int(ok.sum()),), _NEG_INF, dtype=logits.dtype)
    return logits.index_put((row_idx[ok], token_ids[ok]), ninf)


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """transformers' repetition penalty (CTRL paper): for every seen token, a positive logit is
    divided by the penalty and a negative one multiplied, so penalty > 1 always lowers it.

    seen: ``[B, V]`` bool, tokens in the prompt or the output; penalty: ``[B]``.
    """
    p = penalty.to(logits.dtype).unsqueeze(1)  # [B, 1]
    penalised = torch.where(logits < 0, logits * p, logits / p)  # [B, V]
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, output_counts: torch.Tensor, presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's penalties: ``logit -= presence * (count > 0) + frequency * count``.

    output_counts: ``[B, V]``, counts over OUTPUT tokens only (the prompt does not count);
    presence, frequency: ``[B]``.
    """
    counts = output_counts.to(logits.dtype)  # [B, V]
    pres = presence.to(logits.dtype).unsqueeze(1)  # [B, 1]
    freq = frequency.to(logits.dtype).unsqueeze(1)  # [B, 1]
    return logits - pres * (counts > 0).to(logits.dtype) - freq * counts


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (``[B]``, > 0; greedy rows never come here)."""
    return logits / temperature.to(logits.dtype).unsqueeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's.

    min_p: ``[B]`` in [0, 1]; 0 keeps everything. The top token always passes (its probability
    is the max, and min_p <= 1), so no row is emptied.
    """
    probs = logits.softmax(dim=-1)  # [B, V]
    threshold = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (and any tied with the k-th); 0 disables.

    Uses one ``torch.topk`` of the largest k in the batch: a partial selection, never a sort
    of the whole vocabulary.
    """
    k = top_k.clamp(max=logits.shape[-1])  # [B]
    k_max = int(k.max())
    if k_max <= 0:
        return logits
    top_vals = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
    kth = top_vals.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    kth = kth.masked_fill((k <= 0).unsqueeze(1), _NEG_INF)  # rows without top-k keep all
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose mass reaches top_p.

    top_p: ``[B]`` in (0, 1]; 1 disables. This sorts the whole vocabulary; the sampler uses
    :func:`apply_top_k_top_p` instead, which avoids that when top-k is also set.
    """
    sorted_logits, order = logits.sort(dim=-1)  # [B, V], ascending
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    remove_sorted = cum <= _drop_mass(top_p).unsqueeze(1)  # [B, V]
    remove_sorted[:, -1] = False  # the most likely token always stays
    remove = remove_sorted.scatter(1, order, remove_sorted)  # back to vocabulary order
    return logits.masked_fill(remove, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then top-p over what top-k kept (transformers' and vLLM's order).

    When every row that uses top-p also uses top-k, top-p only needs the top-k candidates, which
    ``torch.topk`` already returns in order: no full-vocabulary sort. Otherwise (top-p without
    top-k somewhere in the batch, or ties at the k-th value that make top-k keep more than k
    tokens) it falls back to :func:`apply_top_k` then :func:`apply_top_p`.
    """
    V = logits.shape[-1]
    k = top_k.clamp(min=0, max=V)  # [B]
    p_on = top_p < 1.0  # [B]
    if not bool(p_on.any()):
        return apply_top_k(logits, k)
    if bool((p_on & (k == 0)).any()):
        return apply_top_p(apply_top_k(logits, k), top_p)

    k_max = int(k.max())
    vals, idx = logits.topk(k_max, dim=-1)  # [B, k_max] each, descending
    kth = vals.gather(1, (k - 1).clamp(min=0).unsqueeze(1))  # [B, 1]
    # Top-k keeps every token tied with the k-th value; if that is more than k finite tokens,
    # the candidate list is incomplete. Rare (exact float ties), so take the general path.
    kept_by_k = ((logits >= kth) & (logits > _NEG_INF)).sum(dim=-1)  # [B]
    if bool(((kept_by_k > k) & (k > 0)).any()):
        return apply_top_p(apply_top_k(logits, k), top_p)

    pos = torch.arange(k_max)  # [k_max]
    beyond_k = pos.unsqueeze(0) >= k.unsqueeze(1)  # [B, k_max]: outside this row's own k
    cand = vals.masked_fill(beyond_k, _NEG_INF)  # [B, k_max]
    # Ascending order, as transformers accumulates, so boundary decisions match it.
    cum = cand.flip(-1).softmax(dim=-1).cumsum(dim=-1)  # [B, k_max], ascending
    remove_asc = cum <= _drop_mass(top_p).unsqueeze(1)
    remove_asc[:, -1] = False  # the most likely token always stays
    remove_cand = remove_asc.flip(-1) | beyond_k  # [B, k_max], descending order again
    keep = torch.zeros(logits.shape, dtype=torch.bool).scatter(1, idx, ~remove_cand)  # [B, V]
    keep |= (k == 0).unsqueeze(1)  # here k == 0 implies top_p == 1: the row is untouched
    return logits.masked_fill(~keep, _NEG_INF)


def _drop_mass(top_p: torch.Tensor) -> torch.Tensor:
    """Cumulative (ascending) mass at or below which top-p drops a token: ``1 - top_p``.

    Rows with top_p >= 1 get -1 so they drop nothing, not even tokens whose probability has
    underflowed to exactly 0.
    """
    p = top_p.to(torch.float32)
    return torch.where(p < 1.0, 1.0 - p, torch.full_like(p, -1.0))
