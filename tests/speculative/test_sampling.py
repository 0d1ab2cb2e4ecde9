"""The sampling maths: filters, sparse supports, and rejection sampling's exactness."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speculative.errors import InvalidRequest
from tests.stats import chi2_critical, chi2_stat
from speculative.protocol import SamplingParams
from speculative.sampling import (
    ProbRows,
    argmax_rows,
    check_supports,
    decode_supports,
    draft_support,
    draft_token,
    encode_supports,
    greedy_verify,
    logits_to_probs,
    nucleus,
    one_hot_supports,
    rejection_sample,
    row_max,
    sample,
)

V = 8


def test_logits_to_probs_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    p = logits_to_probs(logits, SamplingParams(temperature=0.0))
    assert torch.equal(p, torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0)), torch.tensor([0.5, 0.25, 0.15, 0.1]))
    # top-k 2 keeps the two largest, renormalised
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, top_k=2)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top-p 0.7: 0.5 < 0.7, 0.75 >= 0.7 -> keep two
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top-p 0.5 keeps just the first (its mass reaches 0.5)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, top_p=0.5)), torch.tensor([1.0, 0, 0, 0]))
    # temperature 2 flattens: p ∝ sqrt(p)
    flat = torch.sqrt(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(logits_to_probs(logits, SamplingParams(2.0)), flat / flat.sum())


def test_min_p_keeps_tokens_within_its_share_of_the_top_before_top_k_and_top_p():
    """min-p (vLLM's order: at temperature, before top-k and top-p) keeps the tokens whose probability is at
    least min_p times the most likely one's, renormalised; top-p then cuts what min-p left (its mass taken
    over those alone); 1 keeps the top alone, 0 is off; the draft's support follows the same p."""
    probs = torch.tensor([0.4, 0.3, 0.1, 0.08, 0.07, 0.05])
    logits = torch.log(probs)
    # 0.25 x 0.4 = 0.1: the first three stay (0.1 exactly at the line stays)
    want = torch.tensor([0.4, 0.3, 0.1, 0, 0, 0]) / 0.8
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, min_p=0.25 - 1e-6)), want)
    assert torch.allclose(logits_to_probs(logits, SamplingParams(1.0, min_p=0.0)), probs)
    assert torch.equal(logits_to_probs(logits, SamplingParams(1.0, min_p=1.0)), torch.tensor([1.0, 0, 0, 0, 0, 0]))
    # at temperature 2, p ∝ sqrt(probs): min-p reads the flattened p (0.08 / 0.4 = 0.2 -> sqrt 0.447)
    flat = torch.sqrt(probs)
    keep = flat >= 0.44 * flat[0]
    assert torch.allclose(logits_to_probs(logits, SamplingParams(2.0, min_p=0.44)), flat * keep / (flat * keep).sum())
    # top-p after min-p: over the three min-p keeps, 0.4 / 0.8 = 0.5 before the third -> two stay at top_p 0.7
    # (over the whole row 0.7 would keep the same two; at top_p 0.8 the row keeps three, min-p's renormalised
    # mass 0.875 before the third cuts it)
    cut = logits_to_probs(logits, SamplingParams(1.0, top_p=0.8, min_p=0.25 - 1e-6))
    assert torch.allclose(cut, torch.tensor([0.4, 0.3, 0, 0, 0, 0]) / 0.7)
    assert int((logits_to_probs(logits, SamplingParams(1.0, top_p=0.8)) > 0).sum()) == 3
    # the draft's q: the same tokens, renormalised over its support
    for params in (SamplingParams(1.0, min_p=0.25 - 1e-6), SamplingParams(2.0, min_p=0.44, top_k=5)):
        _, ids, q = draft_token(logits, params, 0.0, 64, torch.Generator().manual_seed(0))
        p = logits_to_probs(logits, params)
        assert sorted(ids.tolist()) == p.nonzero().flatten().tolist()
        assert torch.allclose(q, p[ids] / p[ids].sum())
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidRequest, match="min_p"):
            SamplingParams(1.0, min_p=bad).validate()


