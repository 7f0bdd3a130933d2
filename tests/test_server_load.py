"""Load on the server: 200 requests from 32 concurrent clients (asyncio + httpx) with varied
prompts, lengths, endpoints and sampling settings, streamed or not, a fraction hanging up
mid-stream. Tiny random model, so it is quick.

Every request is greedy or seeded, and the engine's results do not depend on the batch
(tests/test_batching.py), so each answer must equal what `LLM.generate` gives for the same
prompt and parameters alone: that is how a client knows it got its own answer, all of it.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import wait_until_idle
from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer

NUM_REQUESTS = 200
NUM_CLIENTS = 32
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "def", "return",
         "caf\u00e9", "na\u00efve", "\u4f60\u597d", "12345", "x", "*", "2"]


@dataclass
class Job:
    i: int
    chat: bool
    stream: bool
    disconnect: bool
    prompt: str
    sampling: dict[str, Any]  # OpenAI / SamplingParams names alike
    n: int = 1
    top: int = 0  # top logprobs asked for
    want_text: list[str] = field(default_factory=list)
    want_tokens: list[int] = field(default_factory=list)
    # Chat logprobs list the message's tokens: not an end-of-turn token that ended a choice.
    want_logprob_tokens: int = 0
    want_prompt_tokens: int = 0


@dataclass
class Result:
    status: int
    id: str = ""
    texts: dict[int, str] = field(default_factory=dict)
    logprob_tokens: dict[int, int] = field(default_factory=dict)
    finish: dict[int, str] = field(default_factory=dict)
    usage: dict[str, Any] | None = None


def make_jobs(rng: random.Random) -> list[Job]:
    jobs = []
    for i in range(NUM_REQUESTS):
        words = rng.choices(WORDS, k=rng.randint(1, 30))
        prompt = f"request {i}: " + " ".join(words)  # unique: no two clients share one
        sampling: dict[str, Any] = {"max_tokens": rng.randint(1, 40), "seed": 1000 + i}
        kind = rng.choice(["greedy", "temperature", "top_k", "min_p", "penalties", "stop"])
        if kind == "greedy":
            sampling["temperature"] = 0.0
        elif kind == "temperature":
            sampling.update(temperature=rng.choice([0.5, 1.0, 1.3]), top_p=rng.choice([0.8, 1.0]))
        elif kind == "top_k":
            sampling.update(temperature=0.8, top_k=rng.randint(1, 20))
        elif kind == "min_p":
            sampling.update(temperature=1.0, min_p=0.05)
        elif kind == "penalties":
            sampling.update(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                            repetition_penalty=1.2)
        else:
            sampling.update(temperature=0.0, stop=[rng.choice(["e", " t", "o"])])
        disconnect = rng.random() < 0.15
        if disconnect:  # nothing may end it before its client hangs up
            sampling.update(max_tokens=1000, ignore_eos=True)
            sampling.pop("stop", None)
        jobs.append(Job(i, chat=rng.random() < 0.3, stream=disconnect or rng.random() < 0.5,
                        disconnect=disconnect, prompt=prompt, sampling=sampling,
                        n=2 if not disconnect and rng.random() < 0.1 else 1,
                        top=rng.choice([0, 0, 2])))
    return jobs


def expect(jobs: list[Job], llm: LLM) -> None:
    """What each job must get: LLM.generate on the same prompt and parameters."""
    todo = [j for j in jobs if not j.disconnect]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": j.prompt}]) if j.chat
               else llm.tokenizer.encode(j.prompt) for j in todo]
    params = [SamplingParams(**j.sampling, n=j.n, logprobs=j.top) for j in todo]
    for job, ids, out in zip(todo, prompts, llm.generate(prompts, params), strict=True):
        job.want_prompt_tokens = len(ids)
        job.want_text = [c.text for c in out.outputs]
        job.want_tokens = [len(c.token_ids) for c in out.outputs]
        eos = set(llm.engine.eos_token_ids())
        job.want_logprob_tokens = sum(job.want_tokens) - sum(
            1 for c in out.outputs if job.chat and c.finish_reason == "stop"
            and c.stop_reason is None and c.token_ids and c.token_ids[-1] in eos)


def body(job: Job) -> dict[str, Any]:
    b: dict[str, Any] = {**job.sampling, "n": job.n, "stream": job.stream}
    if job.stream:
        b["stream_options"] = {"include_usage": True}
    if job.chat:
        b.update(messages=[{"role": "user", "content": job.prompt}], logprobs=True,
                 top_logprobs=job.top)
    else:
        b.update(prompt=job.prompt, logprobs=job.top)
    return b


async def run_job(client: httpx.AsyncClient, job: Job) -> Result:
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    if not job.stream:
        r = await client.post(path, json=body(job))
        res = Result(r.status_code)
        if r.status_code != 200:
            return res
        data = r.json()
        res.id, res.usage = data["id"], data["usage"]
        for c in data["choices"]:
            i = c["index"]
            res.texts[i] = c["message"]["content"] if job.chat else c["text"]
            lp = c["logprobs"]
            res.logprob_tokens[i] = len(lp["content"] if job.chat else lp["tokens"])
            res.finish[i] = c["finish_reason"]
        return res
    async with client.stream("POST", path, json=body(job)) as r:
        res = Result(r.status_code)
        if r.status_code != 200:
            return res
        chunks = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                res.finish.setdefault(-1, "[DONE]")
                break
            data = json.loads(line[6:])
            assert "error" not in data, data
            res.id = data["id"]
            if data.get("usage"):
                res.usage = data["usage"]
            for c in data["choices"]:
                i = c["index"]
                text = (c["delta"].get("content") or "") if job.chat else c["text"]
                res.texts[i] = res.texts.get(i, "") + text
                lp = c["logprobs"]
                if lp:
                    res.logprob_tokens[i] = res.logprob_tokens.get(i, 0) + len(
                        lp["content"] if job.chat else lp["tokens"])
                if c["finish_reason"]:
                    assert i not in res.finish, "two finish_reasons for one choice"
                    res.finish[i] = c["finish_reason"]
            chunks += 1
            if job.disconnect and chunks >= 3:
                break  # hang up: leaving the block closes the connection
    return res


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="32MiB"))
    app = create_app(engine, ServerSettings(model_name="tiny"))
    with BackgroundServer(app) as s:
        yield s


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def run_load(url: str, jobs: list[Job], timeout: float) -> tuple[dict[int, Result], float]:
    """The jobs from NUM_CLIENTS clients at once, each taking the next job as it finishes
    one: (results by job index, seconds from the first request to the last answer)."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    results: dict[int, Result] = {}

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
            while not queue.empty():
                job = queue.get_nowait()
                results[job.i] = await run_job(client, job)

    async def main() -> None:
        await asyncio.gather(*(client_loop() for _ in range(NUM_CLIENTS)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return results, time.perf_counter() - t0


def test_200_requests_from_32_clients(server: BackgroundServer, tiny_model_dir: Path) -> None:
    jobs = make_jobs(random.Random(0))
    expect(jobs, LLM(str(tiny_model_dir), kv_cache_memory="32MiB"))
    results, elapsed = run_load(server.url, jobs, timeout=120)

    assert sorted(results) == list(range(NUM_REQUESTS))  # none lost
    ids = [r.id for r in results.values()]
    assert len(set(ids)) == len(ids), "a response id was given twice"
    served = [j for j in jobs if not j.disconnect]
    for job in served:
        res = results[job.i]
        assert res.status == 200, (job, res)
        assert res.usage is not None
        assert res.usage["prompt_tokens"] == job.want_prompt_tokens, job
        assert res.usage["completion_tokens"] == sum(job.want_tokens), job
        assert sum(res.logprob_tokens.values()) == job.want_logprob_tokens, job
        assert res.usage["total_tokens"] == (res.usage["prompt_tokens"]
                                             + res.usage["completion_tokens"])
        assert [res.texts[i] for i in range(job.n)] == job.want_text, job
        assert all(res.finish.get(i) in ("stop", "length") for i in range(job.n)), res.finish
        if job.stream:
            assert res.finish.get(-1) == "[DONE]"
    dropped = [j for j in jobs if j.disconnect]
    assert dropped and all(results[j.i].status == 200 for j in dropped)

    # Every hang-up was aborted and freed its blocks: nothing runs, waits or holds a block.
    text = wait_until_idle(lambda: httpx.get(f"{server.url}/metrics").text)
    aborted = metric(text, 'kvloop_requests_finished_total{finish_reason="abort"}')
    assert aborted == len(dropped)
    assert metric(text, "kvloop_kv_cache_blocks_total") > 0
    print(f"\n{NUM_REQUESTS} requests, {NUM_CLIENTS} clients: {elapsed:.1f} s "
          f"({NUM_REQUESTS / elapsed:.1f} req/s), {len(dropped)} hung up")


# --- soak: many short requests with hang-ups; nothing may accumulate ----------------------------
SOAK_ROUNDS = 8
SOAK_PER_ROUND = 100
SOAK_CLIENTS = 16


def _busy(url: str) -> tuple[float, ...]:
    text = httpx.get(f"{url}/metrics").text
    return tuple(metric(text, f"kvloop_{m}") for m in
                 ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"))


def _python_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.slow
def test_soak_with_disconnects_frees_everything_and_memory_stays_flat(
        server: BackgroundServer) -> None:
    """Rounds of short requests, ~30% hung up mid-stream. After each round nothing runs,
    waits or holds a block; after the warm-up rounds the Python heap holds no more objects
    and the process's RSS grows less than 10%.

    Prompts are token ids of one length and answers one length, so the engine's batches
    take few distinct shapes: its per-shape caches (oneDNN primitives, attention plans)
    fill during the warm-up instead of passing for a leak."""
    import psutil

    rng = random.Random(1)
    proc = psutil.Process()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body: dict[str, Any] = {"prompt": [rng.randrange(2, 300) for _ in range(12)],
                                "max_tokens": 16, "ignore_eos": True, "temperature": 0.8,
                                "seed": i}
        if rng.random() < 0.3:  # hang up after a few events
            body.update(max_tokens=500, stream=True)
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and rng.random() < 0.3:
                        break
            return
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text

    async def round_(start: int) -> None:
        todo = list(range(start, start + SOAK_PER_ROUND))

        async def worker() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                while todo:
                    await one(client, todo.pop())

        await asyncio.gather(*(worker() for _ in range(SOAK_CLIENTS)))

    rss, objects = [], []
    for k in range(SOAK_ROUNDS):
        asyncio.run(round_(k * SOAK_PER_ROUND))
        deadline = time.monotonic() + 10
        while _busy(server.url) != (0, 0, 0):
            assert time.monotonic() < deadline, f"still busy: {_busy(server.url)}"
            time.sleep(0.05)
        objects.append(_python_objects())
        rss.append(proc.memory_info().rss)
    warm = SOAK_ROUNDS // 2
    print("RSS", [f"{r / 2**20:.0f} MiB" for r in rss], "objects", objects)
    assert objects[-1] - objects[warm] < 0.01 * objects[warm], objects
    assert rss[-1] < 1.10 * rss[warm], [f"{r / 2**20:.0f} MiB" for r in rss]
