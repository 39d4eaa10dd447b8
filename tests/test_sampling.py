"""Sampling: greedy, seeded reproducibility, top-k/top-p truncation, bias, penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.sampling import IMPOSSIBLE_LOGPROB, Sampler, SamplingParams, top_k

V = 1000


def logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=V).astype(np.float32) * 3


def test_greedy_is_argmax() -> None:
    x = logits()
    s = Sampler(SamplingParams(temperature=0.0), V)
    assert s.sample(x).token_id == int(np.argmax(x))


def test_seeded_sampling_reproduces_and_seeds_differ() -> None:
    x = logits()
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=42)
    a = [Sampler(p, V).sample(x).token_id for _ in range(1)]
    s1, s2 = Sampler(p, V), Sampler(p, V)
    seq1 = [s1.sample(x).token_id for _ in range(50)]
    seq2 = [s2.sample(x).token_id for _ in range(50)]
    assert seq1 == seq2 and a[0] == seq1[0]
    s3 = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=43), V)
    assert [s3.sample(x).token_id for _ in range(50)] != seq1


def test_top_k_restricts_to_the_k_best() -> None:
    x = logits(1)
    best = set(np.argsort(-x)[:3].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=3, top_p=1.0, seed=0), V)
    assert {s.sample(x).token_id for _ in range(200)} <= best


@pytest.mark.parametrize("k", [1, 3, 40, 999, 1000])
def test_top_k_helper_is_a_stable_descending_selection(k: int) -> None:
    """The k largest scores, largest first, ties in index order; -inf and NaN never selected."""
    rng = np.random.default_rng(k)
    x = rng.integers(-20, 20, V).astype(np.float32)  # many ties
    x[rng.choice(V, 30, replace=False)] = -np.inf
    x[rng.choice(V, 5, replace=False)] = np.nan
    valid = np.flatnonzero(np.isfinite(x))
    expected = valid[np.lexsort((valid, -x[valid]))][:k]
    np.testing.assert_array_equal(top_k(x, k), expected)


@pytest.mark.parametrize(("top_k_", "top_p", "min_p"),
                         [(0, 1.0, 0.0), (40, 1.0, 0.0), (0, 0.9, 0.0), (40, 0.9, 0.0), (0, 0.9, 0.05),
                          (40, 0.9, 0.05), (0, 1.0, 0.05)])
@pytest.mark.parametrize("temperature", [0.8, 2.5])
def test_sampling_follows_llama_cpps_chain(top_k_: int, top_p: float, min_p: float, temperature: float) -> None:
    """Token frequencies match llama.cpp's default sampler chain: the top-k, then the top-p nucleus of their
    softmax, then min-p, all before the temperature; then softmax(x / T) over the tokens kept."""
    x = logits(5) / 3
    order = np.argsort(-x, kind="stable")
    kept = order[:top_k_] if top_k_ else order
    shares = np.exp(x[kept] - x[kept].max())
    shares /= shares.sum()
    if top_p < 1.0:
        kept = kept[:int(np.searchsorted(np.cumsum(shares), top_p) + 1)]
    if min_p:
        kept = kept[x[kept] >= x[kept[0]] + np.log(min_p)]
    probs = np.exp((x[kept] - x[kept].max()) / temperature)
    probs /= probs.sum()
    s = Sampler(SamplingParams(temperature=temperature, top_k=top_k_, top_p=top_p, min_p=min_p, seed=1), V)
    draws = 20000
    counts = np.bincount([s.sample(x).token_id for _ in range(draws)], minlength=V)
    assert counts[np.setdiff1d(np.arange(V), kept)].sum() == 0
    expected = probs * draws
    big = expected > 50
    assert big.sum() >= 2
    assert np.all(np.abs(counts[kept][big] - expected[big]) < 5 * np.sqrt(expected[big]) + 10)


def test_top_p_keeps_the_nucleus() -> None:
    x = np.full(V, -10.0, np.float32)
    x[7], x[8] = 10.0, 9.0  # ~0.73 / ~0.27 of the mass
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.5, seed=0), V)
    assert {s.sample(x).token_id for _ in range(100)} == {7}


@pytest.mark.parametrize("top_k_", [0, 40])
def test_a_high_temperature_does_not_widen_the_nucleus(top_k_: int) -> None:
    """top_p measures the model's own distribution, as llama.cpp's chain does (the temperature comes last): at
    T = 50 the scores / T are nearly flat, and a nucleus measured on them would hold half the vocabulary."""
    x = np.full(V, -10.0, np.float32)
    x[7], x[8], x[9] = 10.0, 9.0, 8.0  # ~0.67 / ~0.24 / ~0.09
    s = Sampler(SamplingParams(temperature=50.0, top_k=top_k_, top_p=0.8, seed=0), V)
    assert {s.sample(x).token_id for _ in range(300)} == {7, 8}


@pytest.mark.parametrize("top_k_", [0, 40])
def test_min_p_cuts_after_the_nucleus(top_k_: int) -> None:
    """llama.cpp applies min_p after top_p: shares 0.4 / 0.3 / 0.2 / 0.1, top_p 0.75 keeps three (0.9), and
    min_p 0.3 (0.12 of the mass) keeps them. min_p first would drop the fourth and renormalise, and the nucleus
    of 0.44 / 0.33 / 0.22 would stop at two."""
    x = np.full(V, -30.0, np.float32)
    x[:4] = np.log([0.4, 0.3, 0.2, 0.1])
    s = Sampler(SamplingParams(temperature=1.0, top_k=top_k_, top_p=0.75, min_p=0.3, seed=0), V)
    assert {s.sample(x).token_id for _ in range(600)} == {0, 1, 2}


def test_top_p_zero_is_greedy() -> None:
    """A nucleus of nothing keeps the best token alone (llama.cpp keeps at least one): argmax at any
    temperature, not an unrestricted draw."""
    x = logits(6)
    for seed in range(5):
        s = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=0.0, seed=seed), V)
        assert s.sample(x).token_id == int(np.argmax(x))


def test_min_p_drops_tokens_below_a_share_of_the_best() -> None:
    """min_p keeps the tokens at least min_p as likely as the best (before temperature) and draws among them
    as the other truncations do; 1 leaves only the best; the logprobs still report the whole distribution."""
    x = np.full(V, -10.0, np.float32)
    x[3], x[4], x[5] = 5.0, 5.0 + np.log(0.5), 5.0 + np.log(0.05)  # 1 : 0.5 : 0.05 of the best's probability
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1, seed=0), V)
    assert {s.sample(x).token_id for _ in range(300)} == {3, 4}
    s = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.1, seed=0), V)
    assert {s.sample(x).token_id for _ in range(300)} == {3, 4}
    s = Sampler(SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.01, seed=0), V)
    assert {s.sample(x).token_id for _ in range(3000)} == {3, 4, 5}
    s = Sampler(SamplingParams(temperature=3.0, min_p=1.0, seed=0, top_logprobs=2), V)
    picked = s.sample(x)
    assert picked.token_id == 3 and picked.top_logprobs[1][0] == 4


def test_logit_bias_forces_and_forbids() -> None:
    x = logits(2)
    target = int(np.argmin(x))
    forced = Sampler(SamplingParams(temperature=0.0, logit_bias={target: 100.0}), V)
    assert forced.sample(x).token_id == target
    top = int(np.argmax(x))
    banned = Sampler(SamplingParams(temperature=0.0, logit_bias={top: -100.0}), V)
    assert banned.sample(x).token_id != top


def test_frequency_penalty_discourages_repeats() -> None:
    x = np.zeros(V, np.float32)
    x[5], x[6] = 1.0, 0.9
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0), V)
    assert [s.sample(x).token_id for _ in range(2)] == [5, 6]


def test_repeat_penalty_scales_the_scores_of_recent_tokens_as_llama_cpp() -> None:
    """llama.cpp's repeat_penalty: a token among the last repeat_last_n of the reply has its score divided by the
    penalty where positive and multiplied where negative, before the presence and frequency penalties; the
    logprobs report the distribution after it, as after the other penalties."""
    rng = np.random.default_rng(11)
    x = (rng.normal(size=V) * 3).astype(np.float32)
    drawn = [int(np.argmax(x)), int(np.argmin(x)), 17, 17, 400]
    for last_n, presence in ((64, 0.0), (2, 0.0), (-1, 0.7), (0, 0.0)):
        s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.8, repeat_last_n=last_n,
                                   presence_penalty=presence, top_logprobs=0), V)
        for token in drawn:
            s._record(token)
        window = set(drawn if last_n < 0 else drawn[-last_n:] if last_n else [])
        ref = x.astype(np.float64)
        for t in window:
            ref[t] = ref[t] / 1.8 if ref[t] > 0 else ref[t] * 1.8
        ref[sorted(set(drawn))] -= presence
        expected = int(np.argmax(ref))
        got = s.sample(x)
        assert got.token_id == expected, last_n
        assert got.logprob == pytest.approx(ref[expected] - np.log(np.exp(ref).sum()), abs=1e-4), last_n


def test_repeat_penalty_moves_greedy_off_a_repeated_token() -> None:
    x = np.zeros(V, np.float32)
    x[5], x[6], x[9] = 3.0, 2.0, -1.0
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0), V)
    assert [s.sample(x).token_id for _ in range(3)] == [5, 6, 5]  # 3 / 2 < 2, then 2 / 2 < 1.5
    assert not s.plain and Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.0), V).plain


def test_logprobs_are_normalized_and_ordered() -> None:
    x = logits(3)
    s = Sampler(SamplingParams(temperature=0.0, top_logprobs=5), V)
    t = s.sample(x)
    ref = x.astype(np.float64) - np.log(np.exp(x.astype(np.float64)).sum())
    assert t.logprob == pytest.approx(ref[t.token_id], abs=1e-4)
    assert [tid for tid, _ in t.top_logprobs] == np.argsort(-x)[:5].tolist()
    lps = [lp for _, lp in t.top_logprobs]
    assert lps == sorted(lps, reverse=True)


def test_masked_alternatives_are_reported_as_impossible_not_as_minus_infinity() -> None:
    """A grammar that allows 2 tokens, 4 alternatives asked for: the 2 allowed ones with their logprobs, then 2
    masked ones at -9999 (OpenAI's and vLLM's value), never -inf, which JSON cannot carry (it became null)."""
    x = logits(4)
    mask = np.zeros(V, bool)
    mask[[10, 20]] = True
    picked = Sampler(SamplingParams(temperature=0.0, top_logprobs=4), V).sample(x, mask)
    allowed = sorted([10, 20], key=lambda t: -x[t])
    assert picked.token_id == allowed[0] and np.isfinite(picked.logprob) and picked.logprob > -1.0
    assert [t for t, _ in picked.top_logprobs[:2]] == allowed
    assert all(-9999.0 < lp <= 0.0 for _, lp in picked.top_logprobs[:2])
    assert [lp for _, lp in picked.top_logprobs[2:]] == [IMPOSSIBLE_LOGPROB, IMPOSSIBLE_LOGPROB] == [-9999.0, -9999.0]
    assert not {t for t, _ in picked.top_logprobs[2:]} & {10, 20}


def test_mask_limits_choices() -> None:
    x = logits(4)
    mask = np.zeros(V, bool)
    mask[[10, 20]] = True
    s = Sampler(SamplingParams(temperature=0.0), V)
    assert s.sample(x, mask).token_id == (10 if x[10] > x[20] else 20)


def test_sample_rows_gives_each_row_what_sample_gives_it() -> None:
    """The batched call takes the plain rows (greedy or top-k, with or without bias); masked rows and rows
    with penalties or logprobs go through Sampler.sample; every row gets the token its sampler alone would
    draw, step after step (the same random stream)."""
    from pantheon.engine.sampling import sample_rows

    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logit_bias={3: 50.0, 7: -100.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1),
        SamplingParams(temperature=1.3, top_k=5, top_p=1.0, seed=2, logit_bias={11: 4.0}),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3, presence_penalty=0.5),  # per row
        SamplingParams(temperature=0.0, top_logprobs=2),  # per row
        SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=4),  # no top-k: per row
        SamplingParams(temperature=0.7, top_k=40, seed=5),  # masked below: per row
    ]
    batched = [Sampler(p, V) for p in params]
    alone = [Sampler(p, V) for p in params]
    mask = np.zeros(V, dtype=bool)
    mask[::3] = True
    rng = np.random.default_rng(7)
    for _ in range(40):
        x = (rng.normal(size=(len(params), V)) * 3).astype(np.float32)
        masks = [None] * (len(params) - 1) + [mask]
        expected = [s.sample(x[i].copy(), masks[i]) for i, s in enumerate(alone)]
        got = sample_rows(x.copy(), [(i, s, masks[i]) for i, s in enumerate(batched)])
        assert [g.token_id for g in got] == [e.token_id for e in expected]
        assert got[5].top_logprobs == expected[5].top_logprobs
    assert [s._counts for s in batched] == [s._counts for s in alone]


@pytest.mark.parametrize("bad", ["nan", "-inf", "masked"])
def test_a_row_that_allows_no_token_fails_alone(bad: str) -> None:
    """A sampled row whose scores allow no token (NaN logits from a broken state, all -inf, or a mask of
    nothing), in either road (the batched call's top-k rows, Sampler.sample's), comes back as NoTokenAllowed in
    its place; every other row gets the token, and keeps the random stream, it has without the bad row beside it.
    (It was a ValueError out of the whole call, and the scheduler failed every row of the step.)"""
    from pantheon.engine.sampling import NoTokenAllowed, sample_rows

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=40, seed=1),
              SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=2), SamplingParams(temperature=0.0,
                                                                                            top_logprobs=2)]
    nothing = np.zeros(V, dtype=bool)
    for bad_row in (1, 2):  # the sampled rows: greedy ones take np.argmax's answer (the test below)
        batched = [Sampler(p, V) for p in params]
        alone = [Sampler(p, V) for p in params]
        rng = np.random.default_rng(bad_row)
        for _ in range(3):
            x = (rng.normal(size=(len(params), V)) * 3).astype(np.float32)
            masks: list[np.ndarray | None] = [None] * len(params)
            if bad == "masked":
                masks[bad_row] = nothing
            else:
                x[bad_row] = np.float32(bad)
            got = sample_rows(x.copy(), [(i, s, masks[i]) for i, s in enumerate(batched)])
            assert isinstance(got[bad_row], NoTokenAllowed), (bad_row, got[bad_row])
            for i, s in enumerate(alone):
                if i != bad_row:
                    assert got[i].token_id == s.sample(x[i].copy(), masks[i]).token_id, (bad_row, i)
        with pytest.raises(NoTokenAllowed):
            alone[bad_row].sample(x[bad_row].copy(), masks[bad_row])


def test_sample_rows_builds_its_operands_again_for_other_samplers_or_rows() -> None:
    """The operands kept from the last call (`_pick_plan`) are only reused for the very same samplers at the
    same rows: new samplers in the same places, or the same samplers on other rows, get their own bias."""
    from pantheon.engine.sampling import sample_rows

    x = np.zeros((2, V), dtype=np.float32)
    x[:, 1] = 1.0
    toward = [Sampler(SamplingParams(temperature=0.0, logit_bias={t: 10.0}), V) for t in (3, 4)]
    assert [g.token_id for g in sample_rows(x.copy(), [(i, s, None) for i, s in enumerate(toward)])] == [3, 4]
    assert [g.token_id for g in sample_rows(x.copy(), [(i, s, None) for i, s in enumerate(toward)])] == [3, 4]
    swapped = [(1, toward[0], None), (0, toward[1], None)]
    x[0, 2] = 20.0  # row 0 now prefers token 2 over toward[1]'s bias
    assert [g.token_id for g in sample_rows(x.copy(), swapped)] == [3, 2]
    plain = [Sampler(SamplingParams(temperature=0.0), V) for _ in range(2)]
    assert [g.token_id for g in sample_rows(x.copy(), [(i, s, None) for i, s in enumerate(plain)])] == [2, 1]
    one = [(1, toward[1], None)]
    assert [g.token_id for g in sample_rows(x.copy(), one)] == [4]


def test_sample_rows_argmax_ties_and_nan_as_numpy() -> None:
    from pantheon.engine.sampling import NoTokenAllowed, sample_rows

    x = np.zeros((3, V), dtype=np.float32)
    x[0, [5, 9]] = 2.0  # a tie: the first
    x[1, 4] = np.nan  # NaN wins, as in np.argmax
    x[2, :] = -np.inf  # nothing allowed: token 0, as np.argmax gives
    samplers = [Sampler(SamplingParams(temperature=0.0), V) for _ in range(3)]
    got = sample_rows(x, [(i, s, None) for i, s in enumerate(samplers)])
    assert [g.token_id for g in got] == [int(np.argmax(r)) for r in x] == [5, 4, 0]
    (refused,) = sample_rows(x[2:].copy(), [(0, Sampler(SamplingParams(temperature=1.0, top_k=5, seed=0), V), None)])
    assert isinstance(refused, NoTokenAllowed) and "every score is -inf" in str(refused)


def test_argmax_over_a_large_vocab_matches_numpy() -> None:
    """`_argmax`'s blocked passes: ties across and inside blocks, NaNs anywhere, -inf, signed zeros, a tail
    shorter than a block, and vocabularies smaller than one."""
    from pantheon.engine.sampling import _argmax

    rng = np.random.default_rng(7)
    for n in (1, 5, 63, 64, 65, 1000, 49152, 49155):
        for case in range(8):
            x = rng.normal(size=n).astype(np.float32)
            if case == 1:
                x[rng.integers(0, n, max(1, n // 10))] = -np.inf
            elif case == 2:  # ties of the maximum, the first one wins
                x[rng.integers(0, n, 3)] = x.max() + 1.0
            elif case == 3:
                x[rng.integers(0, n, 2)] = np.nan
            elif case == 4:
                x[:] = -np.inf
            elif case == 5:
                x[:] = -1.0
                x[rng.integers(0, n, 4)] = 0.0
                x[rng.integers(0, n, 4)] = -0.0
            elif case == 6:
                x[-1] = x.max() + 1.0  # in the tail
            elif case == 7:
                x[-1] = np.nan
            assert _argmax(x) == int(np.argmax(x)), (n, case)


@pytest.mark.parametrize("k", [1, 2, 40, 64, 65])
def test_top_k_over_a_large_vocab_matches_a_stable_sort(k: int) -> None:
    """The blocked first pass of top_k: ties (many equal scores around the k-th), -inf and NaN, a tail shorter
    than a block, and rows with fewer than k finite scores."""
    rng = np.random.default_rng(100 + k)
    for n, case in [(49152, 0), (49155, 1), (49155, 2), (3000, 3), (130, 4)]:
        x = (rng.normal(size=n) * 3).astype(np.float32) if case != 1 else rng.integers(-5, 5, n).astype(np.float32)
        if case == 2:
            x[rng.choice(n, n // 3, replace=False)] = -np.inf
            x[rng.choice(n, 7, replace=False)] = np.nan
            x[-2] = x[np.isfinite(x)].max() + 1.0  # the best score in the tail
        if case == 3:  # fewer finite scores than k
            x[:] = -np.inf
            x[rng.choice(n, k // 2, replace=False)] = 1.0
        if case == 4:
            x[rng.choice(n, 10, replace=False)] = np.nan
        valid = np.flatnonzero(np.isfinite(x))
        expected = valid[np.lexsort((valid, -x[valid]))][:k]
        assert top_k(x, k).tolist() == expected.tolist(), (n, case)
