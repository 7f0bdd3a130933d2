"""Structured output: every constrained output parses and validates (jsonschema), for varied
schemas, regexes, choices and a Lark grammar, greedy and sampled, alone and beside
unconstrained requests whose tokens stay as they were."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvloop import SamplingParams
from kvloop.errors import InvalidParamsError
from kvloop.params import StructuredOutput

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4,
                                                "items": {"type": "string", "maxLength": 12}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["color", "score"], "additionalProperties": False},
    {"type": "object", "properties": {"address": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["address"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer"},
                                                       {"type": "string", "maxLength": 8}]},
                                      "ok": {"type": "boolean"}},
     "required": ["id", "ok"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"},
                                                       "y": {"type": "integer"}},
                      "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                      "year": {"type": "integer", "minimum": 1900,
                                               "maximum": 2030},
                                      "note": {"type": "string", "maxLength": 10}},
     "required": ["title"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
     "minItems": 3, "maxItems": 3},
]
ASK = "Answer with JSON only: describe something you like."


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_validate(kv_default, temperature):
    prompt = chat_ids(kv_default, ASK)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=160,
                             structured=StructuredOutput(json_schema=s))
              for i, s in enumerate(SCHEMAS)]
    outs = kv_default.generate([prompt] * len(SCHEMAS), params)
    for schema, out in zip(SCHEMAS, outs, strict=True):
        comp = out.outputs[0]
        assert comp.finish_reason == "stop", comp.text
        jsonschema.validate(json.loads(comp.text), schema)


@pytest.mark.slow
def test_unconstrained_neighbours_keep_their_tokens(kv_default):
    free = [chat_ids(kv_default, q) for q in ("Name three fruits.", "What is 2 + 2?")]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    alone = kv_default.generate(free, greedy)
    constrained = SamplingParams(temperature=0, max_tokens=64,
                                 structured=StructuredOutput(json_schema=SCHEMAS[0]))
    mixed = kv_default.generate([free[0], chat_ids(kv_default, ASK), free[1]],
                                [greedy, constrained, greedy])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS[0])


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(kv_default):
    phone = SamplingParams(temperature=1.0, seed=3, max_tokens=20,
                           structured=StructuredOutput(regex=r" \(\d{3}\) \d{3}-\d{4}"))
    out = kv_default.generate("Call me at", phone)[0].outputs[0]
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", out.text), out.text
    choice = SamplingParams(temperature=0, max_tokens=10,
                            structured=StructuredOutput(choice=["yes", "no", "it depends"]))
    out = kv_default.generate(chat_ids(kv_default, "Is the sky blue?"), choice)[0].outputs[0]
    assert out.text in ("yes", "no", "it depends")
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    out = kv_default.generate(chat_ids(kv_default, "What is 6 times 7?"), SamplingParams(
        temperature=0, max_tokens=20, structured=StructuredOutput(grammar=lark)))[0].outputs[0]
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.text), out.text
    obj = SamplingParams(temperature=1.0, seed=5, max_tokens=100, n=2,
                         structured=StructuredOutput(json_object=True))
    for comp in kv_default.generate(chat_ids(kv_default, ASK), obj)[0].outputs:
        assert isinstance(json.loads(comp.text), dict)


@pytest.mark.parametrize("structured", [
    StructuredOutput(regex="("),
    StructuredOutput(json_schema="{not json"),
    StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "frob"}}}),
    StructuredOutput(grammar="start: undefined_rule"),
])
def test_bad_constraints_are_refused_before_queueing(tiny_model_dir, structured):
    from kvloop import LLM

    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB")
    with pytest.raises(InvalidParamsError) as info:
        llm.generate("hi", SamplingParams(max_tokens=4, structured=structured))
    assert info.value.param == "structured" and "\n" not in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_constraint_fields_are_checked():
    with pytest.raises(InvalidParamsError, match="exactly one"):
        SamplingParams(structured=StructuredOutput(regex="a", choice=["b"]))
    with pytest.raises(InvalidParamsError, match="exactly one"):
        SamplingParams(structured=StructuredOutput())
    with pytest.raises(InvalidParamsError, match="choice"):
        SamplingParams(structured=StructuredOutput(choice=[]))
    with pytest.raises(InvalidParamsError, match="beam search"):
        SamplingParams(num_beams=2, structured=StructuredOutput(regex="a"))
