"""The OpenAI-compatible server over real HTTP: each server runs uvicorn on a free loopback
port in a background thread, and is stopped at the end of its module or test.

Most tests use the tiny random model (fast). The official `openai` client's greedy
answers are checked against `LLM.generate` on the default model (slow; one server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from conftest import slowed
from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import KvloopError
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer
from kvloop.server.cli import add_serve_parser, cmd_serve, resolve_api_key

SMALL_KV = "16MiB"
PROMPT = "The quick brown fox"
API_KEY = "s3cret-key"
BODY_LIMIT = 4096


def tiny_engine(model_dir: Path, **config: Any) -> LLMEngine:
    return LLMEngine(str(model_dir), EngineConfig(kv_cache_memory=SMALL_KV, **config))


@contextmanager
def serve(engine: LLMEngine, **settings: Any) -> Iterator[BackgroundServer]:
    if engine.checkpoint.name != "SmolLM2-135M-Instruct":
        settings.setdefault("model_name", "tiny")
    with BackgroundServer(create_app(engine, ServerSettings(**settings))) as server:
        yield server


def metric(client: httpx.Client, name: str) -> float:
    """One unlabelled sample from /metrics."""
    text = client.get("/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> None:
    """Poll until no sequence runs or waits and every KV block is free (aborts land
    between engine steps)."""
    deadline = time.monotonic() + timeout
    while True:
        busy = (metric(client, "kvloop_num_requests_running"),
                metric(client, "kvloop_num_requests_waiting"),
                metric(client, "kvloop_kv_cache_blocks_used"))
        if busy == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"still busy (running, waiting, blocks): {busy}"
        time.sleep(0.05)


def assert_error(r: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None, words: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if words is not None:
        assert words in err["message"], err
    return err


def sse_events(r: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent stream, checking it ends with [DONE]."""
    events, done = [], False
    for line in r.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: "):]))
    assert done
    return events


# --- servers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> LLM:
    """The offline API on the same tiny model: what the server's greedy answers must equal."""
    return LLM(str(tiny_model_dir), kv_cache_memory=SMALL_KV)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    with serve(tiny_engine(tiny_model_dir)) as server:
        yield server


@pytest.fixture()
def client(tiny_server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_server.url, timeout=60) as c:
        yield c


