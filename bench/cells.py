"""Running one attack cell: build the observation the attack declares, keep the ground truth here,
score the attack (DESIGN.md s.2, s.5)."""
from __future__ import annotations

import copy
import random
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Subset

from .fl import TrainResult, client_model_state, current, load_state
from .metrics import membership_metrics, membership_point, mean_ci, reconstruction_metrics, to_unit
from .plots import save_grid
from .task import Task
from .training import build_trained_model, target_client
from .types import Attack, ClientState, Defense, Observation, Reconstructions, RoundCtx, Scores


def _items(ds) -> list[Any]:
    return [ds[i] for i in range(len(ds))]


def labels_of(ds) -> list[int] | None:
    """The class / category of every item of ``ds`` when the dataset exposes them, else None."""
    if isinstance(ds, Subset):
        inner = labels_of(ds.dataset)
        return None if inner is None else [inner[i] for i in ds.indices]
    if isinstance(ds, ConcatDataset):
        parts = [labels_of(d) for d in ds.datasets]
        return None if any(p is None for p in parts) else [v for p in parts for v in p]
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


def membership_sets(task: Task, defense: Defense | None, view: str, client: int, seed: int):
    """Members / non-members of the same distribution, split into attacker-known aux and evaluation.

    In the ``client_model`` view the members are one client's (label-skewed) data, so the non-members are
    drawn to match that client's label histogram where the datasets expose labels."""
    if view == "client_model":
        members_ds = task.client_data[client]
    elif defense is not None and defense.setting == "central":
        members_ds = task.central_data
    else:
        members_ds = ConcatDataset(task.client_data) if defense is not None or task.central_data is None \
            else task.central_data
    if task.nonmembers is None:
        raise ValueError(f"task {task.id} has no held-out non-members")
    rng = random.Random(seed)
    m_idx = list(range(len(members_ds)))
    n_idx = list(range(len(task.nonmembers)))
    rng.shuffle(m_idx)
    rng.shuffle(n_idx)
    n = min(len(m_idx), len(n_idx), 2 * task.max_membership)
    half = n // 2
    if half < 4:
        raise ValueError(f"too few candidates for a membership cell ({n}); need at least 8 per side")
    if view == "client_model":
        m_lab, n_lab = labels_of(members_ds), labels_of(task.nonmembers)
        if m_lab is not None and n_lab is not None:
            n_idx = matched_nonmembers(m_idx[:n], m_lab, n_idx, n_lab)
    pick = lambda ds, idx: [ds[i] for i in idx]  # noqa: E731
    evaluation = pick(members_ds, m_idx[:half]), pick(task.nonmembers, n_idx[:half])
    aux = pick(members_ds, m_idx[half:n]), pick(task.nonmembers, n_idx[half:n])
    return evaluation, aux


def run_membership(task: Task, defense: Defense | None, attack: Attack, view: str, train: TrainResult | None,
                   seed: int) -> dict:
    """Score members vs non-members; ``defense`` None = the un-fine-tuned base model (shift check)."""
    client = target_client(train) if train is not None else 0
    if defense is None:
        model = task.api.build_model().eval()
    else:
        state = train.global_state
        if view == "client_model":
            if not train.client_latest:
                raise ValueError("client states were not kept for this run (shared state too large)")
            state = client_model_state(train.global_state, train.client_latest.get(client, {}))
        model = build_trained_model(task, defense, state, train.global_buffers)
    (mem, non), (aux_m, aux_n) = membership_sets(task, defense, view, client, seed)
    candidates = mem + non
    labels = np.array([1] * len(mem) + [0] * len(non))
    order = np.random.default_rng(seed).permutation(len(candidates))
    obs = Observation(view=view, model=model, message=None, api=task.api,
                      public={"aux_members": aux_m, "aux_nonmembers": aux_n})
    torch.manual_seed(seed)
    out = attack.run(obs, [candidates[i] for i in order])
    if not isinstance(out, Scores):
        raise TypeError(f"membership attack {attack.name} returned {type(out).__name__}, expected Scores")
    y = labels[order]
    arrays = {name: np.asarray(torch.as_tensor(s).detach().float().cpu()) for name, s in out.scores.items()}
    variants = {}
    for name, s in arrays.items():
        if s.shape != (len(y),):
            raise ValueError(f"score {name!r} has shape {s.shape}, expected ({len(y)},)")
        variants[name] = membership_point(s, y)
    primary = arrays[out.primary]
    metrics, roc = membership_metrics(primary, y, seed=seed)
    # Per-candidate primary scores and ground truth, so seeds can be pooled and metrics recomputed; the kept
    # variants' scores too (their intervals: e.g. papers/000 Table 4's MaxRenyi-0% / -10% per slice).
    per_candidate = {"score": [float(v) for v in primary], "member": [int(v) for v in y]}
    kept = {k: [float(v) for v in arrays[k]] for k in out.keep if k != out.primary}
    if kept:
        per_candidate["variants"] = kept
    return {"metrics": metrics, "variants": variants, "roc": roc, "primary": out.primary,
            "per_candidate": per_candidate, "target_client": client if view == "client_model" else None, "n_candidates": len(y)}


