"""Sampler and logits processors, each checked against an independent reference.

References: transformers' logits processors on the same random logits, composed in the
sampler's order (bias, suppression, repetition penalty, presence/frequency, then for sampled
rows temperature, min-p, top-k, top-p), or hand-computed values. Sampling is checked
statistically (chi-square) and by never drawing a filtered-out token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvloop.errors import InvalidParamsError
from kvloop.params import SamplingParams
from kvloop.sampling import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_presence_frequency_penalties,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_p,
    token_counts,
)

V = 64
NO_IDS = torch.zeros(1, 0, dtype=torch.long)  # warpers ignore input_ids


def row(
    prompt: Sequence[int] = (1, 2, 3),
    output: Sequence[int] = (),
    seed: int | None = None,
    suppress: Sequence[int] = (),
    **params: Any,
) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), gen, suppress)


def rand_logits(b: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3.0


def reference(logits_row: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """One row through transformers' processors (hand-computed where it has none), in order."""
    p = r.params
    x = logits_row.unsqueeze(0).clone()  # [1, V]
    ids = torch.tensor([[*r.prompt_ids, *r.output_ids]], dtype=torch.long)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor([[[t], float(b)] for t, b in p.logit_bias.items()])(ids, x)
    if r.suppress_ids:
        x = SuppressTokensLogitsProcessor(list(r.suppress_ids))(ids, x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    counts = Counter(r.output_ids)
    for t, c in counts.items():  # OpenAI's formula, by hand
        x[0, t] -= p.presence_penalty + p.frequency_penalty * c
    if p.greedy:
        return x[0]
    if p.temperature != 1.0:
        x = TemperatureLogitsWarper(p.temperature)(NO_IDS, x)
    if p.min_p > 0:
        x = MinPLogitsWarper(p.min_p)(NO_IDS, x)
    if p.top_k > 0:
        x = TopKLogitsWarper(p.top_k)(NO_IDS, x)
    if p.top_p < 1.0:
        x = TopPLogitsWarper(p.top_p)(NO_IDS, x)
    return x[0]


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "different tokens filtered"
    finite = ~torch.isinf(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Processors against transformers, on whole batches with per-row parameters
# ---------------------------------------------------------------------------------------------


def test_temperature_matches_transformers() -> None:
    logits = rand_logits(3)
    temps = [0.3, 1.0, 1.7]
    got = apply_temperature(logits, torch.tensor(temps))
    for i, t in enumerate(temps):
        assert_same_logits(got[i], TemperatureLogitsWarper(t)(NO_IDS, logits[i : i + 1])[0])


def test_top_k_matches_transformers_per_row() -> None:
    logits = rand_logits(4)
    ks = [1, 5, 0, 1000]  # 0 disables; k > V keeps everything
    got = apply_top_k(logits, torch.tensor(ks))
    for i, k in enumerate(ks):
        want = logits[i] if k == 0 else TopKLogitsWarper(k)(NO_IDS, logits[i : i + 1])[0]
        assert_same_logits(got[i], want)
    assert [int((~got[i].isinf()).sum()) for i in range(4)] == [1, 5, V, V]


def test_top_k_keeps_ties_like_transformers() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    got = apply_top_k(logits, torch.tensor([2]))
    assert_same_logits(got[0], TopKLogitsWarper(2)(NO_IDS, logits)[0])
    assert got[0].isinf().tolist() == [False, True, False, False, True]


def test_top_p_matches_transformers_per_row() -> None:
    logits = rand_logits(4)
    ps = [0.05, 0.5, 0.9, 1.0]
    got = apply_top_p(logits, torch.tensor(ps))
    for i, p in enumerate(ps):
        want = logits[i] if p == 1.0 else TopPLogitsWarper(p)(NO_IDS, logits[i : i + 1])[0]
        assert_same_logits(got[i], want)


def test_min_p_matches_transformers_per_row() -> None:
    logits = rand_logits(4)
    mps = [0.0, 0.05, 0.3, 1.0]
    got = apply_min_p(logits, torch.tensor(mps))
    for i, mp in enumerate(mps):
        want = logits[i] if mp == 0 else MinPLogitsWarper(mp)(NO_IDS, logits[i : i + 1])[0]
        assert_same_logits(got[i], want)
    assert int((~got[3].isinf()).sum()) == 1  # min_p = 1 keeps only the top token


@pytest.mark.parametrize("with_min_p", [False, True])
def test_top_k_then_top_p_matches_transformers_chain(with_min_p: bool) -> None:
    """The candidate fast path (every top-p row has top-k) and the sorting fallback (a top-p
    row without top-k) both equal TopK then TopP applied one row at a time."""
    logits = rand_logits(5, seed=3)
    if with_min_p:  # min-p leaves -inf among the top-k candidates
        logits = apply_min_p(logits, torch.full((5,), 0.02))
    for ks, ps in [([3, 10, 0, 20, 40], [0.8, 0.5, 1.0, 1.0, 0.95]),
                   ([3, 0, 0, 20, 40], [0.8, 0.5, 1.0, 1.0, 0.95])]:
        got = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
        for i, (k, p) in enumerate(zip(ks, ps, strict=True)):
            want = logits[i : i + 1]
            if k:
                want = TopKLogitsWarper(k)(NO_IDS, want)
            if p < 1:
                want = TopPLogitsWarper(p)(NO_IDS, want)
            assert_same_logits(got[i], want[0])


def test_top_k_top_p_with_ties_falls_back_correctly() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    got = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.99]))
    want = TopPLogitsWarper(0.99)(NO_IDS, TopKLogitsWarper(2)(NO_IDS, logits))
    assert_same_logits(got[0], want[0])