@pytest.fixture()
def oai(tiny_server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    with serve(tiny_engine(tiny_model_dir), api_key=API_KEY,
               max_body_bytes=BODY_LIMIT) as server:
        yield server


# --- the openai client on the default model: greedy equals LLM.generate ------------------------
@pytest.fixture(scope="module")
def default_server() -> Iterator[BackgroundServer]:
    # fp32, as kv_default (which the greedy test compares with).
    with serve(LLMEngine(None, EngineConfig(kv_cache_memory="256MiB",
                                            quantization="none"))) as server:
        yield server


@pytest.mark.slow
def test_chat_logprobs_cover_the_message_only_and_sdk_fields_are_tolerated(
        default_server: BackgroundServer) -> None:
    """The end-of-turn token that ends a reply is not in logprobs.content (OpenAI lists only
    the message's tokens), streamed or not; store/metadata/service_tier and
    response_format text are accepted."""
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
    kw = dict(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Say hi."}],
              max_tokens=40, temperature=0, logprobs=True, top_logprobs=1)
    chat = client.chat.completions.create(**kw, store=False, metadata={"k": "v"},
                                          service_tier="auto",
                                          response_format={"type": "text"})
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    tokens = [t.token for t in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content
    assert "<|im_end|>" not in tokens
    streamed = list(client.chat.completions.create(**kw, stream=True))
    s_tokens = [t.token for ch in streamed if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert s_tokens == tokens


@pytest.mark.slow
def test_structured_output_fields(default_server: BackgroundServer) -> None:
    """response_format json_schema / json_object through the openai SDK, vLLM's
    structured_outputs and guided_* in extra_body; a bad constraint is a 400 naming the
    field it came in; two constraints at once are refused."""
    import jsonschema

    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "Describe a city as JSON."}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=80, temperature=0)
    chat = client.chat.completions.create(**kw, response_format={
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema,
                                               "strict": True}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    chat = client.chat.completions.create(**kw, response_format={"type": "json_object"})
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        **kw, response_format={"type": "json_object"}, stream=True) if ch.choices)
    assert streamed == chat.choices[0].message.content
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Pick a color:",
                                     max_tokens=5, temperature=0, extra_body={
                                         "structured_outputs": {"choice": ["red", "blue"]}})
    assert comp.choices[0].text in ("red", "blue")
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Year:",
                                     max_tokens=8, temperature=0,
                                     extra_body={"guided_regex": " [12][0-9]{3}"})
    assert re.fullmatch(" [12][0-9]{3}", comp.choices[0].text)
    with httpx.Client(base_url=default_server.url) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "guided_regex": "("})
        assert_error(r, 400, param="guided_regex")
        r = http.post("/v1/chat/completions", json={
            "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"type": "frob"}}}}}})
        assert_error(r, 400, param="response_format")
        r = http.post("/v1/completions", json={"prompt": "x", "guided_regex": "a",
                                               "guided_choice": ["b"]})
        assert_error(r, 400, param="guided_choice")
        wait_idle(http)


@pytest.mark.slow
def test_openai_client_greedy_equals_llm_generate(default_server: BackgroundServer,
                                                   kv_default: LLM) -> None:
    client = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    prompt, messages = "The capital of France is", [{"role": "user", "content": "Say hi."}]
    params = SamplingParams(temperature=0, max_tokens=6)
    want_text = kv_default.generate(prompt, params)[0].text
    want_chat = kv_default.chat(messages, params)[0].text

    comp = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert comp.choices[0].text == want_text
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion"
    assert comp.usage is not None
    assert comp.usage.prompt_tokens == len(kv_default.tokenizer.encode(prompt))
    assert comp.usage.completion_tokens == 6 and comp.choices[0].finish_reason == "length"

    chat = client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == want_chat
    assert chat.choices[0].message.role == "assistant" and chat.id.startswith("chatcmpl-")
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(kv_default.tokenizer.encode_chat(messages))

    # Streamed: the deltas join to the same text; usage arrives last when asked for.
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True))  # type: ignore[arg-type]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# --- the openai client on the tiny model: n, stop, seed, logprobs ------------------------------
def test_openai_client_completions_n_seed_logprobs(oai: openai.OpenAI, tiny_llm: LLM) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=8, n=2, seed=7,
                              temperature=0.9, logprobs=2)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    want = tiny_llm.generate(PROMPT, SamplingParams(max_tokens=8, n=2, seed=7, temperature=0.9,
                                                    logprobs=2))
    assert [c.text for c in a.choices] == [c.text for c in want[0].outputs]
    assert a.usage is not None
    for c in a.choices:
        lp = c.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(len(t) <= 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert a.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in a.choices)  # type: ignore[union-attr]


def test_openai_client_chat_stop_and_stream_n2(oai: openai.OpenAI, tiny_llm: LLM) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    full = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12,
                                                  ignore_eos=True))[0].text
    stop = full[3:5]
    assert stop.strip(), full
    chat = oai.chat.completions.create(model="tiny", messages=messages, temperature=0,  # type: ignore[arg-type]
                                       max_tokens=12, stop=[stop], extra_body={"ignore_eos": True})
    text = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop" and stop not in text
    assert full.startswith(text)

    stream = oai.chat.completions.create(model="tiny", messages=messages, temperature=0,  # type: ignore[arg-type]
                                         max_tokens=6, n=2, stream=True, logprobs=True,
                                         top_logprobs=1, stream_options={"include_usage": True})
    texts, finish, n_logprobs = ["", ""], [None, None], [0, 0]
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                n_logprobs[c.index] += len(c.logprobs.content)
                assert all(len(t.top_logprobs) == 1 for t in c.logprobs.content)
            if c.finish_reason:
                assert finish[c.index] is None, "two finish_reasons for one choice"
                finish[c.index] = c.finish_reason
    want = tiny_llm.chat(messages, SamplingParams(temperature=0, max_tokens=6))[0].text
    assert texts == [want, want] and None not in finish
    assert usage is not None and usage.completion_tokens == sum(n_logprobs)


