"""A one-run epsilon lower bound from a membership cell's candidates, paired so that its coins are independent.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023: m canaries, each
included by an independent fair coin S_i; the auditor guesses r of the coins (abstaining on the rest) from
the trained model and gets v right. If the mechanism is (epsilon, delta)-DP in the change of one coin, then
(Theorem 3.1; Appendix D for delta > 0), with q = e^epsilon / (1 + e^epsilon),

    P[v or more right] <= P[Bin(r, q) >= v] + 2 m delta max_{1 <= i <= v} P[v > Bin(r, q) >= v - i] / i,

so every epsilon whose p-value is below 1 - confidence is rejected, and the largest such is the bound.

The suite's splits draw a fixed number of members, so the candidates' memberships are not independent coins.
They are once paired: within each stratum (the candidates' class, where the clients are split by class) every
evaluation member is matched at random with an evaluation non-member. The split is a uniform permutation of
item identities, so swapping the two items of a pair is as likely as not: given the pairs, each pair's
orientation is an independent fair coin (a canary = a pair), and changing one coin replaces one example by
another of the same class in the same client slot. The guess is "the higher-scored item of the pair is the
member", made on the k pairs whose scores differ most (k from a small grid, Bonferroni over it).

A coin flip is a replace-one change: a mechanism (epsilon, delta)-DP under add/remove of one example or one
client is (2 epsilon, (1 + e^epsilon) delta)-DP under replacement (group privacy), so the bound reported is on
the add/remove epsilon that the defenses claim. Pure numpy/scipy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

GUESS_GRID = (10, 25, 50, 100, 250, 1000)  # pairs guessed (the most confident k); all pairs are always tried
EPS_MAX = 50.0  # bisection ceiling (the bound is reported as >= this when every epsilon below is rejected)


@dataclass(frozen=True)
class OneRunBound:
    """The one-run lower bound (add/remove epsilon) and the guess that achieved it."""

    value: float  # lower bound on the add/remove epsilon (>= 0)
    confidence: float  # the whole bound's, Bonferroni over the ``n_tests`` guesses tried
    delta: float
    pairs: int  # m: canaries (member / non-member pairs)
    guesses: int  # r at the best guess (0: no guess gave a positive bound)
    correct: int  # v at the best guess
    n_tests: int
    stratified: bool  # pairs matched within classes

    def as_dict(self) -> dict:
        return asdict(self)


def _binom_cdf(k: np.ndarray, n: int, p: float) -> np.ndarray:
    """P[Bin(n, p) <= k] (0 for k < 0, 1 for k >= n): ``scipy.special.bdtr`` (scipy.stats costs seconds to import)."""
    from scipy.special import bdtr

    k = np.asarray(k, dtype=float)
    out = bdtr(np.clip(k, 0, n), n, p)
    return np.where(k < 0, 0.0, np.where(k >= n, 1.0, out))


def p_value(*, m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """The probability of ``v`` or more right guesses of ``r`` among ``m`` canaries if the mechanism is
    (``epsilon``, ``delta``)-DP per coin: Steinke et al. 2023, Theorem 3.1 and Appendix D (Proposition 5.7)."""
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if epsilon < 0 or not 0.0 <= delta <= 1.0:
        raise ValueError(f"need epsilon >= 0 and delta in [0, 1], got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    below = float(_binom_cdf(np.array(v - 1), r, q))  # P[Bin(r, q) < v]
    tail = 1.0 - below  # P[Bin(r, q) >= v]
    if delta == 0.0 or v == 0:
        return min(1.0, tail)
    i = np.arange(1, v + 1)
    window = below - _binom_cdf(v - 1 - i, r, q)  # P[v > Bin >= v - i]
    return min(1.0, tail + 2.0 * m * delta * float(np.max(window / i)))


def pair_candidates(members: Sequence[int], strata: Sequence[int] | None, seed: int) -> list[tuple[int, int]]:
    """Each evaluation member matched at random with a non-member of the same stratum (indices into the
    candidate lists); the pairing depends only on positions, strata and ``seed``, never on the scores."""
    y = np.asarray(members, dtype=int)
    st = np.zeros(len(y), dtype=int) if strata is None else np.asarray(strata, dtype=int)
    if st.shape != y.shape:
        raise ValueError(f"strata must match the candidates: {st.shape} vs {y.shape}")
    rng = np.random.default_rng([seed, 0x5354])
    pairs: list[tuple[int, int]] = []
    for s in np.unique(st):
        mem = rng.permutation(np.flatnonzero((st == s) & (y == 1)))
        non = rng.permutation(np.flatnonzero((st == s) & (y == 0)))
        pairs += [(int(a), int(b)) for a, b in zip(mem, non)]
    return pairs


def _largest_rejected(m: int, r: int, v: int, delta: float, alpha: float) -> float:
    """The largest add/remove epsilon whose replace-one form (2 epsilon, (1 + e^epsilon) delta) has a p-value
    <= ``alpha`` (bisection: the p-value grows with epsilon); 0 when even epsilon 0 is not rejected."""

    def rejected(eps: float) -> bool:
        return p_value(m=m, r=r, v=v, epsilon=2.0 * eps, delta=min(1.0, (1.0 + math.exp(eps)) * delta)) <= alpha

    if r == 0 or not rejected(0.0):
        return 0.0
    if rejected(EPS_MAX):
        return EPS_MAX
    lo, hi = 0.0, EPS_MAX
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejected(mid) else (lo, mid)
    return lo


def one_run_bound(
    scores, members, strata=None, *, delta: float, seed: int, confidence: float = 0.95, tests: int = 1
) -> OneRunBound:
    """The one-run lower bound from per-candidate ``scores`` (higher = member), 0/1 ``members`` and optional
    ``strata`` (the class of each candidate); ``tests`` > 1 widens the Bonferroni correction for a caller that
    takes the maximum of several such bounds."""
    s = np.asarray(scores, dtype=float)
    if s.ndim != 1 or s.shape != np.asarray(members).shape:
        raise ValueError(f"scores and members must be 1-D of the same length, got {s.shape}")
    if not np.isfinite(s).all():
        raise ValueError("membership scores contain NaN or inf")
    if not 0.0 <= delta < 1.0 or not 0.0 < confidence < 1.0 or int(tests) < 1:
        raise ValueError(f"need delta in [0, 1), confidence in (0, 1), tests >= 1; got {delta}, {confidence}, {tests}")
    pairs = pair_candidates(members, strata, seed)
    m = len(pairs)
    diff = np.array([s[a] - s[b] for a, b in pairs]) if pairs else np.zeros(0)  # > 0: the member scored higher
    order = np.argsort(-np.abs(diff), kind="stable")
    decided = order[np.abs(diff[order]) > 0]  # ties abstain
    ks = sorted({k for k in GUESS_GRID if k < len(decided)} | {len(decided)})
    n_tests = len(ks) * int(tests)
    alpha = (1.0 - confidence) / n_tests
    best = OneRunBound(0.0, confidence, delta, m, 0, 0, n_tests, strata is not None)
    for k in ks:
        v = int(np.sum(diff[decided[:k]] > 0))
        eps = _largest_rejected(m, k, v, delta, alpha)
        if eps > best.value:
            best = OneRunBound(eps, confidence, delta, m, k, v, n_tests, strata is not None)
    return best


def auditable(rec: dict) -> bool:
    """A membership record the one-run audit can pair: written at schema revision >= 3 (it carries each
    candidate's class where the pools have classes; earlier records do not say, so their pairs might cross
    classes, which the clients' class-based split does not treat as one replacement)."""
    pc = rec.get("per_candidate") or {}
    return bool(pc.get("score")) and (pc.get("label") is not None or (rec.get("schema_revision") or 0) >= 3)


def record_bound(rec: dict, *, delta: float, confidence: float = 0.95, tests: int = 1) -> OneRunBound:
    """The one-run bound of a membership record, paired by its seed within its candidates' classes."""
    pc, seed = rec["per_candidate"], int(rec["seed"])
    return one_run_bound(
        pc["score"], pc["member"], pc.get("label"), delta=delta, seed=seed, confidence=confidence, tests=tests
    )