@pytest.mark.parametrize("temperature", [1e-9, 1e-30, 1.4e-45, 3e38])  # found by tests/coordinator/test_fuzz.py
def test_extreme_temperatures_stay_distributions(temperature):
    """A float32 temperature down to the subnormals tends to the argmax (it gave NaN), a huge
    one to uniform; never NaN or inf, whatever the filters."""
    logits = torch.tensor([[0.3, 2.0, -1.0, 1.9], [5.0, -5.0, 0.0, 4.0]])
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 1e-9), (3, 0.5)):
        p = logits_to_probs(logits, SamplingParams(temperature, top_k=top_k, top_p=top_p))
        assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2)), (top_k, top_p)
        if temperature < 1e-8:
            assert torch.equal(p.argmax(-1), logits.argmax(-1)) and torch.allclose(p.max(-1).values, torch.ones(2))


def _nucleus_by_sorting(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p as written out in full: sort the whole row, keep the tokens with under top_p before them."""
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, ordered)
    return kept / kept.sum(-1, keepdim=True)


def test_nucleus_keeps_what_sorting_the_whole_row_keeps():
    """Rows of 5,000 tokens whose top-p set is small (peaked), past the first 256 tokens looked at
    (flatter), or nearly the whole row (uniform): the same tokens kept, the same renormalised
    probabilities, as a sort of the whole row; rows of different cuts in one call. (Which of tied
    tokens stay is either way's choice: of the uniform row, as many.)"""
    g = torch.Generator().manual_seed(11)
    vocab = 5000
    peaked = torch.softmax(torch.randn(3, vocab, generator=g) * 4, -1)
    flat = torch.softmax(torch.randn(3, vocab, generator=g) * 0.3, -1)
    uniform = torch.full((1, vocab), 1.0 / vocab)
    rows = torch.cat([peaked, flat, uniform])
    for top_p in (0.05, 0.5, 0.9, 0.999):
        cut = nucleus(rows, top_p)
        expected = _nucleus_by_sorting(rows, top_p)
        assert torch.equal(cut[:6] > 0, expected[:6] > 0), top_p
        assert torch.allclose(cut[:6], expected[:6], rtol=1e-5, atol=1e-8), top_p
        assert torch.allclose(cut[6].sort().values, expected[6].sort().values, rtol=1e-5, atol=0), top_p
        for i, row in enumerate(rows):  # row by row as the whole batch
            assert torch.equal(nucleus(row, top_p) > 0, cut[i] > 0)
    kept = (nucleus(rows, 0.9) > 0).sum(-1)
    assert kept[:3].max() < 256 < kept[3:6].min() and kept[6] == 4500  # all three ways to the cut taken


def test_sample_draws_each_token_by_its_probability():
    """4,000 draws from a distribution with zeros, given unnormalised: the chi-squared test at
    alpha = 1e-4, no zero-probability token ever drawn, one draw of the generator a token (the same
    seed, the same tokens); a distribution of no mass or NaN is refused."""
    weights = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.0, 0.05])  # total 6.55
    g = torch.Generator().manual_seed(4)
    draws = [sample(weights, g) for _ in range(4000)]
    counts = torch.bincount(torch.tensor(draws), minlength=V).float()
    assert counts[weights == 0].sum() == 0
    stat, df = chi2_stat(counts, weights / weights.sum())
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} on {df} df"
    again = torch.Generator().manual_seed(4)
    assert [sample(weights, again) for _ in range(50)] == draws[:50]
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan"), 0.5])):
        with pytest.raises(ValueError, match="total mass"):
            sample(bad, g)


def test_row_max_is_torchs_max():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 300, generator=g)
    assert torch.equal(row_max(logits), logits.max(-1, keepdim=True).values)
    assert torch.equal(row_max(logits[2]), logits[2].max(-1, keepdim=True).values)
    assert torch.equal(row_max(logits.double()), logits.double().max(-1, keepdim=True).values)


