"""Beam search inside the engine against transformers' beam search on the default model."""

from __future__ import annotations

import copy

import pytest
import torch

from kvloop import SamplingParams
from kvloop.sampling.beam import BeamSearch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name a primary colour.",
    "What is 12 times 12?",
]


def hf_beams(model, ids: list[int], eos: int):
    cfg = copy.deepcopy(model.generation_config)
    cfg.update(num_beams=4, length_penalty=1.0, early_stopping=True, max_new_tokens=32,
               num_return_sequences=4, do_sample=False, output_scores=True,
               return_dict_in_generate=True, eos_token_id=eos, pad_token_id=eos)
    with torch.inference_mode():
        r = model.generate(torch.tensor([ids]), generation_config=cfg,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    seqs = []
    for row in r.sequences[:, len(ids):].tolist():
        # Shorter hypotheses are padded with EOS after their own EOS: cut at the first one.
        seqs.append(row[: row.index(eos) + 1] if eos in row else row)
    return seqs, r.sequences_scores.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("question", PROMPTS)
def test_beam_search_matches_transformers(kv_default, hf_default, question):
    hf_model, _ = hf_default
    ids = kv_default.tokenizer.encode_chat([{"role": "user", "content": question}])
    eos = kv_default.engine.eos_token_ids()[0]
    params = SamplingParams(num_beams=4, length_penalty=1.0, early_stopping=True,
                            max_tokens=32, num_return_sequences=4)
    out = kv_default.generate([ids], params)[0].outputs
    ref_seqs, ref_scores = hf_beams(hf_model, ids, eos)
    assert [c.token_ids for c in out] == ref_seqs
    assert [c.score for c in out] == pytest.approx(ref_scores, abs=1e-4)
    assert all(o.score is not None for o in out)


def test_beam_step_hand_computed():
    """Two beams, vocab {1, 2, EOS=9}: the bookkeeping of one step, worked by hand."""
    search = BeamSearch(num_beams=2, max_new_tokens=5, length_penalty=1.0,
                        early_stopping=True, eos_token_ids=[9])
    first = search.step([([], 0.0, [(1, -0.1), (9, -0.5), (2, -1.0), (3, -2.0)])])
    # Candidates by score: 1 (-0.1), EOS (-0.5), 2 (-1.0), 3 (-2.0); EOS is in the top 2,
    # so it finishes with score -0.5 / 1; the running beams are the best two non-EOS.
    assert first.next_beams == [(0, 1, -0.1), (0, 2, -1.0)]
    assert [(h.token_ids, h.score) for h in search.finished] == [([9], -0.5)]
    assert not first.done
    second = search.step([([1], -0.1, [(9, -0.2), (4, -0.3), (5, -3.0), (6, -4.0)]),
                          ([2], -1.0, [(7, -0.1), (9, -0.2), (8, -5.0), (5, -6.0)])])
    # Candidates: [1,9] -0.3, [1,4] -0.4, [2,7] -1.1, [2,9] -1.2: [1,9] finishes with
    # -0.3 / 2 = -0.15; two finished hypotheses with early_stopping=True: done.
    assert [(h.token_ids, round(h.score, 6)) for h in search.finished] == [
        ([1, 9], -0.15), ([9], -0.5)]
    assert second.done
