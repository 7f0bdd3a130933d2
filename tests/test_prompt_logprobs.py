"""Prompt log-probabilities: computed in the prompt's own forward (chunked or not), equal to
transformers' log_softmax over the same weights, and max_tokens=0 scores a prompt alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.errors import InvalidParamsError

PROMPTS = [[5, 9, 33, 12, 7, 100, 3, 44, 21, 17, 60, 2, 8],
           [7, 7, 7, 8, 9, 10, 11, 12, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
           [42, 43]]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[torch.Tensor]:
    """transformers' log_softmax at every prompt position: [len, V] per prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in PROMPTS]


def check(out, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        lp, alts = plp[i]
        assert lp == pytest.approx(float(ref[i - 1, prompt[i]]), abs=1e-4)
        if top:
            want = ref[i - 1].topk(top)
            assert [t for t, _ in alts] == want.indices.tolist()
            assert [v for _, v in alts] == pytest.approx(want.values.tolist(), abs=1e-4)
        else:
            assert alts is None


@pytest.mark.parametrize("budget", [2048, 5])  # whole prompts, and chunks of 5 tokens
def test_prompt_logprobs_equal_transformers(tiny_model_dir, reference, budget):
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", kv_cache_dtype="fp32",
              max_num_batched_tokens=budget)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=3))
    for out, prompt, ref in zip(outs, PROMPTS, reference, strict=True):
        assert out.finished and out.outputs[0].token_ids == []
        assert out.outputs[0].finish_reason == "length"
        check(out, prompt, ref, 3)
    assert llm.engine.stats().kv.num_used_blocks == 0


def test_prompt_logprobs_beside_a_completion_and_a_cached_prefix(tiny_model_dir, reference):
    """A prompt whose head is in the prefix cache is still scored from its own forward,
    and generation goes on as usual after it."""
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", kv_cache_dtype="fp32", block_size=4)
    plain = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6))[0]
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6,
                                                    prompt_logprobs=0))[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.metrics.num_cached_tokens == 0  # no prefix-cache hit for a scored prompt
    check(out, PROMPTS[1], reference[1], 0)
    streamed = [o for o in llm.stream_outputs(PROMPTS[0], SamplingParams(
        temperature=0, max_tokens=4, prompt_logprobs=1))]
    with_plp = [o for o in streamed if o.prompt_logprobs is not None]
    assert with_plp[0] is streamed[0] and with_plp[-1] is streamed[-1]  # first and final
    check(streamed[0], PROMPTS[0], reference[0], 1)


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidParamsError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidParamsError, match="prompt_logprobs"):
        SamplingParams(max_tokens=4, prompt_logprobs=21)
    with pytest.raises(InvalidParamsError, match="beam search"):
        SamplingParams(max_tokens=4, num_beams=2, prompt_logprobs=0)


def test_prompt_only_request_ends_on_a_chunk_of_its_last_position(tiny_model_dir, reference):
    """max_tokens=0 with chunks of 6: PROMPTS[0] (13 tokens) runs 6 + 6 + 1, and the last
    chunk, only the final position, scores no prompt token and samples nothing; the request
    must finish there anyway (it once stayed running, its step empty, forever)."""
    llm = LLM(tiny_model_dir, kv_cache_memory="16MiB", kv_cache_dtype="fp32",
              max_num_batched_tokens=6)
    engine = llm.engine
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, scored_token_cost=0)
    engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=0, prompt_logprobs=0))
    final = [out for _ in range(5) for out in engine.step() if out.finished]
    assert engine.num_steps == 3 and [o.request_id for o in final] == ["r"]
    check(final[0], PROMPTS[0], reference[0], 0)
    assert engine.stats().kv.num_used_blocks == 0
