"""Token sampling: logit processors (bias, penalties), top-k, top-p, min-p, temperature, seeded RNG, logprobs.

Runs on one sequence's logits row (float32, vocab-sized) in the forward worker thread. Greedy when
temperature <= 0. The RNG is per sequence (numpy PCG64 seeded from `seed`), so a seeded request reproduces
its tokens whatever else is batched beside it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numba
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 40
    # Tokens less likely than min_p times the most likely one are never drawn (llama.cpp's and vLLM's min_p;
    # after top-k and top-p and before the temperature, where llama.cpp's sampler chain applies it). 0 = off.
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # llama.cpp's repeat_penalty (vLLM's repetition_penalty): a token among the last `repeat_last_n` of the
    # reply has its score divided by it where positive, multiplied where negative. 1 = off; repeat_last_n -1 =
    # the whole reply.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None  # None: no logprobs; 0..20: logprobs with that many alternatives

    @property
    def greedy(self) -> bool:
        """Argmax: temperature <= 0, or a nucleus of nothing (top_p <= 0 keeps only the best token, as in
        llama.cpp), or min_p 1 (only tokens as likely as the best)."""
        return self.temperature <= 0.0 or self.top_p <= 0.0 or self.min_p >= 1.0


# Scores per block of the first passes of `_argmax` and `top_k`: 4 vectors of 16 float32, so that LLVM's loop
# vectorizer turns their inner loops into vector compares and blends with four independent chains.
_BLOCK = 64
_NO_BIAS_IDS = np.empty(0, dtype=np.int64)
_NO_BIAS_VALUES = np.empty(0, dtype=np.float32)


@numba.njit(cache=True, nogil=True)
def _insert_best(scores: np.ndarray, lo: int, hi: int, k: int, ids: np.ndarray, vals: np.ndarray, n: int) -> int:
    """Scores lo .. hi - 1 into the best-k list (ids, vals: n entries, sorted, ties in index order); the new n."""
    for i in range(lo, hi):
        x = scores[i]
        if not x > -np.inf or (n == k and not x > vals[k - 1]):
            continue
        if n < k:
            j = n
            n += 1
        else:
            j = k - 1  # the k-th best drops out
        while j > 0 and vals[j - 1] < x:
            vals[j] = vals[j - 1]
            ids[j] = ids[j - 1]
            j -= 1
        vals[j] = x
        ids[j] = i
    return n


@numba.njit(cache=True, nogil=True)
def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores (fewer if fewer are above -inf; NaN never counts), largest first, ties
    in index order.

    One scalar pass keeping the best k sorted took ~40 us over a 49k vocabulary for k = 40. For k up to a
    block (`_BLOCK`), a vectorized first pass keeps each lane's maximum: the k-th largest of those is
    a score with at least k scores at or above it, so nothing below it can be among the k best, and the sorted
    insertion only visits the blocks holding a score at or above it (a few percent of them)."""
    ids = np.empty(k, dtype=np.int64)
    vals = np.empty(k, dtype=scores.dtype)
    width = _BLOCK
    blocks = scores.size // width
    if k > width or blocks == 0:
        return ids[:_insert_best(scores, 0, scores.size, k, ids, vals, 0)]
    tops = np.full(width, -np.inf, dtype=scores.dtype)
    for b in range(blocks):
        base = b * width
        for j in range(width):
            x = scores[base + j]
            tops[j] = x if x > tops[j] else tops[j]
    floor = np.sort(tops)[width - k]
    n = 0
    for b in range(blocks):
        base = b * width
        hits = 0
        for j in range(width):
            hits += scores[base + j] >= floor
        if hits:
            n = _insert_best(scores, base, base + width, k, ids, vals, n)
    n = _insert_best(scores, blocks * width, scores.size, k, ids, vals, n)
    return ids[:n]


@numba.njit(cache=True, nogil=True)
def _kept(ranked: np.ndarray, total: float, top_p: float, min_p: float) -> int:
    """How many of the best candidates llama.cpp's sampler chain keeps after top-k: `ranked` holds the best
    scores, best first (all of the candidates, or a prefix of them), and `total` the sum of exp(score - best)
    over all of them. top_p (0 < top_p < 1) keeps the fewest whose share of that softmax reaches it; min_p
    (> 0) then those at least min_p times as likely as the best. Both on the scores as they are: llama.cpp
    applies the temperature after them, so it reshapes the draw among the kept tokens, never which are kept."""
    keep = ranked.size
    best = np.float64(ranked[0])
    if 0.0 < top_p < 1.0:
        cumulative = 0.0
        for i in range(ranked.size):
            cumulative += np.exp(np.float64(ranked[i]) - best) / total
            if cumulative >= top_p:
                keep = i + 1
                break
    if min_p > 0.0:
        threshold = best + np.log(min_p)
        while keep > 1 and np.float64(ranked[keep - 1]) < threshold:
            keep -= 1
    return keep


