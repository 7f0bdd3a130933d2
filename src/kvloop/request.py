"""Request state as the scheduler and engine see it: token ids, progress, status, metrics.

No tensors here: a request is bookkeeping. The KV blocks it owns live in the KV cache
manager, its random generator in the runner, its detokenizer in the engine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvloop.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # The request's own work (or the step it ran in) raised: it ends, the engine goes on.
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
        )


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    positions_processed: int = 0  # token positions the model ran for this request
    num_preemptions: int = 0
    # Speculative decoding: draft tokens run through the model, and how many it accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # steps that verified drafts
    # Jump-forward: tokens a grammar forced that the model accepted (they ran as drafts).
    num_forced_tokens: int = 0
    # What the request made the machine do (kvloop.engine.attribution): FLOPs, and bytes
    # read: its share of each step's one read of the weights, and its KV cache.
    flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    # Weight and KV bytes of the steps after its first token: what decode_time read.
    decode_bytes: float = 0.0

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens gained per speculative step (accepted drafts + the token of the step)."""
        if not self.num_spec_steps:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_spec_steps

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival (queueing included), in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float:
        if self.first_token_time is None or self.last_token_time is None:
            return 0.0
        return self.last_token_time - self.first_token_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, in seconds."""
        if self.num_output_tokens < 2:
            return None
        return self.decode_time / (self.num_output_tokens - 1)

    @property
    def decode_tokens_per_s(self) -> float | None:
        tpot = self.tpot
        return None if not tpot else 1.0 / tpot

    @property
    def decode_bytes_per_s(self) -> float | None:
        """The bytes its decode read per second: weights (its share) and its KV cache."""
        t = self.decode_time
        return self.decode_bytes / t if t > 0 else None

    def decode_bandwidth_fraction(self, bandwidth: float) -> float | None:
        """decode_bytes_per_s as a fraction of a machine's memory bandwidth (bytes/s): how
        close its decode came to the limit a memory-bound step has."""
        rate = self.decode_bytes_per_s
        return None if rate is None or bandwidth <= 0 else rate / bandwidth

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "ttft_s": self.ttft,
            "tpot_s": self.tpot,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "e2e_latency_s": self.e2e_latency,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "cached_prompt_tokens": self.num_cached_tokens,
            "positions_processed": self.positions_processed,
            "preemptions": self.num_preemptions,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "forced_tokens": self.num_forced_tokens,
            "flops": self.flops,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "decode_bytes_per_s": self.decode_bytes_per_s,
        }


class Request:
    """One sequence being generated (a fan-out child for n > 1 is a Request of its own)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.priority = priority  # lower runs first (vLLM convention); ties: arrival order
        self.max_model_len = max_model_len
        self.status = RequestStatus.WAITING
        # Tokens whose keys/values are in the KV cache (or, without a cache, that the model
        # has seen in the current recompute pass). Advanced only by the scheduler's commit,
        # after the forward that computed them has returned.
        self.num_computed_tokens = 0
        self.metrics = RequestMetrics(num_prompt_tokens=len(prompt_token_ids))
        self.stop_reason: int | str | None = None
        # n > 1: siblings sampled from this request's first logits, then forked from it.
        self.fork_samples: list[tuple[str, SamplingParams]] = []
        # Draft tokens proposed for the next step (speculative decoding). They run after
        # the next token and are verified against the model; none is part of the output
        # until accepted.
        self.spec_token_ids: list[int] = []
        self.spec_forced = False  # the drafts are the grammar's forced tokens (jump-forward)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if not self.status.finished:
            return None
        return self.status.value

    def suppressed_token_ids(self) -> tuple[int, ...]:
        """End tokens banned while the request is still under min_tokens."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return ()
        return tuple(self.eos_token_ids) + tuple(self.params.stop_token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, "
                f"prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, "
                f"computed={self.num_computed_tokens})")
