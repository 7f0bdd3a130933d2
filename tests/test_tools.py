"""OpenAI tool calling on /v1/chat/completions: the tool-call text parser (pure), the
prompt tools and tool history make, and a real `kvloop serve` of the default model driven
by the openai SDK, LangChain and the `llm` CLI (clients nobody here wrote).

Arguments are checked against each function's schema with `jsonschema` (an independent
validator); a streamed call must assemble, the SDK's way, into the non-streamed one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import jsonschema
import openai
import pytest

from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.loading.loader import default_model_path
from kvloop.loading.tokenizer import Tokenizer
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer
from kvloop.server.protocol import ChatCompletionRequest
from kvloop.server.tool_parsers import (
    ParsedCall,
    detect_format,
    hermes_marker_start,
    parse_tool_calls,
    template_knows_tools,
)
from kvloop.server.tools import StreamedAnswer, plan_tools, template_inputs

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 24},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 1000},
    "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A history in which the assistant called a tool and the tool answered.
HISTORY = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
]


# --- the parser (pure) -------------------------------------------------------------------------
NAMES = ("get_weather", "add")


def test_hermes_calls_are_parsed_with_the_content_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", '
            '"arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = parse_tool_calls(text + "\nDone.", "hermes", NAMES)
    assert content == "Let me check."  # the text before the calls; after them, dropped
    assert calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                     ParsedCall("add", '{"a": 1, "b": 2}')]
    # An unterminated last block (the answer ended at </tool_call>'s stop) still counts.
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', "hermes",
                                NAMES)
    assert calls == [ParsedCall("add", '{"a": 1}')]
    # Arguments written as a JSON string are read as the object they hold.
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'
                                '</tool_call>', "hermes", NAMES)
    assert calls == [ParsedCall("add", '{"a": 1}')]


@pytest.mark.parametrize("text", [
    "It is sunny in Paris.",  # no call at all
    '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
    '<tool_call>{"name": "launch_missiles", "arguments": {}}</tool_call>',  # not declared
    '<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>[1]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
])
def test_anything_but_valid_calls_stays_content(text: str) -> None:
    assert parse_tool_calls(text, "hermes", NAMES) == (text, [])


def test_mistral_and_llama3_formats() -> None:
    content, calls = parse_tool_calls(
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]',
        "mistral", NAMES)
    assert content == "Sure."
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo", "unit": "celsius"}
    _, calls = parse_tool_calls('[TOOL_CALLS]add[ARGS]{"a": 3, "b": 4}', "mistral", NAMES)
    assert calls == [ParsedCall("add", '{"a": 3, "b": 4}')]
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "add", "parameters": {"a": 5, "b": ";"}}', "llama3", NAMES)
    assert content is None
    assert calls == [ParsedCall("add", '{"a": 1, "b": 2}'), ParsedCall("add", '{"a": 5, "b": ";"}')]
    assert parse_tool_calls("The answer is {1}", "llama3", NAMES) == ("The answer is {1}", [])


def test_format_detection_from_the_template_text() -> None:
    assert detect_format("{% if tools %}<tool_call>{{ tools }}{% endif %}") == "hermes"
    assert detect_format("{{ '[TOOL_CALLS]' }}{{ tools | tojson }}") == "mistral"
    assert detect_format("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3"
    assert detect_format("{{ messages }}") == "hermes"  # kvloop's own listing
    assert template_knows_tools("{% if tools is not none %}{% endif %}")
    assert not template_knows_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not template_knows_tools(None)


def test_hermes_marker_start_holds_back_only_a_possible_call() -> None:
    assert hermes_marker_start("Hello there") == len("Hello there")
    assert hermes_marker_start("Hello <tool") == len("Hello")
    assert hermes_marker_start("Hello\n<tool_call>{") == len("Hello")
    assert hermes_marker_start("a < b") == len("a < b")
    assert hermes_marker_start("a \n") == len("a")  # whitespace waits for what follows


def _request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **body})


def test_streamed_pieces_assemble_into_the_whole_answer() -> None:
    """Fed token by token, StreamedAnswer sends exactly the text and calls that the
    non-streamed reading of the same answer gives."""
    text = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", '
            '"unit": "celsius"}}\n</tool_call>')
    plan = plan_tools(_request(tools=TOOLS), None)
    answer = StreamedAnswer(plan)
    content, pieces = "", []
    for k in range(0, len(text), 3):
        c, p = answer.feed(text[k:k + 3])
        content += c or ""
        pieces += p
    assert "<" not in content and not pieces
    c, p, is_calls = answer.finish(text)
    assert is_calls and c is None and content == "Checking."
    assert [(d.index, d.function.name, d.function.arguments) for d in p if d.function] == [
        (0, "get_weather", '{"city": "Rome", "unit": "celsius"}')]
    # A named function streams its arguments as written, the first piece naming it.
    plan = plan_tools(_request(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}}), None)
    answer = StreamedAnswer(plan)
    pieces = answer.feed('{"a": ')[1] + answer.feed("1, ")[1] + answer.feed('"b": 2}')[1]
    assert pieces[0].id and pieces[0].function and pieces[0].function.name == "add"
    assert all(p.id is None for p in pieces[1:])
    assert "".join(p.function.arguments or "" for p in pieces if p.function) == '{"a": 1, "b": 2}'
    assert answer.finish('{"a": 1, "b": 2}') == (None, [], True)
    # A Mistral answer is held whole; its content comes out at the end, as non-streamed.
    plan = plan_tools(_request(tools=TOOLS), "{{ '[TOOL_CALLS]' }}{{ tools }}")
    answer = StreamedAnswer(plan)
    text = 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    assert answer.feed(text[:20]) == (None, []) and answer.feed(text[20:]) == (None, [])
    content, pieces, is_calls = answer.finish(text)
    assert (content, is_calls) == (plan.read(text)[0], True) == ("Sure.", True)
    assert [(d.function.name, d.function.arguments) for d in pieces if d.function] == [
        ("add", '{"a": 1, "b": 2}')]


# --- the prompt --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The default model's tokenizer, with its own (tool-less chatml) template."""
    reader = gguf.GGUFReader(default_model_path())
    return Tokenizer.from_gguf_metadata({k: f.contents() for k, f in reader.fields.items()
                                         if k.startswith(("tokenizer.", "general."))})


