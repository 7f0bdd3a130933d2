"""Speculative decoding: proposers guess a sequence's next tokens cheaply, the model verifies
them all in one forward (see kvloop.sampling.rejection), and every accepted guess is a
decode step saved.

A proposer is pure compute: token ids in, draft token ids out. It knows nothing of
requests; the engine decides who speculates and how far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvloop.spec.ngram import NgramProposer


class Proposer(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens likely to follow `token_ids` (fewer, or none, when unsure)."""
        ...


__all__ = ["NgramProposer", "Proposer"]
