"""Sampling: logits in, token ids (and log-probs) out, batched, one row per sequence.

Knows nothing of models or requests beyond :class:`kvloop.params.SamplingParams`.
"""

from kvloop.sampling.processors import (
    apply_logit_bias,
    apply_min_p,
    apply_min_tokens,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_p,
    token_counts,
)
from kvloop.sampling.sampler import Sampler, SamplerOutput, SamplingRow

__all__ = [
    "Sampler",
    "SamplerOutput",
    "SamplingRow",
    "apply_logit_bias",
    "apply_min_p",
    "apply_min_tokens",
    "apply_presence_frequency_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_top_p",
    "apply_top_p",
    "token_counts",
]