def test_default_template_knows_no_tools_so_they_go_in_hermes_form(tok: Tokenizer) -> None:
    assert not template_knows_tools(tok.chat_template)
    plan = plan_tools(_request(messages=HISTORY, tools=TOOLS), tok.chat_template)
    messages, tools = template_inputs(_request(messages=HISTORY).messages, plan)
    assert tools is None
    text = tok.apply_chat_template(messages)
    # The tools listed in the system turn, the past call as a <tool_call> block in the
    # assistant's turn, the result as a user turn of <tool_response>.
    assert text.startswith("<|im_start|>system\n# Tools")
    for t in TOOLS:
        assert json.dumps(t) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18 degrees and sunny\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    # tool_choice none: no listing, the history still rendered.
    plan = plan_tools(_request(messages=HISTORY, tools=TOOLS, tool_choice="none"),
                      tok.chat_template)
    text = tok.apply_chat_template(template_inputs(_history(), plan)[0])
    assert "# Tools" not in text and "<tool_response>\n18 degrees" in text


def _history() -> Any:
    """HISTORY as the server's request model holds it."""
    return _request(messages=HISTORY).messages


# A template that renders tools itself, in the way HF templates do.
NATIVE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n"
          "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
          "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
          "({{ c.function.arguments.city }}){% endfor %}{% endif %}"
          "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")


def test_a_template_with_tool_support_gets_tools_and_argument_objects() -> None:
    plan = plan_tools(_request(messages=HISTORY, tools=TOOLS), NATIVE)
    assert plan.knows_tools and plan.fmt == "hermes"
    messages, tools = template_inputs(_history(), plan)
    native = Tokenizer.from_gguf_metadata({"tokenizer.chat_template": NATIVE, **{
        k: v for k, v in _metadata().items() if k != "tokenizer.chat_template"}})
    text = native.apply_chat_template(messages, tools=tools)
    # (HF's jinja settings trim the newline after a block tag)
    assert text.startswith("TOOLS:get_weather;add;user: ")
    # arguments reach the template as an object (.city), the tool turn keeps its call id
    assert "assistant: <tool_call>get_weather(Paris)tool: " in text
    assert text.endswith("tool: 18 degrees and sunny[call_1]")


