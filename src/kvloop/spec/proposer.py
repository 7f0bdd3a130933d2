"""The one small interface every proposer implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftRequest:
    """Draft up to `k` tokens to follow `token_ids` (the sequence's tokens so far, its
    latest, not yet run, token last)."""

    seq_id: str
    token_ids: Sequence[int]
    k: int


class Proposer(Protocol):
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Per request, up to k draft tokens (fewer, or none, when unsure); batched, so a
        model-based proposer runs one forward for all of them."""
        ...

    def release(self, seq_id: str) -> None:
        """The sequence ended: drop whatever the proposer keeps for it."""
        ...