@numba.njit(cache=True, nogil=True)
def _draw(scores: np.ndarray, temperature: float, uniform: float) -> int:
    """The index drawn from softmax(scores / temperature) by inverse CDF with one uniform draw in [0, 1)
    (what Generator.choice(p=...) does); -inf scores are never drawn."""
    top = -np.inf
    for i in range(scores.size):
        if scores[i] > top:
            top = np.float64(scores[i])
    weights = np.empty(scores.size, dtype=np.float64)
    total = 0.0
    for i in range(scores.size):
        weights[i] = np.exp((np.float64(scores[i]) - top) / temperature)
        total += weights[i]
    target = uniform * total
    cumulative = 0.0
    for i in range(scores.size):
        cumulative += weights[i]
        if cumulative > target:
            return i
    last = scores.size - 1
    while last > 0 and weights[last] == 0.0:
        last -= 1
    return last


@numba.njit(cache=True, nogil=True)
def _sample_top_k(scores: np.ndarray, k: int, temperature: float, top_p: float, min_p: float,
                  uniform: float) -> int:
    """A token drawn as llama.cpp's default sampler chain draws it: the k best scores, then top_p and min_p
    over their softmax (`_kept`), then the temperature over what is left and one inverse-CDF draw with
    `uniform`; -1 when every score is -inf. One compiled call: the numpy steps it replaces cost ~50 us a row
    in call overheads alone."""
    ids = top_k(scores, k)
    if ids.size == 0:
        return -1
    ranked = np.empty(ids.size, dtype=np.float64)
    total = 0.0
    for i in range(ids.size):
        ranked[i] = scores[ids[i]]
        total += np.exp(ranked[i] - ranked[0])
    keep = _kept(ranked, total, top_p, min_p)
    return ids[_draw(ranked[:keep], temperature, uniform)]


@numba.njit(cache=True, nogil=True)
def _argmax(scores: np.ndarray) -> int:
    """np.argmax: the first largest score, or the first NaN when there is one.

    A plain scan (a compare and a branch per score) is not vectorized, and took ~35 us over SmolLM2's 49152
    scores: 0.3-0.4 ms of an 8-row greedy step. Here a first pass keeps a block's worth of running maxima
    and NaN counts (vectorized), and a second finds the first score equal to the maximum, a block at a time."""
    n = scores.size
    width = _BLOCK
    blocks = n // width
    top = scores[0]
    if top != top:
        return 0
    nans = 0
    if blocks:
        tops = np.empty(width, dtype=np.float32)
        seen_nan = np.zeros(width, dtype=np.int32)
        for j in range(width):
            tops[j] = scores[j]
        for b in range(blocks):
            base = b * width
            for j in range(width):
                x = scores[base + j]
                seen_nan[j] += x != x
                tops[j] = x if x > tops[j] else tops[j]
        for j in range(width):
            nans += seen_nan[j]
            if tops[j] > top:
                top = tops[j]
    for i in range(blocks * width, n):
        x = scores[i]
        nans += x != x
        if x > top:
            top = x
    if nans:
        for i in range(n):
            if scores[i] != scores[i]:
                return i
    for b in range(blocks):
        base = b * width
        hits = 0
        for j in range(width):
            hits += scores[base + j] == top
        if hits:
            for i in range(base, base + width):
                if scores[i] == top:
                    return i
    for i in range(blocks * width, n):
        if scores[i] == top:
            return i
    return 0


# Columns of `_pick_rows`' table: one row per sampled logits row.
_ROW, _GREEDY, _TOP_K, _TEMPERATURE, _TOP_P, _MIN_P, _UNIFORM = range(7)


@numba.njit(cache=True, nogil=True)
def _pick_row(logits, table, i, vocab, bias_ids, bias_values, bias_ends, out):
    """Row i of `_pick_rows`' table."""
    scores = logits[int(table[i, _ROW]), :vocab]
    for j in range(bias_ends[i - 1] if i else 0, bias_ends[i]):
        scores[bias_ids[j]] += bias_values[j]
    if table[i, _GREEDY]:
        out[i] = _argmax(scores)
    else:
        out[i] = _sample_top_k(scores, int(table[i, _TOP_K]), table[i, _TEMPERATURE], table[i, _TOP_P],
                               table[i, _MIN_P], table[i, _UNIFORM])