def test_repetition_penalty_matches_transformers() -> None:
    logits = rand_logits(3)
    histories = [[1, 5, 5, 9], [0, 63, 2], []]
    penalties = [1.3, 0.7, 2.0]
    seen = token_counts(histories, V) > 0
    got = apply_repetition_penalty(logits, seen, torch.tensor(penalties))
    for i, (h, pen) in enumerate(zip(histories, penalties, strict=True)):
        ids = torch.tensor([h], dtype=torch.long) if h else NO_IDS
        want = RepetitionPenaltyLogitsProcessor(pen)(ids, logits[i : i + 1].clone())
        assert_same_logits(got[i], want[0])


def test_presence_frequency_penalties_hand_computed() -> None:
    logits = torch.zeros(2, 6)
    counts = token_counts([[1, 1, 1, 4], [2]], 6)
    got = apply_presence_frequency_penalties(
        logits, counts, torch.tensor([0.5, -1.0]), torch.tensor([0.25, 2.0])
    )
    # row 0: id 1 seen 3x -> -(0.5 + 0.75); id 4 once -> -(0.5 + 0.25)
    # row 1: id 2 once -> -(-1.0 + 2.0)
    want = torch.tensor([[0, -1.25, 0, 0, -0.75, 0], [0, 0, -1.0, 0, 0, 0]])
    torch.testing.assert_close(got, want)


def test_token_counts_drops_out_of_range_ids() -> None:
    counts = token_counts([[0, 3, 3, 99, -1], []], 4)
    assert counts.tolist() == [[1, 0, 0, 2], [0, 0, 0, 0]]


# ---------------------------------------------------------------------------------------------
# The sampler: each row of a mixed batch equals its own reference
# ---------------------------------------------------------------------------------------------


