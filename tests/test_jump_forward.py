"""Jump-forward and speculation under a grammar: forced tokens and drafts are verified like
any draft, so constrained greedy output is token for token what one-token-a-step constrained
decoding writes, in fewer engine steps; masks for draft rows follow the grammar one token
at a time and leave the matcher as it was."""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass

import jsonschema
import pytest
import torch

from kvloop import LLM, SamplingParams
from kvloop.params import StructuredOutput
from kvloop.sampling.processors import unpack_bitmask
from structured_schemas import REGEXES, SCHEMAS


def chat_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


@contextmanager
def jump_forward(llm: LLM, on: bool):
    """The engine's jump-forward switch (EngineConfig.jump_forward), flipped for one run
    so that both runs share the same loaded model."""
    before = llm.engine.jump_forward
    llm.engine.jump_forward = on
    try:
        yield
    finally:
        llm.engine.jump_forward = before


def run_alone(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """Each request by itself (the same forward shapes whatever else is queued); the
    outputs and the engine steps they took."""
    start = llm.engine.num_steps
    outs = [llm.generate([ids], p, use_tqdm=False)[0] for ids, p in zip(prompts, params,
                                                                         strict=True)]
    return outs, llm.engine.num_steps - start


def schema_requests(llm: LLM, temperature: float = 0.0):
    prompts = [chat_ids(llm, ask) for _, _, ask in SCHEMAS]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                             structured=StructuredOutput(json_schema=schema))
              for i, (_, schema, _) in enumerate(SCHEMAS)]
    return prompts, params


def regex_requests(llm: LLM):
    prompts = [chat_ids(llm, ask) for _, _, ask in REGEXES]
    params = [SamplingParams(temperature=0.0, max_tokens=120,
                             structured=StructuredOutput(regex=regex))
              for _, regex, _ in REGEXES]
    return prompts, params


