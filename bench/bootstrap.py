"""Resampling for membership scores, pure numpy/scipy (the harness's positive control and the reporting both use
it): vectorised AUROC and TPR at a fixed FPR, the hierarchical bootstrap (seeds, then candidates within each
drawn seed; Efron & Tibshirani 1993, ch. 6), and its paired form, where two rows scored on the same candidates
(``per_candidate.id``) share every resampling, so their difference has the paired interval; where the seeds
share candidates or targets by id, ``bench.pigeonhole`` resamples seeds and ids independently instead. Replicates are
computed from the draws' counts over one sort of each sample (:class:`Drawn`), not by ranking every replicate:
the same numbers, ~7x faster for AUROC (tests/bench_bootstrap.py).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import numpy as np

LEVEL = 0.95
# TPR at FPR f is only reported with at least MIN_NEG_PER_FPR / f non-members (10 false positives at the
# threshold): with fewer, "TPR at 0.1% FPR" is TPR at zero false positives whatever f is.
MIN_NEG_PER_FPR = 10

Stat = Callable[[np.ndarray, np.ndarray], np.ndarray]


def min_nonmembers(fpr: float) -> int:
    """Non-members needed before TPR at FPR ``fpr`` is reported (10 / fpr)."""
    return int(math.ceil(MIN_NEG_PER_FPR / fpr - 1e-9))


def tpr_unreported(fpr: float, n_nonmembers: int) -> str:
    """The reason TPR at ``fpr`` is not reported with ``n_nonmembers`` non-members, or "" when it is."""
    need = min_nonmembers(fpr)
    return "" if n_nonmembers >= need else f"n/a: needs >= {need} non-members for FPR {fpr:g}, has {n_nonmembers}"


def auroc_rows(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """AUROC per row of [B, n1] member and [B, n0] non-member scores (Mann-Whitney U, ties averaged)."""
    n1, n0 = pos.shape[1], neg.shape[1]
    ranks = rank_rows(np.concatenate([pos, neg], axis=1))
    return (ranks[:, :n1].sum(1) - n1 * (n1 + 1) / 2) / (n1 * n0)


def rank_rows(x: np.ndarray) -> np.ndarray:
    """1-based ranks within each row of ``x``, ties averaged, a row holding NaN all NaN: exactly
    ``scipy.stats.rankdata(x, axis=1)`` (tests/test_report_stats.py), without importing scipy.stats (seconds at
    start-up, which a cached re-run's leaderboards would spend on this alone)."""
    x = np.asarray(x, dtype=float)
    if x.ndim != 2:
        raise ValueError(f"rank_rows ranks the rows of a 2-d array, got shape {x.shape}")
    b, n = x.shape
    ranks = np.full((b, n), np.nan)
    if n == 0:
        return ranks
    order = np.argsort(x, axis=1, kind="mergesort")
    xs = np.take_along_axis(x, order, axis=1)
    first = np.ones((b, n), dtype=bool)  # a position that starts a run of equal values
    first[:, 1:] = xs[:, 1:] != xs[:, :-1]
    last = np.ones((b, n), dtype=bool)  # ... that ends one
    last[:, :-1] = first[:, 1:]
    pos = np.arange(n)
    start = np.maximum.accumulate(np.where(first, pos, 0), axis=1)
    end = np.minimum.accumulate(np.where(last, pos, n - 1)[:, ::-1], axis=1)[:, ::-1]
    np.put_along_axis(ranks, order, (start + end + 2) / 2.0, axis=1)  # mean of the 1-based ranks start..end
    ranks[np.isnan(x).any(axis=1)] = np.nan
    return ranks


def tpr_at_fpr_rows(pos: np.ndarray, neg: np.ndarray, fpr: float) -> np.ndarray:
    """Highest TPR with FPR <= ``fpr`` per row (the conservative ROC reading of bench.metrics)."""
    m = int(math.floor(fpr * neg.shape[1] + 1e-9))  # non-members allowed above the threshold
    if m >= neg.shape[1]:
        return np.ones(len(pos))
    thr = -np.sort(-neg, axis=1)[:, m]  # the (m+1)-th highest non-member score
    return (pos > thr[:, None]).mean(1)


class Drawn:
    """One sample's members ``pos`` and non-members ``neg`` prepared for statistics on bootstrap draws given as
    indices (``i`` [B, n1] into ``pos``, ``m`` [B, n0] into ``neg``): the non-members are sorted once and each
    draw becomes a count per sorted position, so AUROC and TPR at FPR cost O(B x n) with no per-replicate sort.
    Results equal the statistic on the drawn values exactly (tests/test_report_stats.py); a sample holding NaN
    falls back to drawing the values."""

    def __init__(self, pos: np.ndarray, neg: np.ndarray) -> None:
        self.pos, self.neg = np.asarray(pos, float), np.asarray(neg, float)
        self.no_nan = not (np.isnan(self.pos).any() or np.isnan(self.neg).any())
        order = np.argsort(self.neg, kind="stable")
        self.where = np.empty(len(order), dtype=np.intp)  # sorted position of each non-member
        self.where[order] = np.arange(len(order))
        ns = self.neg[order]
        self.below = np.searchsorted(ns, self.pos, "left")  # non-members strictly below each member
        self.upto = np.searchsorted(ns, self.pos, "right")  # ... below or tied

    def cumulative(self, m: np.ndarray) -> np.ndarray:
        """[B, n0 + 1]: drawn non-members at sorted positions < k, per draw."""
        b, n0 = m.shape
        counts = np.bincount((np.arange(b)[:, None] * n0 + self.where[m]).ravel(), minlength=b * n0)
        c = np.zeros((b, n0 + 1), dtype=np.int64)
        np.cumsum(counts.reshape(b, n0), axis=1, out=c[:, 1:])
        return c

    def auroc(self, i: np.ndarray, m: np.ndarray) -> np.ndarray:
        if not self.no_nan:
            return auroc_rows(self.pos[i], self.neg[m])
        c = self.cumulative(m)
        twice_u = (np.take_along_axis(c, self.below[i], 1) + np.take_along_axis(c, self.upto[i], 1)).sum(1)
        return (twice_u / 2) / (i.shape[1] * m.shape[1])

    def tpr_at_fpr(self, i: np.ndarray, m: np.ndarray, fpr: float) -> np.ndarray:
        n0 = m.shape[1]
        allowed = int(math.floor(fpr * n0 + 1e-9))
        if not self.no_nan or allowed >= n0:
            return tpr_at_fpr_rows(self.pos[i], self.neg[m], fpr)
        above = n0 - self.cumulative(m)[:, :-1]  # drawn non-members at sorted positions >= k
        k = (above >= allowed + 1).sum(1) - 1  # sorted position of the (allowed+1)-th highest drawn non-member
        return (self.below[i] > k[:, None]).mean(1)


class MemberStat:
    """A membership statistic: on score rows (``stat(pos [B, n1], neg [B, n0])``) and on bootstrap draws
    (``stat.drawn(Drawn(pos, neg), i, m)``), both giving the same numbers."""

    def __init__(self, metric: str, fpr: float | None = None) -> None:
        self.metric, self.fpr = metric, fpr

    def __call__(self, pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
        if self.fpr is not None:
            return tpr_at_fpr_rows(pos, neg, self.fpr)
        return self.of_auroc(auroc_rows(pos, neg))

    def drawn(self, sample: Drawn, i: np.ndarray, m: np.ndarray) -> np.ndarray:
        if self.fpr is not None:
            return sample.tpr_at_fpr(i, m, self.fpr)
        return self.of_auroc(sample.auroc(i, m))

    def of_auroc(self, auc: np.ndarray) -> np.ndarray:
        return np.abs(auc - 0.5) / 0.5 if self.metric == "advantage" else auc


AUROC = MemberStat("auroc")


def member_stat(metric: str) -> MemberStat | None:
    """The vectorised statistic of a membership metric name, None for metrics without one."""
    if metric in ("auroc", "advantage"):
        return MemberStat(metric)
    m = re.fullmatch(r"tpr@([0-9.]+)fpr", metric)
    if m:
        return MemberStat(metric, float(m.group(1)))
    return None


def draw_stat(stat: Stat, sample: Drawn, b: int, rng: np.random.Generator) -> np.ndarray:
    """``stat`` on ``b`` bootstrap draws of ``sample``'s members and non-members (members drawn first)."""
    i = rng.integers(0, len(sample.pos), (b, len(sample.pos)))
    m = rng.integers(0, len(sample.neg), (b, len(sample.neg)))
    return on_draws(stat, sample, i, m)


def on_draws(stat: Stat, sample: Drawn, i: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``stat`` on the draws ``i`` (members) and ``m`` (non-members) of ``sample``: from counts where it can."""
    return stat.drawn(sample, i, m) if isinstance(stat, MemberStat) else stat(sample.pos[i], sample.neg[m])


def percentile_interval(reps: np.ndarray) -> tuple[float, float]:
    a = (1 - LEVEL) / 2 * 100
    return float(np.percentile(reps, a)), float(np.percentile(reps, 100 - a))


def mean_of_draws(values: np.ndarray, b: int, rng: np.random.Generator) -> np.ndarray:
    """The mean of ``b`` bootstrap draws of ``values`` (a ``draw`` for :func:`hierarchical` over per-sample values)."""
    return values[rng.integers(0, len(values), (b, len(values)))].mean(1)


def hierarchical(groups: list[Any], draw, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Bootstrap replicates: resample seeds, then ``draw(group, n_rows, rng)`` within each drawn seed."""
    k = len(groups)
    seed_idx = rng.integers(0, k, size=(n_boot, k)) if k > 1 else np.zeros((n_boot, 1), dtype=int)
    total = np.zeros(n_boot)
    for j in range(seed_idx.shape[1]):
        col = np.zeros(n_boot)
        for g in range(k):
            rows = np.flatnonzero(seed_idx[:, j] == g)
            if len(rows):
                col[rows] = draw(groups[g], len(rows), rng)
        total += col
    return total / seed_idx.shape[1]


# ----------------------------------------------------------------------------------------------
# per-target values of reconstruction records

TARGET_ALIASES = {"label_acc": "label_correct"}  # a record metric -> its per-target values' name


def target_values(rec: dict, metric: str) -> dict[str, float] | None:
    """{target id: value of ``metric``} of one reconstruction record (``per_candidate``: the ``primary`` metric is
    the score, the others are variants), None without ids or values."""
    pc = rec.get("per_candidate") or {}
    name = TARGET_ALIASES.get(metric, metric)
    ids = pc.get("id")
    vals = pc.get("score") if name == rec.get("primary") else (pc.get("variants") or {}).get(name)
    if not ids or not vals or len(ids) != len(vals):
        return None
    return {str(i): float(v) for i, v in zip(ids, vals)}


# ----------------------------------------------------------------------------------------------
# paired rows: the same candidates (by id) in the same seeds


def candidates(rec: dict, variant: str | None = None) -> dict[str, tuple[float, int]] | None:
    """{candidate id: (score, member)} of one record, None without ids (or scores)."""
    pc = rec.get("per_candidate") or {}
    ids, y = pc.get("id"), pc.get("member")
    sc = pc.get("score") if variant is None else (pc.get("variants") or {}).get(variant)
    if not ids or not sc or not y or not len(ids) == len(sc) == len(y):
        return None
    return {str(i): (float(s), int(m)) for i, s, m in zip(ids, sc, y)}


def shared_by_seed(by_a: dict, by_b: dict) -> list[tuple[dict, dict, list[str]]] | None:
    """Per seed both rows have (sorted): the two rows' {id: value} maps and their shared ids (sorted); None when
    a record of a shared seed has no ids (the rows cannot be paired)."""
    out = []
    for seed in sorted(set(by_a) & set(by_b)):
        a, b = by_a[seed], by_b[seed]
        if a is None or b is None:
            return None
        out.append((a, b, sorted(set(a) & set(b))))
    return out


def paired_hierarchical(
    groups: list[Any], draw, rng: np.random.Generator, n_boot: int
) -> tuple[np.ndarray, np.ndarray]:
    """Replicates of two rows under one shared resampling: seeds (the same for both rows), then ``draw(group,
    n_rows, rng) -> (row a's values, row b's values)`` within each drawn seed; the mean over drawn seeds."""
    k = len(groups)
    seed_idx = rng.integers(0, k, size=(n_boot, k)) if k > 1 else np.zeros((n_boot, 1), dtype=int)
    tot_a, tot_b = np.zeros(n_boot), np.zeros(n_boot)
    for j in range(seed_idx.shape[1]):
        for g in range(k):
            rows = np.flatnonzero(seed_idx[:, j] == g)
            if len(rows):
                va, vb = draw(groups[g], len(rows), rng)
                tot_a[rows] += va
                tot_b[rows] += vb
    return tot_a / seed_idx.shape[1], tot_b / seed_idx.shape[1]
