"""SchedulerOutput: the one contract between the scheduler (who runs) and the runner (how)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvloop.params import SamplingParams


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: which tokens to run and where their KV lives."""

    request_id: str
    # Tokens to run this step: 1 for a decode, a chunk for a prefill, and after them the
    # `num_draft` speculative tokens to verify.
    token_ids: list[int]
    start_pos: int  # position of token_ids[0]; tokens before it are already in the cache
    block_ids: list[int]  # the sequence's whole block table (empty without a cache)
    sample: bool  # sample a token after this chunk (false for a non-final prefill chunk)
    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    suppress_ids: tuple[int, ...] = ()
    # Extra sequences to sample from this same row: (id, params) of n > 1 siblings that
    # will fork from this one once its prompt is in the cache.
    fork_samples: list[tuple[str, SamplingParams]] = field(default_factory=list)
    num_draft: int = 0  # trailing draft tokens in token_ids: sample at each of them too
    # The drafts are the grammar's forced tokens (jump-forward), not a proposer's guesses:
    # counted apart from speculation's.
    forced: bool = False
    # The block tables of KV cache groups 1.. (sliding-window layers; block_ids is group
    # 0's); empty for a one-group cache. A dropped entry reads as block 0, never attended.
    group_block_ids: tuple[list[int], ...] = ()

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each
    # Several tokens each: prompt chunks, recomputes, and decodes with draft tokens.
    prefills: list[ScheduledSeq] = field(default_factory=list)
    use_cache: bool = True
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    # Sequences this step's scheduling preempted (freed, back to the queue), in order.
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_preempted(self) -> int:
        return len(self.preempted_ids)

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills
