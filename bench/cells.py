"""Running one membership cell: build the observation the attack declares, keep the ground truth here,
score the attack (docs/design.md s.2, s.5; reconstruction cells: bench/recon_cells.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Subset

from .fl import TrainResult, client_model_state
from .metrics import membership_metrics, membership_point
from .progress import progress, stage
from .reference import Reference
from .signal_cache import group_cache
from .task import Task
from .training import build_trained_model
from .types import (
    Attack,
    Defense,
    Observation,
    Public,
    Scores,
    View,
    n_items,
)


def _items(ds) -> list[Any]:
    return [ds[i] for i in range(len(ds))]


def labels_of(ds) -> list[int] | None:
    """The class / category of every item of ``ds`` when the dataset exposes them, else None."""
    if isinstance(ds, Subset):
        inner = labels_of(ds.dataset)
        return None if inner is None else [inner[i] for i in ds.indices]
    if isinstance(ds, ConcatDataset):
        out: list[int] = []
        for part in (labels_of(d) for d in ds.datasets):
            if part is None:
                return None
            out.extend(part)
        return out
    for attr in ("labels", "targets"):
        v = getattr(ds, attr, None)
        if v is not None:
            return [int(c) for c in v]
    return None


def matched_nonmembers(members: list[int], m_labels: list[int], n_idx: list[int], n_labels: list[int]) -> list[int]:
    """Non-member indices drawn to follow the members' label histogram (one per member, in order, without
    replacement), topped up from the rest when a label runs out: a client's Dirichlet-skewed data against
    the global non-member pool would otherwise let an attack win on class alone (a distribution shift)."""
    pools: dict[int, list[int]] = {}
    for i in n_idx:
        pools.setdefault(n_labels[i], []).append(i)
    chosen, short = [], 0
    for m in members:
        pool = pools.get(m_labels[m])
        if pool:
            chosen.append(pool.pop(0))
        else:
            short += 1
    taken = set(chosen)
    rest = [i for i in n_idx if i not in taken]
    return chosen + rest[:short] + rest[short:]


def pool_kind(task: Task, view: str) -> str:
    """Which member pool a view draws its candidates from: ``"central"`` (the released model's training set) or
    ``"clients"`` (every client's data); views of one kind score the same candidates."""
    return "central" if view == "released_model" or not task.client_data else "clients"


def member_pool(task: Task, view: str):
    """The members a view's candidates come from: the released model's training set (``central_data``)
    in the released view, else every client's data concatenated (client k's items follow client k-1's),
    so the global and client views share candidate ids and the base model scores the same texts."""
    if pool_kind(task, view) == "central":
        if task.central_data is None:
            raise ValueError(f"task {task.id} has no central training set for the {view} view")
        return task.central_data
    return ConcatDataset(task.client_data)


@dataclass(frozen=True)
class CandidateSplit:
    """Indices into the member pool (``m``) and ``task.nonmembers`` (``n``): evaluation candidates, then
    the attacker's auxiliary ones (disjoint). Drawn from the cell seed and the pool sizes alone."""

    members: list[int]
    nonmembers: list[int]
    aux_members: list[int]
    aux_nonmembers: list[int]


def aux_reserve(max_per_side: int) -> int:
    """Items per side held back from evaluation for the attacker's auxiliary split (fixed, whether or
    not the attack uses it, so the evaluation candidates never depend on the attack)."""
    return max(8, max_per_side // 4)


def split_candidates(n_members: int, n_nonmembers: int, max_per_side: int, seed: int) -> CandidateSplit:
    """Evaluation: ``min(max_per_side, pool - aux_reserve)`` per side; aux: the rest, at most as many."""
    reserve = aux_reserve(max_per_side)
    e = min(max_per_side, n_members - reserve, n_nonmembers - reserve)
    if e < 8:
        raise ValueError(
            f"too few candidates for a membership cell: {n_members} members and {n_nonmembers} "
            f"non-members leave {e} per side after the attacker's {reserve}; need at least 8"
        )
    rng = np.random.default_rng([seed, 0x4D49])  # the seed only: every defense and the base model agree
    pm, pn = rng.permutation(n_members).tolist(), rng.permutation(n_nonmembers).tolist()
    a = min(len(pm) - e, len(pn) - e, e)
    return CandidateSplit(pm[:e], pn[:e], pm[e : e + a], pn[e : e + a])


def view_split(task: Task, view: str, n_members: int, seed: int) -> CandidateSplit:
    """The seed's candidate split of a view's pools. A task with ``eval_subsets`` (ldm-t2i: [SMP-LoRA]
    evaluates on D_te only) draws the evaluation candidates from those positions, the aux split from the rest."""
    if task.nonmembers is None:
        raise ValueError(f"task {task.id} has no held-out non-members")
    n_nonmembers = n_items(task.nonmembers)
    subsets = task.eval_subsets
    if not subsets:
        return split_candidates(n_members, n_nonmembers, task.max_membership, seed)
    key = pool_kind(task, view)
    em, en = list(subsets[key]), list(subsets["nonmembers"])
    if not (set(em) <= set(range(n_members)) and set(en) <= set(range(n_nonmembers))):
        raise ValueError(f"task {task.id}: eval_subsets name positions outside the {view} pools")
    e = min(task.max_membership, len(em), len(en))
    if e < 8:
        raise ValueError(
            f"too few evaluation candidates for a membership cell: {len(em)} members and {len(en)} "
            f"non-members in the task's eval_subsets; need at least 8"
        )
    rm = [i for i in range(n_members) if i not in set(em)]
    rn = [i for i in range(n_nonmembers) if i not in set(en)]
    rng = np.random.default_rng([seed, 0x4D49])  # the seed only: every defense and the base model agree
    pick = lambda xs: [xs[i] for i in rng.permutation(len(xs))]  # noqa: E731
    pm, pn, am, an = pick(em), pick(en), pick(rm), pick(rn)
    a = min(len(am), len(an), e)
    return CandidateSplit(pm[:e], pn[:e], am[:a], an[:a])


def candidate_ids(split: CandidateSplit) -> list[str]:
    """Stable ids in the record's order: members then non-members, ``m:<i>`` / ``n:<i>`` into the pools."""
    return [f"m:{i}" for i in split.members] + [f"n:{i}" for i in split.nonmembers]


def client_ranges(task: Task) -> list[range]:
    """Each client's index range in the concatenated member pool."""
    out, start = [], 0
    for ds in task.client_data:
        out.append(range(start, start + n_items(ds)))
        start += n_items(ds)
    return out


def assign_nonmembers(
    groups: list[list[int]], m_labels: list[int] | None, nonmembers: list[int], n_labels: list[int] | None
) -> list[list[int]]:
    """Split ``nonmembers`` over member groups, one per member, each group's label-matched where the
    datasets expose labels (else in order): every non-member is used once."""
    if m_labels is None or n_labels is None:
        order, k, out = list(nonmembers), 0, []
        for g in groups:
            out.append(order[k : k + len(g)])
            k += len(g)
        return out
    pools: dict[int, list[int]] = {}
    for i in nonmembers:
        pools.setdefault(n_labels[i], []).append(i)
    slots = [[pools[m_labels[m]].pop(0) if pools.get(m_labels[m]) else None for m in g] for g in groups]
    taken = {i for g in slots for i in g if i is not None}
    rest = iter([i for i in nonmembers if i not in taken])  # a label that ran out: top up in order
    return [[i if i is not None else next(rest) for i in g] for g in slots]  # one non-member per member


@dataclass
class Part:
    """One model's share of a cell: the candidates it scores and its aux split (pool indices). The model is
    built when the part is scored (``build``), so a client view holds one client's model (and its reference
    models) at a time, not every client's at once."""

    build: Callable[[], nn.Module]
    members: list[int]
    nonmembers: list[int]
    aux: tuple[list[int], list[int]]
    client: int | None = None


def membership_parts(
    task: Task, defense: Defense | None, view: str, train: TrainResult | None, seed: int
) -> tuple[Any, CandidateSplit, list[Part]]:
    """The member pool, the seed's candidate split, and the models that score it.

    Global / released view and the base model: one model scores every candidate. Client view: every
    client's reconstructed model (its latest sent weights over the global ones) scores its own evaluation
    members against label-matched evaluation non-members; the pooled candidates equal the global view's."""
    if task.nonmembers is None:
        raise ValueError(f"task {task.id} has no held-out non-members")
    pool = member_pool(task, view)
    split = view_split(task, view, len(pool), seed)
    whole = (split.aux_members, split.aux_nonmembers)
    if defense is None:
        return pool, split, [Part(lambda: task.api.build_model().eval(), split.members, split.nonmembers, whole)]
    if train is None:
        raise ValueError(f"the {view} view of defense {defense.name} needs its training run")
    if view != "client_model":
        build = functools.partial(build_trained_model, task, defense, train.global_state, train.global_buffers)
        return pool, split, [Part(build, split.members, split.nonmembers, whole)]
    if not train.client_latest:
        raise ValueError("client states were not kept for this run (shared state too large)")
    ranges = client_ranges(task)
    m_lab, n_lab = labels_of(pool), labels_of(task.nonmembers)
    groups = [[i for i in split.members if i in r] for r in ranges]
    non = assign_nonmembers(groups, m_lab, split.nonmembers, n_lab)
    aux_groups = [[i for i in split.aux_members if i in r] for r in ranges]
    aux_non = assign_nonmembers(aux_groups, m_lab, split.aux_nonmembers, n_lab)
    parts = []
    for k, (mem, nm) in enumerate(zip(groups, non)):
        if not mem or k not in train.client_latest:
            continue  # a client with no evaluation members, or whose state was not kept (large models)
        # the client's own aux members; a client with fewer than 8 gets the pooled aux split
        aux = (aux_groups[k], aux_non[k]) if len(aux_groups[k]) >= 8 else whole
        parts.append(Part(functools.partial(_client_model, task, defense, train, k), mem, nm, aux, client=k))
    if not parts:
        raise ValueError("no client's reconstructed model has evaluation candidates")
    return pool, split, parts


def _client_model(task: Task, defense: Defense, train: TrainResult, k: int) -> nn.Module:
    """Client ``k``'s reconstructed model: its latest sent weights over the global ones."""
    state = client_model_state(train.global_state, train.client_latest[k])
    return build_trained_model(task, defense, state, train.global_buffers)


def aux_threshold_asr(
    scores: np.ndarray, y: np.ndarray, thresholds: np.ndarray, *, seed: int, n_boot: int = 200
) -> dict[str, float]:
    """Balanced accuracy of ``score >= threshold`` (each candidate's threshold is its model's, chosen on
    the attacker's aux data), with a 95% bootstrap interval over candidates."""
    pred = scores >= thresholds

    def bacc(idx: np.ndarray) -> float:
        t, p = y[idx], pred[idx]
        return float(0.5 * (p[t == 1].mean() + (~p[t == 0]).mean()))

    rng = np.random.default_rng(seed)
    boots = []
    for _ in range(n_boot):
        idx = rng.integers(0, len(y), len(y))
        if 0 < y[idx].sum() < len(idx):
            boots.append(bacc(idx))
    return {
        "value": bacc(np.arange(len(y))),
        "ci_low": float(np.percentile(boots, 2.5)),
        "ci_high": float(np.percentile(boots, 97.5)),
    }


def best_threshold(members: np.ndarray, nonmembers: np.ndarray) -> float:
    """The threshold maximising the balanced accuracy of ``score >= t`` on the attacker's aux scores."""
    s = np.concatenate([members, nonmembers]).astype(float)
    y = np.r_[np.ones(len(members)), np.zeros(len(nonmembers))]
    from sklearn.metrics import roc_curve  # lazy: sklearn is not needed to plan (start-up)

    fpr, tpr, thr = roc_curve(y, s, drop_intermediate=False)
    j = int(np.argmax(tpr - fpr))
    return float(thr[j]) if np.isfinite(thr[j]) else float(s.max()) + 1.0


def _np(t) -> np.ndarray:
    return np.asarray(torch.as_tensor(t).detach().double().cpu())


def run_membership(
    task: Task,
    defense: Defense | None,
    attack: Attack,
    view: str,
    train: TrainResult | None,
    seed: int,
    *,
    cache_root: Path | None = None,
) -> dict:
    """Score the seed's candidates; ``defense`` None = the un-fine-tuned base model (shift check), on the
    same candidates in every view.

    The aux split reaches the attack (``obs.public``) only when it ``uses_aux``; for other attacks the
    harness scores the aux split separately to pick the ``asr_aux`` threshold; an attack that trains on
    aux reports ``asr_aux`` only when it returns held-out ``Scores.calibration``."""
    uses_aux = bool(getattr(attack, "uses_aux", False))
    pool, split, parts = membership_parts(task, defense, view, train, seed)
    # Canonical order (members then non-members, as split) so rows of a (task, view, seed) align by position.
    pos = {("m", i): j for j, i in enumerate(split.members)}
    pos.update({("n", i): len(split.members) + j for j, i in enumerate(split.nonmembers)})
    n_all = len(pos)
    arrays: dict[str, np.ndarray] = {}
    thresholds = np.full(n_all, np.nan)
    seen = np.zeros(n_all, dtype=bool)
    nonmembers = task.nonmembers
    assert nonmembers is not None  # membership_parts checked
    item = lambda c: pool[c[1]] if c[0] == "m" else nonmembers[c[1]]  # noqa: E731
    primary = ""
    details: dict[str, Any] = {}  # Scores.details per scoring model (client view: per client)
    used: dict[str, Any] | None = None  # the reference-model attacker's stated knowledge
    # the cell's main loop (bench.progress): one part per scored model, the attack's own loops nested in it
    for part in progress(parts, desc=f"{attack.name} {view}", leave=False, unit=True):
        cands = [("m", i) for i in part.members] + [("n", i) for i in part.nonmembers]
        order = np.random.default_rng([seed, 1 + (part.client or 0)]).permutation(len(cands))
        steps = _part_steps(len(cands), part, uses_aux)
        with stage(0, steps):  # three steps of a part: its model, the candidates' scores, the aux threshold's
            obs = membership_observation(task, defense, attack, view, part, pool, seed, cache_root=cache_root)
        reference = obs.reference
        torch.manual_seed(seed)
        with stage(1, steps):
            out = attack.run(obs, [item(cands[o]) for o in order])
        if not isinstance(out, Scores):
            raise TypeError(f"membership attack {attack.name} returned {type(out).__name__}, expected Scores")
        at = [pos[cands[o]] for o in order]
        for name, raw in out.scores.items():
            s = _np(raw)
            if s.shape != (len(at),):
                raise ValueError(f"score {name!r} has shape {s.shape}, expected ({len(at)},)")
            arrays.setdefault(name, np.full(n_all, np.nan))[at] = s
        seen[at] = True
        primary = out.primary
        if out.details:
            details["all" if part.client is None else str(part.client)] = out.details
        with stage(2, steps):
            thresholds[at] = _aux_threshold(attack, out, obs, part, pool, task, seed, uses_aux)
        used = reference.used if reference is not None else None
        del obs, reference, out  # this client's model and reference models go before the next client's are built
    # Candidates of clients without a kept state are dropped (large models keep one client).
    idx = np.flatnonzero(seen)
    ids = candidate_ids(split)
    ids = [ids[j] for j in idx]
    y = np.array([1] * len(split.members) + [0] * len(split.nonmembers))[idx]
    arrays = {k: v[idx] for k, v in arrays.items()}
    variants = {name: _rename_asr(membership_point(s, y)) for name, s in arrays.items()}
    metrics, roc = membership_metrics(arrays[primary], y, seed=seed)
    metrics = _rename_asr(metrics)
    if np.isfinite(thresholds[idx]).all():
        metrics["asr_aux"] = aux_threshold_asr(arrays[primary], y, thresholds[idx], seed=seed)
    # Per-candidate primary scores, ground truth and ids (seeds pool, rows pair on ids); every other score
    # variant's too, so any two scores compare paired on the same candidates (attack strength, [FedRand] Table 4).
    per_candidate = {"score": [float(v) for v in arrays[primary]], "member": [int(v) for v in y], "id": ids}
    m_lab, n_lab = labels_of(pool), labels_of(nonmembers)
    if m_lab is not None and n_lab is not None:  # the one-run audit pairs within a class (bench.one_run_audit)
        lab = {"m": m_lab, "n": n_lab}
        per_candidate["label"] = [int(lab[c[0]][int(c[2:])]) for c in ids]
    kept = {k: [float(v) for v in arrays[k]] for k in arrays if k != primary}
    if kept:
        per_candidate["variants"] = kept
    clients = [p.client for p in parts if p.client is not None]
    extra = {"reference": used} if used is not None else {}  # what the attacker was assumed to know
    if details:  # what the attack states about its scoring (max_renyi: each slice's token count)
        extra["attack_details"] = details["all"] if list(details) == ["all"] else {"per_client": details}
    return {
        **extra,
        "metrics": metrics,
        "variants": variants,
        "roc": roc,
        "primary": primary,
        "per_candidate": per_candidate,
        "clients": clients if view == "client_model" else None,
        "n_candidates": len(y),
        "n_members": int(y.sum()),
        "n_nonmembers": int(len(y) - y.sum()),
        "n_aux": [len(split.aux_members), len(split.aux_nonmembers)] if uses_aux else [0, 0],
    }


def membership_observation(
    task: Task,
    defense: Defense | None,
    attack: Attack,
    view: str,
    part: Part,
    pool,
    seed: int,
    *,
    cache_root: Path | None = None,
) -> Observation:
    """What a membership attack observes for one scoring model (``part``): the model, the aux split in
    ``public`` only when it ``uses_aux``, reference models when it ``uses_reference``, the base model's builder
    when it ``uses_base``, the shared signals."""
    uses_aux = bool(getattr(attack, "uses_aux", False))
    nonmembers = task.nonmembers
    if uses_aux and nonmembers is None:
        raise ValueError(f"task {task.id} has no held-out non-members")
    public = (
        Public(aux_members=[pool[i] for i in part.aux[0]], aux_nonmembers=[nonmembers[i] for i in part.aux[1]])
        if nonmembers is not None and uses_aux
        else Public()
    )
    # reference-model attacks ([RMIA]): reference models of this view / client, cached under cache_root
    reference = (
        Reference(task, defense, view, part.client, seed, cache_root)
        if getattr(attack, "uses_reference", False)
        else None
    )
    model = part.build()
    # the base model: the target itself on the base row (not built twice); else a fresh build when asked for
    base = (lambda: model) if defense is None else task.api.build_model
    return Observation(
        view=cast(View, view),
        model=model,
        message=None,
        api=task.api,
        public=public,
        seed=seed,
        # shared per-candidate signals; spilled beside the training cache, so a killed cell resumes from its passes
        signals=group_cache((task.id, repr(defense), seed), None if cache_root is None else cache_root / "signals"),
        reference=reference,
        base_model=base if getattr(attack, "uses_base", False) else None,
    )


MODEL_STEP = 0.05  # a part's model building, as a share of its scoring: a cached run loaded, a few seconds


def _part_steps(n_candidates: int, part: Part, uses_aux: bool) -> tuple[float, float, float]:
    """A part's three steps weighted by expected cost (bench.progress.stage): the model, the candidates' scores
    (by their count), the aux split's scores (by its count, where the harness scores it: :func:`_aux_threshold`).
    Equal thirds put a third of each part on its model building (seconds): the bar jumped at every part, and a
    resumed cell's ETA came out a fraction of its time (vlm-caption's RMIA client cell: 50 s for ~20 min)."""
    n = float(max(n_candidates, 1))
    n_aux = 0 if uses_aux or not part.aux[0] or not part.aux[1] else len(part.aux[0]) + len(part.aux[1])
    return (MODEL_STEP * n, n, float(n_aux))


def _aux_threshold(
    attack: Attack, out: Scores, obs: Observation, part: Part, pool, task: Task, seed: int, uses_aux: bool
) -> float:
    """The primary score's threshold chosen on the attacker's aux split (NaN: none available)."""
    cal = out.calibration or {}
    if out.primary in cal:
        cm, cn = cal[out.primary]
        return best_threshold(_np(cm), _np(cn))
    if uses_aux or not part.aux[0] or not part.aux[1]:
        return float("nan")  # its scores on the aux split are in-sample (it trained on them)
    nonmembers = task.nonmembers
    assert nonmembers is not None  # membership_parts checked
    aux = [pool[i] for i in part.aux[0]] + [nonmembers[i] for i in part.aux[1]]
    torch.manual_seed(seed)
    aux_out = attack.run(obs, aux)
    if not isinstance(aux_out, Scores):
        raise TypeError(f"membership attack {attack.name} returned {type(aux_out).__name__}, expected Scores")
    s = _np(aux_out.scores[out.primary])
    return best_threshold(s[: len(part.aux[0])], s[len(part.aux[0]) :])


def _rename_asr(d: dict) -> dict:
    """``asr`` from ``membership_point`` picks its threshold on the evaluation set itself: an oracle."""
    return {("asr_oracle" if k == "asr" else k): v for k, v in d.items()}