def mixed_rows() -> list[SamplingRow]:
    return [
        row(temperature=0.0),
        row(temperature=0.0, repetition_penalty=1.5, output=[7, 7, 8],
            logit_bias={3: 5.0, 11: -100.0}),
        row(temperature=0.7, top_k=8, seed=1),
        row(temperature=1.3, top_p=0.6, seed=2),
        row(temperature=0.9, min_p=0.1, top_k=20, top_p=0.9, seed=3),
        row(presence_penalty=1.0, frequency_penalty=0.5, output=[4, 4, 4, 9], seed=4),
        row(repetition_penalty=1.2, prompt=[0, 1, 2, 30], output=[31], min_tokens=2,
            max_tokens=5, suppress=[0, 63], top_k=5),
        row(temperature=0.5, logit_bias={60: 30.0}, min_p=0.5, seed=5),
    ]


def test_mixed_batch_each_row_matches_its_reference() -> None:
    rows = mixed_rows()
    logits = rand_logits(len(rows), seed=7)
    got = Sampler().process_logits(logits, rows)
    for i, r in enumerate(rows):
        assert_same_logits(got[i], reference(logits[i], r))


def test_mixed_batch_tokens_are_valid_and_greedy_rows_take_argmax() -> None:
    rows = mixed_rows()
    logits = rand_logits(len(rows), seed=7)
    processed = Sampler().process_logits(logits, rows)
    out = Sampler()(logits, rows)
    assert out.token_ids.shape == (len(rows),) and out.token_ids.dtype == torch.int64
    for i, r in enumerate(rows):
        tok = int(out.token_ids[i])
        assert not processed[i, tok].isinf(), f"row {i} drew a filtered token"
        if r.params.greedy:
            assert tok == int(processed[i].argmax())


def test_greedy_is_argmax_of_raw_logits_without_controls() -> None:
    logits = rand_logits(4)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(4)])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    single = Sampler()(logits[:1], [row(temperature=0.0)])
    assert int(single.token_ids[0]) == int(logits[0].argmax())


def test_penalties_and_bias_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    assert Sampler()(logits, [row(temperature=0, prompt=[1], repetition_penalty=2.0)]
                     ).token_ids.tolist() == [2]  # 5/2 < 4
    assert Sampler()(logits, [row(temperature=0, output=[1, 1], frequency_penalty=1.0)]
                     ).token_ids.tolist() == [2]  # 5-2 < 4
    assert Sampler()(logits, [row(temperature=0, logit_bias={3: 10.0})]
                     ).token_ids.tolist() == [3]
    assert Sampler()(logits, [row(temperature=0, suppress=[1])]).token_ids.tolist() == [2]


def test_min_tokens_suppression_matches_transformers() -> None:
    """The engine passes EOS as suppress_ids while under min_tokens; compare with
    MinNewTokensLengthLogitsProcessor over the same history."""
    eos, prompt, min_new = [5, 9], [1, 2, 3], 3
    logits = rand_logits(1)
    for output in ([], [4], [4, 4], [4, 4, 4]):
        suppress = eos if len(output) < min_new else []
        r = row(prompt=prompt, output=output, suppress=suppress, temperature=0.0,
                min_tokens=min_new)
        got = Sampler().process_logits(logits, [r])
        ids = torch.tensor([[*prompt, *output]])
        want = MinNewTokensLengthLogitsProcessor(len(prompt), min_new, eos)(ids, logits.clone())
        assert_same_logits(got[0], want[0])


def test_logit_bias_hand_computed_and_out_of_range_rejected() -> None:
    logits = torch.zeros(2, 5)
    rows = [row(temperature=0, logit_bias={0: 1.5, 4: -2.0}), row(temperature=0)]
    got = Sampler().process_logits(logits, rows)
    torch.testing.assert_close(got, torch.tensor([[1.5, 0, 0, 0, -2.0], [0.0] * 5]))
    with pytest.raises(InvalidParamsError, match="logit_bias"):
        Sampler()(logits, [row(logit_bias={5: 1.0}), row()])


def test_does_not_modify_callers_logits() -> None:
    logits = rand_logits(len(mixed_rows()), seed=7)
    before = logits.clone()
    Sampler()(logits, mixed_rows())
    assert torch.equal(logits, before)


