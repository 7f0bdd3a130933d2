"""SamplingParams validation: every value the engine cannot represent or honour is refused
on construction with one InvalidParamsError naming the field; every boundary is accepted.

These are the words the Python API, the CLI and the HTTP server all report (the server builds
SamplingParams and maps the error's `param` to its own field name)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvloop.errors import InvalidParamsError
from kvloop.params import (
    LENGTH_PENALTY_RANGE,
    MAX_BEAMS,
    MAX_INT32,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)

NAN, INF = float("nan"), float("inf")

# (case id, kwargs, the param the error must name)
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    # integers the engine cannot represent (issue 10, item 1)
    ("seed 2**70", {"seed": 2**70}, "seed"),
    ("seed 2**63", {"seed": 2**63}, "seed"),
    ("seed below -2**63", {"seed": -(2**63) - 1}, "seed"),
    ("seed float", {"seed": 1.5}, "seed"),
    ("seed bool", {"seed": True}, "seed"),
    ("top_k 2**63", {"top_k": 2**63}, "top_k"),
    ("top_k 2**31", {"top_k": 2**31}, "top_k"),
    ("top_k -2", {"top_k": -2}, "top_k"),
    ("top_k float", {"top_k": 5.0}, "top_k"),
    ("stop_token_ids 2**70", {"stop_token_ids": [2**70]}, "stop_token_ids"),
    ("stop_token_ids 2**31", {"stop_token_ids": [3, 2**31]}, "stop_token_ids"),
    ("stop_token_ids negative", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("stop_token_ids bool", {"stop_token_ids": [True]}, "stop_token_ids"),
    ("stop_token_ids str", {"stop_token_ids": "12"}, "stop_token_ids"),
    ("stop_token_ids too many", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
     "stop_token_ids"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens 2**31", {"max_tokens": 2**31}, "max_tokens"),
    ("max_tokens bool", {"max_tokens": True}, "max_tokens"),
    ("max_tokens float", {"max_tokens": 4.0}, "max_tokens"),
    ("min_tokens -1", {"min_tokens": -1}, "min_tokens"),
    ("min_tokens > max_tokens", {"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ("n 0", {"n": 0}, "n"),
    ("n bool", {"n": True}, "n"),
    ("n above cap", {"n": MAX_N + 1}, "n"),
    ("num_beams 0", {"num_beams": 0}, "num_beams"),
    ("num_beams -3", {"num_beams": -3}, "num_beams"),
    ("num_beams above cap", {"num_beams": MAX_BEAMS + 1}, "num_beams"),
    ("num_beams bool", {"num_beams": True}, "num_beams"),
    ("logprobs 21", {"logprobs": 21}, "logprobs"),
    ("logprobs -1", {"logprobs": -1}, "logprobs"),
    ("logprobs bool", {"logprobs": True}, "logprobs"),
    ("ignore_eos int", {"ignore_eos": 1}, "ignore_eos"),
    # floats: finite and in a meaningful range (items 1 and 8)
    ("temperature nan", {"temperature": NAN}, "temperature"),
    ("temperature inf", {"temperature": INF}, "temperature"),
    ("temperature negative", {"temperature": -0.1}, "temperature"),
    ("temperature above cap", {"temperature": MAX_TEMPERATURE * 1.01}, "temperature"),
    ("temperature huge int", {"temperature": 10**400}, "temperature"),
    ("temperature bool", {"temperature": True}, "temperature"),
    ("temperature str", {"temperature": "0.5"}, "temperature"),
    ("top_p nan", {"top_p": NAN}, "top_p"),
    ("top_p 0", {"top_p": 0.0}, "top_p"),
    ("top_p above 1", {"top_p": 1.0001}, "top_p"),
    ("min_p nan", {"min_p": NAN}, "min_p"),
    ("min_p negative", {"min_p": -0.1}, "min_p"),
    ("repetition_penalty 1e-300", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("repetition_penalty 0", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("repetition_penalty nan", {"repetition_penalty": NAN}, "repetition_penalty"),
    ("repetition_penalty inf", {"repetition_penalty": INF}, "repetition_penalty"),
    ("repetition_penalty above cap", {"repetition_penalty": 100.5}, "repetition_penalty"),
    ("presence_penalty nan", {"presence_penalty": NAN}, "presence_penalty"),
    ("presence_penalty 2.5", {"presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty -inf", {"frequency_penalty": -INF}, "frequency_penalty"),
    ("frequency_penalty -2.5", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("logit_bias value nan", {"logit_bias": {5: NAN}}, "logit_bias"),
    ("logit_bias value inf", {"logit_bias": {5: INF}}, "logit_bias"),
    ("logit_bias value 101", {"logit_bias": {5: 101.0}}, "logit_bias"),
    ("logit_bias key 2**70", {"logit_bias": {2**70: 1.0}}, "logit_bias"),
    ("logit_bias key negative", {"logit_bias": {-1: 1.0}}, "logit_bias"),
    ("logit_bias key str", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ("logit_bias key bool", {"logit_bias": {True: 1.0}}, "logit_bias"),
    ("logit_bias key superscript", {"logit_bias": {"\u00b2": 1.0}}, "logit_bias"),
    ("stop None", {"stop": None}, "stop"),
    ("stop_token_ids None", {"stop_token_ids": None}, "stop_token_ids"),
    ("logit_bias too many", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
     "logit_bias"),
    ("logit_bias not a dict", {"logit_bias": [1, 2]}, "logit_bias"),
    ("length_penalty 1e308", {"num_beams": 2, "length_penalty": 1e308}, "length_penalty"),
    ("length_penalty nan", {"num_beams": 2, "length_penalty": NAN}, "length_penalty"),
    ("length_penalty -11", {"num_beams": 2, "length_penalty": -11.0}, "length_penalty"),
    # other shapes
    ("stop empty string", {"stop": [""]}, "stop"),
    ("stop not a string", {"stop": ["x", 3]}, "stop"),
    ("stop int", {"stop": 3}, "stop"),
    ("early_stopping 1", {"num_beams": 2, "early_stopping": 1}, "early_stopping"),
    ("early_stopping str", {"num_beams": 2, "early_stopping": "always"}, "early_stopping"),
    ("num_return_sequences > num_beams", {"num_beams": 3, "num_return_sequences": 4},
     "num_return_sequences"),
    ("num_return_sequences 0", {"num_beams": 3, "num_return_sequences": 0},
     "num_return_sequences"),
    # beam search cannot honour these: refused, no longer silently ignored (item 8)
    ("beams + n", {"num_beams": 2, "n": 2}, "n"),
    ("beams + stop", {"num_beams": 2, "stop": ["x"]}, "stop"),
    ("beams + stop_token_ids", {"num_beams": 2, "stop_token_ids": [3]}, "stop_token_ids"),
    ("beams + min_tokens", {"num_beams": 2, "min_tokens": 1}, "min_tokens"),
    ("beams + logit_bias", {"num_beams": 2, "logit_bias": {3: 1.0}}, "logit_bias"),
    ("beams + repetition_penalty", {"num_beams": 2, "repetition_penalty": 1.3},
     "repetition_penalty"),
    ("beams + presence_penalty", {"num_beams": 2, "presence_penalty": 0.5}, "presence_penalty"),
    ("beams + frequency_penalty", {"num_beams": 2, "frequency_penalty": 0.5},
     "frequency_penalty"),
    ("beams + temperature", {"num_beams": 2, "temperature": 0.7}, "temperature"),
    ("beams + top_k", {"num_beams": 2, "top_k": 5}, "top_k"),
    ("beams + top_p", {"num_beams": 2, "top_p": 0.9}, "top_p"),
    ("beams + min_p", {"num_beams": 2, "min_p": 0.1}, "min_p"),
    ("beams + logprobs", {"num_beams": 3, "logprobs": 2}, "logprobs"),
    ("beams + logprobs 0", {"num_beams": 3, "logprobs": 0}, "logprobs"),
    # beam-only fields without beams would be ignored just as silently
    ("length_penalty without beams", {"length_penalty": 2.0}, "length_penalty"),
    ("early_stopping without beams", {"early_stopping": True}, "early_stopping"),
    ("num_return_sequences without beams", {"n": 2, "num_return_sequences": 2},
     "num_return_sequences"),
]


@pytest.mark.parametrize(("kwargs", "param"), [(k, p) for _, k, p in REFUSED],
                         ids=[name for name, _, _ in REFUSED])
def test_bad_value_is_refused_naming_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParamsError) as info:
        SamplingParams(**kwargs)
    err = info.value
    assert err.param == param
    msg = str(err)
    assert msg.startswith(param), msg  # the same words lead for API, CLI and HTTP
    assert "\n" not in msg and len(msg) < 300, msg


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("defaults", {}),
    ("seed min", {"seed": SEED_MIN}),
    ("seed max", {"seed": SEED_MAX}),
    ("seed 0", {"seed": 0}),
    ("seed -1", {"seed": -1}),
    ("top_k max", {"top_k": MAX_INT32}),
    ("top_k -1 disables", {"top_k": -1}),
    ("stop_token_ids bounds", {"stop_token_ids": [0, MAX_INT32]}),
    ("stop_token_ids cap", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}),
    ("max_tokens max", {"max_tokens": MAX_INT32, "min_tokens": MAX_INT32}),
    ("n max", {"n": MAX_N}),
    ("temperature 0", {"temperature": 0}),
    ("temperature max", {"temperature": MAX_TEMPERATURE}),
    ("top_p tiny", {"top_p": 1e-9}),
    ("min_p 1", {"min_p": 1.0}),
    ("repetition_penalty min", {"repetition_penalty": REPETITION_PENALTY_RANGE[0]}),
    ("repetition_penalty max", {"repetition_penalty": REPETITION_PENALTY_RANGE[1]}),
    ("penalties at the ends", {"presence_penalty": -2, "frequency_penalty": 2.0}),
    ("logit_bias ends", {"logit_bias": {0: -100.0, MAX_INT32: 100}}),
    ("logit_bias cap", {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS)}}),
    ("logit_bias str keys", {"logit_bias": {"50": 1.0}}),
    ("logprobs 0 and 20", {"logprobs": 20}),
    ("beams max", {"num_beams": MAX_BEAMS, "num_return_sequences": MAX_BEAMS}),
    ("beams length_penalty ends", {"num_beams": 2, "length_penalty": LENGTH_PENALTY_RANGE[0]}),
    ("beams length_penalty max", {"num_beams": 2, "length_penalty": LENGTH_PENALTY_RANGE[1]}),
    ("beams early_stopping never", {"num_beams": 2, "early_stopping": "never"}),
    ("beams greedy temperature", {"num_beams": 2, "temperature": 0.0}),
    ("beams seed and ignore_eos", {"num_beams": 2, "seed": 3, "ignore_eos": True}),
    ("num_return_sequences 1 without beams", {"num_return_sequences": 1}),
    ("n with seed", {"n": 4, "seed": 7, "temperature": 0.8, "top_k": 5, "top_p": 0.9}),
    ("stop as a string", {"stop": "###"}),
]


@pytest.mark.parametrize("kwargs", [k for _, k in ACCEPTED], ids=[n for n, _ in ACCEPTED])
def test_boundary_value_is_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    params.validate()  # the engine validates again: still fine


def test_normalised_fields() -> None:
    """Spellings the HTTP layer and Python callers use are normalised, not refused."""
    loose: dict[str, Any] = {"stop": "x", "stop_token_ids": (3, 4),
                             "logit_bias": {"7": 1, 8: -2.5}}  # JSON keys are strings
    assert SamplingParams(top_k=-1).top_k == 0
    params = SamplingParams(**loose)
    assert params.stop == ["x"]
    assert params.stop_token_ids == [3, 4]
    bias = params.logit_bias
    assert bias == {7: 1.0, 8: -2.5}
    assert all(isinstance(v, float) for v in (bias or {}).values())


def test_mutated_params_are_refused_by_validate() -> None:
    """The dataclass is mutable: validate() (which the engine runs again) sees the change."""
    p = SamplingParams()
    p.seed = 2**64
    with pytest.raises(InvalidParamsError) as info:
        p.validate()
    assert info.value.param == "seed"


def test_sibling_seeds_stay_in_range_and_distinct() -> None:
    """seed + i for the n samples of one request, wrapped into the seed range: the top seed
    still gives valid, distinct per-sample seeds."""
    top = SamplingParams(seed=SEED_MAX, n=MAX_N, temperature=1.0)
    seeds = [top.sibling_seed(i) for i in range(MAX_N)]
    assert seeds[0] == SEED_MAX and seeds[1] == SEED_MIN
    assert len(set(seeds)) == MAX_N
    for s in seeds:
        SamplingParams(seed=s)  # each one valid on its own
    assert SamplingParams(seed=5, n=2).sibling_seed(1) == 6
    assert SamplingParams(n=2).sibling_seed(1) is None


def test_refusal_messages_are_finite_words() -> None:
    """An error for a non-finite value says what was given (no float repr surprises)."""
    with pytest.raises(InvalidParamsError, match="nan"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(InvalidParamsError, match="beam search"):
        SamplingParams(num_beams=2, stop=["x"])
