"""Prompt log-probabilities must not cost everyone (issue 25, item 2).

A request's prompt tokens x top log-probs is capped (EngineConfig.max_prompt_logprobs): past
it the Python API raises and the server answers 400 naming the field, before anything runs.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError, KvloopError
from kvloop.params import check_prompt_logprobs
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer
from test_server_hostile import Target, assert_whole, error_of

CAP = 60  # prompt tokens x top log-probs, small enough for the tiny model's prompts


def test_the_cap_counts_prompt_tokens_times_top_logprobs() -> None:
    check_prompt_logprobs(20, 3, 60)  # at the limit: served
    check_prompt_logprobs(10**6, None, 60)  # nothing asked for: nothing to count
    check_prompt_logprobs(60, 0, 60)  # the token's own log-prob counts as one
    with pytest.raises(InvalidParamsError, match="max_prompt_logprobs") as e:
        check_prompt_logprobs(21, 3, 60)
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(InvalidParamsError, match="61 entries"):
        check_prompt_logprobs(61, 0, 60)


def test_bad_cap_is_one_error_naming_it() -> None:
    with pytest.raises(KvloopError, match="max_prompt_logprobs") as e:
        EngineConfig(max_prompt_logprobs=-1)
    assert getattr(e.value, "param", None) == "max_prompt_logprobs"
    proc = subprocess.run([sys.executable, "-m", "kvloop.cli", "generate",
                           "--max-prompt-logprobs", "-1", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvloop: error:"), proc.stderr
    assert "max_prompt_logprobs" in lines[0]


def test_engine_refuses_a_request_past_the_cap(tiny_model_dir: Path) -> None:
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", max_prompt_logprobs=CAP)
    prompt = list(range(5, 25))  # 20 tokens
    ok = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert ok.prompt_logprobs is not None and len(ok.prompt_logprobs) == 20
    with pytest.raises(InvalidParamsError, match="max_prompt_logprobs") as e:
        llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=4))
    assert e.value.param == "prompt_logprobs"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats().kv.num_used_blocks == 0


@pytest.fixture(scope="module")
def capped(tiny_model_dir: Path) -> Iterator[Target]:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="32MiB",
                                                         max_prompt_logprobs=CAP))
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny"))) as server:
        t = Target(server)
        yield t
        t.client.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"echo": True, "logprobs": 5, "max_tokens": 0}, "logprobs"),
    ({"echo": True, "logprobs": 5, "max_tokens": 2}, "logprobs"),
    ({"prompt_logprobs": 5, "max_tokens": 2}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 5, "max_tokens": 2}, "prompt_logprobs"),
])
def test_server_refuses_past_the_cap_and_stays_whole(capped: Target, body: dict,
                                                     param: str) -> None:
    prompt = list(range(5, 25))  # 20 tokens x 5 = 100 entries > 60
    r = capped.client.post("/v1/completions", json={"prompt": prompt, **body})
    err = error_of(r, 400, param)
    assert "max_prompt_logprobs" in err["message"], err
    assert_whole(capped)


def test_server_cap_covers_the_whole_prompt_list(capped: Target) -> None:
    """Each prompt of a list is scored and all are one answer: the cap is on their sum."""
    one = list(range(5, 25))  # 20 tokens x 2 = 40 entries: under the cap alone
    body = {"echo": True, "logprobs": 2, "max_tokens": 0}
    r = capped.client.post("/v1/completions", json={"prompt": one, **body})
    assert r.status_code == 200, r.text
    r = capped.client.post("/v1/completions", json={"prompt": [one, one], **body})
    error_of(r, 400, "logprobs")
    assert_whole(capped)  # nothing runs or holds a block; the greedy probe is unchanged
