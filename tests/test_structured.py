"""Structured output through the Python API: regex, choice, Lark and any-JSON with n = 2 on the
default model, and constraints refused before queueing. The acceptance cases (23 schemas,
alone and in a batch of 32) are tests/test_structured_schemas.py; jump-forward and
speculation under a grammar, tests/test_jump_forward.py."""

from __future__ import annotations

import json
import re

import pytest

from kvloop import SamplingParams
from kvloop.errors import InvalidParamsError
from kvloop.params import StructuredOutput

ASK = "Answer with JSON only: describe something you like."


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


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
