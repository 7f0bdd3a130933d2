"""The decode loop and its stop conditions, on a tiny random model (fast)."""

from __future__ import annotations

import pytest

from kvloop import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> LLM:
    # fp32 KV: compared with the no-cache run, which keeps everything in fp32.
    return LLM(str(tiny_model_dir), kv_cache_memory="64MiB", kv_cache_dtype="fp32")


@pytest.fixture(scope="module")
def tiny_nocache(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), use_cache=False)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_positions_processed_with_and_without_cache(tiny, tiny_nocache):
    """1,000 tokens from a 1-token prompt: 1,000 positions with the cache, 500,500 without."""
    cached = tiny.generate([[5]], greedy(1000))[0]
    assert len(cached.outputs[0].token_ids) == 1000
    assert cached.metrics.positions_processed == 1000
    uncached = tiny_nocache.generate([[5]], greedy(1000))[0]
    assert uncached.metrics.positions_processed == sum(range(1, 1001)) == 500_500
    # Same greedy tokens either way: the cache changes the cost, not the result.
    assert uncached.outputs[0].token_ids == cached.outputs[0].token_ids


def test_cached_and_uncached_agree_on_varied_prompts(tiny, tiny_nocache):
    prompts = ["The quick brown fox", "def f(x):", "Caf\u00e9 \u4f60\u597d", "1 2 3"]
    a = tiny.generate(prompts, greedy(40))
    b = tiny_nocache.generate(prompts, greedy(40))
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].text == y.outputs[0].text


def test_max_tokens_is_length(tiny):
    out = tiny.generate("The quick", greedy(7))[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny):
    free = tiny.generate("The quick", greedy(30))[0].outputs[0]
    eos = free.token_ids[4]  # pretend the 5th greedy token is an end token
    tiny.engine.model_config.__dict__["eos_token_ids"] = (eos,)  # frozen dataclass: test hack
    try:
        out = tiny.generate("The quick", SamplingParams(temperature=0, max_tokens=30))[0]
        comp = out.outputs[0]
        assert comp.finish_reason == "stop" and comp.token_ids == free.token_ids[:5]
        assert comp.stop_reason is None
        ignored = tiny.generate("The quick", greedy(30))[0].outputs[0]
        assert ignored.token_ids == free.token_ids
        # min_tokens bans the end token until enough tokens exist.
        later = tiny.generate("The quick", SamplingParams(temperature=0, max_tokens=30,
                                                          min_tokens=8))[0].outputs[0]
        assert len(later.token_ids) >= 8 and eos not in later.token_ids[:7]
    finally:
        tiny.engine.model_config.__dict__["eos_token_ids"] = ()


def test_stop_token_ids(tiny):
    free = tiny.generate("hello", greedy(20))[0].outputs[0]
    stop_id = free.token_ids[6]
    first = free.token_ids.index(stop_id)
    out = tiny.generate("hello", greedy(20, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[: first + 1]


def _stop_string_spanning_tokens(llm: LLM, prompt: str) -> tuple[str, str]:
    """A stop string that starts inside one token and ends inside a later one."""
    comp = llm.generate(prompt, greedy(40))[0].outputs[0]
    tok = llm.tokenizer
    pieces = [tok.decode(comp.token_ids[: i + 1]) for i in range(len(comp.token_ids))]
    for i in range(5, len(pieces) - 1):
        a, b = len(pieces[i - 1]), len(pieces[i])
        if b - a >= 2 and len(pieces[i + 1]) > b:
            stop = comp.text[b - 1: b + 1]  # last char of token i + first of token i+1
            if comp.text.find(stop) == b - 1:
                return comp.text, stop
    pytest.skip("no suitable token boundary in this model's output")


def test_stop_string_spanning_tokens_is_never_emitted(tiny):
    full, stop = _stop_string_spanning_tokens(tiny, "The quick brown fox")
    params = greedy(40, stop=[stop])
    out = tiny.generate("The quick brown fox", params)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.find(stop)]
    streamed = list(tiny.stream("The quick brown fox", params))
    assert "".join(streamed) == out.text
    assert all(stop[0] not in d or d.find(stop[0]) < len(d) for d in streamed)
    assert stop not in "".join(streamed)


def test_stream_deltas_concatenate_to_text(tiny):
    params = greedy(60)
    text = tiny.generate("Caf\u00e9 \u4f60\u597d", params)[0].outputs[0].text
    deltas = list(tiny.stream("Caf\u00e9 \u4f60\u597d", params))
    assert "".join(deltas) == text
    # A random model may emit invalid UTF-8 (then U+FFFD is honest text); the real-model
    # test below shows no delta splits a character.


@pytest.mark.slow
def test_stream_never_splits_utf8_on_default_model(kv_default):
    text = "Write 'caf\u00e9', '\u4f60\u597d' and an emoji: \U0001f600"
    msgs = [{"role": "user", "content": text}]
    ids = kv_default.tokenizer.encode_chat(msgs)
    params = greedy(40)
    text = kv_default.generate([ids], params)[0].outputs[0].text
    deltas = list(kv_default.stream(ids, params))
    assert "".join(deltas) == text
    assert any(ord(ch) > 127 for ch in text), text
    assert len(deltas) < 40  # characters did span several tokens: the case under test
    # Only the very end may hold half a character (max_tokens cut it); it is flushed as is.
    assert not any("\ufffd" in d for d in deltas[:-1])


def test_seeded_sampling_is_reproducible(tiny):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    a = tiny.generate("The", p)[0].outputs[0].token_ids
    b = tiny.generate("The", p)[0].outputs[0].token_ids
    c = tiny.generate("The", SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=8,
                                            ignore_eos=True))[0].outputs[0].token_ids
    assert a == b and a != c


def test_metrics_are_filled(tiny):
    m = tiny.generate("The quick", greedy(10))[0].metrics
    assert m.ttft is not None and m.ttft > 0
    assert m.decode_tokens_per_s is not None and m.decode_tokens_per_s > 0
    assert m.num_output_tokens == 10 and m.positions_processed == m.num_prompt_tokens + 9


def test_logprobs_and_top_logprobs(tiny):
    out = tiny.generate("The", greedy(5, logprobs=3))[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    assert out.top_logprobs is not None and all(len(t) == 3 for t in out.top_logprobs)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-6  # greedy: chosen = best


def test_running_outputs_are_deltas_and_the_final_output_is_whole(tiny):
    """Each step's output carries only what is new (no copy of the history); the deltas
    concatenate to the final output's text, token ids and log-probs."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2,
                            stop=["zz"])
    outs = list(tiny.stream_outputs("The quick", params))
    final = outs[-1].outputs[0]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    for o in outs[:-1]:
        c = o.outputs[0]
        assert c.text == "" and c.token_ids == [] and c.logprobs == []
        assert len(c.delta_logprobs) == len(c.delta_top_logprobs) == len(c.delta_token_ids)
    cs = [o.outputs[0] for o in outs]
    assert "".join(c.delta for c in cs) == final.text
    assert [t for c in cs for t in c.delta_token_ids] == final.token_ids
    assert [lp for c in cs for lp in c.delta_logprobs] == final.logprobs
    assert [row for c in cs for row in c.delta_top_logprobs] == final.top_logprobs
    assert final.cumulative_logprob == pytest.approx(sum(final.logprobs))