def _metadata() -> dict[str, Any]:
    reader = gguf.GGUFReader(default_model_path())
    return {k: f.contents() for k, f in reader.fields.items()
            if k.startswith(("tokenizer.", "general."))}


# --- a real server -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(LLMEngine(None, EngineConfig(kv_cache_memory="256MiB")),
                                     ServerSettings())) as s:
        yield s


@pytest.fixture()
def oai(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def _assemble(stream: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    """A streamed answer's tool calls joined by index as the openai SDK's helpers join
    them (id, type and name from the first piece, arguments concatenated), its finish
    reason and its content."""
    calls: dict[int, dict[str, Any]] = {}
    finish, content = None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or d.id
            if d.function:
                call["name"] = call["name"] or d.function.name
                call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[k] for k in sorted(calls)], finish, content


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
def test_forced_calls_are_schema_valid_and_stream_the_same(oai: openai.OpenAI,
                                                           choice: Any) -> None:
    # Sampled, one call (parallel_tool_calls false): free to add calls, this small model
    # may go on adding them until max_tokens cuts the list short.
    for temperature, parallel in ((0, True), (1, False)):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice=choice, temperature=temperature,
                                        parallel_tool_calls=parallel, seed=3, max_tokens=80)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert c.message.tool_calls
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments),
                                SCHEMAS[call.function.name])
        if isinstance(choice, dict):
            assert [t.function.name for t in c.message.tool_calls] == ["add"]
    # Greedy: the streamed pieces assemble into the same call.
    whole = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice=choice, temperature=0, max_tokens=80)
    calls, finish, content = _assemble(oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
        max_tokens=80, stream=True, stream_options={"include_usage": True}))
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls)
    # The SDK's own stream helper agrees.
    with oai.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                     tool_choice=choice, temperature=0, max_tokens=80) as s:
        final = s.get_final_completion()
    assert [(t.function.name, t.function.arguments)
            for t in final.choices[0].message.tool_calls or []] == [
        (t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls]


@pytest.mark.slow
def test_streamed_tool_calls_carry_every_token_logprob_once(oai: openai.OpenAI) -> None:
    """Tokens of a call held back while it is written still get their log-probs, once
    each, in the same order as the non-streamed answer's."""
    for choice in ("required", "auto"):
        kw: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                  temperature=0, max_tokens=40, logprobs=True, top_logprobs=2)
        whole = oai.chat.completions.create(**kw)
        want = [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
        got = []
        for chunk in oai.chat.completions.create(**kw, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                got += [(t.token, t.logprob) for t in chunk.choices[0].logprobs.content]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)


@pytest.mark.slow
def test_a_call_cut_by_max_tokens_says_length(server: BackgroundServer) -> None:
    """A forced call that max_tokens cuts short: a named function's call comes back with
    its partial arguments, a "required" list (which does not parse) as content; both
    with finish_reason length, streamed or not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for choice in (named, "required"):
            body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice,
                    "temperature": 0, "max_tokens": 4}
            c = http.post("/v1/chat/completions", json=body).json()["choices"][0]
            assert c["finish_reason"] == "length"
            if choice == "required":
                assert "tool_calls" not in c["message"]
                assert c["message"]["content"].startswith('[{"name":')
            else:
                [call] = c["message"]["tool_calls"]
                assert call["function"]["name"] == "get_weather"
                assert call["function"]["arguments"].startswith('{"city":')
            with http.stream("POST", "/v1/chat/completions",
                             json={**body, "stream": True}) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            args = "".join(t["function"].get("arguments", "") for e in events
                           for t in e["choices"][0]["delta"].get("tool_calls", []))
            if choice == "required":
                assert (text, args) == (c["message"]["content"], "")
            else:
                assert (text, args) == ("", c["message"]["tool_calls"][0]["function"][
                    "arguments"])


@pytest.mark.slow
def test_parallel_tool_calls_false_gives_one_call(server: BackgroundServer) -> None:
    """With parallel_tool_calls false the constraint allows exactly one call: asked for
    three additions, the answer still holds one."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Add 1+2, 3+4 and 5+6."}],
            "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1, "seed": 0, "max_tokens": 120, "n": 4})
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "tool_calls"
            assert len(choice["message"]["tool_calls"]) == 1


