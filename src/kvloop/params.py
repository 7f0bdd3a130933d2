"""SamplingParams: how one request chooses its tokens and when it stops.

Imports nothing of kvloop but its errors, so every layer can use it. Validation happens here,
once, so the Python API, the CLI and the server reject the same values with the same words.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvloop.errors import InvalidParamsError

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM / OpenAI semantics where they overlap).

    temperature 0 means greedy. ``repetition_penalty`` follows transformers (divide positive
    logits, multiply negative ones, for every token seen in prompt or output);
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI (subtract, over output tokens).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; N: plus the top N
    n: int = 1
    # Beam search (used by the engine when num_beams > 1).
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        def bad(name: str, value: object, rule: str) -> InvalidParamsError:
            return InvalidParamsError(f"{name} must be {rule}, got {value!r}",
                                      param=name.split()[0])

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "in [0, 20]")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise bad("num_beams", self.num_beams, "an integer >= 1")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", self.early_stopping, 'True, False or "never"')
        if self.num_return_sequences is not None and not (
            1 <= self.num_return_sequences <= max(self.num_beams, self.n)
        ):
            raise bad(
                "num_return_sequences", self.num_return_sequences,
                f"in [1, {max(self.num_beams, self.n)}]",
            )
        if any(not s for s in self.stop):
            raise bad("stop", self.stop, "non-empty strings")
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            for v in self.logit_bias.values():
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias values", v, "in [-100, 100]")

    @property
    def max_stop_len(self) -> int:
        """Characters of output held back so a stop string is never partly emitted."""
        return max((len(s) for s in self.stop), default=0)
