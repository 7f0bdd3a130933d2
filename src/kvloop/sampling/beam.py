"""Beam search as a pure step function, with transformers' semantics.

Knows nothing of requests or KV caches: each step it takes, for every live beam, its
cumulative log-prob and its top (token, log-prob) continuations, and says which beams
live on (by parent index and new token) and which hypotheses are finished. The engine
maps that onto sequences that share KV blocks.

Matches transformers' `_beam_search` (num_beams B, 2B candidates kept per step, only the
top B candidates may finish, `length_penalty` dividing by generated-length ** penalty,
`early_stopping` True / False / "never"), so its sequences and `sequences_scores` agree.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class Hypothesis:
    token_ids: list[int]  # generated tokens (the end token included, if it ended with one)
    score: float  # cumulative log-prob / len(token_ids) ** length_penalty
    cumulative_logprob: float


@dataclass
class BeamStep:
    """What one step decided. `next_beams[i] = (parent, token, cumulative_logprob)`."""

    next_beams: list[tuple[int, int, float]]
    done: bool


@dataclass
class BeamSearch:
    num_beams: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    eos_token_ids: Collection[int] = ()
    finished: list[Hypothesis] = field(default_factory=list)
    num_generated: int = 0  # tokens each running beam has generated so far
    _improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky)

    def step(self, beams: Sequence[tuple[list[int], float, list[tuple[int, float]]]]) -> BeamStep:
        """beams[b] = (generated tokens, cumulative log-prob, top continuations), where the
        continuations hold at least 2B (token, log-prob) pairs, best first."""
        B = self.num_beams
        keep = max(2, 1 + len(self.eos_token_ids)) * B
        # Every beam's best `keep` contain the global best `keep`; order beam-major like
        # transformers' flattened [beams * vocab] top-k, best first, stable on ties.
        cands = [(score + lp, b, tok)
                 for b, (_, score, conts) in enumerate(beams) for tok, lp in conts[:keep]]
        cands.sort(key=lambda c: -c[0])
        cands = cands[:keep]
        new_len = self.num_generated + 1
        at_limit = new_len >= self.max_new_tokens
        hits = [at_limit or tok in self.eos_token_ids for _, _, tok in cands]

        # Beams to continue: the best B candidates that did not stop.
        running = [c for c, h in zip(cands, hits, strict=True) if not h][:B]
        next_beams = [(b, tok, acc) for acc, b, tok in running]

        # Finished: only the top B candidates may finish, and only while improvement is
        # possible (and, with early_stopping=True, while fewer than B are done).
        full = len(self.finished) >= B and self.early_stopping is True
        if self._improvable and not full:
            norm = new_len ** self.length_penalty
            for i, ((acc, b, tok), hit) in enumerate(zip(cands, hits, strict=True)):
                if i < B and hit:
                    self.finished.append(Hypothesis([*beams[b][0], tok], acc / norm, acc))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier ones win ties
            del self.finished[B:]
        self.num_generated = new_len

        # transformers' heuristic: can the best running beam still beat the worst finished?
        if len(self.finished) >= B and running:
            best_len = (self.max_new_tokens if self.early_stopping == "never"
                        and self.length_penalty > 0 else new_len)
            best_possible = running[0][0] / best_len ** self.length_penalty
            self._improvable = self._improvable and best_possible > self.finished[-1].score
        done = (not self._improvable or (len(self.finished) >= B and self.early_stopping is True)
                or all(hits) or not running)
        return BeamStep(next_beams, done)

    def results(self, num_return_sequences: int) -> list[Hypothesis]:
        return self.finished[:num_return_sequences]
