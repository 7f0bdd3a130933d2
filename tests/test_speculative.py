"""Speculative decoding with n-gram lookup: exact for greedy, the target's distribution for
sampling, and clean KV accounting whatever is accepted or rejected."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy.stats import chisquare

from conftest import inject_forward_failure, write_tiny_model
from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError, ModelLoadError
from kvloop.params import SamplingParams
from kvloop.runner import kv_cache_bytes_per_block
from kvloop.sampling import Sampler, SamplingRow
from kvloop.sampling.rejection import verify_drafts
from kvloop.spec import NgramProposer

# Repetitive prompts: lookup finds matches (and the tiny random model loops, so its own
# output feeds the lookup too).
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6],
    [20, 21, 22, 20, 21, 22, 20, 21],
    list(range(30, 60)) + list(range(30, 45)),
    [100, 101, 102, 103],
    [7] * 5,
]


# Every proposer: prompt lookup, and the model's own quantized weights as a draft model.
METHODS = ["ngram", "self:int8", "self:int4"]


def make_engine(model_dir, method: str | None, **kw) -> LLMEngine:
    spec: dict = {}
    if method == "ngram":
        spec = dict(speculative="ngram", ngram_min=1, ngram_max=3)
    elif method is not None:
        spec = dict(speculative=method)
    return LLMEngine(str(model_dir), EngineConfig(block_size=16, **spec, **kw))


def run(engine: LLMEngine, prompts, params) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    stats = engine.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    draft_kv = getattr(engine.proposer, "kv", None)  # a draft model's own pool
    if draft_kv is not None:
        assert draft_kv.pool.num_free == draft_kv.pool.num_blocks
    return finals


PARAMS = {
    "plain": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    "penalties": SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.3),
    "min_tokens_and_bias": SamplingParams(temperature=0, max_tokens=30, min_tokens=12,
                                          logit_bias={5: 2.0, 6: -1.0}),
    "logprobs": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
    "short": SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(PARAMS))
def test_greedy_with_drafts_is_token_identical(tiny_model_dir, name, method):
    params = PARAMS[name]
    base = run(make_engine(tiny_model_dir, None), PROMPTS, params)
    engine = make_engine(tiny_model_dir, method)
    spec = run(engine, PROMPTS, params)
    drafted = accepted = 0
    for rid, out in base.items():
        a, b = out.outputs[0], spec[rid].outputs[0]
        assert b.token_ids == a.token_ids, rid
        assert b.text == a.text and b.finish_reason == a.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
        if params.logprobs:
            assert [[t for t, _ in row] for row in b.top_logprobs] == \
                   [[t for t, _ in row] for row in a.top_logprobs]
        drafted += spec[rid].metrics.num_draft_tokens
        accepted += spec[rid].metrics.num_accepted_tokens
    if params.max_tokens > 3:
        assert drafted > accepted  # some drafts were rolled back
    if name in ("plain", "logprobs"):
        assert accepted > 0  # (penalties steer the model away from repeating itself)


@pytest.mark.parametrize("method", METHODS)
def test_stop_string_inside_an_accepted_run(tiny_model_dir, method):
    """A stop found in the middle of an accepted run ends the output there."""
    probe = run(make_engine(tiny_model_dir, None), PROMPTS[:1],
                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = probe["r0"].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop],
                            stop_token_ids=[probe["r0"].outputs[0].token_ids[25]])
    a = run(make_engine(tiny_model_dir, None), PROMPTS[:1], params)["r0"].outputs[0]
    b = run(make_engine(tiny_model_dir, method), PROMPTS[:1], params)["r0"].outputs[0]
    assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == \
           (a.text, a.token_ids, a.finish_reason, a.stop_reason)


@pytest.mark.parametrize("method", METHODS)
def test_greedy_identical_in_a_mixed_batch_with_chunked_prefill_and_preemption(
        tiny_model_dir, method):
    prompts = [p * 3 for p in PROMPTS] * 3
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * len(prompts)
    params[1] = SamplingParams(max_tokens=20, num_beams=2)  # never speculates
    # A small pool (preemption) and a small token budget (chunked prefill).
    # (fp32 KV: the block size in bytes is fp32's.)
    kw = dict(kv_cache_memory=24 * kv_cache_bytes_per_block(2, 2, 16, 16),
              kv_cache_dtype="fp32", max_num_batched_tokens=32)
    base_engine = make_engine(tiny_model_dir, None, **kw)
    base = run(base_engine, prompts, params)
    engine = make_engine(tiny_model_dir, method, speculative_max_batch=64, **kw)
    spec = run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for rid, out in base.items():
        assert [c.token_ids for c in spec[rid].outputs] == [c.token_ids for c in out.outputs]
    assert spec["r1"].metrics.num_draft_tokens == 0
    assert sum(o.metrics.num_accepted_tokens for o in spec.values()) > 0


def test_no_drafts_when_the_batch_is_compute_bound(tiny_model_dir):
    method = "ngram"
    engine = make_engine(tiny_model_dir, method, speculative_max_batch=2)
    outs = run(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert all(o.metrics.num_draft_tokens == 0 for o in outs.values())


# -- sampling keeps the target's distribution ----------------------------------------------------


def _next_token_frequencies(logits: torch.Tensor, params: SamplingParams, draft: int,
                            trials: int, accept_all: bool) -> collections.Counter:
    """First-token counts from verify_drafts over one draft token (or, as a negative
    control, a 'verifier' that takes every draft)."""
    sampler = Sampler()
    gen = torch.Generator().manual_seed(1234)
    counts: collections.Counter = collections.Counter()
    for _ in range(trials):
        rows = [SamplingRow(params, [1], [], gen), SamplingRow(params, [1], [draft], gen)]
        if accept_all:
            counts[draft] += 1
            continue
        toks = verify_drafts(sampler, logits, rows, [[draft]])[0]
        counts[toks[0].token_id] += 1
    return counts


@pytest.mark.parametrize("accept_all", [False, True])
def test_rejection_sampling_has_the_target_distribution(accept_all):
    """Chi-square of first-token counts against the target's probabilities (temperature
    and top-p applied); the negative control, accepting every draft, must fail it."""
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(2, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4)
    target = Sampler().process_logits(logits[:1], [SamplingRow(params, [1], [], None)])
    p = target.softmax(dim=-1)[0]
    draft = int(p.argsort()[-2])  # a likely but not the likeliest token
    trials = 4000
    counts = _next_token_frequencies(logits, params, draft, trials, accept_all)
    support = [t for t in range(vocab) if p[t] > 0]
    assert set(counts) <= set(support)
    observed = [counts.get(t, 0) for t in support]
    expected = [float(p[t]) * trials for t in support]
    scale = trials / sum(expected)
    _, pvalue = chisquare(observed, [e * scale for e in expected])
    if accept_all:
        assert pvalue < 1e-6
    else:
        assert pvalue > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_sampled_requests_with_drafts_finish_and_release(tiny_model_dir, method):
    engine = make_engine(tiny_model_dir, method)
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=30, ignore_eos=True, seed=3)
    outs = run(engine, PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs.values())
    assert sum(o.metrics.num_draft_tokens for o in outs.values()) > 0


@pytest.mark.parametrize("method", METHODS)
def test_failed_speculative_step_commits_no_draft(tiny_model_dir, method):
    """A forward that raises in a step verifying drafts commits none of them: the request
    fails, its blocks are freed, and a request with the same prefix gets cold tokens."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = PROMPTS[0] * 4  # three full blocks, and lookup finds drafts at once
    cold = run(make_engine(tiny_model_dir, None), [prompt], params)["r0"]

    engine = make_engine(tiny_model_dir, method)
    engine.add_request("victim", prompt, params)
    victim = engine.scheduler.requests["victim"]
    for _ in range(20):  # until lookup finds drafts (the model's output repeats itself)
        engine.step()
        if victim.spec_token_ids:
            break
    assert victim.spec_token_ids  # the next step verifies drafts: make it fail
    committed = victim.num_computed_tokens
    drafted = victim.metrics.num_draft_tokens
    inject_forward_failure(engine, at_step=1, seen=[])
    (failed,) = engine.step()
    assert failed.finished and failed.error and "injected" in failed.error
    assert victim.num_computed_tokens == committed  # nothing of the step committed
    assert victim.metrics.num_draft_tokens == drafted
    assert engine.stats().kv.num_used_blocks == 0
    again = run(engine, [prompt], params)["r0"]
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_per_request_opt_out_and_cap(tiny_model_dir):
    method = "self:int8"
    engine = make_engine(tiny_model_dir, method)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=False),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                             num_speculative_tokens=1)]
    outs = run(engine, PROMPTS[:2], params)
    assert outs["r0"].metrics.num_draft_tokens == 0
    m = outs["r1"].metrics
    assert m.num_draft_tokens > 0 and m.num_draft_tokens == m.num_spec_steps  # one a step