# ---------------------------------------------------------------------------------------------
# Sampling: distribution, exclusions, seeds
# ---------------------------------------------------------------------------------------------


SMALL = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])  # V = 8


def draw_counts(n: int, **params: Any) -> torch.Tensor:
    """n draws of one distribution as one batch of n rows on the global RNG."""
    torch.manual_seed(1234)
    out = Sampler()(SMALL.expand(n, -1), [row(**params) for _ in range(n)])
    return torch.bincount(out.token_ids, minlength=SMALL.numel()).double()


def test_temperature_sampling_matches_softmax_chi_square() -> None:
    n, t = 20_000, 0.7
    counts = draw_counts(n, temperature=t)
    right = torch.softmax(SMALL.double() / t, -1) * n
    wrong = torch.softmax(SMALL.double() / 1.0, -1) * n  # the test must be able to fail
    assert chisquare(counts.numpy(), right.numpy()).pvalue > 0.001
    assert chisquare(counts.numpy(), wrong.numpy()).pvalue < 1e-6


def test_seeded_sampling_matches_softmax_chi_square() -> None:
    """Same check through per-row generators (the path seeded requests take)."""
    n, t = 5_000, 1.5
    rows = [row(temperature=t, seed=s) for s in range(n)]
    out = Sampler()(SMALL.expand(n, -1), rows)
    counts = torch.bincount(out.token_ids, minlength=SMALL.numel()).double()
    right = torch.softmax(SMALL.double() / t, -1) * n
    wrong = torch.softmax(SMALL.double() / 0.7, -1) * n
    assert chisquare(counts.numpy(), right.numpy()).pvalue > 0.001
    assert chisquare(counts.numpy(), wrong.numpy()).pvalue < 1e-6


def test_filtered_sampling_matches_renormalized_distribution() -> None:
    """top-k + top-p: draws follow the softmax over the surviving tokens only."""
    n = 20_000
    counts = draw_counts(n, top_k=4, top_p=0.8)
    kept = reference(SMALL, row(top_k=4, top_p=0.8))
    expected = torch.softmax(kept.double(), -1) * n
    on = ~kept.isinf()
    assert counts[~on].sum() == 0
    assert chisquare(counts[on].numpy(), expected[on].numpy()).pvalue > 0.001


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 3}, {0, 6, 1}),
        ({"top_p": 0.5}, {0, 6}),  # p(0) = 0.38 < 0.5 <= p(0) + p(6) = 0.61
        ({"min_p": 0.5}, {0, 6}),  # p >= p(0) / 2  <=>  logit >= 2 - ln 2 = 1.31
        ({"top_k": 1, "temperature": 5.0}, {0}),
        ({"top_p": 1e-6}, {0}),
        ({"min_p": 1.0}, {0}),
    ],
)
def test_filters_never_draw_excluded_tokens(params: dict[str, Any], allowed: set[int]) -> None:
    kept = set((~reference(SMALL, row(**params)).isinf()).nonzero().flatten().tolist())
    counts = draw_counts(5_000, **params)
    drawn = set(counts.nonzero().flatten().tolist())
    assert kept == allowed  # the reference agrees with the hand-computed set
    assert drawn <= kept


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = rand_logits(1, seed=11)

    def run(seed: int) -> list[int]:
        r = row(seed=seed, temperature=1.0)
        return [int(Sampler()(logits, [r]).token_ids[0]) for _ in range(30)]

    assert run(42) == run(42)
    assert run(42) != run(43)


def test_seeded_row_is_independent_of_its_batch() -> None:
    logits = rand_logits(3, seed=5)
    alone = Sampler()(logits[1:2], [row(seed=9, top_k=10)]).token_ids
    torch.manual_seed(0)
    batch = Sampler()(logits, [row(), row(seed=9, top_k=10), row(temperature=0)]).token_ids
    assert int(batch[1]) == int(alone[0])


