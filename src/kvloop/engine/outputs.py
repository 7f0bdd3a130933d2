"""What the engine hands back: per-sequence completions grouped per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.request import RequestMetrics


@dataclass
class CompletionOutput:
    """One sequence's output. While the request runs, an output carries only what is new
    since the previous one (the delta_* fields); the final output (RequestOutput.finished)
    also carries the whole text, token ids and log-probs."""

    index: int
    text: str
    token_ids: list[int]
    # "stop" | "length" | "abort" | "error" | None while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None  # chosen tokens' logprobs, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cumulative_logprob: float = 0.0
    score: float | None = None  # beam search: transformers' sequences_scores convention
    delta: str = ""  # text added since the previous output of this request (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    # Log-probs of delta_token_ids (None when not asked for), like logprobs/top_logprobs.
    delta_logprobs: list[float] | None = None
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when the request failed (its own work or its step's forward raised): the request
    # is finished and this says why; other requests were not affected.
    error: str | None = None
    # With SamplingParams.prompt_logprobs: per prompt token, its log-prob under the model
    # and its top alternatives (None for the first token, which nothing predicts). In the
    # output of the step that finished the prompt, and in the final output.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]] | None] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text