@numba.njit(cache=True, nogil=True)
def _pick_rows_serial(logits, table, vocab, bias_ids, bias_values, bias_ends, out):
    for i in range(table.shape[0]):
        _pick_row(logits, table, i, vocab, bias_ids, bias_values, bias_ends, out)


@numba.njit(cache=True, nogil=True, parallel=True)
def _pick_rows_parallel(logits, table, vocab, bias_ids, bias_values, bias_ends, out):
    for i in numba.prange(table.shape[0]):
        _pick_row(logits, table, np.int64(i), vocab, bias_ids, bias_values, bias_ends, out)


@numba.njit(cache=True, nogil=True)
def _pick_rows(logits, table, vocab, bias_ids, bias_values, bias_ends, out):
    """Sampler.sample for several rows in one nogil call (the plain rows of `sample_rows`): row table[i, _ROW] of
    logits (its first `vocab` scores) gets its bias added in place (ids and values bias_ends[i - 1] ..
    bias_ends[i]), then out[i] is its argmax (greedy) or a top-k draw with its uniform; -1 when every score is
    -inf. Rows are independent (each has its own draw in the table), so several go over the threads: right after
    a decode step, whose weights evicted the logits' caches, a greedy row over SmolLM2's 49152 scores took
    ~10 us hot and more cold, on the one thread that the next step waits for."""
    if table.shape[0] > 1:
        _pick_rows_parallel(logits, table, vocab, bias_ids, bias_values, bias_ends, out)
    else:
        _pick_rows_serial(logits, table, vocab, bias_ids, bias_values, bias_ends, out)


class NoTokenAllowed(ValueError):
    """A sampled (not greedy) row's scores allow no token: every one -inf or NaN after bias, penalties and mask
    (NaN logits from a broken state, or a mask that leaves nothing). `sample_rows` returns it in that row's
    place, so that only the row's own turn fails. Greedy rows take np.argmax's answer in both of sample_rows'
    roads (a NaN first; token 0 when every score is -inf)."""

    def __init__(self) -> None:
        super().__init__("no token is allowed: every score is -inf or NaN")


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    # (token id, logprob) of the most likely alternatives, best first, when asked for.
    top_logprobs: list[tuple[int, float]] | None = None


# The logprob reported for a token that cannot come (a grammar masked it: -inf), as OpenAI and vLLM report it.
# JSON has no -inf: orjson would write null, which clients that type `logprob` as a number refuse.
IMPOSSIBLE_LOGPROB = -9999.0


def _reported(logprob: float) -> float:
    """A logprob as the response carries it: a finite number, IMPOSSIBLE_LOGPROB at the least (NaN too)."""
    return logprob if logprob > IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    m = np.max(logits)
    shifted = logits - m
    return shifted - np.log(np.sum(np.exp(shifted)))