def probe_observations(task: Task, defense: Defense, seed: int) -> tuple[list[Observation], list[Any]]:
    """One batch-1 client update per reconstruction target, made by the defense's own client code
    from the initial global model (the round-0 update the attacker intercepts)."""
    api = task.api
    model0 = defense.setup(api.build_model(), api)
    names = tuple(task.shared_names(model0))
    state0 = current(model0, names)
    fl = replace(task.fl, batch_size=1, local_epochs=1, max_local_steps=1, rounds=1)
    if defense.fl_mode():
        fl = replace(fl, mode=defense.fl_mode())
    work = copy.deepcopy(model0)
    observations, targets = [], list(task.recon_targets or [])
    for i, item in enumerate(targets):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        ctx = RoundCtx(round=0, rounds=1, fl=fl, task=api, generator=gen, num_selected=1, global_state=state0,
                       shared_names=names, extras=task.extras)
        load_state(work, state0)
        msg = defense.client_step(ClientState(1000 + i, work, [item], {}), ctx)
        observations.append(Observation(view="client_update", model=copy.deepcopy(model0), message=msg, api=api,
                                        public={"global_state": state0, "lr": fl.lr, "local_steps": 1,
                                                "num_samples": 1, "mode": fl.mode}))
    return observations, targets


def run_reconstruction(task: Task, attack: Attack, probes: tuple[list[Observation], list[Any]], seed: int,
                       artifact_dir: Path) -> dict:
    observations, targets = probes
    if not targets:
        raise ValueError(f"task {task.id} has no reconstruction targets")
    torch.manual_seed(seed)
    outs = attack.run_batch(observations) if hasattr(attack, "run_batch") else [attack.run(o, None) for o in observations]
    recon = torch.cat([o.images for o in outs]).detach().float().cpu().numpy()
    truth = torch.stack([t[0] for t in targets]).float().numpy()
    if recon.shape != truth.shape:
        raise ValueError(f"reconstructions have shape {recon.shape}, targets {truth.shape}")
    info = task.api.info
    r01, t01 = to_unit(recon, info["mean"], info["std"]), to_unit(truth, info["mean"], info["std"])
    per = reconstruction_metrics(r01, t01)
    metrics = {k: mean_ci(v, seed=seed) for k, v in per.items()}
    labels = [o.labels for o in outs if o.labels is not None]
    if labels:
        got = torch.cat(labels).cpu().numpy()
        want = np.array([int(t[1]) for t in targets])
        per["label_correct"] = (got == want).astype(float).tolist()
        metrics["label_acc"] = mean_ci(per["label_correct"], seed=seed)
    failed = [o.details.get("failed") for o in outs if o.details.get("failed")]
    grid = save_grid(t01, r01, artifact_dir / "grid.png", title=f"{task.id} / {attack.name}",
                     scores=per["ssim"])
    return {"metrics": metrics, "per_sample": per, "artifacts": {"grid": grid},
            "attack_notes": sorted(set(failed))}
