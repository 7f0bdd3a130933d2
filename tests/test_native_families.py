"""The native step (one C++ call per step, kvloop.models.native) on every family it runs,
against the PyTorch modules and transformers.

Each tiny random model switches on what its family has, with sliding windows that bite
(16 tokens, prompts up to 130): Gemma 3's QK-norm, (1 + w) sandwich norms, GELU-tanh, two
rope bases (and linear scaling on the global layers), embedding scale, tied and untied
heads, final logit soft-capping; Mistral's window on every layer (one sliding KV cache
group); Qwen2's q/k/v biases with use_sliding_window (a full and a sliding group); Phi-3's
fused tensors with a window; Gemma 2's attention and final logit soft-capping; Qwen3's
QK-norm with a window. Greedy
tokens must equal the modules' (use_kernels=False) and transformers', for each prompt
alone and for a batch of 16 with chunked prefill and preemption; the native step must be
what ran (runner.decoder, counted calls). Also the kernel's soft-capping on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    require_native_kernels,
    write_tiny_gemma2,
    write_tiny_gemma3,
    write_tiny_mistral,
    write_tiny_model,
    write_tiny_phi3,
    write_tiny_qwen2,
    write_tiny_qwen3,
)
from kvloop import LLM, SamplingParams
from kvloop.kernels import paged_attention as pa
from kvloop.models.attention import softcapped_sdpa
from kvloop.models.native import describe, native_supported
from kvloop.models.registry import ARCHITECTURES
from test_kernels import ATOL, RTOL, make_case
from test_model_parity import compare_greedy, hf_greedy

WINDOW = 16
KV = "64MiB"
NEW_TOKENS = 24
ALONE = (1, 5, WINDOW - 1, WINDOW + 1, 40, 130)  # around and past the window
BATCH = 16
CHUNK = 32  # max_num_batched_tokens: prompts past it are prefilled in chunks

GLOBAL_ROPE_SCALED = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}


def gemma3_untied_capped(path: Path) -> Path:
    return write_tiny_gemma3(path, tie_word_embeddings=False, final_logit_softcapping=3.0)


def gemma3_rope_scaled(path: Path) -> Path:
    return write_tiny_gemma3(path, rope_parameters=GLOBAL_ROPE_SCALED)


def qwen2_sliding(path: Path) -> Path:
    """q/k/v biases; layer 1 slides (use_sliding_window from max_window_layers on)."""
    return write_tiny_qwen2(path, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)


def qwen3_sliding(path: Path) -> Path:
    """QK-norm (plain w), head_dim 32 unlike hidden / heads; layer 1 slides."""
    return write_tiny_qwen3(path, use_sliding_window=True, sliding_window=WINDOW,
                            max_window_layers=1)


def phi3_sliding(path: Path) -> Path:
    return write_tiny_phi3(path, sliding_window=WINDOW)


# name -> (writer of the tiny model with each variant its family has, KV cache bytes too few
# for 16 sequences of up to 88 tokens: a block is 2 x 16 positions x kv heads x head_dim x
# 4 bytes per layer of a KV cache group; the scheduler must preempt and recompute).
MODELS: dict[str, tuple[Callable[[Path], Path], int]] = {
    # Tied head, QK-norm, 5 local : 1 global (six groups of one layer), window 16.
    "gemma3": (write_tiny_gemma3, 96 * 8192),
    "gemma3-untied-capped": (gemma3_untied_capped, 96 * 8192),
    "gemma3-rope-scaled": (gemma3_rope_scaled, 96 * 8192),
    # Every layer sliding: one sliding group of both layers.
    "mistral": (write_tiny_mistral, 24 * 8192),
    # One full and one sliding group of one layer each.
    "qwen2-sliding": (qwen2_sliding, 48 * 4096),
    "qwen3-sliding": (qwen3_sliding, 48 * 8192),
    "phi3-sliding": (phi3_sliding, 24 * 8192),
    # Attention and final soft-capping; 2 full + 2 sliding layers: two groups of two layers.
    "gemma2": (write_tiny_gemma2, 48 * 16384),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, int]:
    from transformers import AutoModelForCausalLM

    write, tight_kv = MODELS[request.param]
    d = write(tmp_path_factory.mktemp(request.param))
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval(), tight_kv


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


def positions_only(llm: LLM) -> None:
    """Chunks charged by positions alone: beside decodes the scheduler also charges each
    prompt position its attention depth, which on these tiny models (matrices of 64 wide)
    shrinks chunks enough that the tight pool would never fill and preempt."""
    sched = llm.engine.scheduler
    sched.config = dataclasses.replace(sched.config, context_token_cost=0.0)


def assert_matches_transformers(got: list[list[int]], hf: Any,
                                prompts: list[list[int]]) -> None:
    for ours, ids in zip(got, prompts, strict=True):
        want, logits = hf_greedy(hf, ids, NEW_TOKENS)
        assert compare_greedy(ours, want, logits) == len(want)


def test_alone_matches_modules_and_transformers(model: tuple[Path, Any, int]) -> None:
    """Each prompt alone (prefilled whole, natively: fp32 layers have the batched path)."""
    require_native_kernels()
    d, hf, _ = model
    prompts = prompts_of(ALONE, 1)
    llm, calls = native_llm(d, kv_cache_memory=KV)
    spec = describe(llm.engine.model)
    assert spec is not None and any(layer.window == WINDOW for layer in spec.layers)
    got = [greedy(llm, [p])[0] for p in prompts]
    assert calls[0] >= len(prompts) * (NEW_TOKENS - 1)  # every decode step, at least
    modules = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=KV, use_kernels=False)
    assert modules.engine.runner.decoder is None
    assert got == [greedy(modules, [p])[0] for p in prompts]
    assert_matches_transformers(got, hf, prompts)


def test_batch_chunked_and_preempted_matches_modules_and_transformers(
        model: tuple[Path, Any, int]) -> None:
    """16 prompts of 17..62 tokens at once: prefilled in chunks of 32 tokens beside other
    sequences' decode rows, preempted when the blocks run out, recomputed."""
    require_native_kernels()
    d, hf, tight_kv = model
    lengths = tuple(17 + 3 * i for i in range(BATCH))
    prompts = prompts_of(lengths, 2)
    llm, calls = native_llm(d, kv_cache_memory=tight_kv, max_num_batched_tokens=CHUNK)
    positions_only(llm)
    got = greedy(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    assert calls[0] > 0
    assert llm.engine.kv.pool.num_free == llm.engine.kv.pool.num_blocks
    modules = LLM(d, kv_cache_dtype="fp32", kv_cache_memory=tight_kv,
                  max_num_batched_tokens=CHUNK, use_kernels=False)
    positions_only(modules)
    assert greedy(modules, prompts) == got
    assert_matches_transformers(got, hf, prompts)


# Every architecture the registry runs, by a writer of a tiny model of it; GGUF's names
# for an architecture that config.json names otherwise map to the latter.
WRITERS: dict[str, Callable[[Path], Path]] = {
    "llama": write_tiny_model, "mistral": write_tiny_mistral, "qwen2": write_tiny_qwen2,
    "qwen3": write_tiny_qwen3, "phi3": write_tiny_phi3, "gemma2": write_tiny_gemma2,
    "gemma3_text": write_tiny_gemma3,
}
SAME_AS = {"gemma3": "gemma3_text"}


def test_every_registered_family_runs_natively(tmp_path: Path) -> None:
    """native_supported declines no family the registry runs: a family added to the
    registry fails here until it is listed above, and declined if its layers have no
    description (it would run on the modules, slower)."""
    require_native_kernels()
    assert set(ARCHITECTURES) == set(WRITERS) | set(SAME_AS)
    for name, same in SAME_AS.items():
        assert ARCHITECTURES[name].model_class is ARCHITECTURES[same].model_class
        assert ARCHITECTURES[name].describe is ARCHITECTURES[same].describe
    declined = []
    for name, write in WRITERS.items():
        llm = LLM(write(tmp_path / name), kv_cache_memory="16MiB")
        if not native_supported(llm.engine.model) or llm.engine.runner.decoder is None:
            declined.append(name)
    assert declined == []


@pytest.mark.parametrize("window", [0, 5, 40])
def test_kernel_softcaps_the_scores(window: int) -> None:
    """The paged-attention kernel's soft-capping (Gemma 2, as the native step runs it):
    decode rows and prefill chunks in one call, windowed or not, against the modules'
    softcapped_sdpa with the causal window mask."""
    require_native_kernels()
    ctx, rows = [1, 9, 40, 77], [1, 1, 12, 30]
    D, H, Hkv, scale, cap = 32, 4, 2, 0.2, 3.0
    case = make_case(ctx, Hkv, D, 16, seed=window)
    q = torch.randn(sum(rows), H, D, generator=torch.Generator().manual_seed(window)) * 4
    qstart = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()])
    out = pa.paged_attention_varlen(q, case.cache, case.tables, qstart, case.ctx, 16, scale,
                                    window, softcap=cap)
    uncapped = pa.paged_attention_varlen(q, case.cache, case.tables, qstart, case.ctx, 16,
                                         scale, window)
    assert not torch.allclose(out, uncapped, atol=1e-2)  # the cap bites at these scores
    for i, (c, n) in enumerate(zip(ctx, rows, strict=True)):
        r = slice(int(qstart[i]), int(qstart[i + 1]))
        qpos, kpos = torch.arange(c - n, c)[:, None], torch.arange(c)[None, :]
        mask = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        want = softcapped_sdpa(q[r].transpose(0, 1)[None], case.keys[i][None],
                               case.values[i][None], attn_mask=mask, scale=scale, softcap=cap)
        torch.testing.assert_close(out[r], want[0].transpose(0, 1), atol=ATOL, rtol=RTOL)
