"""Verifying draft tokens: which of a sequence's proposed tokens the model accepts.

A sequence that ran k draft tokens gives k + 1 rows of logits: row i is the model's
distribution for the token after the sequence's last token and drafts[:i]. Its rows arrive
with the history each row has (output so far plus the drafts before it), so penalties,
min_tokens and every other control shape each row exactly as they would without drafts.

- Greedy rows accept the longest run of drafts equal to the argmax, then take the argmax
  of the first row that disagrees (or of the last row when all agree): the same tokens as
  plain greedy decoding.
- Sampled rows use the standard rejection rule (Leviathan et al., Chen et al. 2023): draft
  x is accepted with probability min(1, p(x) / q(x)); on rejection the token is drawn from
  max(0, p - q), renormalised; when every draft is accepted one more is drawn from the last
  row's p. The output then has exactly the target's distribution p. A lookup proposer
  (n-gram) proposes a point mass, q(x) = 1, so the rule is: accept with probability p(x),
  else draw from p with x removed. Every draw uses the request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvloop.sampling.sampler import Sampler, SamplingRow
from kvloop.sampling.sampler import _logprobs as logprobs_of


@dataclass
class VerifiedToken:
    token_id: int
    logprob: float  # under the raw logits, as the sampler reports it
    top_logprobs: list[tuple[int, float]] | None


def verify_drafts(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                  drafts: Sequence[Sequence[int]]) -> list[list[VerifiedToken]]:
    """Per sequence, the tokens it gains: its accepted drafts and one more token.

    logits: [R, V], the rows of all sequences back to back (len(drafts[s]) + 1 rows for
    sequence s); rows: one SamplingRow per logits row, same order.
    """
    x = sampler.process_logits(logits, rows)  # [R, V]: what each row chooses from
    greedy = torch.tensor([r.params.greedy for r in rows])
    argmax = x.argmax(dim=-1).tolist()  # [R]; used by greedy rows only
    probs = x.softmax(dim=-1) if not bool(greedy.all()) else None  # [R, V]

    chosen_rows: list[int] = []
    chosen_ids: list[int] = []
    per_seq: list[int] = []  # tokens gained by each sequence
    start = 0
    for d in drafts:
        gained = 0
        for i in range(len(d) + 1):
            row = start + i
            r = rows[row]
            if r.params.greedy:
                tok = argmax[row]
                accepted = i < len(d) and tok == d[i]
            else:
                assert probs is not None
                tok, accepted = _rejection_step(probs[row], d[i] if i < len(d) else None,
                                                r.generator)
            chosen_rows.append(row)
            chosen_ids.append(tok)
            gained += 1
            if not accepted:
                break
        per_seq.append(gained)
        start += len(d) + 1

    chosen_logits = logits[chosen_rows]  # [C, V]
    lps, tops = logprobs_of(chosen_logits, torch.tensor(chosen_ids),
                            [rows[i] for i in chosen_rows],
                            torch.logsumexp(chosen_logits, dim=-1))
    lp_list = lps.tolist()
    out: list[list[VerifiedToken]] = []
    j = 0
    for n in per_seq:
        out.append([VerifiedToken(chosen_ids[j + t], lp_list[j + t], tops[j + t])
                    for t in range(n)])
        j += n
    return out


def _rejection_step(p: torch.Tensor, draft: int | None,
                    generator: torch.Generator | None) -> tuple[int, bool]:
    """One sampled row against a point-mass draft: (token, whether it was the draft)."""
    if draft is None:  # past the last draft: a plain draw from p
        return int(torch.multinomial(p, 1, generator=generator)), False
    u = float(torch.rand((), generator=generator))
    if u < float(p[draft]):
        return draft, True
    residual = p.clone()  # [V]
    residual[draft] = 0.0
    if float(residual.sum()) <= 0.0:  # p was a point mass on the draft (u hit exactly 1)
        return draft, True
    return int(torch.multinomial(residual, 1, generator=generator)), False