class Sampler:
    """Samples one sequence's tokens; holds its RNG and the counts the penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.params = params
        self.vocab_size = vocab_size
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self._rng = np.random.Generator(np.random.PCG64(int(seed) & ((1 << 128) - 1)))
        self._counts: dict[int, int] = {}
        self._repeats = params.repeat_penalty != 1.0 and params.repeat_last_n != 0
        # The repeat penalty's window of the last repeat_last_n tokens drawn (the whole reply, -1: `_counts`' keys).
        self._recent: collections.deque[int] | None = (
            collections.deque(maxlen=params.repeat_last_n) if self._repeats and params.repeat_last_n > 0 else None)
        self._bias_ids = np.array([t for t in params.logit_bias if 0 <= t < vocab_size], dtype=np.int64)
        self._bias_values = np.array([params.logit_bias[int(t)] for t in self._bias_ids], dtype=np.float32)
        # Whether `sample_rows` may take this sampler's rows in its batched call: no penalties, no logprobs,
        # greedy or top-k (the other cases need the whole distribution); and its columns of that call's table.
        self.plain = (params.top_logprobs is None and not params.presence_penalty and not params.frequency_penalty
                      and not self._repeats
                      and (params.greedy or 0 < params.top_k < vocab_size))
        self._spec = (1.0 if params.greedy else 0.0, float(params.top_k), float(params.temperature),
                      float(params.top_p), float(params.min_p))

    def _record(self, token: int) -> None:
        self._counts[token] = self._counts.get(token, 0) + 1
        if self._recent is not None:
            self._recent.append(token)

    def _processed(self, logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
        p = self.params
        out = logits.astype(np.float32, copy=True)
        if self._bias_ids.size:
            out[self._bias_ids] += self._bias_values
        if self._repeats and self._counts:  # before presence and frequency, as in llama.cpp's penalties sampler
            window = self._counts.keys() if self._recent is None else set(self._recent)
            ids = np.fromiter(window, dtype=np.int64, count=len(window))
            ids = ids[ids < out.size]
            scores = out[ids]
            out[ids] = np.where(scores > 0, scores / p.repeat_penalty, scores * p.repeat_penalty)
        if self._counts and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._counts.keys(), dtype=np.int64, count=len(self._counts))
            counts = np.fromiter(self._counts.values(), dtype=np.float32, count=len(self._counts))
            out[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if mask is not None:
            out[~mask] = -np.inf
        return out

    def sample(self, logits: np.ndarray, mask: np.ndarray | None = None) -> SampledToken:
        """`mask`: optional boolean (vocab,) array of allowed tokens (grammar constraints)."""
        p = self.params
        scores = self._processed(logits[: self.vocab_size], mask)
        if p.greedy:
            token = int(np.argmax(scores))  # as np.argmax: a NaN first, token 0 when every score is -inf
        else:
            token = self._sample_stochastic(scores)
        self._record(token)
        result = SampledToken(token)
        if p.top_logprobs is not None:
            # Log-probabilities of the distribution the model gave (after bias/penalties, before temperature
            # and truncation), as OpenAI reports them.
            logp = _log_softmax(scores)
            result.logprob = _reported(float(logp[token]))
            k = p.top_logprobs
            if k > 0:
                top = np.argpartition(-logp, k - 1)[:k]
                top = top[np.argsort(-logp[top], kind="stable")]
                # Where a grammar allows fewer than k tokens, the rest are masked ones, reported as impossible.
                result.top_logprobs = [(int(t), _reported(float(logp[t]))) for t in top]
            else:
                result.top_logprobs = []
        return result

    def _sample_stochastic(self, scores: np.ndarray) -> int:
        """llama.cpp's default chain: top-k, top-p, min-p on the scores as they are, then the temperature over
        the tokens left (`_kept`); its sampler does the same, so that a high temperature flattens the draw among
        the nucleus instead of widening the nucleus to tokens top_p exists to cut."""
        p = self.params
        if 0 < p.top_k < scores.size:
            token = int(_sample_top_k(scores, int(p.top_k), float(p.temperature), float(p.top_p), float(p.min_p),
                                      self._rng.random()))
            if token < 0:
                raise NoTokenAllowed()
            return token
        candidates = self._candidates(scores)
        return int(candidates[_draw(scores[candidates], float(p.temperature), self._rng.random())])

    def _candidates(self, scores: np.ndarray) -> np.ndarray:
        """Without top-k: the ids top-p and min-p keep of every finite score. top-p needs the best ones in
        order: the k best for k = 64, then 512, until they hold top_p of the probability, else a full sort
        (~5 ms over this vocabulary, so only for flat distributions). min-p alone keeps those above its
        threshold, in vocabulary order, as does neither (every finite score)."""
        p = self.params
        finite = np.flatnonzero(np.isfinite(scores))
        if finite.size == 0:
            raise NoTokenAllowed()
        best = np.float64(scores[finite].max())
        if not 0.0 < p.top_p < 1.0:
            if p.min_p > 0.0:
                return finite[scores[finite] >= best + np.log(p.min_p)]
            return finite
        total = float(np.exp(scores[finite].astype(np.float64) - best).sum())
        for k in (64, 512):
            if k >= finite.size:
                break
            ranked = top_k(scores, k)
            values = scores[ranked].astype(np.float64)
            if np.exp(values - best).sum() >= p.top_p * total:
                return ranked[:_kept(values, total, p.top_p, p.min_p)]
        ranked = finite[np.argsort(-scores[finite], kind="stable")]
        return ranked[:_kept(scores[ranked].astype(np.float64), total, p.top_p, p.min_p)]


@dataclass
class _PickPlan:
    """`_pick_rows`' operands for one list of (logits row, sampler): a decode run asks for the same rows of the
    same samplers step after step, so they are built once (`_pick_plan`) and only the draws change."""

    rows: tuple[int, ...]
    samplers: tuple[Sampler, ...]
    table: np.ndarray  # float64 (n, 7): the columns _ROW .. _UNIFORM
    bias_ids: np.ndarray
    bias_values: np.ndarray
    bias_ends: np.ndarray
    tokens: np.ndarray  # int64 (n,): _pick_rows' output
    drawn: list[int]  # the table rows that take a new uniform each step (top-k samplers)


_last_plan = threading.local()  # the plan of this thread's last sample_rows call


def _pick_plan(rows: tuple[int, ...], samplers: tuple[Sampler, ...]) -> _PickPlan:
    """The plan of the last call when it was for these rows and these very samplers, else a new one."""
    plan = getattr(_last_plan, "plan", None)
    if (plan is not None and plan.rows == rows and len(plan.samplers) == len(samplers)
            and all(a is b for a, b in zip(plan.samplers, samplers))):
        return plan
    table = np.array([(row, *s._spec, 0.0) for row, s in zip(rows, samplers)], dtype=np.float64)
    if any(s._bias_ids.size for s in samplers):
        bias_ids = np.concatenate([s._bias_ids for s in samplers])
        bias_values = np.concatenate([s._bias_values for s in samplers])
        bias_ends = np.cumsum([s._bias_ids.size for s in samplers], dtype=np.int64)
    else:
        bias_ids, bias_values, bias_ends = _NO_BIAS_IDS, _NO_BIAS_VALUES, np.zeros(len(samplers), dtype=np.int64)
    plan = _PickPlan(rows, samplers, table, bias_ids, bias_values, bias_ends, np.empty(len(samplers), np.int64),
                     [k for k, s in enumerate(samplers) if not s.params.greedy])
    _last_plan.plan = plan
    return plan


def sample_rows(logits: np.ndarray, picks: list[tuple[int, Sampler, np.ndarray | None]]
                ) -> list[SampledToken | NoTokenAllowed]:
    """`sampler.sample(logits[row], mask)` for every (row, sampler, mask) of a step: the same tokens from the same
    random draws; a row whose scores allow no token gets the NoTokenAllowed in its place (the others' tokens and
    draws are what they would be without it). The rows of plain samplers without a mask go through one compiled
    call that gives the GIL up once; per row, numpy's copy and argmax gave it up twice, and under the server
    each give-up can cost a wait of up to a switch interval to take it back while the event loop holds it.
    Their bias is added to `logits` in place: the caller's scores, which the step no longer needs.

    Its Python runs after every decode step, with the caches cold from the step's weights: ~10 us per numpy
    call there. So the rows' parameters go in as one table, kept with the bias arrays from one call to the next
    while the rows and samplers stay the same (`_pick_plan`): a step only writes the top-k rows' draws. On the
    2-core Zen 4 VM (2026-12-05), 8 greedy rows with a logit bias inside the scheduler's decode runs: the call
    took 0.22-0.25 ms a step (median), its compiled part 0.08 of it, when it built them every time; 0.11-0.12
    ms, and 0.05, with them kept and the rows picked over the threads."""
    results: list[SampledToken | NoTokenAllowed | None] = [None] * len(picks)
    fast = [i for i, (_, sampler, mask) in enumerate(picks) if mask is None and sampler.plain]
    if fast:
        if logits.dtype != np.float32 or not logits.flags.writeable:
            logits = np.array(logits, dtype=np.float32)
        samplers = tuple(picks[i][1] for i in fast)
        plan = _pick_plan(tuple(picks[i][0] for i in fast), samplers)
        for k in plan.drawn:  # one draw per sampled row, from its own generator, as Sampler.sample makes it
            plan.table[k, _UNIFORM] = samplers[k]._rng.random()
        _pick_rows(logits, plan.table, min(samplers[0].vocab_size, logits.shape[1]), plan.bias_ids,
                   plan.bias_values, plan.bias_ends, plan.tokens)
        for i, sampler, token in zip(fast, samplers, plan.tokens.tolist()):
            if token < 0:
                results[i] = NoTokenAllowed()
                continue
            sampler._record(token)
            results[i] = SampledToken(token)
    for i, (row, sampler, mask) in enumerate(picks):
        if results[i] is None:
            try:
                results[i] = sampler.sample(logits[row], mask)
            except NoTokenAllowed as exc:
                results[i] = exc
    return results  # type: ignore[return-value]
