"""Empirical lower bound on a mechanism's epsilon from a membership attack's ROC (an audit of a DP claim).

Jagielski, Ullman & Oprea, "Auditing Differentially Private Machine Learning: How Private is Private
SGD?", NeurIPS 2020 (s.3, Eq. 1): an (epsilon, delta)-DP mechanism makes every test S satisfy
P[S | member] <= e^epsilon P[S | non-member] + delta, so a membership test with true-positive rate TPR and
false-positive rate FPR shows

    epsilon >= log((TPR - delta) / FPR).

Here TPR is replaced by its one-sided Clopper-Pearson lower bound and FPR by its upper bound, for every
threshold t of the test "member iff score >= t" and for its symmetric complement "non-member iff
score < t" (the roles of the two neighbouring datasets swapped: (1 - FPR) <= e^epsilon (1 - TPR) + delta);
the bound is the maximum over thresholds and both forms, clamped at 0.

Multiple testing: the maximum over thresholds would make a per-test 95% bound optimistic, so a Bonferroni
correction over every (threshold, form) tried (times ``tests``, for a caller maximising over several
attacks) divides the error budget: each rate's one-sided interval has level alpha / (2 m). The whole
bound then holds with probability >= ``confidence``. Pure numpy/scipy; the harness and the reports use it.

Caveat: Jagielski et al. count one trial per training run. The suite scores many candidates of one run,
treating them as independent trials; that is a heuristic (candidates share the run, the split is fixed per
seed), so the bound is an empirical audit, not a proof. The one-run audit of Steinke, Nasr & Jagielski
("Privacy Auditing with One (1) Training Run", NeurIPS 2023), which needs no such independence, is in
``bench.one_run_audit`` (candidates paired so that each pair is an independent coin).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_DELTA = 1e-5  # the delta used to audit a defense that claims no (epsilon, delta)


@dataclass(frozen=True)
class EpsilonBound:
    """An audited epsilon lower bound with the test that achieved it."""

    value: float  # the lower bound (>= 0)
    confidence: float  # the whole bound's confidence, Bonferroni-corrected over ``n_tests``
    delta: float
    threshold: float | None  # None: no threshold gave a positive bound
    form: str  # "member>=t" or "complement" (non-member iff score < t)
    tpr_low: float | None  # the rates' confidence bounds at that threshold (of the form's test)
    fpr_high: float | None
    n_members: int
    n_nonmembers: int
    n_tests: int
    correction: str = "bonferroni"

    def as_dict(self) -> dict:
        return asdict(self)


def _beta_ppf(q: float, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The Beta(a, b) quantile at ``q``: ``scipy.special.betaincinv``, which ``scipy.stats.beta.ppf`` computes too
    (bit-identical inside the support, tests/test_audit.py); scipy.stats alone costs seconds at start-up."""
    from scipy.special import betaincinv

    return betaincinv(a, b, q)


def cp_lower(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson lower bound (level 1 - alpha) on a proportion with k successes of n."""
    k = np.asarray(k, dtype=float)
    with np.errstate(invalid="ignore"):
        out = _beta_ppf(alpha, k, n - k + 1)
    return np.where(k <= 0, 0.0, out)


def cp_upper(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided Clopper-Pearson upper bound (level 1 - alpha) on a proportion with k successes of n."""
    k = np.asarray(k, dtype=float)
    with np.errstate(invalid="ignore"):
        out = _beta_ppf(1.0 - alpha, k + 1, n - k)
    return np.where(k >= n, 1.0, out)


def epsilon_lower_bound(scores, members, *, delta: float, confidence: float = 0.95, tests: int = 1) -> EpsilonBound:
    """The audited lower bound on epsilon at ``delta`` from per-candidate ``scores`` (higher = member) and
    0/1 ``members``; ``tests`` > 1 widens the Bonferroni correction for a caller that takes the maximum of
    ``tests`` such bounds (e.g. the strongest of several attacks)."""
    s = np.asarray(scores, dtype=float)
    y = np.asarray(members, dtype=int)
    if s.ndim != 1 or s.shape != y.shape:
        raise ValueError(f"scores and members must be 1-D of the same length, got {s.shape} and {y.shape}")
    if not np.isfinite(s).all():
        raise ValueError("membership scores contain NaN or inf")
    if not set(np.unique(y)) <= {0, 1}:
        raise ValueError("members must be 0/1 labels")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if int(tests) < 1:
        raise ValueError(f"tests must be >= 1, got {tests}")
    pos, neg = s[y == 1], s[y == 0]
    n1, n0 = len(pos), len(neg)
    # thresholds: every distinct score but the smallest (there the test "score >= t" accepts everything)
    thr = np.unique(s)[1:]
    m = 2 * len(thr) * int(tests)
    empty = EpsilonBound(0.0, confidence, delta, None, "member>=t", None, None, n1, n0, m)
    if n1 == 0 or n0 == 0 or len(thr) == 0:
        return empty
    a = (1.0 - confidence) / (2.0 * m)  # each rate's one-sided error, Bonferroni over m tests
    tp = n1 - np.searchsorted(np.sort(pos), thr, side="left")  # members with score >= t
    fp = n0 - np.searchsorted(np.sort(neg), thr, side="left")
    cands = (
        ("member>=t", cp_lower(tp, n1, a), cp_upper(fp, n0, a)),  # P[S|m] <= e^eps P[S|n] + delta
        ("complement", cp_lower(n0 - fp, n0, a), cp_upper(n1 - tp, n1, a)),
    )  # roles swapped, S^c
    best = empty
    for form, lo, hi in cands:
        with np.errstate(divide="ignore", invalid="ignore"):
            eps = np.where((lo - delta > 0) & (hi > 0), np.log(np.maximum(lo - delta, 1e-300) / hi), -np.inf)
        i = int(np.argmax(eps))
        if eps[i] > best.value:
            best = EpsilonBound(
                float(eps[i]), confidence, delta, float(thr[i]), form, float(lo[i]), float(hi[i]), n1, n0, m
            )
    return best


def audit_delta(privacy_delta: float | None) -> float:
    """The delta an audit uses: the defense's own if it claims (epsilon, delta), else ``DEFAULT_DELTA``."""
    if privacy_delta is None or not math.isfinite(float(privacy_delta)):
        return DEFAULT_DELTA
    return float(privacy_delta)


def record_bound(per_candidate: dict, *, delta: float, attack: str, confidence: float = 0.95) -> dict:
    """The ``privacy.epsilon_lower_bound`` block of a membership record, from its per-candidate scores."""
    b = epsilon_lower_bound(per_candidate["score"], per_candidate["member"], delta=delta, confidence=confidence)
    return {
        "value": b.value,
        "confidence": b.confidence,
        "delta": b.delta,
        "attack": attack,
        "threshold": b.threshold,
        "form": b.form,
        "n_tests": b.n_tests,
        "correction": b.correction,
    }