def test_ngram_proposer_finds_the_latest_longest_match():
    p = NgramProposer(1, 3)
    assert p.lookup([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]
    assert p.lookup([1, 2, 3, 7, 2, 3, 8, 2, 3], 5) == [8, 2, 3]  # latest of two matches
    assert p.lookup([5, 6, 7, 5], 3) == [6, 7, 5]
    assert p.lookup([1, 2, 3], 2) == [] and p.lookup([1], 3) == []
    assert NgramProposer(2, 3).lookup([4, 1, 9, 1], 3) == []  # a 1-gram is too short
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def test_a_separate_draft_model_with_the_same_tokenizer(tiny_model_dir, tmp_path):
    """draft:PATH: another (here: differently seeded) model drafts; output is the target's."""
    draft = write_tiny_model(tmp_path / "draft", seed=7)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = run(make_engine(tiny_model_dir, None), PROMPTS, params)
    spec = run(make_engine(tiny_model_dir, f"draft:{draft}"), PROMPTS, params)
    for rid, out in base.items():
        assert spec[rid].outputs[0].token_ids == out.outputs[0].token_ids
    assert sum(o.metrics.num_draft_tokens for o in spec.values()) > 0


def test_draft_models_that_cannot_work_are_refused(tiny_model_dir, tmp_path):
    other = write_tiny_model(tmp_path / "other-vocab", vocab_size=300)
    with pytest.raises(ModelLoadError, match="does not share the target's tokenizer"):
        make_engine(tiny_model_dir, f"draft:{other}")
    with pytest.raises(InvalidParamsError, match="smaller weights") as info:
        EngineConfig(speculative="self:int4", quantization="int4")
    assert info.value.param == "speculative"
    for bad in ("draft:", "self:fp16", "eagle"):
        with pytest.raises(InvalidParamsError):
            EngineConfig(speculative=bad)


def test_a_failing_proposer_costs_drafts_not_requests(tiny_model_dir):
    engine = make_engine(tiny_model_dir, "self:int8")

    def broken(requests):
        raise RuntimeError("draft model exploded")

    engine.proposer.propose = broken  # type: ignore[union-attr,method-assign]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = run(make_engine(tiny_model_dir, None), PROMPTS[:2], params)
    outs = run(engine, PROMPTS[:2], params)
    for rid, out in base.items():
        assert outs[rid].error is None
        assert outs[rid].outputs[0].token_ids == out.outputs[0].token_ids
        assert outs[rid].metrics.num_draft_tokens == 0


def test_draft_length_follows_acceptance_and_backs_off():
    from kvloop.engine.llm_engine import MAX_SPEC_PAUSE, _SpecState

    st = _SpecState(4)
    assert st.next_k() == 4
    st.update(drafted=4, accepted=4, k_max=6)
    assert st.next_k() == 6  # all accepted: ask for two more (capped)
    st.update(drafted=6, accepted=2, k_max=6)
    assert st.next_k() == 3  # one more than were accepted
    st.update(drafted=3, accepted=0, k_max=6)
    assert st.next_k() == 1  # a miss: one draft, no pause yet
    st.update(drafted=1, accepted=0, k_max=6)
    assert [st.next_k() for _ in range(5)] == [0, 0, 0, 0, 1]  # two misses: pause 4 steps
    for _ in range(10):
        st.update(drafted=1, accepted=0, k_max=6)
    assert st.pause == MAX_SPEC_PAUSE
    st.pause = 0
    st.update(drafted=1, accepted=1, k_max=6)
    assert (st.misses, st.next_k()) == (0, 3)
