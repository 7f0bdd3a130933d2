"""What each request costs the machine: the FLOPs it made the model do and the bytes it made
it read, step by step, so that a request's figures say where its time went (the roofline of
kvloop.roofline, per request instead of per model).

A step reads the weights once for every sequence in it: that read is shared, and each
sequence is charged its share by the positions it ran (a 500-token prefill chunk beside a
one-token decode pays 500/501 of it). Its own KV cache, read by its attention, and the
FLOPs of its positions are its alone. Over a run the shares add up to the weight bytes the
engine read: `LLMEngine.weight_bytes_read`.

    costs = ModelCosts.of(model.config, model.decode_read_bytes(), kv_bytes_per_token)
    for seq, cost in zip(sched.seqs, costs.step(sched.seqs)): ...
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvloop.batch import ScheduledSeq
from kvloop.config import ModelConfig


@dataclass(frozen=True, slots=True)
class SeqCost:
    """One sequence's share of one step."""

    flops: float
    weight_bytes: float  # its share of the step's one read of the weights
    kv_bytes: float  # its cache, read by its attention


@dataclass(frozen=True)
class ModelCosts:
    """The per-step costs of a loaded model, as the roofline counts them."""

    weight_bytes: int  # read once a step, whatever its batch (the model's decode_read_bytes)
    kv_bytes_per_token: int  # K and V of one position over every layer, as stored
    layer_flops_per_token: float  # 2 x the decoder layers' parameters
    head_flops_per_row: float  # 2 x the head's: only sampled rows reach it
    attn_flops_per_pair: float  # QK^T and PV of one (query, key) pair over every layer

    @classmethod
    def of(cls, c: ModelConfig, weight_bytes: int, kv_bytes_per_token: int) -> ModelCosts:
        return cls(weight_bytes, kv_bytes_per_token,
                   layer_flops_per_token=2.0 * c.num_layers * c.layer_matrix_params,
                   head_flops_per_row=2.0 * c.vocab_size * c.hidden_size,
                   attn_flops_per_pair=4.0 * c.num_layers * c.num_heads * c.head_dim)

    def step(self, seqs: Sequence[ScheduledSeq]) -> list[SeqCost]:
        """Each scheduled sequence's cost (in `seqs` order). Attention is counted over the
        whole context (a sliding window reads less: an upper bound there), as
        kvloop.roofline counts the cache."""
        total = sum(s.num_tokens for s in seqs)
        out = []
        for s in seqs:
            n, start = s.num_tokens, s.start_pos
            pairs = n * start + n * (n + 1) // 2  # query i sees positions 0..start + i
            rows = s.num_draft + (1 if s.sample else 0)  # the rows sampled: the head's
            flops = (self.layer_flops_per_token * n + self.head_flops_per_row * rows
                     + self.attn_flops_per_pair * pairs)
            out.append(SeqCost(flops, self.weight_bytes * n / total,
                               float(self.kv_bytes_per_token * (start + n))))
        return out
