"""kvloop's model and decode loop against transformers, the independent oracle.

Greedy token ids must equal transformers' `generate`; logits must agree within 1e-3. The
only excusable divergence is a true tie (top-2 logits within 1e-4 at that step), and the
test shows it by checking the oracle's own logits at the divergent step.
"""

from __future__ import annotations

import pytest
import torch

from conftest import (
    write_tiny_gemma2,
    write_tiny_gemma3,
    write_tiny_llama3,
    write_tiny_mistral,
    write_tiny_model,
    write_tiny_phi3,
    write_tiny_qwen2,
    write_tiny_qwen3,
)
from kvloop import LLM, SamplingParams
from kvloop.models import AttentionMetadata, PrefillSegment

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):  # complete this Python function",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]
NEW_TOKENS = 64
TIE = 1e-4


def kv_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """kvloop's model on a whole sequence, no cache: logits at every position. [T, V]"""
    model = llm.engine.model
    with torch.inference_mode():
        t = torch.tensor(ids)
        meta = AttentionMetadata(prefills=[PrefillSegment(0, len(ids))])
        h = model(t, torch.arange(len(ids)), meta)
        return model.compute_logits(h)


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers generate, greedy, EOS ignored; returns new ids and per-step logits [n, V]."""
    import copy

    # Unset fields of a passed config fall back to the model's own (EOS included), so the
    # model's generation config itself is what must lose its EOS.
    cfg = copy.deepcopy(model.generation_config)
    cfg.update(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
               output_logits=True, return_dict_in_generate=True)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), generation_config=cfg,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    new = out.sequences[0, len(ids):].tolist()
    assert len(new) == n, "the oracle stopped early: EOS was not ignored"
    return new, torch.cat(out.logits, dim=0).float()


def compare_greedy(kv_ids: list[int], hf_ids: list[int], hf_step_logits: torch.Tensor) -> int:
    """Index of the first divergence (len if none); asserts any divergence is a true tie."""
    for t, (a, b) in enumerate(zip(kv_ids, hf_ids, strict=True)):
        if a != b:
            top2 = hf_step_logits[t].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE, f"step {t}: kvloop chose {a}, transformers {b}, logit gap {gap:.2e}"
            print(f"excused tie at step {t}: top-2 logit gap {gap:.2e}")
            return t
    return len(kv_ids)


def check_model(llm: LLM, hf_model, prompts: list[list[int]], n_new: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        comp = out.outputs[0]
        assert len(comp.token_ids) == n_new and comp.finish_reason == "length"
        hf_ids, hf_logits = hf_greedy(hf_model, ids, n_new)
        agree = compare_greedy(comp.token_ids, hf_ids, hf_logits)
        # Logits of every step up to the divergence (the whole run, without a tie), from
        # kvloop's model on the same sequence, against the oracle's per-step logits.
        seq = ids + comp.token_ids
        ours = kv_logits(llm, seq)[len(ids) - 1: len(ids) - 1 + agree]
        assert (ours - hf_logits[:agree]).abs().max().item() < 1e-3
        # The cached decode loop reports logprobs of the chosen tokens: same numbers.
        ref_lp = torch.log_softmax(hf_logits[:agree], -1).gather(
            1, torch.tensor(hf_ids[:agree]).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(comp.logprobs[:agree]), ref_lp, atol=1e-3)


@pytest.mark.slow
def test_default_model_greedy_matches_transformers(kv_default, hf_default):
    hf_model, _ = hf_default
    prompts = [kv_default.tokenizer.encode_chat([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    assert len(prompts) >= 8
    # Last-position logits of each prompt, directly.
    for ids in prompts:
        with torch.inference_mode():
            ref = hf_model(torch.tensor([ids])).logits[0, -1]
        assert (kv_logits(kv_default, ids)[-1] - ref).abs().max().item() < 1e-3
    check_model(kv_default, hf_model, prompts, NEW_TOKENS)


# One tiny random model per family kvloop runs, each written by transformers, each with its
# distinguishing feature set so that it matters (tests/test_families.py shows it does).
TINY_FAMILIES = {
    "llama": write_tiny_model,
    "llama3": write_tiny_llama3,  # rope scaling
    "qwen2": write_tiny_qwen2,  # q/k/v biases
    "qwen3": write_tiny_qwen3,  # QK-norm, explicit head_dim
    "mistral": write_tiny_mistral,  # sliding window on every layer
    "phi3": write_tiny_phi3,  # fused qkv / gate-up weights
    "gemma2": write_tiny_gemma2,  # attention + final softcapping, alternating windows
    "gemma3": write_tiny_gemma3,  # QK-norm, 5:1 local/global, two rope bases
}


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_tiny_hf_model_greedy_matches_transformers(family, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir if family == "llama" else TINY_FAMILIES[family](tmp_path / family)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), kv_cache_memory="64MiB", kv_cache_dtype="fp32")  # the oracle's
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 130)]
    check_model(llm, hf_model, prompts, 48)