@dataclass
class Reference:
    """Requests (the greedy schema ones, then the regex ones) and what each wrote alone,
    one token a step: the outputs every faster way must reproduce."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    outputs: list
    schema_steps: int  # engine steps the schema requests took


@pytest.fixture(scope="module")
def one_token_a_step(kv_default) -> Reference:
    """Each request alone without jump-forward (one run shared by the tests below)."""
    schema_prompts, schema_params = schema_requests(kv_default)
    regex_prompts, regex_params = regex_requests(kv_default)
    with jump_forward(kv_default, False):
        schemas, schema_steps = run_alone(kv_default, schema_prompts, schema_params)
        regexes, _ = run_alone(kv_default, regex_prompts, regex_params)
    return Reference(schema_prompts + regex_prompts, schema_params + regex_params,
                     schemas + regexes, schema_steps)


@pytest.mark.slow
def test_jump_forward_same_tokens_fewer_steps(kv_default, one_token_a_step):
    n = len(SCHEMAS)
    prompts, params = one_token_a_step.prompts[:n], one_token_a_step.params[:n]
    ref, ref_steps = one_token_a_step.outputs[:n], one_token_a_step.schema_steps
    with jump_forward(kv_default, True):
        out, steps = run_alone(kv_default, prompts, params)
    for (name, schema, _), a, b in zip(SCHEMAS, ref, out, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, name
        assert a.outputs[0].finish_reason == "stop", name
        jsonschema.validate(json.loads(b.outputs[0].text), schema)
        assert a.metrics.num_forced_tokens == 0
    forced = [o.metrics.num_forced_tokens for o in out]
    # Every schema here is an object or array with fixed punctuation: something is forced.
    assert all(f > 0 for f in forced), dict(zip([n for n, _, _ in SCHEMAS], forced,
                                                strict=True))
    # One step per token without it; each forced token accepted saves one, except that
    # a request whose grammar completes inside a forced run ends without the step's own
    # token (at most one such step per request).
    assert ref_steps == sum(len(o.outputs[0].token_ids) for o in ref)
    assert ref_steps - sum(forced) <= steps <= ref_steps - sum(forced) + len(SCHEMAS)
    assert steps < 0.9 * ref_steps


@pytest.mark.slow
def test_jump_forward_sampled_outputs_validate(kv_default):
    """Sampled rows verify forced tokens with the rejection rule: outputs still follow
    the schema (distribution kept; tests/test_speculative.py checks the rule itself)."""
    prompts, params = schema_requests(kv_default, temperature=1.0)
    outs = kv_default.generate(prompts[:8], params[:8], use_tqdm=False)
    for (name, schema, _), o in zip(SCHEMAS[:8], outs, strict=True):
        assert o.outputs[0].finish_reason == "stop", name
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert sum(o.metrics.num_forced_tokens for o in outs) > 0


@pytest.fixture(scope="module")
def kv_ngram():
    return LLM(quantization="none", speculative="ngram")


@pytest.mark.slow
def test_constrained_outputs_identical_with_speculation(kv_ngram, one_token_a_step):
    ref = one_token_a_step
    for jf in (False, True):
        stats0 = kv_ngram.engine.stats()
        with jump_forward(kv_ngram, jf):
            out, _ = run_alone(kv_ngram, ref.prompts, ref.params)
        for i, (a, b) in enumerate(zip(ref.outputs, out, strict=True)):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids, (jf, i)
        stats = kv_ngram.engine.stats()
        # The proposer's guesses ran under the grammar, and some were right.
        assert stats.num_accepted_tokens > stats0.num_accepted_tokens


@pytest.mark.slow
def test_jump_forward_with_prefix_cache_and_n(kv_default):
    """A second identical request hits the prefix cache and writes the same tokens; n = 2
    siblings fork before anything is forced and each follows the schema."""
    _, schema, ask = SCHEMAS[0]
    ids = chat_ids(kv_default, ask)
    p = SamplingParams(temperature=0.0, max_tokens=200,
                       structured=StructuredOutput(json_schema=schema))
    first = kv_default.generate([ids], p, use_tqdm=False)[0]
    again = kv_default.generate([ids], p, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    two = kv_default.generate([ids], SamplingParams(
        n=2, temperature=1.0, seed=3, max_tokens=200,
        structured=StructuredOutput(json_schema=schema)), use_tqdm=False)[0]
    assert len(two.outputs) == 2
    for c in two.outputs:
        jsonschema.validate(json.loads(c.text), schema)


def test_draft_masks_follow_the_grammar(kv_default):
    """Row i of fill_masks is the mask after consuming drafts[:i] one by one; the matcher
    is left as it was; past a refused draft the rows repeat the last mask."""
    grammars = kv_default.engine.grammars
    so = StructuredOutput(json_schema={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}}, "required": ["name"],
        "additionalProperties": False})
    m = grammars.matcher(so)
    forced = grammars.forced_tokens(m)
    assert kv_default.tokenizer.decode(forced).startswith('{"name')
    drafts = [*forced, *kv_default.tokenizer.encode(' "Bo')]
    masks = grammars.fill_masks(m, drafts)  # [1 + k, W]
    step = grammars.matcher(so)
    for i, tok in enumerate(drafts):
        assert torch.equal(masks[i], grammars.fill_masks(step)[0]), i
        assert step.consume_token(tok)
    assert torch.equal(masks[-1], grammars.fill_masks(step)[0])
    # The matcher that computed the rows is back where it started.
    assert torch.equal(grammars.fill_masks(m)[0], masks[0])
    assert grammars.valid_prefix(m, drafts) == len(drafts)
    # A refused draft (a digit where the key's quote must come) ends the valid rows.
    bad = [forced[0], kv_default.tokenizer.encode("7")[0], forced[1]]
    rows = grammars.fill_masks(m, bad)
    assert grammars.valid_prefix(m, bad) == 1
    assert not bool(unpack_bitmask(rows[1:2], kv_default.engine.model_config.vocab_size)
                    [0, bad[1]])
    assert torch.equal(rows[2], rows[1])
    assert torch.equal(grammars.fill_masks(m)[0], masks[0])


def test_compiled_grammar_is_shared_matchers_are_not(kv_default):
    """A grammar text is compiled once; each request's matcher is its own copy, so one
    request's progress never moves another's."""
    grammars = kv_default.engine.grammars
    so = StructuredOutput(regex="(ab|cd)+")
    a, b = grammars.matcher(so), grammars.matcher(so)
    assert a is not b
    start = grammars.fill_masks(b)[0]
    assert a.consume_token(kv_default.tokenizer.encode("ab")[0])
    assert torch.equal(grammars.fill_masks(b)[0], start)
    assert not torch.equal(grammars.fill_masks(a)[0], start)
    assert torch.equal(grammars.fill_masks(grammars.matcher(so))[0], start)
