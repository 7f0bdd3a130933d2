"""The native step (one C++ call per step, kvloop.models.native) on every family it runs,
against the PyTorch modules and transformers.

Each tiny random model switches on what its family has: Gemma 3's sliding windows that
bite (16 tokens, prompts up to 130), QK-norm, (1 + w) sandwich norms, GELU-tanh, two rope
bases (and linear scaling on the global layers), embedding scale, tied and untied heads,
final logit soft-capping. Greedy tokens must equal the modules' (use_kernels=False) and
transformers', for each prompt alone and for a batch of 16 with chunked prefill and
preemption; the native step must be what ran (runner.decoder, counted calls).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import require_native_kernels, write_tiny_gemma3
from kvloop import LLM, SamplingParams
from kvloop.models.native import native_supported
from test_model_parity import compare_greedy, hf_greedy

WINDOW = 16
KV = "64MiB"
NEW_TOKENS = 24
ALONE = (1, 5, WINDOW - 1, WINDOW + 1, 40, 130)  # around and past the window
BATCH = 16
# 96 blocks of 8 KiB (one layer's block of a group of one layer): too few for 16 sequences
# of up to 88 tokens each, so the scheduler preempts and recomputes.
TIGHT_KV = 96 * 8192
CHUNK = 32  # max_num_batched_tokens: prompts past it are prefilled in chunks

GLOBAL_ROPE_SCALED = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}

# name -> writer of the tiny model: each variant the family has.
MODELS: dict[str, Callable[[Path], Path]] = {
    "gemma3": write_tiny_gemma3,  # tied head, QK-norm, 5 local : 1 global, window 16
    "gemma3-untied-capped": lambda p: write_tiny_gemma3(
        p, tie_word_embeddings=False, final_logit_softcapping=3.0),
    "gemma3-rope-scaled": lambda p: write_tiny_gemma3(p, rope_parameters=GLOBAL_ROPE_SCALED),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    d = MODELS[request.param](tmp_path_factory.mktemp(request.param))
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def prompts_of(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


def greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def native_llm(d: Path, **kw: Any) -> tuple[LLM, list[int]]:
    """An engine whose steps must run natively, and a counter of the native steps."""
    llm = LLM(d, kv_cache_dtype="fp32", **kw)
    runner = llm.engine.runner
    assert native_supported(llm.engine.model)
    assert runner.decoder is not None and runner.native_prefill  # fp32: prefill too
    calls = [0]
    step = runner._native_step

    def counted(sched: Any) -> torch.Tensor:
        calls[0] += 1
        return step(sched)

    runner._native_step = counted  # type: ignore[method-assign]
    return llm, calls


def assert_matches_transformers(got: list[list[int]], hf: Any,
                                prompts: list[list[int]]) -> None:
    for ours, ids in zip(got, prompts, strict=True):
        want, logits = hf_greedy(hf, ids, NEW_TOKENS)
        assert compare_greedy(ours, want, logits) == len(want)


def test_alone_matches_modules_and_transformers(model: tuple[Path, Any]) -> None:
    """Each prompt alone (prefilled whole, natively when the prefill path is ready)."""
    require_native_kernels()
    d, hf = model
    prompts = prompts_of(ALONE, 1)
    llm, calls = native_llm(d, kv_cache_memory=KV)
    assert len(llm.engine.runner.kv_groups) > 1  # sliding groups: one table each
    got = [greedy(llm, [p])[0] for p in prompts]
    assert calls[0] >= len(prompts) * (NEW_TOKENS - 1)  # every decode step, at least
    modules = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV, use_kernels=False)
    assert modules.engine.runner.decoder is None
    assert got == [greedy(modules, [p])[0] for p in prompts]
    assert_matches_transformers(got, hf, prompts)


def test_batch_chunked_and_preempted_matches_modules_and_transformers(
        model: tuple[Path, Any]) -> None:
    """16 prompts of 17..64 tokens at once: prefilled in chunks of 32 tokens beside other
    sequences' decode rows, preempted when the 96 blocks run out, recomputed."""
    require_native_kernels()
    d, hf = model
    lengths = tuple(17 + 3 * i for i in range(BATCH))
    prompts = prompts_of(lengths, 2)
    llm, calls = native_llm(d, kv_cache_memory=TIGHT_KV, max_num_batched_tokens=CHUNK)
    got = greedy(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert calls[0] > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    modules = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=TIGHT_KV,
                  max_num_batched_tokens=CHUNK, use_kernels=False)
    assert greedy(modules, prompts) == got
    assert_matches_transformers(got, hf, prompts)
