"""Chat templates render in worker processes (issue 25, item 3): a template's C-level work
(`sum` over lists, which checks no deadline and holds the interpreter lock) no longer
freezes the server. The worker is killed at the time limit, runs under a memory limit, and
imports jinja2, not torch; the common render stays a cheap pipe round trip."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import metric
from kvloop.errors import ModelLoadError
from kvloop.loading import chat_template
from kvloop.loading.chat_template import (
    TEMPLATE_MAX_MEMORY,
    TEMPLATE_TIME_LIMIT_S,
    TemplateLimitError,
)
from test_hostile_files import CHATML, tokenizer
from test_server_shutdown import kvloop_serve

# One C-level call: quadratic list concatenation, seconds of work between two Python lines.
C_LEVEL = "{{ (([[0]] * 300000) | sum(start=[])) | length }}"
# Every step within the size limits (a fresh 4 MB string each), together gigabytes in a second.
MEMORY_BOMB = ("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}"
               "{% set ns.x = [ns.x, 'A' * 4000000 ~ i] %}{% endfor %}")
# Hostile only when asked, so that the server loads it (its sample chats render).
SERVED_TEMPLATE = (
    "{% if messages[-1]['content'] == 'freeze' %}" + C_LEVEL + "{% endif %}"
    "{% if messages[-1]['content'] == 'bomb' %}" + MEMORY_BOMB + "{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The limit, the kill's grace (0.5 s: kills land at 1.5 s) and a second of slack for a
# loaded 2-core machine; the work itself would take seconds more.
KILLED_WITHIN = TEMPLATE_TIME_LIMIT_S + 1.5
CHAT = [{"role": "user", "content": "hi"}]


def test_the_worker_imports_jinja2_not_torch() -> None:
    code = ("import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "import kvloop.loading.template_sandbox; print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-c", code,
                          json.dumps(chat_template._worker_path())],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    modules = set(json.loads(out))
    assert "jinja2" in modules
    assert not modules & {"torch", "numpy", "tokenizers", "kvloop.loading.tokenizer"}


def test_the_engine_process_never_imports_jinja2() -> None:
    """Templates render in the workers: the process that loads a model and renders a chat
    (through a worker) imports no jinja2 (its import was ~5% of a one-shot command)."""
    code = ("import json, sys\n"
            "from kvloop.loading.tokenizer import Tokenizer\n"
            "import kvloop.engine.llm_engine\n"
            "from kvloop.loading.chat_template import render_chat_template\n"
            "out = render_chat_template(sys.argv[1], {'messages': [{'role': 'user', "
            "'content': 'hi'}], 'add_generation_prompt': True})\n"
            "print(json.dumps([out, 'jinja2' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, CHATML], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    rendered, imported = json.loads(out)
    assert rendered == "<|start|>user hi<|end|> <|start|>assistant "
    assert imported is False


def test_c_level_work_is_killed_at_the_limit_and_the_pool_recovers() -> None:
    tok = tokenizer()
    tok.chat_template = C_LEVEL  # past the load check
    start = time.monotonic()
    with pytest.raises(TemplateLimitError, match="timed out"):
        tok.apply_chat_template(CHAT)
    assert time.monotonic() - start < KILLED_WITHIN
    assert tokenizer().encode_chat(CHAT) == [7, 4, 3, 8, 7, 5]  # a fresh worker renders


def test_c_level_work_does_not_hold_this_process() -> None:
    """While a worker grinds, this interpreter runs: a ticking loop never waits long."""
    tok = tokenizer()
    tok.chat_template = C_LEVEL
    done = threading.Event()

    def render() -> None:
        with contextlib.suppress(TemplateLimitError):
            tok.apply_chat_template(CHAT)
        done.set()

    threading.Thread(target=render).start()
    last, longest = time.monotonic(), 0.0
    while not done.is_set():
        time.sleep(0.01)
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    assert longest < 0.5, longest


SMALL_MEMORY = 128 * 2**20  # a worker's interpreter and jinja2 take ~26 MiB of it


@pytest.fixture
def small_memory_workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Render workers as the server starts them, but under a 128 MiB memory limit: a bomb
    then reaches the limit after ~25 MB of pages instead of ~500 MB. On a busy machine,
    faulting in 500 MB took longer than the 1 s time limit (a CI run), so the memory limit
    went untested; at 128 MiB it is reached well inside the time limit everywhere."""
    boot = chat_template._BOOT.replace(
        "_worker_main()", f"_worker_main(max_memory={SMALL_MEMORY})")
    assert boot != chat_template._BOOT
    monkeypatch.setattr(chat_template, "_BOOT", boot)
    monkeypatch.setattr(chat_template, "_pools", {})
    yield
    chat_template._pool().close()


def test_workers_run_under_the_memory_limit() -> None:
    pool = chat_template._pool()
    worker = pool.acquire()
    try:
        limits = Path(f"/proc/{worker.proc.pid}/limits").read_text().splitlines()
    finally:
        pool.release(worker, reuse=True)
    (line,) = [x for x in limits if x.startswith("Max address space")]
    assert line.split()[3:5] == [str(TEMPLATE_MAX_MEMORY)] * 2


