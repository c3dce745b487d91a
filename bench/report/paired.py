"""Differences between two leaderboard rows, paired where they can be.

When both rows scored the same candidates (``per_candidate.id``) in the same seeds, the difference is bootstrapped
with one resampling shared by both rows (seeds, and members and non-members by id across seeds:
``bench.pigeonhole``; reconstruction: seeds and targets, ``bench.report.targets``), so the noise of drawing
candidates cancels; a row minus itself is exactly [0, 0]. Without ids it falls back to the difference of
independent replicates (unpaired, wider) and says so in ``method``.

Minimum detectable effect (MDE) at this sample size: ``MDE_FACTOR`` x SE of the difference, SE the standard
deviation of its bootstrap replicates (else the 95% interval's half-width / 1.96). 2.8 = z(0.975) + z(0.80) =
1.96 + 0.84: the true difference a two-sided test at alpha 0.05 detects with 80% power.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from ..bootstrap import member_stat
from ..pigeonhole import describe, pigeonhole, points, record_seeds
from .stats import N_BOOT, Estimate, _pct, _rng, leakage, unresolvable
from .targets import paired_target_difference

MDE_FACTOR = 2.8
Transform = Callable[[np.ndarray], np.ndarray]


def leak_transform(metric: str) -> Transform:
    """The privacy-ranked quantity of a metric: AUROC's distance from 0.5, else the metric itself."""
    return (lambda x: np.abs(x - 0.5)) if metric == "auroc" else (lambda x: x)


def paired_difference(
    recs_a: Sequence[dict],
    recs_b: Sequence[dict],
    metric: str,
    *,
    key: object = "",
    transform: Transform | None = None,
    n_boot: int = N_BOOT,
    variant_a: str | None = None,
    variant_b: str | None = None,
) -> Estimate | None:
    """transform(a) - transform(b) on the candidates both rows scored, paired bootstrap; None when the rows
    share no candidate ids (or the metric has no per-candidate statistic). ``variant_a`` / ``variant_b``: a kept
    variant's per-candidate scores (``per_candidate.variants``) instead of the row's primary score. Reconstruction
    rows pair on their target ids (``bench.report.targets``)."""
    kinds = {r.get("attack_kind") for r in (*recs_a, *recs_b)}
    if kinds == {"reconstruction"}:
        return paired_target_difference(recs_a, recs_b, metric, key=key, transform=transform, n_boot=n_boot)
    stat = member_stat(metric)
    if stat is None:
        return None
    why = unresolvable(list(recs_a) + list(recs_b), metric)
    if why:
        return Estimate(math.nan, method="not reported", note=why)
    seeds = record_seeds([recs_a, recs_b], [variant_a, variant_b])
    if seeds is None:
        return None
    f = transform or (lambda x: x)
    pa, pb = points(seeds, stat)
    ra, rb = pigeonhole(seeds, stat, _rng("paired", key, metric), n_boot)
    reps = f(ra) - f(rb)
    lo, hi = _pct(reps)
    value = float(f(np.array([pa]))[0] - f(np.array([pb]))[0])
    return Estimate(value, lo, hi, len(seeds), f"paired bootstrap over {describe(seeds)}", reps)


def unpaired_difference(a: Estimate | None, b: Estimate | None) -> Estimate | None:
    """a - b from two separately estimated rows: independent replicates, else the intervals' extremes."""
    if a is None or b is None or math.isnan(a.value) or math.isnan(b.value):
        return None
    if a.reps is not None and b.reps is not None and len(a.reps) == len(b.reps):
        reps = a.reps - b.reps
        lo, hi = _pct(reps)
        return Estimate(
            a.value - b.value, lo, hi, min(a.n_seeds, b.n_seeds), "unpaired bootstrap (no shared ids)", reps
        )
    if a.has_ci() and b.has_ci():
        return Estimate(
            a.value - b.value, a.lo - b.hi, a.hi - b.lo, min(a.n_seeds, b.n_seeds), "unpaired, interval extremes"
        )
    return Estimate(a.value - b.value, method="unpaired, no intervals")


def difference(
    res, recs_a: Sequence[dict], recs_b: Sequence[dict], metric: str, *, leak: bool = True, key: object = ""
) -> Estimate | None:
    """Row a minus row b in ``metric`` (its leakage when ``leak``): paired when the rows share candidate (or
    reconstruction target) ids, else unpaired from each row's own estimate (``method`` says which)."""
    if not recs_a or not recs_b:
        return None
    t = leak_transform(metric) if leak else None
    kinds = {r.get("attack_kind") for r in (*recs_a, *recs_b)}
    d = None
    if kinds in ({"membership"}, {"reconstruction"}):
        d = paired_difference(recs_a, recs_b, metric, key=key, transform=t)
    if d is not None:
        return d
    ea, eb = res.metric(recs_a, metric), res.metric(recs_b, metric)
    if leak:
        ea, eb = leakage(ea, metric), leakage(eb, metric)
    return unpaired_difference(ea, eb)


def sign(d: Estimate | None) -> int:
    """-1 if the difference's interval lies below 0, +1 above, 0 if it contains 0 (or cannot tell)."""
    if d is None or not d.has_ci():
        return 0
    return -1 if d.hi < 0 else (1 if d.lo > 0 else 0)


def is_paired(d: Estimate | None) -> bool:
    return d is not None and d.method.startswith("paired")


def standard_error(d: Estimate | None) -> float:
    if d is None:
        return math.nan
    if d.reps is not None and len(d.reps) > 1:
        return float(np.std(d.reps, ddof=1))
    return (d.hi - d.lo) / (2 * 1.96) if d.has_ci() else math.nan


def mde(d: Estimate | None) -> float:
    """Minimum detectable effect of a difference (module docstring): 2.8 x its SE; NaN without an interval."""
    return MDE_FACTOR * standard_error(d)
