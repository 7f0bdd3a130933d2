"""Prompt lookup: propose the tokens that followed the last occurrence of the sequence's
final n tokens. No model: it pays off where the output repeats its input (edits,
summaries that quote, code that restates a signature) and costs a search when it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvloop.spec.proposer import DraftRequest


@dataclass(frozen=True)
class NgramProposer:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {self.min_n}, "
                             f"{self.max_n}")

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        return [self.lookup(r.token_ids, r.k) for r in requests]

    def release(self, seq_id: str) -> None:
        pass  # keeps nothing per sequence

    def lookup(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The `k` tokens after the latest earlier match of the longest suffix (max_n
        down to min_n tokens) that occurs earlier; [] when none does."""
        n_tokens = len(token_ids)
        if k < 1 or n_tokens < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself: ids[i:i+n] for i < L - n.
            windows = sliding_window_view(ids[:-1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: nearest context
                return [int(t) for t in ids[start:start + k]]
        return []
