"""Reconstruction rows paired on their targets.

A reconstruction record keeps each target's metrics by target id (``per_candidate``: ``score`` is the record's
``primary`` metric, the others are ``variants``; ``bench.recon_cells.per_target``). Every defense and seed of a task
attacks the same targets, so two rows' difference is bootstrapped with one resampling shared by both: when every
shared seed holds the same shared targets (the design is crossed), seeds and targets are resampled independently
(``bench.pigeonhole.crossed``); otherwise seeds, then the shared targets of each drawn seed (the same indices for
both rows). Records without target ids (written before they were kept) cannot be paired: None, and the caller
falls back to the unpaired difference.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..bootstrap import paired_hierarchical, shared_by_seed, target_values
from ..pigeonhole import crossed
from .stats import N_BOOT, Estimate, _pct, _rng

TargetGroup = tuple[np.ndarray, np.ndarray]  # one seed: row a's and row b's values on the shared targets


def target_groups(recs_a: Sequence[dict], recs_b: Sequence[dict], metric: str) -> tuple[list[TargetGroup], bool] | None:
    """Per seed both rows have, their values on the shared target ids (sorted), and whether every seed shares the
    same ids (a crossed design); None when a record has no ids or the rows share no seed with shared targets."""
    by_a = {r.get("seed", 0): target_values(r, metric) for r in recs_a}
    by_b = {r.get("seed", 0): target_values(r, metric) for r in recs_b}
    seeds = shared_by_seed(by_a, by_b)
    if seeds is None:
        return None
    seeds = [(a, b, ids) for a, b, ids in seeds if ids]
    groups = [(np.array([a[i] for i in ids]), np.array([b[i] for i in ids])) for a, b, ids in seeds]
    return (groups, all(ids == seeds[0][2] for _, _, ids in seeds)) if groups else None


def target_replicates(
    groups: list[TargetGroup], rng: np.random.Generator, n_boot: int, *, same_targets: bool
) -> tuple[np.ndarray, ...]:
    """Both rows' mean (over drawn seeds, of the mean over drawn targets) under one shared resampling: crossed when
    every seed holds the same targets (``same_targets``: the values form seeds x targets tables), else nested."""
    if same_targets:
        return crossed([np.stack([a for a, _ in groups]), np.stack([b for _, b in groups])], rng, n_boot)

    def draw(group: TargetGroup, n: int, r: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        va, vb = group
        i = r.integers(0, len(va), (n, len(va)))
        return va[i].mean(1), vb[i].mean(1)

    return paired_hierarchical(groups, draw, rng, n_boot)


def paired_target_difference(
    recs_a: Sequence[dict],
    recs_b: Sequence[dict],
    metric: str,
    *,
    key: object = "",
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
    n_boot: int = N_BOOT,
) -> Estimate | None:
    """transform(mean a) - transform(mean b) on the targets both rows attacked, paired bootstrap; None when the
    rows share no target ids."""
    found = target_groups(recs_a, recs_b, metric)
    if found is None:
        return None
    groups, same_targets = found
    f = transform or (lambda x: x)
    ra, rb = target_replicates(groups, _rng("paired-targets", key, metric), n_boot, same_targets=same_targets)
    reps = f(ra) - f(rb)
    lo, hi = _pct(reps)
    pa, pb = np.mean([a.mean() for a, _ in groups]), np.mean([b.mean() for _, b in groups])
    value = float(f(np.array([pa]))[0] - f(np.array([pb]))[0])
    return Estimate(value, lo, hi, len(groups), f"paired bootstrap over {design(groups, same_targets)}", reps)


def design(groups: Sequence[tuple[np.ndarray, ...]], same_targets: bool) -> str:
    """How the resampling ran, for an estimate's ``method``: seeds crossed with the same targets, or nested."""
    k, n = len(groups), sum(len(g[0]) for g in groups)
    if k == 1:
        return f"{n} targets"
    return f"{k} seeds x {len(groups[0][0])} targets (crossed)" if same_targets else f"seeds x {n} targets (nested)"