@pytest.mark.usefixtures("small_memory_workers")
def test_memory_bomb_is_refused_by_the_memory_limit() -> None:
    tok = tokenizer()
    tok.chat_template = MEMORY_BOMB
    start = time.monotonic()
    with pytest.raises(TemplateLimitError) as info:
        tok.apply_chat_template(CHAT)
    assert time.monotonic() - start < KILLED_WITHIN
    assert f"out of memory (limit {SMALL_MEMORY // 2**20} MiB)" in str(info.value)
    assert tokenizer().encode_chat(CHAT) == [7, 4, 3, 8, 7, 5]  # a fresh worker renders


@pytest.mark.usefixtures("small_memory_workers")
def test_hostile_templates_are_refused_at_load() -> None:
    for template, words in ((C_LEVEL, "timed out"), (MEMORY_BOMB, "ran out of memory")):
        with pytest.raises(ModelLoadError, match=f"sample chat it {words}"):
            tokenizer(template)


def test_a_worker_killed_from_outside_is_replaced() -> None:
    tok = tokenizer()
    want = tok.apply_chat_template(CHAT)
    for worker in list(chat_template._pool()._idle):
        worker.proc.kill()
        worker.proc.wait()
    assert tok.apply_chat_template(CHAT) == want


def test_workers_are_reused_and_renders_stay_cheap() -> None:
    """A render is a round trip to a warm worker: no process starts per render, and the
    cost stays far under the time limit (about 0.15 ms here against 0.09 ms in-process)."""
    tok = tokenizer(CHATML)
    tok.apply_chat_template(CHAT)
    pool = chat_template._pool()
    pids = {w.proc.pid for w in pool._idle}
    start = time.monotonic()
    for _ in range(200):
        tok.apply_chat_template(CHAT)
    per_render = (time.monotonic() - start) / 200
    assert {w.proc.pid for w in pool._idle} == pids
    assert per_render < 0.01, per_render


def test_a_prestarted_worker_serves_the_first_render() -> None:
    """prestart() boots one worker in the background; a render asked for meanwhile waits
    for it rather than starting a second process, and prestarting again is a no-op."""
    pool = chat_template._WorkerPool(2)
    try:
        pool.prestart()
        pool.prestart()
        worker = pool.acquire()
        assert pool._count == 1 and worker.proc.poll() is None
        pool.release(worker, reuse=True)
        pool.prestart()  # one is idle: nothing to start
        assert pool._count == 1 and len(pool._idle) == 1
    finally:
        pool.close()


# --- the server ---------------------------------------------------------------------------------
def stream_gaps(url: str, model: str, stop: threading.Event, gaps: list[float]) -> None:
    """Greedy completion streams one after another until `stop`: the longest wait between
    two tokens of each goes into `gaps`."""
    body = {"model": model, "prompt": "hello", "max_tokens": 256, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            last, longest = None, 0.0
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        if last is not None:
                            longest = max(longest, now - last)
                        last = now
            gaps.append(longest)


@pytest.mark.serial
def test_served_hostile_template_freezes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "hostile.jinja"
    template.write_text(SERVED_TEMPLATE)
    with kvloop_serve(tiny_model_dir, tmp_path, "--chat-template", str(template)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]

        def chat(content: str) -> httpx.Response:
            return client.post("/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 8, "temperature": 0})

        probe = chat("hello")
        assert probe.status_code == 200, probe.text
        stop, gaps = threading.Event(), []
        streams = threading.Thread(target=stream_gaps, args=(server.url, model, stop, gaps))
        streams.start()
        time.sleep(0.5)  # the stream is running
        health: list[float] = []
        # The bomb reaches the memory limit in ~0.35 s alone (test_memory_bomb_is_refused_by_
        # the_memory_limit pins that limit); here it shares 2 cores with a streaming engine
        # and can meet the 1 s limit first. Either is the worker's refusal, and what this
        # test pins is that neither holds the server.
        for content, words in (("freeze", ("timed out",)),
                               ("bomb", ("out of memory", "timed out"))):
            with httpx.Client(base_url=server.url, timeout=10) as prober:
                done = threading.Event()

                def poll_health(prober: httpx.Client = prober, done: threading.Event = done
                                ) -> None:
                    while not done.is_set():
                        start = time.monotonic()
                        assert prober.get("/health").status_code == 200
                        health.append(time.monotonic() - start)
                        time.sleep(0.05)

                poller = threading.Thread(target=poll_health)
                poller.start()
                start = time.monotonic()
                r = chat(content)
                took = time.monotonic() - start
                done.set()
                poller.join()
            assert r.status_code == 400, r.text
            assert any(w in r.json()["error"]["message"] for w in words), r.text
            assert took < KILLED_WITHIN + 0.5, took
        assert streams.is_alive()  # it ran through both renders
        stop.set()
        streams.join()
        print(f"longest token gap {max(gaps):.3f} s, slowest /health {max(health):.3f} s")
        assert gaps and max(gaps) < 1.0, gaps
        assert health and max(health) < 1.0, max(health)
        assert chat("hello").json()["choices"][0]["message"] == probe.json()["choices"][0][
            "message"]
        text = client.get("/metrics").text
        assert metric(text, "kvloop_num_requests_running") == 0
        assert metric(text, "kvloop_kv_cache_blocks_used") == 0
        assert server.proc.poll() is None