def test_draft_support_truncates_and_renormalises():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.0, 0.25])
    ids, q = draft_support(probs, 2)
    assert ids.tolist() == [1, 2] and torch.allclose(q, torch.tensor([4 / 7, 3 / 7]))
    ids, q = draft_support(probs, 64)  # zero-probability tokens are not part of the support
    assert sorted(ids.tolist()) == [0, 1, 2, 4] and math.isclose(float(q.sum()), 1.0, rel_tol=1e-6)


def test_draft_token_samples_from_the_support_of_p():
    """A sampled draft token's q is the top `max_support` tokens of p (temperature, top-k, top-p)
    renormalised, as building p over the whole row and truncating it gives, for temperatures, top-k
    under and over the support, top-p cut inside and past it, rows with masked (-inf) tokens; p_min
    stops where p's top probability before top-p is under it; a row with nothing allowed drafts nothing."""
    g = torch.Generator().manual_seed(12)
    vocab, support = 3000, 64
    checked = 0
    for temperature in (0.3, 0.7, 1.5):
        for top_k in (0, 5, 100, vocab):
            for top_p in (1.0, 0.9, 0.3):
                row = torch.randn(vocab, generator=g) * 3
                row[torch.randperm(vocab, generator=g)[:500]] = float("-inf")
                params = SamplingParams(temperature, top_k=top_k, top_p=top_p)
                token, ids, q = draft_token(row, params, 0.0, support, g)
                want_ids, want_q = draft_support(logits_to_probs(row, params), support)
                assert torch.equal(ids, want_ids), (temperature, top_k, top_p)
                assert torch.allclose(q, want_q, rtol=1e-4, atol=1e-7) and token in ids.tolist()
                top = float(logits_to_probs(row, SamplingParams(temperature, top_k=top_k)).max())
                for p_min in (top * 0.99, top * 1.01):
                    assert (draft_token(row, params, p_min, support, g) is None) == (p_min > top)
                checked += 1
    assert checked == 36
    nothing = torch.full((vocab,), float("-inf"))
    assert draft_token(nothing, SamplingParams(0.7), 0.0, support, g) is None


def test_supports_round_trip_and_validation():
    q_ids = [torch.tensor([3, 1]), torch.tensor([0])]
    q_probs = [torch.tensor([0.75, 0.25]), torch.tensor([1.0])]
    sizes, ids, probs = encode_supports(q_ids, q_probs)
    assert sizes == [2, 1] and len(ids) == 12 and len(probs) == 12
    back_ids, back_probs = decode_supports(2, sizes, ids, probs, vocab=V)
    assert [t.tolist() for t in back_ids] == [[3, 1], [0]]
    assert [t.tolist() for t in back_probs] == [[0.75, 0.25], [1.0]]
    bad = [
        (3, sizes, ids, probs, V),                      # tokens vs sizes
        (2, [2, 2], ids, probs, V),                     # sizes vs arrays
        (2, sizes, ids[:-1], probs, V),                 # ragged bytes
        (2, sizes, ids, probs, 2),                      # id out of vocabulary
        (2, [2, 1], ids, encode_supports(q_ids, [torch.tensor([0.5, 0.25]), torch.tensor([1.0])])[2], V),  # sum != 1
        (2, [2, 1], ids, encode_supports(q_ids, [torch.tensor([1.5, -0.5]), torch.tensor([1.0])])[2], V),  # negative
        (2, [2, 1], ids, encode_supports(q_ids, [torch.tensor([float("nan"), 1.0]), torch.tensor([1.0])])[2], V),
    ]
    for args in bad:
        with pytest.raises(InvalidRequest):
            decode_supports(*args)
    tokens = [5, 0, 5]  # a greedy draft's one-hot q, encoded without tensors
    assert one_hot_supports(tokens) == encode_supports([torch.tensor([t]) for t in tokens], [torch.ones(1)] * 3)
    # given the draft tokens, each must have probability in its own q
    assert check_supports([1, 0], sizes, ids, probs, V)[2] == [2, 1]
    zero = encode_supports(q_ids, [torch.tensor([1.0, 0.0]), torch.tensor([1.0])])[2]
    for tokens, p in (([2, 0], probs), ([3, 1], probs), ([1, 0], zero)):  # absent, absent at its position, q = 0
        with pytest.raises(InvalidRequest, match="has no probability"):
            check_supports(tokens, sizes, ids, p, V)


