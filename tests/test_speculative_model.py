"""Speculative decoding on the default model (SmolLM2-135M-Instruct, fp32): greedy with each
proposer gives token-identical output to greedy without speculation, on 16 varied prompts
(open chat, code, input-grounded: repeat / edit / summarize a text or code given in the
prompt), 64 new tokens each: alone (one request at a time), in a batch of 32 where half the
requests do not speculate, with chunked prefill, and under preemption; prefix caching is on
throughout (the engine's default).

The reference (no speculation) runs once per module and is shared by every parametrization.
"""

from __future__ import annotations

import pytest

from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.errors import InvalidParamsError
from kvloop.params import SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 64  # 128 took six minutes of the suite; 64 gives every proposer drafts to verify
# Every proposer to hold to the acceptance bar; one the engine does not take yet is skipped.
PROPOSERS = ["ngram", "self:int4"]

_CODE = '''def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
_TEXT = ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. "
         "Residents praised the safer crossings, but shop owners worried about losing parking "
         "spaces in front of their stores. After two hours of debate, the council agreed to "
         "a six-month trial, with a review of traffic and sales figures in the spring.")
_LIST = "apples, bread, milk, eggs, butter, rice, tomatoes, onions, cheese, coffee"

# (kind, user message): chat goes through the model's chat template.
PROMPTS = [
    ("chat", "What are three tips for staying focused while studying?"),
    ("chat", "Explain why the sky is blue to a ten-year-old."),
    ("chat", "Write a short poem about the sea at night."),
    ("chat", "What is the difference between a virus and a bacterium?"),
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("code", "Write a JavaScript function that returns the n-th Fibonacci number."),
    ("code", "Write a SQL query that lists the ten customers with the most orders."),
    ("code", "Write a bash script that counts the lines of every .py file in a folder."),
    ("grounded", f"Repeat the following code exactly, then explain it:\n\n{_CODE}"),
    ("grounded", "Rename the function to merge_sorted and the variable out to result in "
                 f"this code, and show the whole new code:\n\n{_CODE}"),
    ("grounded", f"Add type hints and a docstring to this function:\n\n{_CODE}"),
    ("grounded", f"Summarize this text in two sentences:\n\n{_TEXT}"),
    ("grounded", f"Repeat this text word for word:\n\n{_TEXT}"),
    ("grounded", f"Rewrite this text in the first person, as a shop owner:\n\n{_TEXT}"),
    ("grounded", f"Sort this shopping list alphabetically, one item a line: {_LIST}"),
    ("grounded", "Translate this Python to JavaScript, keeping the same names:\n\n"
                 f"{_CODE}"),
]

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
NO_SPEC = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                         speculative=False)

# The default model's config, read once (the engines below share the loaded checkpoint).
# fp32 ("none"): the identity tests were written against the fp32 model.
_BASE = dict(block_size=16, max_model_len=1024, quantization="none")


@pytest.fixture(scope="module")
def reference():
    """Token ids of the prompts, and their greedy outputs without speculation (one batch)."""
    engine = LLMEngine(None, EngineConfig(**_BASE))
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": text}])
               for _, text in PROMPTS]
    outs = token_ids(run(engine, prompts, [GREEDY] * len(prompts)))
    assert all(len(o) == MAX_TOKENS for o in outs)
    return engine.checkpoint, prompts, outs


def make_engine(checkpoint, proposer: str, **kw) -> LLMEngine:
    try:
        config = EngineConfig(**{**_BASE, **kw}, speculative=proposer)
    except InvalidParamsError as e:
        pytest.skip(f"EngineConfig does not take speculative={proposer!r} yet: {e}")
    return LLMEngine(None, config, checkpoint=checkpoint)


def run(engine: LLMEngine, prompts, params, one_at_a_time: bool = False) -> list:
    """The final RequestOutput per prompt; checks every KV block came back afterwards."""
    ids = []
    finals = {}

    def drain() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    assert out.error is None, out.error
                    finals[out.request_id] = out

    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        ids.append(engine.add_request(f"r{i}", p, sp))
        if one_at_a_time:
            drain()
    drain()
    stats = engine.stats()
    assert stats.kv.num_used_blocks == 0 and stats.num_running == stats.num_waiting == 0
    draft_kv = getattr(engine.proposer, "kv", None)  # a draft model's own pool
    if draft_kv is not None:
        assert draft_kv.pool.num_free == draft_kv.pool.num_blocks
    return [finals[rid] for rid in ids]


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def accepted(outs) -> tuple[int, int]:
    """(drafted, accepted) tokens summed over the outputs."""
    return (sum(o.metrics.num_draft_tokens for o in outs),
            sum(o.metrics.num_accepted_tokens for o in outs))


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)))


def assert_identical(got: list[list[int]], want: list[list[int]], labels) -> None:
    bad = [f"{label}: first difference at token {first_difference(g, w)}"
           for g, w, label in zip(got, want, labels, strict=True) if g != w]
    assert not bad, "greedy with speculation differs from greedy without:\n" + "\n".join(bad)


def labels(n: int = len(PROMPTS)) -> list[str]:
    return [f"prompt {i % len(PROMPTS)} ({PROMPTS[i % len(PROMPTS)][0]})" for i in range(n)]


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_alone(reference, proposer):
    """One request at a time through the same engine (batch size 1 throughout)."""
    checkpoint, prompts, want = reference
    engine = make_engine(checkpoint, proposer)
    outs = run(engine, prompts, [GREEDY] * len(prompts), one_at_a_time=True)
    assert_identical(token_ids(outs), want, labels())
    drafted, acc = accepted(outs)
    assert drafted > 0 and acc > 0


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_batch_of_32_half_not_speculating(reference, proposer):
    """Each prompt twice in one batch of 32: once speculating, once with speculative=False;
    speculative_max_batch 64 so that drafts do run at this batch size."""
    checkpoint, prompts, want = reference
    engine = make_engine(checkpoint, proposer, speculative_max_batch=64)
    n = len(prompts)
    outs = run(engine, prompts * 2, [GREEDY] * n + [NO_SPEC] * n)
    assert_identical(token_ids(outs), want * 2, labels(2 * n))
    drafted, acc = accepted(outs[:n])
    assert drafted > 0 and acc > 0
    assert accepted(outs[n:]) == (0, 0)


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_chunked_prefill_and_prefix_cache(reference, proposer):
    """A 48-token step budget: prompts prefill in chunks beside other sequences' verify
    rows (drafts count against the budget too); the prompts share the chat template's
    system prefix, so later ones start from cached blocks."""
    checkpoint, prompts, want = reference
    engine = make_engine(checkpoint, proposer, max_num_batched_tokens=48,
                         speculative_max_batch=64)
    outs = run(engine, prompts, [GREEDY] * len(prompts))
    assert_identical(token_ids(outs), want, labels())
    assert max(len(p) for p in prompts) > 48  # the chunking did happen
    assert sum(o.metrics.num_cached_tokens for o in outs) > 0
    assert accepted(outs)[1] > 0


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_under_preemption(reference, proposer):
    """A KV pool of 48 blocks (768 tokens) for 16 sequences of ~100-220 tokens: the
    scheduler preempts (and recomputes) sequences mid-speculation."""
    checkpoint, prompts, want = reference
    blocks = 48
    per_block = engine_bytes_per_block(checkpoint)
    engine = make_engine(checkpoint, proposer, kv_cache_memory=blocks * per_block,
                         max_model_len=512, speculative_max_batch=64)
    outs = run(engine, prompts, [GREEDY] * len(prompts))
    assert engine.scheduler.num_preemptions > 0
    assert_identical(token_ids(outs), want, labels())
    assert accepted(outs)[1] > 0


def engine_bytes_per_block(checkpoint) -> int:
    from kvloop.runner import kv_cache_bytes_per_block

    c = checkpoint.config
    return kv_cache_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim,
                                    _BASE["block_size"])
