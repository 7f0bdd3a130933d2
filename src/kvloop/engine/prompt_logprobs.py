"""A scored prompt's log-probs, gathered chunk by chunk as its prefill runs.

Kept as three small tensors (a prompt of P tokens at top k: P x (1 + 2k) numbers, 660 KB
for 4,000 tokens at top 20) rather than a Python tuple per token and per alternative,
which cost ~100 bytes each and, freed, left the heap fragmented. Python lists are made
only for the output, once the prompt is whole; the tensors go with the request.
"""

from __future__ import annotations

import torch

from kvloop.runner import PromptLogprob, PromptLogprobChunk


class PromptLogprobs:
    def __init__(self, num_prompt_tokens: int, top: int) -> None:
        self.top = top
        # Row i scores prompt token i; row 0 is never written (nothing predicts the first).
        self.logprobs = torch.zeros(num_prompt_tokens)  # [P] fp32
        self.top_ids = torch.zeros(num_prompt_tokens, top, dtype=torch.int32)  # [P, k]
        self.top_logprobs = torch.zeros(num_prompt_tokens, top)  # [P, k] fp32

    def write(self, chunk: PromptLogprobChunk) -> None:
        """Store a chunk's rows at their prompt positions (a recomputed, preempted prompt
        writes the same values to the same rows again)."""
        rows = slice(chunk.start, chunk.start + len(chunk))
        self.logprobs[rows] = chunk.logprobs
        if self.top and chunk.top_ids is not None and chunk.top_logprobs is not None:
            self.top_ids[rows] = chunk.top_ids.to(torch.int32)
            self.top_logprobs[rows] = chunk.top_logprobs

    def to_list(self) -> list[PromptLogprob | None]:
        """Per prompt token: None for the first, else (its log-prob, its top alternatives
        as (token id, log-prob) best first, or None when no alternatives were asked for)."""
        lps = self.logprobs.tolist()
        out: list[PromptLogprob | None] = [None]
        if not self.top:
            out.extend((lp, None) for lp in lps[1:])
            return out
        ids, values = self.top_ids.tolist(), self.top_logprobs.tolist()
        out.extend((lps[i], list(zip(ids[i], values[i], strict=True)))
                   for i in range(1, len(lps)))
        return out