@pytest.mark.slow
def test_history_with_tool_calls_and_results_is_accepted_and_rendered(
        oai: openai.OpenAI, tok: Tokenizer) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS,  # type: ignore[arg-type]
                                    temperature=0, max_tokens=30)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The prompt the server ran is the history rendered with the tools and the result.
    plan = plan_tools(_request(messages=HISTORY, tools=TOOLS), tok.chat_template)
    messages, tools = template_inputs(_history(), plan)
    expected = tok.encode_chat(messages, True, tools)
    assert "18 degrees and sunny" in tok.decode(expected, skip_special_tokens=False)
    assert r.usage is not None and r.usage.prompt_tokens == len(expected)
    # Without tools the history is accepted too.
    r = oai.chat.completions.create(model=MODEL, messages=HISTORY, temperature=0,  # type: ignore[arg-type]
                                    max_tokens=5)
    assert r.choices[0].message.content


@pytest.mark.slow
def test_auto_parses_a_hermes_call_the_model_writes(server: BackgroundServer) -> None:
    """With tool_choice auto, a call the model writes in the Hermes format comes back as
    tool_calls; the model is steered to write one by a regex (this small model rarely
    calls tools of its own accord), and without one the answer is a plain message."""
    call = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call>')
    regex = call.replace("{", r"\{").replace("}", r"\}")
    body = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60,
            "guided_regex": regex}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        [tc] = choice["message"]["tool_calls"]
        assert tc["function"] == {"name": "get_weather",
                                  "arguments": '{"city": "Paris", "unit": "celsius"}'}
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        calls, finish, content = _assemble(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
            max_tokens=60, stream=True, extra_body={"guided_regex": regex}))
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [
            ("get_weather", tc["function"]["arguments"])]
        # No call written: a plain answer, streamed and not, the same text.
        plain = {**body, "guided_regex": "It is sunny in Paris[.]"}
        r = http.post("/v1/chat/completions", json=plain)
        msg = r.json()["choices"][0]
        assert msg["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
        assert msg["finish_reason"] == "stop"
        calls, finish, content = _assemble(client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
            max_tokens=60, stream=True, extra_body={"guided_regex": "It is sunny in Paris[.]"}))
        assert (calls, finish, content) == ([], "stop", "It is sunny in Paris.")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [*TOOLS, {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"x": {"type": "frob"}}}}}]},
     "tools[2].function.parameters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
])
def test_bad_tool_requests_are_400_naming_the_field(server: BackgroundServer,
                                                    body: dict[str, Any], param: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("body,words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "oops": 1}}]}, "oops"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f"}}]}]}, "arguments"),
])
def test_malformed_tool_fields_are_400(server: BackgroundServer, body: dict[str, Any],
                                       words: str) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, **body})
        assert r.status_code == 400, r.text
        assert words in json.dumps(r.json()), r.json()