def test_concurrent_requests_join_one_batch(slow_server: BackgroundServer,
                                            slow_client: httpx.Client) -> None:
    # Slowed steps: 20 of them outlast the 8 requests' arrival over HTTP on any machine.
    engine = slow_server.app.state.async_engine.engine
    wait_idle(slow_client)
    steps = engine.num_steps

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=slow_server.url, timeout=60) as ac:
            return await asyncio.gather(*(
                ac.post("/v1/completions", json={"prompt": f"{i} {PROMPT}", "max_tokens": 20,
                                                 "ignore_eos": True}) for i in range(8)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    # One at a time would take 8 x 20 steps; batched, the decode steps are shared.
    assert engine.num_steps - steps < 8 * 20 // 2


def test_batch_prompts_get_their_own_choices(client: httpx.Client, tiny_llm: LLM) -> None:
    prompts = ["one two three", "def f(x):"]
    r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 5,
                                             "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    want = [o.text for o in tiny_llm.generate(prompts, SamplingParams(temperature=0,
                                                                      max_tokens=5))]
    assert [c["text"] for c in choices] == [want[0], want[0], want[1], want[1]]
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == sum(len(tiny_llm.tokenizer.encode(p)) for p in prompts)


def test_token_id_prompt_and_cached_tokens(client: httpx.Client, tiny_llm: LLM) -> None:
    ids = tiny_llm.tokenizer.encode("the lazy dog " * 12)
    assert len(ids) > 32
    first = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2}).json()
    again = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 2}).json()
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"] == len(ids)
    # The second one found the first one's full blocks in the prefix cache.
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def test_chat_default_max_tokens_is_the_rest_of_the_context(tmp_path: Path) -> None:
    from conftest import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny48", max_position_embeddings=48)
    with serve(tiny_engine(model)) as server, httpx.Client(base_url=server.url) as c:
        r = c.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 48
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_beam_search_equals_llm_generate(client: httpx.Client, tiny_llm: LLM) -> None:
    want = tiny_llm.generate(PROMPT, SamplingParams(max_tokens=6, num_beams=3,
                                                    num_return_sequences=2))[0]
    want_texts = [c.text for c in want.outputs]
    for beams in ({"use_beam_search": True, "best_of": 3}, {"num_beams": 3}):
        body = {"prompt": PROMPT, "max_tokens": 6, "n": 2, **beams}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in choices] == want_texts
    # Streamed, the beams arrive whole at the end.
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        texts = ["", ""]
        for event in sse_events(r):
            for c in event["choices"]:
                texts[c["index"]] += c["text"]
    assert texts == want_texts
    r = client.post("/v1/completions", json={"prompt": PROMPT, "n": 3, "use_beam_search": True,
                                             "best_of": 2})
    assert_error(r, 400, "n")  # more sequences than beams


def test_models_health_metrics_ids_and_log(client: httpx.Client,
                                           caplog: pytest.LogCaptureFixture) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    with caplog.at_level(logging.INFO, logger="kvloop.server"):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
        rid = r.json()["id"]
        assert r.headers["x-request-id"] == rid and rid.startswith("cmpl-")
        deadline = time.monotonic() + 5
        while not any(rid in rec.getMessage() for rec in caplog.records):
            assert time.monotonic() < deadline, "no log line for the request"
            time.sleep(0.02)
    line = next(rec.getMessage() for rec in caplog.records if rid in rec.getMessage())
    assert "finished" in line and "TTFT" in line and "completion 3 tokens" in line
    m = client.get("/metrics")
    assert m.headers["content-type"].startswith("text/plain")
    for name in ("kvloop_time_to_first_token_seconds_count",
                 "kvloop_time_per_output_token_seconds_count",
                 "kvloop_e2e_request_latency_seconds_count", "kvloop_prompt_tokens_total",
                 "kvloop_generation_tokens_total"):
        assert metric(client, name) > 0, name
    assert metric(client, "kvloop_kv_cache_blocks_total") > 0
    for name in ("kvloop_num_preemptions_total", "kvloop_prefix_cache_hit_rate"):
        assert metric(client, name) >= 0