# ---------------------------------------------------------------------------------------------
# Log-probs
# ---------------------------------------------------------------------------------------------


def test_logprobs_and_top_logprobs_describe_raw_distribution() -> None:
    rows = [
        row(temperature=0.0, logprobs=3),
        row(temperature=0.5, top_k=4, logprobs=5, seed=1, repetition_penalty=1.5, output=[2]),
        row(logprobs=0, seed=2),
        row(temperature=0.0),
    ]
    logits = rand_logits(len(rows), seed=2)
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    assert out.top_logprobs[2] is None and out.top_logprobs[3] is None
    for i, n in [(0, 3), (1, 5)]:
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        ref_vals, ref_ids = ref[i].topk(n)
        assert [t for t, _ in top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_vals)


# ---------------------------------------------------------------------------------------------
# Cost: no full-vocabulary sort unless top-p without top-k asks for one
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def no_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("sorted the vocabulary")

    for name in ("sort", "argsort", "msort"):
        monkeypatch.setattr(torch, name, boom)
        if hasattr(torch.Tensor, name):
            monkeypatch.setattr(torch.Tensor, name, boom)


@pytest.mark.usefixtures("no_sort")
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 0.0, "repetition_penalty": 1.2, "presence_penalty": 0.5},
        {"top_k": 5},
        {"top_k": 5, "temperature": 0.7, "min_p": 0.05},
        {"top_k": 40, "top_p": 0.9},
        {},
    ],
)
def test_no_full_sort(params: dict[str, Any]) -> None:
    logits = rand_logits(2)
    rows = [row(output=[1, 2], seed=0, **params), row(temperature=0.0)]
    Sampler()(logits, rows)
    Sampler()(logits[:1], rows[:1])


def test_the_sort_guard_works(no_sort: None) -> None:
    with pytest.raises(AssertionError, match="sorted"):
        Sampler()(rand_logits(1), [row(top_p=0.9)])


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_extremes_of_the_allowed_ranges_give_finite_logits(penalty: float) -> None:
    """SamplingParams refuses repetition_penalty 1e-300 (positive logits / 1e-300 became inf
    and the softmax NaN); at the ends of what it accepts, combined with every other control at
    its own extreme, the processed logits of seen tokens stay finite and the draw is a
    valid token (only masked-out tokens are -inf)."""
    seen = list(range(0, V, 2))
    rows = [
        row(prompt=seen, output=seen[:4], temperature=temp, seed=3, repetition_penalty=penalty,
            presence_penalty=pres, frequency_penalty=-pres, logit_bias={0: 100.0, 1: -100.0})
        for temp, pres in ((1e-5, 2.0), (100.0, -2.0), (0.0, 2.0))
    ]
    logits = rand_logits(len(rows), seed=4) * 30.0  # far wider than a real model's logits
    processed = Sampler().process_logits(logits, rows)
    assert not processed.isnan().any()
    assert processed.isfinite().all()  # no filter is on: nothing is masked
    assert not processed.softmax(-1).isnan().any()
    out = Sampler()(logits, rows)
    assert ((out.token_ids >= 0) & (out.token_ids < V)).all()
    assert out.logprobs.isfinite().all()