def test_few_and_many_support_entries_are_checked_alike():
    """check_supports checks a proposal of at most FEW_SUPPORT_ENTRIES entries in plain Python, more with numpy:
    over random supports, valid and with one fault each (an id out of the vocabulary, a negative, NaN or
    infinite probability, a position whose q does not sum to 1, an id twice at a position, a draft token absent
    from its q or of q 0),
    the two ways pass or fail alike, with the same message; and check_supports takes each way by size."""
    from speculative import sampling

    g = torch.Generator().manual_seed(31)
    faults = ["none", "id", "negative", "nan", "inf", "sum", "repeat", "absent", "zero"]
    outcomes = {}
    for case in range(400):
        k = int(torch.randint(1, 6, (1,), generator=g))
        sizes = [int(torch.randint(1, 5, (1,), generator=g)) for _ in range(k)]
        q_ids = [torch.randperm(V, generator=g)[:n] for n in sizes]
        q_probs = [torch.softmax(torch.randn(n, generator=g), -1) for n in sizes]
        tokens = [int(ids[0]) for ids in q_ids]
        fault, i = faults[case % len(faults)], int(torch.randint(0, k, (1,), generator=g))
        if fault == "id":
            q_ids[i][0] = V
        elif fault in ("negative", "nan", "inf"):
            q_probs[i][0] = {"negative": -0.5, "nan": float("nan"), "inf": float("inf")}[fault]
        elif fault == "sum":
            q_probs[i] = q_probs[i] * 0.5
        elif fault == "repeat":  # (the id twice, each with half its probability)
            q_ids[i] = torch.cat([q_ids[i][:1], q_ids[i]])
            q_probs[i] = torch.cat([q_probs[i][:1] / 2, q_probs[i][:1] / 2, q_probs[i][1:]])
            sizes[i] += 1
        elif fault == "absent":
            tokens[i] = next(t for t in range(V) if t not in q_ids[i].tolist())
        elif fault == "zero":
            q_probs[i][0], tokens[i] = 0.0, int(q_ids[i][0])
            q_probs[i] = q_probs[i] / q_probs[i].sum() if q_probs[i].sum() > 0 else q_probs[i]
        _, ids, probs = encode_supports(q_ids, q_probs)
        ids_np, probs_np = np.frombuffer(ids, dtype="<i4"), np.frombuffer(probs, dtype="<f4")
        results = []
        for way in (sampling._check_few, sampling._check_many):
            try:
                way(tokens, sizes, ids_np, probs_np, V)
                results.append("ok")
            except InvalidRequest as e:
                results.append(str(e))
        assert results[0] == results[1], (fault, results)
        outcomes[fault] = outcomes.get(fault, set()) | {results[0] == "ok"}
    assert outcomes["none"] == {True} and all(False in outcomes[f] for f in faults[1:])
    ways = []
    for n in (sampling.FEW_SUPPORT_ENTRIES, sampling.FEW_SUPPORT_ENTRIES + 1):
        seen = []
        few, many = sampling._check_few, sampling._check_many
        sampling._check_few = lambda *a: seen.append("few") or few(*a)
        sampling._check_many = lambda *a: seen.append("many") or many(*a)
        try:
            check_supports(n, [1] * n, *one_hot_supports([0] * n)[1:], V)
        finally:
            sampling._check_few, sampling._check_many = few, many
        ways += seen
    assert ways == ["few", "many"]


