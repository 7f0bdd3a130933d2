"""SamplingParams: how one request chooses its tokens and when it stops.

Imports nothing of kvloop but its errors, so every layer can use it. Validation happens here,
once, so the Python API, the CLI and the server reject the same values with the same words:
every error is an ``InvalidParamsError`` whose message starts with the field's name and whose
``param`` is that name (the server maps it to the request's own field name, the CLI to a flag).

The limits are what the code can represent and what means something, not taste: a value
outside them used to crash or hang the engine mid-step (taking every other request with it)
or to give silently wrong output, so it is refused before anything is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvloop.errors import InvalidParamsError

_GREEDY_EPS = 1e-5

# Integers the engine keeps in int32/int64 tensors or loops over: far above any real use.
MAX_INT32 = 2**31 - 1
# Seeds are the signed 64-bit range. torch.Generator takes [-2**63, 2**64) and maps a negative
# seed s to s + 2**64; keeping seeds below 2**63 means no two accepted seeds share a stream, and
# leaves room for the engine's per-sibling seeds (seed + i, i < n <= MAX_N).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # samples per request (each a sequence with its own KV blocks)
MAX_BEAMS = 128
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_LOGIT_BIAS = 1024  # entries; each costs a scatter per step
MAX_STOP_TOKEN_IDS = 1024
MAX_SPECULATIVE_TOKENS = 16  # drafts per step: more only wastes rows when guesses miss
MAX_TEMPERATURE = 100.0  # logits / 100 is already uniform to within float error
# transformers-style repetition penalty multiplies or divides a logit by it: at 0.01..100 a
# float32 logit stays finite; at 1e-300 positive logits became inf and softmax gave NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# The beam score divides by generated_length ** length_penalty; at |penalty| <= 10 that stays
# a finite float for any length below 2**31 (1e308 overflowed the beam step).
LENGTH_PENALTY_RANGE = (-10.0, 10.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency, OpenAI's range


def _bad(name: str, value: object, rule: str, param: str | None = None) -> InvalidParamsError:
    return InvalidParamsError(f"{name} must be {rule}, got {_shown(value)}", param=param or name)


def _check_int(name: str, value: object, lo: int, hi: int, param: str | None = None) -> None:
    # bool is an int subclass, but `n=True` is a mistake, not a count of 1.
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(name, value, f"an integer >= {lo} and <= {hi}", param)


def _check_float(name: str, value: object, lo: float, hi: float, *,
                 lo_open: bool = False, param: str | None = None) -> None:
    """A real number in [lo, hi] (or (lo, hi]): NaN and ±inf never pass. Ints are compared
    exactly, so 10**400 is refused rather than overflowing a float conversion."""
    rule = (f"a finite number in ({lo:g}, {hi:g}]" if lo_open
            else f"a finite number >= {lo:g} and <= {hi:g}")
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not math.isfinite(value))
            or not (lo < value if lo_open else lo <= value) or not value <= hi):
        raise _bad(name, value, rule, param)


MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar's text; compiled per request
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutput:
    """Constrain the output to a language: exactly one of a JSON schema (a dict or its
    text), any JSON object, a regular expression, a choice of strings, or a context-free
    grammar in Lark syntax (llguidance's dialect)."""

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def validate(self) -> None:
        given = [name for name, v in (("json_schema", self.json_schema),
                                      ("json_object", self.json_object or None),
                                      ("regex", self.regex), ("choice", self.choice),
                                      ("grammar", self.grammar)) if v is not None]
        if len(given) != 1:
            raise InvalidParamsError(
                f"structured output takes exactly one of json_schema, json_object, regex, "
                f"choice or grammar, got {given or 'none'}", param="structured")
        if not isinstance(self.json_object, bool):
            raise _bad("structured.json_object", self.json_object, "true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value
                                      or len(value) > MAX_GRAMMAR_CHARS):
                raise _bad(f"structured.{name}", value,
                           f"a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not 1 <= len(self.choice) <= MAX_CHOICES
                or any(not isinstance(c, str) or not c for c in self.choice)):
            raise _bad("structured.choice", self.choice,
                        f"a list of 1 to {MAX_CHOICES} non-empty strings")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str)):
            raise _bad("structured.json_schema", self.json_schema, "a JSON schema object")


