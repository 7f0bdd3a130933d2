"""Per-sequence output state: incremental text, stop conditions, held-back streaming text.

A stop string is never emitted, not even in part: while a sequence runs, the last
(longest stop string - 1) characters are held back, since they might begin a stop string
that the next token completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvloop.engine.detokenizer import IncrementalDetokenizer
from kvloop.request import Request, RequestStatus


@dataclass
class SeqOutputState:
    request: Request
    detok: IncrementalDetokenizer
    index: int = 0
    text: str = ""  # all decoded text (may run past a stop string until truncated)
    emitted: int = 0  # characters already handed out as deltas
    emitted_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # Structured output: the sequence's grammar matcher (llguidance), advanced per token.
    matcher: Any = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def append(self, token_id: int, logprob: float,
               top: list[tuple[int, float]] | None) -> RequestStatus | None:
        """Add a generated token; return the finished status if this token ends the sequence."""
        req, p = self.request, self.request.params
        req.output_token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.cumulative_logprob += logprob
        if p.logprobs:
            self.top_logprobs.append(top or [])
        n_out = len(req.output_token_ids)

        if not p.ignore_eos and token_id in req.eos_token_ids and n_out >= p.min_tokens:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token_id in p.stop_token_ids and n_out >= p.min_tokens:
            req.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED

        delta = self.detok.add(token_id)
        if delta:
            old_len = len(self.text)
            self.text += delta
            if p.stop and n_out >= p.min_tokens and self._check_stop_strings(old_len):
                return RequestStatus.FINISHED_STOPPED
        if n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.max_model_len is not None and req.num_tokens >= req.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _check_stop_strings(self, old_len: int) -> bool:
        # Only a match that ends in the new text is new: search from just before it.
        p = self.request.params
        start = max(0, old_len - p.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in p.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.request.stop_reason = best[1]
        return True

    def finish(self, status: RequestStatus) -> None:
        if status != RequestStatus.FINISHED_STOPPED or self.request.stop_reason is None:
            # Natural end (EOS, length, abort): flush held-back bytes of the last character.
            self.text += self.detok.flush()

    def take_delta(self, finished: bool) -> tuple[str, list[int]]:
        """Text and token ids not yet handed out; while running, hold back a possible
        stop-string prefix."""
        hold = 0 if finished else max(self.request.params.max_stop_len - 1, 0)
        end = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        ids = self.request.output_token_ids[self.emitted_tokens:]
        self.emitted_tokens = len(self.request.output_token_ids)
        return delta, ids