# --- bad input: a 400 naming the problem, nothing queued, the server goes on -------------------
BAD_COMPLETIONS: list[tuple[str, bytes | dict, str | None, str | None]] = [
    ("malformed JSON", b'{"prompt": "hi", ', None, "invalid_json"),
    ("not an object", b"[1, 2]", None, None),
    ("empty body", b"", None, None),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', "temperature", None),
    ("wrong type", {"prompt": "hi", "temperature": "hot"}, "temperature", None),
    ("string number", {"prompt": "hi", "max_tokens": "5"}, "max_tokens", None),
    ("prompt type", {"prompt": 5}, "prompt", "invalid_type"),
    ("unknown field", {"prompt": "hi", "tempreature": 0.5}, "tempreature", "unknown_field"),
    ("missing prompt", {"max_tokens": 5}, "prompt", None),
    ("unknown model", {"prompt": "hi", "model": "gpt-4o"}, "model", "model_not_found"),
    ("temperature", {"prompt": "hi", "temperature": -1}, "temperature", None),
    ("top_p", {"prompt": "hi", "top_p": 1.5}, "top_p", None),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    ("n 0", {"prompt": "hi", "n": 0}, "n", None),
    ("n huge", {"prompt": "hi", "n": 100000}, "n", None),
    ("presence", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", None),
    ("logprobs", {"prompt": "hi", "logprobs": 50}, "logprobs", None),
    ("min_tokens", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens", None),
    ("bias id", {"prompt": "hi", "logit_bias": {"100000": 5}}, "logit_bias", None),
    ("bias key", {"prompt": "hi", "logit_bias": {"abc": 5}}, "logit_bias", None),
    ("bias value", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias", None),
    ("empty stop", {"prompt": "hi", "stop": [""]}, "stop", None),
    ("context", {"prompt": "hi", "max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ("long prompt", {"prompt": [5] * 2048}, "prompt", "context_length_exceeded"),
    ("bad ids", {"prompt": [5, 99999]}, "prompt", None),
    ("empty prompt", {"prompt": []}, "prompt", None),
    ("max_tokens 0 without echo", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
    ("prompt_logprobs", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", None),
    ("best_of", {"prompt": "hi", "best_of": 3}, "best_of", "unsupported"),
]
BAD_CHATS: list[tuple[str, dict, str | None, str | None]] = [
    ("no messages", {"messages": []}, "messages", None),
    ("bad role", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
    ("content type", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "invalid_type"),
    ("top_logprobs alone", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs", None),
    ("too many top", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                      "top_logprobs": 50}, "top_logprobs", None),
    ("context", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
     "max_completion_tokens", "context_length_exceeded"),
]


def _post(client: httpx.Client, path: str, body: bytes | dict) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


@pytest.mark.parametrize(("name", "body", "param", "code"), BAD_COMPLETIONS,
                         ids=[b[0] for b in BAD_COMPLETIONS])
def test_bad_completion_is_400_naming_it(client: httpx.Client, name: str, body: bytes | dict,
                                         param: str | None, code: str | None) -> None:
    before = metric(client, "kvloop_prompt_tokens_total")
    err = assert_error(_post(client, "/v1/completions", body), 400, param, code)
    assert err["type"] == "invalid_request_error"
    # Stream or not, the refusal comes before anything is queued.
    if isinstance(body, dict):
        assert_error(_post(client, "/v1/completions", {**body, "stream": True}), 400, param)
    assert metric(client, "kvloop_prompt_tokens_total") == before
    assert metric(client, "kvloop_num_requests_waiting") == 0


@pytest.mark.parametrize(("name", "body", "param", "code"), BAD_CHATS,
                         ids=[b[0] for b in BAD_CHATS])
def test_bad_chat_is_400_naming_it(client: httpx.Client, name: str, body: dict,
                                   param: str | None, code: str | None) -> None:
    assert_error(_post(client, "/v1/chat/completions", body), 400, param, code)


def test_non_json_content_type_is_named(client: httpx.Client) -> None:
    r = client.post("/v1/completions", content=b'{"prompt": "hi"}',
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert_error(r, 400, code="invalid_content_type", words="application/json")


def test_unknown_route_and_method_keep_the_error_shape(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_a_bug_in_a_route_is_one_500_logged_once(tiny_server: BackgroundServer,
                                                 client: httpx.Client,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    serving = tiny_server.app.state.serving

    def boom(*_: Any) -> list[list[int]]:
        raise RuntimeError("simulated bug")

    serving._encode_all = boom
    try:
        with caplog.at_level(logging.ERROR):
            err = assert_error(client.post("/v1/completions", json={"prompt": PROMPT}), 500)
    finally:
        del serving._encode_all
    assert err["type"] == "internal_error" and "simulated bug" in err["message"]
    logged = [r for r in caplog.records if r.exc_info and "simulated bug" in str(r.exc_info[1])]
    assert len(logged) == 1, logged
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}
                       ).status_code == 200


def test_server_answers_correctly_after_bad_input(client: httpx.Client, tiny_llm: LLM) -> None:
    for case in BAD_COMPLETIONS:
        assert _post(client, "/v1/completions", case[1]).status_code == 400
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6,
                                             "temperature": 0})
    assert r.status_code == 200
    want = tiny_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6))[0].text
    assert r.json()["choices"][0]["text"] == want
    assert client.get("/health").status_code == 200


# --- API key and body size ---------------------------------------------------------------------
def test_api_key_guards_v1_only(keyed_server: BackgroundServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    with httpx.Client(base_url=keyed_server.url) as c:
        assert_error(c.post("/v1/completions", json=body), 401, code="invalid_api_key")
        for auth in (f"Bearer {API_KEY}x", f"Basic {API_KEY}", API_KEY, "Bearer", "Bearer x"):
            r = c.post("/v1/completions", json=body, headers={"Authorization": auth})
            assert_error(r, 401)
        assert_error(c.get("/v1/models"), 401)
        ok = {"Authorization": f"Bearer {API_KEY}"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY,
                               max_retries=0)
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong",
                          max_retries=0).models.list()


def test_oversized_body_is_413_before_parsing(keyed_server: BackgroundServer) -> None:
    ok = {"Authorization": f"Bearer {API_KEY}"}
    big = json.dumps({"prompt": "x" * BODY_LIMIT, "max_tokens": 1}).encode()
    with httpx.Client(base_url=keyed_server.url, headers=ok) as c:
        r = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert_error(r, 413, code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: the bytes are counted
            for i in range(0, len(big), 1000):
                yield big[i:i + 1000]

        r = c.post("/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"})
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert_error(r, 413, code="request_too_large")
        # Malformed JSON under the limit is still a 400; and the server goes on.
        r = c.post("/v1/completions", content=b"{" * 100,
                   headers={"Content-Type": "application/json"})
        assert_error(r, 400, code="invalid_json")
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# --- bad clients: disconnects and overload -----------------------------------------------------
@pytest.fixture(scope="module")
def slow_server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    """1500 tokens take >= 3 s here: far longer than the disconnect tests wait."""
    with serve(slowed(tiny_engine(tiny_model_dir), 0.002)) as server:
        yield server


@pytest.fixture()
def slow_client(slow_server: BackgroundServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=slow_server.url, timeout=60) as c:
        yield c


def test_stream_disconnect_aborts_and_frees_blocks(slow_client: httpx.Client,
                                                   slow_server: BackgroundServer) -> None:
    client = slow_client
    wait_idle(client)
    generated = metric(client, "kvloop_generation_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=slow_server.url) as c2, \
            c2.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: {")
            if got == 3:
                break
        assert metric(client, "kvloop_kv_cache_blocks_used") > 0
        steps = metric(client, "kvloop_engine_steps_total")
        assert steps > 0
        deadline = time.monotonic() + 10
        while metric(client, "kvloop_engine_steps_total") == steps:  # the counter moves
            assert time.monotonic() < deadline, "kvloop_engine_steps_total did not move"
    wait_idle(client, timeout=5)
    assert metric(client, "kvloop_generation_tokens_total") - generated < 1500


def test_non_stream_disconnect_aborts(slow_client: httpx.Client,
                                      slow_server: BackgroundServer) -> None:
    wait_idle(slow_client)
    generated = metric(slow_client, "kvloop_generation_tokens_total")
    body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow_server.url}/v1/completions", json=body, timeout=0.5)
    wait_idle(slow_client, timeout=5)
    assert metric(slow_client, "kvloop_generation_tokens_total") - generated < 1500


def test_overload_is_429_with_retry_after(tiny_model_dir: Path) -> None:
    # A must still run when C arrives: as long as the context allows, and each step slowed
    # to >= 5 ms (the tiny model alone decodes 2000 tokens in well under a second).
    engine = slowed(tiny_engine(tiny_model_dir, max_num_seqs=1), 0.005)
    long = {"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with serve(engine, max_waiting=1) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
                # A runs (it takes the only seat); B waits; C finds the queue full.
                async with ac.stream("POST", "/v1/completions",
                                     json={**long, "stream": True}) as a:
                    lines = a.aiter_lines()  # held: a collected iterator closes the stream
                    async for line in lines:
                        if line.startswith("data: {"):
                            break
                    # ignore_eos: B's length must not hang on what the random model says
                    # (its greedy tokens depend on the batch it shares; one run ended at EOS).
                    b = asyncio.create_task(ac.post("/v1/completions", json={
                        "prompt": "hi", "max_tokens": 3, "ignore_eos": True}))
                    deadline = time.monotonic() + 10
                    while metric(c, "kvloop_num_requests_waiting") < 1:
                        assert time.monotonic() < deadline, "B never waited"
                        await asyncio.sleep(0.02)
                    refused = await ac.post("/v1/completions", json=long)
                # A is gone (its client closed the stream): B gets the seat.
                return refused, await b

        refused, b = asyncio.run(scenario())
        assert_error(refused, 429, code="server_busy")
        assert refused.headers["retry-after"].isdigit()
        assert b.status_code == 200 and b.json()["usage"]["completion_tokens"] == 3
        wait_idle(c)


def test_engine_failure_is_500_then_503_when_it_keeps_failing(tiny_model_dir: Path) -> None:
    """A loop that fails is restarted (the request gets a 500 error event, /health stays
    ok); one that keeps failing is declared dead: 503 everywhere, /health 503."""
    from kvloop.engine.async_engine import MAX_RESTARTS

    engine = tiny_engine(tiny_model_dir)

    def broken_step() -> list:
        raise RuntimeError("simulated engine failure")

    engine.step = broken_step  # type: ignore[method-assign]
    body = {"prompt": PROMPT, "max_tokens": 4}
    with serve(engine) as server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events and events[-1]["error"]["code"] == "request_failed"
        assert c.get("/health").status_code == 200  # restarted
        for _ in range(MAX_RESTARTS - 1):
            assert_error(c.post("/v1/completions", json=body), 500, code="request_failed")
        # The failure that exceeds the restart budget: its own request, then every later one.
        assert c.post("/v1/completions", json=body).status_code in (500, 503)
        assert_error(c.get("/health"), 503, code="engine_dead")
        assert_error(c.post("/v1/completions", json=body), 503)
        assert c.get("/v1/models").status_code == 200  # the server itself lives on


# --- `kvloop serve` flags and the real command ---------------------------------------------------
def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_defaults_and_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _serve_args()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    assert args.max_body_bytes == 1 << 20
    monkeypatch.delenv("KVLOOP_API_KEY", raising=False)
    assert resolve_api_key(args) is None
    monkeypatch.setenv("KVLOOP_API_KEY", "from-env")
    assert resolve_api_key(args) == "from-env"
    assert resolve_api_key(_serve_args("--api-key", "flag")) == "flag"
    assert _serve_args("--max-body-bytes", "2KiB").max_body_bytes == 2048
    with pytest.raises(KvloopError, match="--port"):
        cmd_serve(_serve_args("--port", "70000"))  # refused before any model load
    # Issue 10's limits: defaults, and nonsense refused before the model loads.
    assert (args.max_prompts_per_request, args.default_max_tokens, args.shutdown_grace,
            args.header_timeout, args.body_timeout, args.max_connections,
            args.max_header_bytes) == (64, 1024, 30.0, 10.0, 30.0, 1024, 16384)
    for flag, value in (("--max-prompts-per-request", "0"), ("--default-max-tokens", "-1"),
                        ("--shutdown-grace", "-1"), ("--header-timeout", "0"),
                        ("--body-timeout", "nan"), ("--max-connections", "0"),
                        ("--max-header-bytes", "0")):
        with pytest.raises(KvloopError, match=flag):
            cmd_serve(_serve_args(flag, value))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_command_end_to_end(tiny_model_dir: Path) -> None:
    port = _free_port()
    env = {**os.environ, "KVLOOP_API_KEY": API_KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop.server.cli", "--model", str(tiny_model_dir),
         "--port", str(port), "--kv-cache-memory", SMALL_KV],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, proc)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                                       "ignore_eos": True},
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    # ignore_eos: the random tiny model may sample its stop token first (CI saw "finished: stop").
    assert f"{rid} finished: length" in out, out


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if ready():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not come up")


def test_speculative_server_same_greedy_text_and_spec_metrics(tiny_model_dir: Path) -> None:
    """A server with n-gram speculation answers the openai client with the same greedy text
    as one without; a request can opt out; /metrics counts drafted and accepted tokens
    and the per-step acceptance histogram."""
    prompt = "one two three one two three one two three one two"
    kw = dict(model="tiny", prompt=prompt, max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True})
    with serve(tiny_engine(tiny_model_dir)) as plain:
        want = openai.OpenAI(base_url=f"{plain.url}/v1", api_key="x").completions.create(**kw)
    with serve(tiny_engine(tiny_model_dir, speculative="ngram", ngram_min=1)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        got = client.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        with httpx.Client(base_url=server.url) as http:
            wait_idle(http)
            drafted = metric(http, "kvloop_spec_draft_tokens_total")
            accepted = metric(http, "kvloop_spec_accepted_tokens_total")
            steps = metric(http, "kvloop_spec_accepted_per_step_count")
            assert drafted > 0 and 0 <= accepted <= drafted and steps > 0
            assert metric(http, "kvloop_spec_accepted_per_step_sum") == accepted
            opted_out = client.completions.create(
                **{**kw, "extra_body": {"ignore_eos": True, "speculative": False}})
            assert opted_out.choices[0].text == want.choices[0].text
            wait_idle(http)
            assert metric(http, "kvloop_spec_draft_tokens_total") == drafted
            r = http.post("/v1/completions", json={"prompt": "hi", "num_speculative_tokens": 99})
            assert_error(r, 400, param="num_speculative_tokens")


def test_echo_with_logprobs_scores_the_prompt(tiny_model_dir: Path) -> None:
    """lm-evaluation-harness's loglikelihood request: echo + logprobs (+ max_tokens 0)
    returns the prompt's tokens with their log-probs (None for the first), equal to
    transformers'; streamed, the prompt comes first; vLLM's prompt_logprobs too."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [5, 9, 33, 12, 7, 100, 3, 44]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want = [None] + [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    # An fp32 KV cache: the oracle's precision (the fp16 default moves log-probs ~1e-3).
    with serve(tiny_engine(tiny_model_dir, kv_cache_dtype="fp32")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        scored = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2,
                                           max_tokens=0, temperature=0)
        (choice,) = scored.choices
        lp = choice.logprobs
        assert lp is not None and len(lp.tokens) == len(ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
        assert all(len(t) == 2 for t in lp.top_logprobs[1:])
        assert choice.text == "".join(lp.tokens) and lp.text_offset[0] == 0
        assert choice.finish_reason == "length"

        # echo with a completion: the prompt, then the completion, in one logprobs list.
        both = client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=0,
                                         max_tokens=3, temperature=0)
        plain = client.completions.create(model="tiny", prompt=ids, logprobs=0, max_tokens=3,
                                          temperature=0)
        c, p = both.choices[0], plain.choices[0]
        assert c.text == choice.text + p.text
        assert c.logprobs.token_logprobs[len(ids):] == p.logprobs.token_logprobs
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(want[1:], abs=1e-4)
        assert c.logprobs.text_offset[len(ids)] == len(choice.text)
        streamed = list(client.completions.create(model="tiny", prompt=ids, echo=True,
                                                  logprobs=0, max_tokens=3, temperature=0,
                                                  stream=True))
        assert "".join(ch.choices[0].text for ch in streamed) == c.text
        first = streamed[0].choices[0].logprobs
        assert first.token_logprobs[1:len(ids)] == pytest.approx(want[1:], abs=1e-4)

        vllm = client.completions.create(model="tiny", prompt=ids, max_tokens=1,
                                         extra_body={"prompt_logprobs": 1})
        rows = vllm.choices[0].model_extra["prompt_logprobs"]
        assert rows[0] is None and len(rows) == len(ids)
        assert rows[1][str(ids[1])]["logprob"] == pytest.approx(want[1], abs=1e-4)
        with httpx.Client(base_url=server.url) as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            assert_error(r, 400, param="max_tokens")
            wait_idle(http)
