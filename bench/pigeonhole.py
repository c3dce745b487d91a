"""The bootstrap of a crossed design: seeds and candidates (or targets) resampled independently, by id.

The seeds of a task score overlapping candidates: every seed attacks the same reconstruction targets, ldm-t2i scores
the same 256 + 256 candidates in every seed, and 60-73% of an llm-text or image-cls cell's candidate ids recur in
another seed. A candidate that is easy (or hard) in one seed is so in the others, so resampling candidates anew
within each drawn seed (``bench.bootstrap.hierarchical``) counts it as independent draws and narrows the interval:
on the published default records, by 1.75x in width for ldm-t2i FedRand's loss attack and 1.5x for image-cls ViT
FedAvg's. Here one replicate draws the seeds, and, once for all seeds, the member ids and the non-member ids from
their unions over the seeds (stratified); each drawn seed then scores the drawn ids it holds, with their
multiplicities ([Pigeonhole]: Owen's pigeonhole bootstrap, rows and columns resampled independently). With one
seed, or seeds that share no id, it is the stratified bootstrap of candidates within seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .bootstrap import MemberStat, candidates

Scores = dict[str, tuple[float, int]]  # one record's {candidate id: (score, member)}


def counts(n_boot: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, n]: how often each of ``n`` units is drawn in ``n`` draws with replacement, per replicate."""
    idx = rng.integers(0, n, (n_boot, n)) + n * np.arange(n_boot)[:, None]
    return np.bincount(idx.ravel(), minlength=n_boot * n).reshape(n_boot, n).astype(float)


def seed_weights(n_boot: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, k]: each seed's share of a replicate's drawn seeds (all ones with one seed: nothing to draw)."""
    return np.ones((n_boot, 1)) if k == 1 else counts(n_boot, k, rng) / k


# ----------------------------------------------------------------------------------------------
# reconstruction: every seed attacked the same targets


def aligned(maps: Sequence[dict[str, float] | None]) -> np.ndarray | None:
    """A seeds x targets table of per-seed {target id: value} maps over the same ids (columns in sorted id order);
    None when a map is missing or the seeds' targets differ (the design is then not crossed)."""
    if not maps or any(m is None for m in maps):
        return None
    ids = sorted(maps[0])  # type: ignore[arg-type]
    if not ids or any(set(m) != set(ids) for m in maps):  # type: ignore[arg-type]
        return None
    return np.array([[m[i] for i in ids] for m in maps], float)  # type: ignore[index]


def crossed(tables: Sequence[np.ndarray], rng: np.random.Generator, n_boot: int) -> tuple[np.ndarray, ...]:
    """Replicates of the mean of each seeds x targets table (same shape), seeds and targets resampled
    independently, one draw shared by all tables (a paired difference is the difference of their replicates)."""
    k, t = tables[0].shape
    w, u = seed_weights(n_boot, k, rng), counts(n_boot, t, rng) / t
    return tuple(np.einsum("bk,kt,bt->b", w, v, u) for v in tables)


# ----------------------------------------------------------------------------------------------
# membership: members and non-members by id


@dataclass(frozen=True)
class Seed:
    """One seed's candidates scored by every row: member and non-member ids, and each row's scores on them."""

    pos_ids: list[str]
    neg_ids: list[str]
    pos: list[np.ndarray]  # one array per row, aligned with pos_ids
    neg: list[np.ndarray]


def seeds_of(rows: Sequence[dict[int, Scores | None]]) -> list[Seed] | None:
    """Per seed every row has (sorted), the candidates all rows scored with the same membership (sorted ids);
    None when a record of such a seed has no ids, or no seed leaves a member and a non-member."""
    out = []
    for seed in sorted(set.intersection(*(set(r) for r in rows))):
        maps = [r[seed] for r in rows]
        if any(m is None for m in maps):
            return None
        shared = sorted(set.intersection(*(set(m) for m in maps)))  # type: ignore[arg-type]
        y = {i: {m[i][1] for m in maps} for i in shared}  # type: ignore[index]
        pos_ids, neg_ids = [i for i in shared if y[i] == {1}], [i for i in shared if y[i] == {0}]
        if pos_ids and neg_ids:
            pos = [np.array([m[i][0] for i in pos_ids]) for m in maps]  # type: ignore[index]
            neg = [np.array([m[i][0] for i in neg_ids]) for m in maps]  # type: ignore[index]
            out.append(Seed(pos_ids, neg_ids, pos, neg))
    return out or None


