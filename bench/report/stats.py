"""Statistics of the leaderboards: point estimates with 95% intervals, the bootstrap over seeds and candidates
(Efron & Tibshirani 1993, ch. 6), and the comparison of two estimates.

Membership metrics with per-candidate ids are bootstrapped over seeds and, independently, over member and
non-member ids drawn once for all seeds (stratified: the seeds share most candidates, ``bench.pigeonhole``);
reconstruction metrics over seeds and target ids (every seed attacks the same targets). Records without ids
fall back to seeds, then candidates (or images) within each drawn seed. Without per-candidate scores a single
seed keeps the record's own interval and several seeds use a normal approximation combining the per-seed
intervals with the between-seed spread. Utility has one value per seed: a Student-t interval over seeds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Iterable, Sequence

import numpy as np

from ..bootstrap import (
    LEVEL,
    Drawn,
    auroc_rows,
    draw_stat,
    hierarchical,
    mean_of_draws,
    member_stat,
    percentile_interval,
    target_values,
    tpr_at_fpr_rows,
    tpr_unreported,
)
from ..pigeonhole import aligned, crossed, describe, pigeonhole, points, record_seeds
from ..store import stable_hash

__all__ = ["LEVEL", "N_BOOT", "Estimate", "auroc_rows", "tpr_at_fpr_rows"]  # re-exported for the tables and tests
N_BOOT = 1000


# ----------------------------------------------------------------------------------------------
# estimates with intervals


@dataclass
class Estimate:
    """A point value with a 95% interval; ``reps`` are bootstrap replicates when there are any."""

    value: float
    lo: float = math.nan
    hi: float = math.nan
    n_seeds: int = 1
    method: str = "point"
    reps: np.ndarray | None = None
    note: str = ""  # why there is no value (value NaN), e.g. a TPR at an FPR the non-members cannot resolve

    def has_ci(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def fmt(self, digits: int = 3) -> str:
        s = num(self.value, digits)
        return s + (f" [{num(self.lo, digits - 1)}, {num(self.hi, digits - 1)}]" if self.has_ci() else "")


def num(x: float, digits: int = 3) -> str:
    """Fixed decimals in the usual range, 3 significant digits for very large or small magnitudes."""
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}f}"
    return f"{x:.3g}"


def bounds(metric: str) -> tuple[float, float]:
    """The natural range of a metric (intervals from normal / t approximations are clipped to it)."""
    m = metric.rsplit(":", 1)[-1].removeprefix("utility.")
    if m in ("auroc", "advantage", "asr", "asr_oracle", "asr_aux", "accuracy", "label_acc") or m.startswith("tpr@"):
        return 0.0, 1.0
    if m == "ssim":
        return -1.0, 1.0
    if m in ("psnr", "mse", "test_loss", "perplexity", "fid", "kid"):
        return 0.0, math.inf
    return -math.inf, math.inf


def clipped(e: Estimate | None, metric: str) -> Estimate | None:
    if e is None or not e.has_ci():
        return e
    lo, hi = bounds(metric)
    e.lo, e.hi = min(max(e.lo, lo), hi), max(min(e.hi, hi), lo)
    return e


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng(int(stable_hash(list(map(str, key)), 15), 16))


_pct = percentile_interval
_hierarchical = hierarchical


def unresolvable(recs: Sequence[dict], metric: str) -> str:
    """Why a TPR at FPR f is not reported for these records (fewer than 10 / f non-members in a seed), or ""."""
    m = re.fullmatch(r"tpr@([0-9.]+)fpr", metric)
    if not m:
        return ""
    for r in recs:
        y = (r.get("per_candidate") or {}).get("member")
        if y:
            why = tpr_unreported(float(m.group(1)), len(y) - int(sum(y)))
        else:
            why = ((r.get("metrics") or {}).get(metric) or {}).get("reason") or ""
        if why:
            return why
    return ""


def membership_estimate(
    recs: Sequence[dict], metric: str, *, key: Any = "", n_boot: int = N_BOOT, variant: str | None = None
) -> Estimate | None:
    """A membership metric over the seeds in ``recs`` (one record per seed, status ok): of the primary score,
    or of a ``variant`` whose per-candidate scores the records kept (``per_candidate.variants``)."""

    def metrics_of(r: dict) -> dict:
        if variant is None:
            return r.get("metrics") or {}
        return {k: {"value": v} for k, v in ((r.get("variants") or {}).get(variant) or {}).items()}

    def scores_of(r: dict) -> list | None:
        pc = r.get("per_candidate") or {}
        return pc.get("score") if variant is None else (pc.get("variants") or {}).get(variant)

    why = unresolvable(recs, metric)
    if why:
        return Estimate(math.nan, n_seeds=len(recs), method="not reported", note=why)
    recs = [r for r in recs if metric in metrics_of(r) and metrics_of(r)[metric].get("value") is not None]
    if not recs:
        return None
    stat = member_stat(metric)
    seeds = record_seeds([recs], [variant]) if stat is not None else None
    if stat is not None and seeds is not None and len(seeds) == len(recs):  # by id: seeds share candidates
        (reps,) = pigeonhole(seeds, stat, _rng("member", key, metric), n_boot)
        lo, hi = _pct(reps)
        return Estimate(points(seeds, stat)[0], lo, hi, len(recs), f"bootstrap over {describe(seeds)}", reps)
    samples = [(scores_of(r), (r.get("per_candidate") or {}).get("member")) for r in recs]
    if stat is not None and all(sc and y and len(sc) == len(y) for sc, y in samples):
        groups = []
        for sc_raw, y_raw in samples:
            sc, y = np.asarray(sc_raw, float), np.asarray(y_raw, int)
            groups.append(Drawn(sc[y == 1], sc[y == 0]))
        if all(len(g.pos) and len(g.neg) for g in groups):
            value = float(np.mean([stat(g.pos[None], g.neg[None])[0] for g in groups]))
            reps = _hierarchical(groups, partial(draw_stat, stat), _rng("member", key, metric), n_boot)
            lo, hi = _pct(reps)
            return Estimate(
                value, lo, hi, len(recs), f"bootstrap over {'seeds x ' if len(recs) > 1 else ''}candidates", reps
            )
    return _from_record_cis([metrics_of(r)[metric] for r in recs])


def _from_record_cis(ms: Sequence[dict]) -> Estimate:
    vals = np.array([m["value"] for m in ms], float)
    if len(ms) == 1:
        m = ms[0]
        return Estimate(
            float(m["value"]), float(m.get("ci_low", math.nan)), float(m.get("ci_high", math.nan)), 1, "record interval"
        )
    from scipy import stats  # lazy: scipy.stats costs seconds at start-up, and one seed needs none

    z = stats.norm.ppf(0.5 + LEVEL / 2)
    se_within = [(m.get("ci_high", math.nan) - m.get("ci_low", math.nan)) / (2 * z) for m in ms]
    within = float(np.nanmean(np.square(se_within))) if not np.all(np.isnan(se_within)) else 0.0
    se = math.sqrt((within + float(vals.var(ddof=1))) / len(vals))
    v = float(vals.mean())
    return Estimate(v, v - z * se, v + z * se, len(ms), "normal approx. over seeds")


def sample_estimate(
    recs: Sequence[dict], metric: str, *, key: Any = "", transform=None, n_boot: int = N_BOOT
) -> Estimate | None:
    """Mean of a per-sample metric (reconstruction: per image) over seeds x samples: crossed when every seed
    attacked the same target ids (``bench.pigeonhole.crossed``), else seeds, then samples within each."""
    groups = [np.asarray((r.get("per_sample") or {}).get(metric, []), float) for r in recs]
    groups = [g if transform is None else transform(g) for g in groups if len(g)]
    if not groups:
        ms = [r["metrics"][metric] for r in recs if metric in (r.get("metrics") or {})]
        return _from_record_cis(ms) if ms else None
    value = float(np.mean([g.mean() for g in groups]))
    rng = _rng("sample", key, metric, transform is not None)
    table = aligned([target_values(r, metric) for r in recs]) if len(groups) == len(recs) else None
    if table is not None and len(groups) > 1:
        (reps,) = crossed([table if transform is None else transform(table)], rng, n_boot)
        design = f"{len(groups)} seeds x {table.shape[1]} targets (crossed)"
    else:
        reps = _hierarchical(groups, mean_of_draws, rng, n_boot)
        design = f"{'seeds x ' if len(groups) > 1 else ''}samples"
    lo, hi = _pct(reps)
    return Estimate(value, lo, hi, len(groups), f"bootstrap over {design}", reps)


def seed_estimate(values: Iterable[float]) -> Estimate | None:
    """Mean over seeds with a Student-t interval (one value per seed, e.g. utility)."""
    v = np.array([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], float)
    if not len(v):
        return None
    if len(v) == 1:
        return Estimate(float(v[0]), n_seeds=1, method="single seed")
    from scipy import stats  # lazy (see _from_record_cis)

    half = stats.t.ppf(0.5 + LEVEL / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return Estimate(float(v.mean()), float(v.mean() - half), float(v.mean() + half), len(v), "t over seeds")


def distance_from(e: Estimate | None, ref: float) -> Estimate | None:
    """|value - ref| with its interval (AUROC is ranked by its distance from chance: a score that separates
    members in the "wrong" direction still leaks, as in [SMP-LoRA]'s |AUC - 0.5| / 0.5)."""
    if e is None:
        return None
    reps = np.abs(e.reps - ref) if e.reps is not None else None
    if reps is not None:
        lo, hi = _pct(reps)
    elif e.has_ci():
        a, b = abs(e.lo - ref), abs(e.hi - ref)
        lo, hi = (0.0 if e.lo <= ref <= e.hi else min(a, b)), max(a, b)
    else:
        lo = hi = math.nan
    return Estimate(abs(e.value - ref), lo, hi, e.n_seeds, e.method, reps)


def leakage(e: Estimate | None, metric: str) -> Estimate | None:
    """The quantity ranked for privacy (lower = less leakage): AUROC's distance from 0.5, else the metric."""
    return distance_from(e, 0.5) if metric == "auroc" else e