def test_rejection_sample_greedy():
    p = torch.nn.functional.one_hot(torch.tensor([2, 5, 1]), V).float()  # target argmaxes 2, 5, then bonus 1
    one = lambda x: ([torch.tensor([x])], [torch.tensor([1.0])])  # noqa: E731
    ids0, pr0 = one(2)
    ids1, pr1 = one(4)
    g = torch.Generator().manual_seed(0)
    assert rejection_sample(p, torch.tensor([2, 4]), ids0 + ids1, pr0 + pr1, g) == (1, 5)  # reject 4, recover 5
    ids1, pr1 = one(5)
    assert rejection_sample(p, torch.tensor([2, 5]), ids0 + ids1, pr0 + pr1, g) == (2, 1)  # all accepted, bonus 1
    assert rejection_sample(p[:1], torch.tensor([], dtype=torch.long), [], [], g) == (0, 2)  # no draft: plain step


def _supports_holding(draft: torch.Tensor, g: torch.Generator, others: int, floor: float):
    """Random q supports, one a draft token: the token and up to `others` random ids, each with a random
    probability of at least about `floor`, renormalised. -> (q_ids, q_probs)"""
    q_ids, q_probs = [], []
    for x in draft.tolist():
        extra = torch.randperm(V, generator=g)[:others]
        ids = torch.cat([torch.tensor([x]), extra[extra != x]])
        q = torch.rand(len(ids), generator=g) + floor
        q_ids.append(ids)
        q_probs.append(q / q.sum())
    return q_ids, q_probs


def test_greedy_verify_is_rejection_sampling_of_one_hot_p():
    """The greedy shortcut returns what rejection_sample returns on temperature-0 p, for random
    logits with ties (small integers), random drafts mostly matching the argmax, and random q
    supports that contain the draft token; K from 0 to 6."""
    g = torch.Generator().manual_seed(3)
    greedy = SamplingParams(temperature=0.0)
    cases = mismatches = 0
    for _ in range(400):
        k = int(torch.randint(0, 7, (1,), generator=g))
        logits = torch.randint(0, 4, (k + 1, V), generator=g).float()  # many ties
        best = logits.argmax(-1)
        draft = torch.where(torch.rand(k, generator=g) < 0.7, best[:k], torch.randint(0, V, (k,), generator=g))
        q_ids, q_probs = _supports_holding(draft, g, 3, 0.1)
        expected = rejection_sample(logits_to_probs(logits, greedy), draft, q_ids, q_probs, g)
        assert greedy_verify(logits, draft.tolist()) == expected
        cases += 1
        mismatches += expected[0] < k
    assert cases == 400 and 100 < mismatches < 400  # both paths: rejections and full acceptance


def test_argmax_rows_is_torchs_argmax_first_maximum_on_ties():
    """numpy's path (float32 on the CPU) and torch's (other dtypes) pick what torch.argmax picks: rows
    with many ties, a row alone, rows of a transposed (strided) tensor, bfloat16, inference tensors."""
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for rows in (1, 5, 9):
            logits = torch.randint(0, 3, (rows, 4099), generator=g).float()  # ties everywhere
            assert argmax_rows(logits) == logits.argmax(-1).tolist()
            assert argmax_rows(logits[-1]) == int(logits[-1].argmax())
            strided = logits.t().contiguous().t()
            assert strided.is_contiguous() == (rows == 1) and argmax_rows(strided) == logits.argmax(-1).tolist()
            half = logits.bfloat16()
            assert argmax_rows(half) == half.argmax(-1).tolist()
    assert isinstance(argmax_rows(torch.tensor([0.0, 2.0, 2.0])), int) and argmax_rows(torch.tensor([0.0, 2.0, 2.0])) == 1


def _random_dist(g: torch.Generator, support: int | None = None) -> torch.Tensor:
    logits = torch.randn(V, generator=g) * 1.5
    if support is not None:
        keep = torch.randperm(V, generator=g)[:support]
        logits = torch.full((V,), float("-inf")).index_copy(0, keep, logits[keep])
    return torch.softmax(logits, -1)


