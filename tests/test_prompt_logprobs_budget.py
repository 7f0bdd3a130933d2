"""Prompt log-probabilities must not cost everyone (issue 25, item 2).

A scored prompt rides the normal chunked prefill: each step's chunk is scored in bounded
blocks of rows, only its top-k kept, and the head's work is counted in the step's token
budget, so other streams keep their pace. A request's prompt tokens x top log-probs is
capped (EngineConfig.max_prompt_logprobs): past it the Python API raises and the server
answers 400 naming the field, before anything runs.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError, KvloopError
from kvloop.kv_cache import KVCacheManager
from kvloop.params import check_prompt_logprobs
from kvloop.request import Request
from kvloop.runner import PROMPT_LOGPROB_ROWS
from kvloop.scheduler import Scheduler, SchedulerConfig
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer
from test_server_hostile import Target, assert_whole, error_of, metric
from test_server_shutdown import kvloop_serve

CAP = 60  # prompt tokens x top log-probs, small enough for the tiny model's prompts
PROMPT = [(7 * i + 3) % 300 + 2 for i in range(90)]  # 90 tokens of the tiny vocabulary


@pytest.mark.parametrize("top", [0, 5])
def test_chunked_and_whole_prompts_score_the_same(tiny_model_dir: Path, top: int) -> None:
    """The same log-probs whether the prompt runs in one step or in chunks of 7 or 32
    tokens (a chunk's positions are scored in its own step), beside a decoding stream."""
    results = []
    for budget in (2048, 32, 7):
        llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", max_num_batched_tokens=budget)
        outs = llm.generate([PROMPT, PROMPT[:9]], [
            SamplingParams(max_tokens=0, prompt_logprobs=top),
            SamplingParams(max_tokens=12, temperature=0)])
        results.append((outs[0].prompt_logprobs, outs[1].outputs[0].token_ids))
    (whole, text), *chunked = results
    assert whole is not None and len(whole) == len(PROMPT) and whole[0] is None
    for plp, other in chunked:
        assert other == text
        assert plp is not None and len(plp) == len(whole)
        for got, want in zip(plp[1:], whole[1:], strict=True):
            assert got is not None and want is not None
            assert got[0] == pytest.approx(want[0], abs=1e-5)
            if top:
                assert got[1] is not None and want[1] is not None
                assert [t for t, _ in got[1]] == [t for t, _ in want[1]]
                assert [v for _, v in got[1]] == pytest.approx([v for _, v in want[1]],
                                                               abs=1e-5)
            else:
                assert got[1] is None and want[1] is None


def test_runner_never_makes_prompt_by_vocabulary_logits(tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits are taken PROMPT_LOGPROB_ROWS rows at a time, and what a step hands the engine
    is [rows, k], not [rows, vocabulary]."""
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", max_num_batched_tokens=2048)
    runner = llm.engine.runner
    monkeypatch.setattr("kvloop.runner.PROMPT_LOGPROB_ROWS", 16)
    seen_rows: list[int] = []
    real_logits, real_execute = runner._logits, runner.execute

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        seen_rows.append(hidden.shape[0])
        return real_logits(hidden)

    chunks = []

    def execute(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real_execute(*args, **kwargs)
        chunks.extend(result.prompt_logprobs.values())
        return result

    monkeypatch.setattr(runner, "_logits", logits)
    monkeypatch.setattr(runner, "execute", execute)
    llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=3))
    assert max(seen_rows) == 16 and sum(seen_rows) == len(PROMPT) - 1
    assert len(chunks) == 1
    assert chunks[0].top_ids.shape == (len(PROMPT) - 1, 3)
    assert chunks[0].logprobs.shape == (len(PROMPT) - 1,)
    assert PROMPT_LOGPROB_ROWS >= 16


def test_scored_chunks_spend_the_heads_share_of_the_budget() -> None:
    """With the head costing half a forward per scored position, a scored prompt takes
    chunks of 2/3 of the budget; a plain one the whole budget; decodes are unchanged."""
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 30, True, scored_token_cost=0.5), kv)
    scored = Request("scored", list(range(100, 150)), SamplingParams(max_tokens=0,
                                                                     prompt_logprobs=2))
    sched.add_request(scored)
    out = sched.schedule()
    assert [s.num_tokens for s in out.prefills] == [20]  # 20 + ceil(20 * 0.5) = 30
    sched.commit(out)
    out = sched.schedule()
    assert [s.num_tokens for s in out.prefills] == [20]
    sched.commit(out)
    plain = Request("plain", list(range(300, 340)), SamplingParams(max_tokens=1))
    sched.add_request(plain)
    out = sched.schedule()
    # The last 10 positions score 9 tokens (the last predicts nothing in the prompt):
    # 10 + ceil(4.5) = 15 of the budget; the plain prompt gets the other 15.
    assert [(s.request_id, s.num_tokens) for s in out.prefills] == [("scored", 10),
                                                                    ("plain", 15)]


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


# --- acceptance: a long scored prompt beside 8 streams, on the default model ----------------
NUM_STREAMS = 8
SCORED_TOKENS = 4000
# The default step budget: beside decoding streams a prompt runs at most
# max_prefill_tokens_while_decoding (128) positions a step, and the scored positions' head
# work is charged to that share too (ModelConfig.head_cost_ratio).
# The KV pool's pages become resident as blocks are first written (runner.py), and blocks
# are handed out least recently freed first: a pool barely larger than the warm-up touched
# keeps the KV cache's own growth out of the memory comparison. int8 KV: ~12 KB a token.
KV_FLAGS = ("--kv-cache-dtype", "int8", "--kv-cache-memory", "96MiB")


def vm_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _stream_times(url: str, i: int, times: list[float], stop: asyncio.Event) -> None:
    body = {"prompt": f"Tell me a story, number {i}:", "max_tokens": 600, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client, \
            client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return  # hanging up aborts the stream and frees its blocks


async def _scored_beside_streams(url: str, ids: list[int]) -> tuple[dict, float, float,
                                                                    list[list[float]]]:
    times: list[list[float]] = [[] for _ in range(NUM_STREAMS)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_stream_times(url, i, times[i], stop))
             for i in range(NUM_STREAMS)]
    while not all(len(t) >= 3 for t in times):  # every stream is decoding
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.monotonic()
        r = await client.post("/v1/completions", json={
            "prompt": ids, "echo": True, "logprobs": 20, "max_tokens": 0})
        end = time.monotonic()
    stop.set()
    await asyncio.gather(*tasks)
    assert r.status_code == 200, r.text
    return r.json(), start, end, times


def _longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest wait between two tokens of a stream, over the scored request's span."""
    gaps = [b - a for a, b in itertools.pairwise(times) if b > start and a < end]
    assert gaps, "the stream produced nothing while the scored prompt ran"
    return max(gaps)


@pytest.mark.serial
@pytest.mark.slow
def test_scored_prompt_keeps_other_streams_pace_and_returns_its_memory(
        default_gguf: Path, tmp_path: Path) -> None:
    rng = random.Random(25)
    ids = [rng.randrange(1000, 40000) for _ in range(SCORED_TOKENS)]
    warm = [rng.randrange(1000, 40000) for _ in range(SCORED_TOKENS)]
    with kvloop_serve(default_gguf, tmp_path, *KV_FLAGS) as server:
        client = httpx.Client(base_url=server.url, timeout=600)
        # Warm-up: the KV pages of a prompt this long, and the scoring path over all of it
        # (its response is as large as the measured one's): what the process keeps after
        # one such request is its working set, what it keeps more after the next a leak.
        r = client.post("/v1/completions", json={
            "prompt": warm, "echo": True, "logprobs": 20, "max_tokens": 0})
        assert r.status_code == 200, r.text
        before = vm_rss_mib(server.proc.pid)
        body, start, end, times = asyncio.run(_scored_beside_streams(server.url, ids))
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == SCORED_TOKENS and lp["token_logprobs"][0] is None
        # {text: log-prob}: alternatives that decode to the same text (byte pieces of one
        # character, all "\ufffd" alone) share one key, so a few positions list fewer.
        sizes = [len(top) for top in lp["top_logprobs"][1:]]
        assert max(sizes) == 20 and sizes.count(20) > 0.9 * len(sizes), sizes
        del body, lp
        wait_idle(client)
        after = vm_rss_mib(server.proc.pid)
        gaps = [_longest_gap(t, start, end) for t in times]
        print(f"scored {SCORED_TOKENS} tokens in {end - start:.1f} s; longest gaps "
              f"{[round(g, 2) for g in gaps]} s; VmRSS {before:.0f} -> {after:.0f} MiB")
        assert max(gaps) < 1.0, gaps
        assert after - before < 100, (before, after)
        client.close()


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> None:
    """Nothing runs, waits or holds a KV block (a hung-up stream's abort lands between
    engine steps)."""
    deadline = time.monotonic() + timeout
    while True:
        text = client.get("/metrics").text
        busy = [metric(text, f"kvloop_{m}") for m in
                ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used")]
        if busy == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