# --- LangChain ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_langchain_structured_output_and_bind_tools(server: BackgroundServer) -> None:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and how many people live in it."""

        name: str = Field(max_length=30)
        population: int = Field(ge=0)

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="x",  # type: ignore[arg-type]
                     model=MODEL, temperature=0, max_tokens=60, max_retries=0)
    # strict: LangChain closes the objects (additionalProperties false); an open schema
    # lets this small model add properties of its own until max_tokens cuts it short.
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method,  # type: ignore[arg-type]
                                          strict=True).invoke(
            "Name a large city and its population.")
        assert isinstance(city, City), (method, city)
        City.model_validate(city.model_dump())

    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city (unit: celsius or fahrenheit)."""
        return "sunny"

    bound = llm.bind_tools([get_weather, TOOLS[1]], tool_choice="required", strict=True)
    msg = bound.invoke("What is the weather like in Paris?")
    assert msg.tool_calls, msg
    tool = msg.tool_calls[0]
    schema = {"get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city", "unit"]},
        "add": ADD}[tool["name"]]
    jsonschema.validate(tool["args"], schema)
    # Streamed, LangChain joins the tool-call pieces into the same call.
    streamed = None
    for piece in bound.stream("What is the weather like in Paris?"):
        streamed = piece if streamed is None else streamed + piece
    assert streamed is not None
    assert [(t["name"], t["args"]) for t in streamed.tool_calls] == [  # type: ignore[attr-defined]
        (t["name"], t["args"]) for t in msg.tool_calls]


# --- the llm CLI -------------------------------------------------------------------------------
@pytest.fixture()
def llm_cli(server: BackgroundServer, tmp_path: Path) -> Any:
    """Runs simonw's `llm` against the server, configured through its
    extra-openai-models.yaml in a private LLM_USER_PATH."""
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: kvloop\n  model_name: {MODEL}\n  api_base: {server.url}/v1\n"
        "  supports_schema: true\n  supports_tools: true\n")
    # LLM_LOAD_PLUGINS empty: only llm's own plugins. The default model's package is an
    # llm plugin too, and importing it needs llama-cpp-python (installed only by make bench).
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "x",
           "LLM_LOAD_PLUGINS": ""}

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "llm", "-m", "kvloop", "--no-log", *args],
                              capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    return run


@pytest.mark.slow
def test_llm_cli_schema_json_object_and_functions(llm_cli: Any, tmp_path: Path) -> None:
    # A closed schema (llm's "name, population int" shorthand leaves it open, and this
    # small model then adds properties until max_tokens cuts it short).
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "population": {"type": "integer"}},
              "required": ["name", "population"], "additionalProperties": False}
    out = llm_cli("--schema", json.dumps(schema), "-o", "temperature", "0",
                  "-o", "max_tokens", "60", "Name a city.")
    jsonschema.validate(json.loads(out), schema)
    out = llm_cli("-o", "json_object", "1", "-o", "temperature", "0", "-o", "max_tokens", "60",
                  "Describe a city as JSON.")
    assert isinstance(json.loads(out), dict)
    # --functions: the model may call the function or answer; either way llm runs it.
    functions = tmp_path / "functions.py"
    functions.write_text("def add(a: int, b: int) -> int:\n"
                         '    """Add two numbers."""\n    return a + b\n')
    out = llm_cli("--functions", str(functions), "-o", "temperature", "0",
                  "-o", "max_tokens", "40", "What is 2 + 3?")
    assert out.strip()


# A chatml template that renders tools and tool turns itself, Qwen's way.
QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\nCall one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.slow
def test_a_template_with_tool_support_end_to_end() -> None:
    """The default model served with a template that renders tools itself: the tools and
    the history reach it (the call's arguments as an object), and a call the model writes
    in its format is parsed."""
    engine = LLMEngine(None, EngineConfig(kv_cache_memory="64MiB", chat_template=QWEN_LIKE))
    native = [{"role": "user", "content": ASK[0]["content"]},
              {"role": "assistant", "content": "", "tool_calls": [{
                  "id": "call_1", "type": "function", "function": {
                      "name": "get_weather", "arguments": {"city": "Paris",
                                                           "unit": "celsius"}}}]},
              {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": "call_1"}]
    expected = engine.tokenizer.encode_chat(native, True, TOOLS)
    text = engine.tokenizer.decode(expected, skip_special_tokens=False)
    assert text.startswith('<|im_start|>system\nTools:{"type": "function", "function": '
                           '{"name": "get_weather"')  # (a block tag eats its newline)
    assert ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}</tool_call>') in text
    assert "<tool_response>18 degrees and sunny</tool_response>" in text
    with BackgroundServer(create_app(engine, ServerSettings())) as s, \
            httpx.Client(base_url=s.url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": HISTORY, "tools": TOOLS, "temperature": 0, "max_tokens": 40,
            "guided_regex": r'<tool_call>\{"name": "add", "arguments": \{"a": 1, "b": 2\}\}'
                            r"</tool_call>"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert [c["function"] for c in choice["message"]["tool_calls"]] == [
            {"name": "add", "arguments": '{"a": 1, "b": 2}'}]
