"""Tensor parallelism (kvloop.distributed): 2 ranks on this machine over gloo give the
greedy tokens of the single process, on tiny random models whose heads split evenly and
unevenly, and on the default model; what cannot be split is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import write_tiny_model
from kvloop import LLM, SamplingParams
from kvloop.config import EngineConfig
from kvloop.distributed import ShardPlan
from kvloop.distributed.tensor_parallel import split_sizes
from kvloop.errors import InvalidParamsError
from kvloop.loading.loader import load_checkpoint

PROMPTS = ["The quick brown fox", "def f(x):\n    return", "Caf\u00e9 na\u00efve 12345",
           "over the lazy dog. The quick"]


def greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def same_as_single(model: str | None, max_tokens: int, **options: object) -> None:
    """Each prompt alone and all of them in one batch: identical tokens on 1 and 2 ranks."""
    single = LLM(model, **options)
    want_batch = greedy(single, PROMPTS, max_tokens)
    want_each = [greedy(single, [p], max_tokens)[0] for p in PROMPTS[:2]]
    tp = LLM(model, tensor_parallel_size=2, **options)
    try:
        assert greedy(tp, PROMPTS, max_tokens) == want_batch
        assert [greedy(tp, [p], max_tokens)[0] for p in PROMPTS[:2]] == want_each
    finally:
        tp.close()


@pytest.fixture(scope="module")
def uneven_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 KV heads (6 query heads) and 100 MLP columns: 2 ranks take 2 + 1 KV heads."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-uneven"), seed=3, hidden_size=96,
                            num_attention_heads=6, num_key_value_heads=3,
                            intermediate_size=101)


def test_split_sizes_and_plan(uneven_model_dir: Path) -> None:
    assert split_sizes(3, 2) == [2, 1] and split_sizes(1536, 2) == [768, 768]
    config = load_checkpoint(uneven_model_dir).config
    plans = [ShardPlan.of(config, r, 2) for r in range(2)]
    assert [(p.kv_start, p.num_kv_heads, p.q_start, p.num_heads) for p in plans] == [
        (0, 2, 0, 4), (2, 1, 4, 2)]
    assert [(p.inter_start, p.intermediate_size) for p in plans] == [(0, 51), (51, 50)]


def test_even_heads_greedy_identical(tiny_model_dir: Path) -> None:
    same_as_single(str(tiny_model_dir), 24)  # 4 heads, 2 KV heads: 1 KV head per rank


def test_uneven_heads_greedy_identical(uneven_model_dir: Path) -> None:
    same_as_single(str(uneven_model_dir), 24)


def test_uneven_heads_without_kernels_or_packing(uneven_model_dir: Path) -> None:
    """The PyTorch attention path and F.linear: the same tokens too."""
    same_as_single(str(uneven_model_dir), 12, use_kernels=False, pack_weights=False)


@pytest.mark.slow
def test_default_model_greedy_identical() -> None:
    """SmolLM2-135M (9 heads, 3 KV heads: split 6 + 3 and 2 + 1) in fp32."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    single = LLM(quantization="none")
    want = greedy(single, prompts, 32)
    tp = LLM(quantization="none", tensor_parallel_size=2)
    try:
        assert greedy(tp, prompts, 32) == want
    finally:
        tp.close()


def test_quantized_weights_refused() -> None:
    for quantization in ("int8", "int4", "gguf"):
        with pytest.raises(InvalidParamsError, match="'none' \\(fp32\\) with "
                                                     "tensor_parallel_size 2"):
            EngineConfig(quantization=quantization, tensor_parallel_size=2)
    with pytest.raises(InvalidParamsError, match="a draft model is not sharded"):
        EngineConfig(speculative="self:int4", tensor_parallel_size=2)
    with pytest.raises(InvalidParamsError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


def test_too_many_ranks_refused_before_any_spawn(tiny_model_dir: Path) -> None:
    """2 KV heads cannot go to 3 ranks: one error naming the numbers, no process left."""
    import multiprocessing

    with pytest.raises(InvalidParamsError,
                       match="tensor_parallel_size 3 cannot split this model: its "
                             "num_key_value_heads is 2"):
        LLM(str(tiny_model_dir), tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run([sys.executable, "-m", "kvloop.cli", "generate", *args],
                          capture_output=True, text=True, encoding="utf-8", timeout=300,
                          env=env, check=False)


def test_cli_generate_tensor_parallel_same_text(uneven_model_dir: Path) -> None:
    args = ["The quick brown fox", "--model", str(uneven_model_dir), "--max-tokens", "20",
            "--kv-cache-memory", "16MiB"]
    single = run_generate(*args)
    tp = run_generate(*args, "--tensor-parallel", "2")
    assert single.returncode == 0, single.stderr
    assert tp.returncode == 0, tp.stderr
    assert single.stdout.strip() and tp.stdout == single.stdout


def test_cli_refuses_quantized_tensor_parallel_in_one_line(tiny_model_dir: Path) -> None:
    p = run_generate("hi", "--model", str(tiny_model_dir), "--quantization", "int8",
                     "--tensor-parallel", "2")
    assert p.returncode == 2
    assert "tensor_parallel_size 2" in p.stderr and "Traceback" not in p.stderr


def test_server_completion_equals_single_process(uneven_model_dir: Path) -> None:
    """/v1/completions served by a 2-rank engine answers what 1 process generates."""
    import httpx

    from kvloop.engine.llm_engine import LLMEngine
    from kvloop.server.app import ServerSettings, create_app
    from kvloop.server.background import BackgroundServer

    prompt = "The quick brown fox"
    single = LLM(str(uneven_model_dir), kv_cache_memory="16MiB")
    want = single.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    engine = LLMEngine(str(uneven_model_dir),
                       EngineConfig(kv_cache_memory="16MiB", tensor_parallel_size=2))
    try:
        app = create_app(engine, ServerSettings(model_name="tiny"))
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url,
                                                            timeout=120) as client:
            r = client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.outputs[0].text
    finally:
        engine.close()


def test_dead_rank_is_a_clear_error_not_a_hang(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), kv_cache_memory="16MiB", tensor_parallel_size=2)
    group = llm.engine.tensor_parallel
    assert group is not None
    try:
        group.processes[0].kill()
        group.processes[0].join(timeout=10)
        # The engine fails the step's requests (fault isolation) with the reason.
        out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4))[0]
        assert out.error is not None and "kvloop-tp-rank1 exited" in out.error
    finally:
        llm.close()


def test_serve_command_tensor_parallel_end_to_end(uneven_model_dir: Path) -> None:
    """`kvloop serve --tensor-parallel 2` as its own process: its completion equals the
    single process's, and stopping it leaves no rank behind."""
    import socket
    import time

    import httpx

    from kvloop.client import probe

    prompt = "The quick brown fox"
    single = LLM(str(uneven_model_dir), kv_cache_memory="16MiB")
    want = single.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvloop.server.cli", "--model", str(uneven_model_dir),
         "--port", str(port), "--kv-cache-memory", "16MiB", "--tensor-parallel", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while probe(url) != "ok":
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.outputs[0].text
        ranks = children(proc.pid)
        assert ranks, "no rank process under the server"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in ranks):
        assert time.monotonic() < deadline, f"ranks {ranks} outlived the server\n{out}"
        time.sleep(0.2)


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