@pytest.mark.parametrize("vocab", [96, 100])
def test_allowed_mask_matches_bit_by_bit_reference(vocab):
    """Grammar masks: token t is kept iff bit t % 32 of word t // 32 is set. Rows that
    allow everything (skipped by the fast path), rows allowing nothing but a few, and
    rows not in row_idx (untouched)."""
    from kvloop.sampling.processors import apply_allowed_mask, unpack_bitmask

    g = torch.Generator().manual_seed(0)
    W = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (3, W), dtype=torch.int32, generator=g)
    bits[1] = -1  # everything allowed
    bits[2] = 0
    bits[2, 1] = 0b101  # tokens 32 and 34 only
    logits = torch.randn(4, vocab, generator=g)
    rows = torch.tensor([0, 1, 3])
    out = apply_allowed_mask(logits, rows, bits)
    expected = logits.clone()
    for j, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bits[j, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.isfinite(out[2]).all()  # not in row_idx
    assert unpack_bitmask(bits[2:], vocab)[0].nonzero().flatten().tolist() == [32, 34]
    # Every row allowing everything: nothing changes.
    assert torch.equal(apply_allowed_mask(logits, torch.tensor([1]), bits[1:2]), logits)


# --- the native argmax + logsumexp (csrc/sampling.cpp) ---------------------------------------


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512vnni"])
def test_native_argmax_logsumexp_gives_torchs_answers(isa: str) -> None:
    """The kernel's first maximum is torch.argmax's and its logsumexp torch's (float64's
    within a few units in the last place), across the chunks it cuts rows into (16384
    logits): widths on either side of a chunk, ties between chunks (the first wins), NaN
    (the first NaN; lse NaN), +inf (lse +inf), a row of -inf (index 0, lse -inf), and
    logits far below the maximum (their exp underflows to 0)."""
    from kvloop.kernels import build

    if isa not in build.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} build")
    mod = build.native_module() if isa == build.native_module().compiled_isa() \
        else build._build(isa)
    g = torch.Generator().manual_seed(7)
    for b, v in [(1, 1), (2, 7), (3, 16383), (2, 16384), (4, 16385), (5, 49152),
                 (1, 262144), (33, 40000)]:
        x = torch.randn(b, v, generator=g) * 8
        ids, lse = mod.argmax_logsumexp(x)
        assert torch.equal(ids, x.argmax(dim=-1)), (isa, b, v)
        ref = torch.logsumexp(x.double(), dim=-1)
        assert ((lse.double() - ref).abs() <= 4e-7 * ref.abs().clamp(min=1)).all(), (isa, b, v)
    x = torch.randn(6, 40000, generator=g)
    x[0, 17] = x[0, 30000] = float("nan")
    x[1, 5] = x[1, 39999] = float("inf")
    x[2] = float("-inf")
    x[3, 20000] = x[3, 30000] = x[3].max() + 1  # a tie across chunks
    x[4, 100:] = -1e30  # exp of these underflows
    x[5, 0] = float("nan")
    ids, lse = mod.argmax_logsumexp(x)
    assert torch.equal(ids, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), equal_nan=True)
    with pytest.raises(RuntimeError, match=r"float32 \[B, V\]"):
        mod.argmax_logsumexp(x.double())


def test_native_sampler_equals_pytorch_sampler() -> None:
    """A Sampler on the native argmax + logsumexp picks what the PyTorch one picks, with
    the same log-probs (to fp32 rounding), for plain greedy rows, greedy rows whose
    penalties change the argmax, and sampled rows beside them."""
    from kvloop import kernels

    if not kernels.available():
        pytest.skip("native kernels unavailable")
    logits = rand_logits(4, 50000, seed=3)
    batches = [
        [row(temperature=0.0) for _ in range(4)],
        [row(temperature=0.0, prompt=[int(logits[i].argmax())], repetition_penalty=5.0,
             logprobs=3) for i in range(4)],
        [row(temperature=0.0), row(temperature=0.8, seed=1), row(temperature=0.0, top_k=5,
                                                                  seed=2),
         row(temperature=1.0, top_p=0.9, seed=3)],
    ]
    for rows in batches:
        for r in rows:
            if r.generator is not None:
                r.generator.manual_seed(11)
        want = Sampler(native=False)(logits, rows)
        for r in rows:
            if r.generator is not None:
                r.generator.manual_seed(11)
        got = Sampler(native=True)(logits, rows)
        assert torch.equal(got.token_ids, want.token_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=2e-6)
        assert [None if t is None else [i for i, _ in t] for t in got.top_logprobs] == \
            [None if t is None else [i for i, _ in t] for t in want.top_logprobs]
