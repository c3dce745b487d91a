"""Reconstruction rows paired on their targets.

A reconstruction record keeps each target's metrics by target id (``per_candidate``: ``score`` is the record's
``primary`` metric, the others are ``variants``; ``bench.recon_cells.per_target``). Every defense and seed of a task
attacks the same targets, so two rows' difference is bootstrapped with one resampling shared by both: seeds, then
the shared targets of each drawn seed (the same indices for both rows). Records without target ids (written
before they were kept) cannot be paired: None, and the caller falls back to the unpaired difference.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..bootstrap import paired_hierarchical, shared_by_seed
from .stats import N_BOOT, Estimate, _pct, _rng

ALIASES = {"label_acc": "label_correct"}  # a record metric -> its per-target values' name
TargetGroup = tuple[np.ndarray, np.ndarray]  # one seed: row a's and row b's values on the shared targets


def target_values(rec: dict, metric: str) -> dict[str, float] | None:
    """{target id: value of ``metric``} of one reconstruction record, None without ids or values."""
    pc = rec.get("per_candidate") or {}
    name = ALIASES.get(metric, metric)
    ids = pc.get("id")
    vals = pc.get("score") if name == rec.get("primary") else (pc.get("variants") or {}).get(name)
    if not ids or not vals or len(ids) != len(vals):
        return None
    return {str(i): float(v) for i, v in zip(ids, vals)}


def target_groups(recs_a: Sequence[dict], recs_b: Sequence[dict], metric: str) -> list[TargetGroup] | None:
    """Per seed both rows have, their values on the shared target ids (sorted); None when a record has no ids
    or the rows share no seed with shared targets."""
    by_a = {r.get("seed", 0): target_values(r, metric) for r in recs_a}
    by_b = {r.get("seed", 0): target_values(r, metric) for r in recs_b}
    seeds = shared_by_seed(by_a, by_b)
    if seeds is None:
        return None
    groups = [(np.array([a[i] for i in ids]), np.array([b[i] for i in ids])) for a, b, ids in seeds if ids]
    return groups or None


def target_replicates(groups: list[TargetGroup], rng: np.random.Generator, n_boot: int) -> tuple[np.ndarray, ...]:
    """Both rows' mean (over drawn seeds, of the mean over drawn targets) under one shared resampling."""

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
    groups = target_groups(recs_a, recs_b, metric)
    if groups is None:
        return None
    f = transform or (lambda x: x)
    ra, rb = target_replicates(groups, _rng("paired-targets", key, metric), n_boot)
    reps = f(ra) - f(rb)
    lo, hi = _pct(reps)
    pa, pb = np.mean([a.mean() for a, _ in groups]), np.mean([b.mean() for _, b in groups])
    value = float(f(np.array([pa]))[0] - f(np.array([pb]))[0])
    n = sum(len(a) for a, _ in groups)
    seeds = "seeds x " if len(groups) > 1 else ""
    return Estimate(value, lo, hi, len(groups), f"paired bootstrap over {seeds}{n} shared targets", reps)