def record_seeds(recs_by_row: Sequence[Sequence[dict]], variants: Sequence[str | None]) -> list[Seed] | None:
    """:func:`seeds_of` the rows' records (one per seed), each row's primary score or its kept ``variant``."""
    return seeds_of([{r.get("seed", 0): candidates(r, v) for r in recs} for recs, v in zip(recs_by_row, variants)])


def weighted(stat: MemberStat, pos: np.ndarray, neg: np.ndarray, wp: np.ndarray, wn: np.ndarray) -> np.ndarray:
    """``stat`` per replicate when member i counts ``wp[b, i]`` times and non-member j ``wn[b, j]`` times: AUROC as
    the weighted Mann-Whitney U, TPR at FPR f above the (floor(f x drawn non-members) + 1)-th highest drawn
    non-member (``bench.bootstrap.Drawn``'s rule). Replicates without a drawn member or non-member are NaN."""
    order = np.argsort(neg, kind="stable")
    c = np.zeros((wn.shape[0], len(neg) + 1))
    np.cumsum(wn[:, order], axis=1, out=c[:, 1:])
    ns = neg[order]
    below, upto = np.searchsorted(ns, pos, "left"), np.searchsorted(ns, pos, "right")
    n1, n0 = wp.sum(1), c[:, -1]
    with np.errstate(invalid="ignore", divide="ignore"):
        if stat.fpr is None:
            return stat.of_auroc(((c[:, below] + c[:, upto]) * wp).sum(1) / 2 / (n1 * n0))
        allowed = np.floor(stat.fpr * n0 + 1e-9)
        k = ((n0[:, None] - c[:, :-1]) >= allowed[:, None] + 1).sum(1) - 1
        return ((below[None, :] > k[:, None]) * wp).sum(1) / n1


def pigeonhole(seeds: Sequence[Seed], stat: MemberStat, rng: np.random.Generator, n_boot: int) -> list[np.ndarray]:
    """Each row's replicates of ``stat`` (the mean over drawn seeds), under one resampling shared by all rows:
    seeds, and the member and non-member ids across seeds (module doc). A drawn seed holding no drawn member or
    no drawn non-member is left out of that replicate's mean."""
    mem = {i: j for j, i in enumerate(sorted({i for s in seeds for i in s.pos_ids}))}
    non = {i: j for j, i in enumerate(sorted({i for s in seeds for i in s.neg_ids}))}
    cm, cn = counts(n_boot, len(mem), rng), counts(n_boot, len(non), rng)
    w = seed_weights(n_boot, len(seeds), rng)
    rows = len(seeds[0].pos)
    total, sums = np.zeros(n_boot), [np.zeros(n_boot) for _ in range(rows)]
    for g, s in enumerate(seeds):
        wp, wn = cm[:, [mem[i] for i in s.pos_ids]], cn[:, [non[i] for i in s.neg_ids]]
        wg = w[:, g] * ((wp.sum(1) > 0) & (wn.sum(1) > 0))
        total += wg
        for r in range(rows):
            sums[r] += wg * np.nan_to_num(weighted(stat, s.pos[r], s.neg[r], wp, wn))
    with np.errstate(invalid="ignore", divide="ignore"):
        return [x / total for x in sums]


def points(seeds: Sequence[Seed], stat: MemberStat) -> list[float]:
    """Each row's statistic on the candidates of every seed, averaged over the seeds."""
    return [float(np.mean([stat(s.pos[r][None], s.neg[r][None])[0] for s in seeds])) for r in range(len(seeds[0].pos))]


def describe(seeds: Sequence[Seed]) -> str:
    """The design, for an estimate's ``method``: seeds and the distinct member + non-member ids drawn from."""
    n1, n0 = len({i for s in seeds for i in s.pos_ids}), len({i for s in seeds for i in s.neg_ids})
    return f"{len(seeds)} seeds x {n1}+{n0} candidates by id" if len(seeds) > 1 else f"{n1}+{n0} candidates"