@dataclass
class SamplingParams:
    """Per-request decoding parameters (vLLM / OpenAI semantics where they overlap).

    temperature 0 means greedy. ``repetition_penalty`` follows transformers (divide positive
    logits, multiply negative ones, for every token seen in prompt or output);
    ``presence_penalty`` / ``frequency_penalty`` follow OpenAI (subtract, over output tokens).

    Accepted values (anything else raises ``InvalidParamsError`` naming the field):

    - ``max_tokens`` int in [1, 2**31-1] (the engine also caps it by the context);
      ``min_tokens`` int in [0, max_tokens].
    - ``temperature`` in [0, 100]; ``top_k`` int in [0, 2**31-1] (-1 means 0: off; a k larger
      than the vocabulary cuts nothing); ``top_p`` in (0, 1]; ``min_p`` in [0, 1].
    - ``repetition_penalty`` in [0.01, 100]; ``presence_penalty`` and ``frequency_penalty``
      in [-2, 2]; ``logit_bias`` at most 1024 entries, ids in [0, 2**31), biases in
      [-100, 100] (the engine checks ids against the vocabulary).
    - ``seed`` None or an int in [-2**63, 2**63-1]. A negative seed is a fixed seed like any
      other (not "random", as -1 is in llama.cpp).
    - ``stop`` non-empty strings; ``stop_token_ids`` at most 1024 ints in [0, 2**31) (checked
      against the vocabulary by the engine).
    - ``logprobs`` None or int in [0, 20]; ``n`` int in [1, 128].
    - Beam search: ``num_beams`` int in [1, 128]; ``length_penalty`` in [-10, 10];
      ``early_stopping`` True, False or "never"; ``num_return_sequences`` None or an int in
      [1, num_beams].

    Every float must be finite, and bools are not numbers here. Beam search ranks the model's
    raw log-probabilities, so the fields it cannot honour are refused with ``num_beams > 1``
    rather than silently ignored: stop strings and ids, min_tokens, logit_bias, the three
    penalties, temperature other than 0 or 1, top_k, top_p, min_p, logprobs and n > 1 (ask
    for num_return_sequences instead). The beam-only fields (length_penalty, early_stopping,
    num_return_sequences) are likewise refused when set without beams.
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
    # The same for every prompt token after the first (scoring a text: max_tokens may then
    # be 0, to score the prompt alone).
    prompt_logprobs: int | None = None
    n: int = 1
    # Beam search (used by the engine when num_beams > 1).
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    # Speculative decoding, where the engine has a proposer: False opts this request out;
    # num_speculative_tokens caps its drafts per step (None: the engine's setting).
    speculative: bool = True
    num_speculative_tokens: int | None = None
    # Constrained decoding: the output follows this schema / regex / choice / grammar.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop, (str, bytes)) or not _is_iterable(self.stop):
            raise _bad("stop", self.stop, "a string or a list of strings")
        self.stop = list(self.stop)
        if not _is_iterable(self.stop_token_ids) or isinstance(self.stop_token_ids,
                                                                (str, bytes)):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of token ids")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        """Raise InvalidParamsError for the first field the engine cannot honour.

        Runs on construction and again when the engine admits the request (the dataclass is
        mutable, so a caller may have changed a field since)."""
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        # max_tokens 0 only scores the prompt: it means something only with prompt_logprobs.
        _check_int("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1,
                   MAX_INT32)
        _check_int("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, 0, MAX_INT32)  # -1 became 0 in __post_init__
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _check_float("presence_penalty", self.presence_penalty, *PENALTY_RANGE)
        _check_float("frequency_penalty", self.frequency_penalty, *PENALTY_RANGE)
        self._validate_logit_bias()
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        if not isinstance(self.stop, list) or any(
                not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", self.stop, "a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or len(
                self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad("stop_token_ids", self.stop_token_ids,
                       f"a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids items", t, 0, MAX_INT32, param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "true or false")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_int("n", self.n, 1, MAX_N)
        _check_int("num_beams", self.num_beams, 1, MAX_BEAMS)
        _check_float("length_penalty", self.length_penalty, *LENGTH_PENALTY_RANGE)
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise _bad("early_stopping", self.early_stopping, 'True, False or "never"')
        if self.num_return_sequences is not None:
            _check_int("num_return_sequences", self.num_return_sequences, 1, self.num_beams)
        if not isinstance(self.speculative, bool):
            raise _bad("speculative", self.speculative, "true or false")
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0,
                       MAX_SPECULATIVE_TOKENS)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise _bad("structured", self.structured, "a StructuredOutput")
            self.structured.validate()
        if self.num_beams > 1:
            self._validate_beam_combination()
        else:
            self._validate_no_beam_fields()

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", self.logit_bias,
                       f"a mapping of at most {MAX_LOGIT_BIAS} token ids to biases")
        bias: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            # JSON object keys arrive as strings ("50256"): accept decimal ids, nothing else.
            key = int(k) if isinstance(k, str) and k.strip().lstrip("-").isdecimal() else k
            _check_int("logit_bias keys", key, 0, MAX_INT32, param="logit_bias")
            _check_float("logit_bias values", v, *LOGIT_BIAS_RANGE, param="logit_bias")
            bias[key] = float(v)
        self.logit_bias = bias or None

    def _validate_beam_combination(self) -> None:
        """Beam search keeps the top 2B raw log-probabilities each step and nothing else:
        a field that would change which tokens are possible or how they score is refused."""
        unsupported = [
            ("n", self.n != 1, "ask for num_return_sequences instead"),
            ("stop", bool(self.stop), ""),
            ("stop_token_ids", bool(self.stop_token_ids), ""),
            ("min_tokens", self.min_tokens != 0, ""),
            ("logit_bias", bool(self.logit_bias), ""),
            ("repetition_penalty", self.repetition_penalty != 1.0, ""),
            ("presence_penalty", self.presence_penalty != 0.0, ""),
            ("frequency_penalty", self.frequency_penalty != 0.0, ""),
            # 1 is the default (and the raw distribution beams rank); 0 asks for no sampling.
            ("temperature", self.temperature not in (0.0, 1.0), "leave it at 1 (or 0)"),
            ("top_k", self.top_k != 0, ""),
            ("top_p", self.top_p != 1.0, ""),
            ("min_p", self.min_p != 0.0, ""),
            ("logprobs", self.logprobs is not None, ""),
            ("prompt_logprobs", self.prompt_logprobs is not None, ""),
            ("structured", self.structured is not None, ""),
        ]
        for name, is_set, hint in unsupported:
            if is_set:
                value = getattr(self, name)
                raise InvalidParamsError(
                    f"{name} is not supported with beam search (num_beams "
                    f"{self.num_beams}), got {_shown(value)}" + (f": {hint}" if hint else ""),
                    param=name)

    def _validate_no_beam_fields(self) -> None:
        """length_penalty, early_stopping and num_return_sequences > 1 only mean something
        with num_beams > 1; without beams they would be silently ignored."""
        for name, is_set in (("length_penalty", self.length_penalty != 1.0),
                             ("early_stopping", self.early_stopping is not False),
                             ("num_return_sequences", (self.num_return_sequences or 1) != 1)):
            if is_set:
                raise InvalidParamsError(
                    f"{name} only applies to beam search (num_beams > 1), got "
                    f"{_shown(getattr(self, name))}", param=name)

    def sibling_seed(self, i: int) -> int | None:
        """The seed of sample i of an n > 1 request: seed + i, wrapped into the seed range so
        that a seed near the top still gives n valid, distinct seeds (None when unseeded)."""
        if self.seed is None:
            return None
        span = SEED_MAX - SEED_MIN + 1
        return (self.seed + i - SEED_MIN) % span + SEED_MIN

    @property
    def max_stop_len(self) -> int:
        """Characters of output held back so a stop string is never partly emitted."""
        return max((len(s) for s in self.stop), default=0)


def prompt_logprobs_entries(num_prompt_tokens: int, top: int) -> int:
    """What scoring a prompt costs the answer: one entry per prompt token per log-prob it
    carries (its own counts as one when no top alternatives are asked for)."""
    return num_prompt_tokens * max(top, 1)


def check_prompt_logprobs(num_prompt_tokens: int, top: int | None, limit: int) -> None:
    """InvalidParamsError (param "prompt_logprobs") when prompt tokens x top log-probs is
    above `limit`: the engine's per-request cap (EngineConfig.max_prompt_logprobs). The
    answer grows with that product (about 30 bytes of JSON an entry), so it is bounded
    before anything is queued. `top` None: nothing asked for, nothing to check."""
    if top is None:
        return
    entries = prompt_logprobs_entries(num_prompt_tokens, top)
    if entries > limit:
        raise InvalidParamsError(
            f"prompt_logprobs: {num_prompt_tokens} prompt tokens x {max(top, 1)} log-probs "
            f"= {entries} entries, above the limit of {limit} (max_prompt_logprobs); ask for "
            f"fewer top log-probs or send a shorter prompt", param="prompt_logprobs")


def _is_iterable(value: object) -> bool:
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _shown(value: object, limit: int = 60) -> str:
    """The value's repr, cut short so an error line stays one readable line (a 10**400 or a
    list of a thousand ids would otherwise fill the screen, or a log)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