def _emitted_histograms(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run n rounds with fixed per-position p [K+1, V] and q [K, V]; count the token emitted at
    each position j over the rounds that emitted one. -> (counts [K+1, V], rounds reaching j [K+1])."""
    k = q.shape[0]
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(k + 1, V)
    reached = torch.zeros(k + 1)
    supports = [draft_support(q[i], V) for i in range(k)]
    for _ in range(n):
        draft = torch.stack([ids[torch.multinomial(pr, 1, generator=g)][0] for ids, pr in supports]) if k else \
            torch.zeros(0, dtype=torch.long)
        accepted, token = rejection_sample(p, draft, [s[0] for s in supports], [s[1] for s in supports], g)
        emitted = draft[:accepted].tolist() + [token]
        for j, t in enumerate(emitted):
            counts[j, t] += 1
            reached[j] += 1
    return counts, reached


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("filters", ["none", "target_filtered", "draft_filtered", "both_filtered"])
def test_rejection_sampling_emits_the_target_distribution(k, filters):
    """Every emitted position is distributed as p, however different q is.

    4000 rounds over V = 8 tokens; a chi-squared test per position at
    alpha = 1e-4 (all positions of all 16 cases: < 0.01 false alarms in all).
    test_the_statistical_check_can_fail shows the same check rejects q.
    """
    g = torch.Generator().manual_seed(100 * k + len(filters))
    target_support = 3 if filters in ("target_filtered", "both_filtered") else None
    draft_support_size = 2 if filters in ("draft_filtered", "both_filtered") else None
    p = torch.stack([_random_dist(g, target_support) for _ in range(k + 1)])
    q = torch.stack([_random_dist(g, draft_support_size) for _ in range(k)])
    counts, reached = _emitted_histograms(p, q, 4000, seed=k)
    assert reached[0] == 4000
    for j in range(k + 1):
        if reached[j] < 50:
            continue  # too few rounds got this far to test
        stat, df = chi2_stat(counts[j], p[j])
        if df > 0:
            assert stat < chi2_critical(df), f"position {j}: chi2 {stat:.1f} on {df} df"


def test_the_statistical_check_can_fail():
    """Emitting the draft's tokens uncorrected must fail the same check."""
    g = torch.Generator().manual_seed(7)
    p, q = _random_dist(g), _random_dist(g)
    samples = torch.multinomial(q, 4000, replacement=True, generator=g)
    stat, df = chi2_stat(torch.bincount(samples, minlength=V).float(), p)
    assert stat > 10 * chi2_critical(df)


def test_rejection_sampling_over_rows_computed_as_read_returns_the_same_and_reads_no_further():
    """ProbRows (a verify's p, each row computed when rejection_sample first reads it) gives what the
    whole p [K+1, V] gives from the same generator seed, for random logits, K 0 to 5, drafts partly drawn
    from p and partly not, at a temperature, with top-k and with top-p; and no row past the first
    rejection is computed (the bonus row only where every draft token was accepted)."""
    g = torch.Generator().manual_seed(11)
    settings = [SamplingParams(0.8), SamplingParams(1.2, top_k=5), SamplingParams(0.7, top_p=0.8)]
    outcomes = set()
    for case in range(300):
        k, params = case % 6, settings[case % 3]
        logits = torch.randn(k + 1, V, generator=g) * 2
        p = logits_to_probs(logits, params)
        draft = torch.where(torch.rand(k, generator=g) < 0.6, torch.multinomial(p[:k], 1, generator=g)[:, 0],
                            torch.randint(0, V, (k,), generator=g)) if k else torch.zeros(0, dtype=torch.long)
        q_ids, q_probs = _supports_holding(draft, g, 4, 0.05)
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        expected = rejection_sample(p, draft, q_ids, q_probs, torch.Generator().manual_seed(seed))
        rows = ProbRows(logits, params)
        assert rejection_sample(rows, draft, q_ids, q_probs, torch.Generator().manual_seed(seed)) == expected
        assert sorted(rows._rows) == list(range(expected[0] + 1))
        assert all(torch.equal(row, p[i]) for i, row in rows._rows.items())
        outcomes.add((k, expected[0] == k))
    assert {(k, all_kept) for k in range(1, 6) for all_kept in (False, True)} <= outcomes  # rejections and none
