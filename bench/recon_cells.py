"""Running one reconstruction cell: the intercepted round-0 client updates (one per target, made by the
defense's own client code), the attack's reconstructions scored against the targets it never saw, and the
random-image control on the same targets (docs/design.md s.2, s.5; membership cells: bench/cells.py)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import Dataset

from .fl import current, load_state
from .metrics import mean_ci, reconstruction_metrics, to_unit
from .task import Task
from .types import Attack, ClientState, Defense, FLMode, Observation, Public, Reconstructions, RoundCtx


def probe_observations(task: Task, defense: Defense, seed: int) -> tuple[list[Observation], list[Any]]:
    """One batch-1 client update per reconstruction target, made by the defense's own client code
    from the initial global model (the round-0 update the attacker intercepts). Target i is always
    ``task.recon_targets[i]`` sent alone by client 1000 + i with a generator seeded by (seed, i): the
    targets never depend on the defense or its use of randomness. BatchNorm normalises with the global model's
    running statistics (``batchnorm_stats="public"``, :data:`PROBE_PROTOCOL`)."""
    api = task.api
    model0 = defense.setup(api.build_model(), api)
    names = tuple(task.shared_names(model0))
    state0 = current(model0, names)
    fl = replace(task.fl, batch_size=1, local_epochs=1, max_local_steps=1, rounds=1, batchnorm_stats="public")
    mode = defense.fl_mode()
    if mode:
        fl = replace(fl, mode=mode)
    work = copy.deepcopy(model0)
    observations, targets = [], list(task.recon_targets or [])
    for i, item in enumerate(targets):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        ctx = RoundCtx(
            round=0,
            rounds=1,
            fl=fl,
            task=api,
            generator=gen,
            num_selected=1,
            global_state=state0,
            shared_names=names,
            extras=task.extras,
        )
        load_state(work, state0)
        one = cast(Dataset, [item])  # a list is a map-style dataset (len and indexing)
        msg = defense.client_step(ClientState(1000 + i, work, one, {}), ctx)
        observations.append(
            Observation(
                view="client_update",
                model=copy.deepcopy(model0),
                message=msg,
                api=api,
                public=Public(
                    global_state=state0,
                    lr=fl.lr,
                    local_steps=1,
                    num_samples=1,
                    mode=cast(FLMode, fl.mode),
                    batchnorm_stats=fl.batchnorm_stats,
                    optimizer=fl.optimizer,
                ),
                seed=seed,
            )
        )
    return observations, targets


def target_ids(task: Task) -> list[str]:
    """Stable ids of ``task.recon_targets``, in order: the task's ``recon_ids``, else ``t:<position>``. The targets
    depend on the task alone (not the defense or the seed), so rows of a task pair on these ids."""
    n = len(task.recon_targets or [])
    ids = [str(i) for i in task.recon_ids] if task.recon_ids is not None else [f"t:{i}" for i in range(n)]
    if len(ids) != n or len(set(ids)) != n:
        raise ValueError(f"task {task.id}: recon_ids must name its {n} reconstruction targets once each, got {ids}")
    return ids


def per_target(per: dict[str, list[float]], ids: list[str], primary: str = "ssim") -> dict:
    """``per_candidate`` of a reconstruction record: target ids, the ``primary`` metric per target as the score,
    the other per-target metrics as variants (the membership layout, without ``member``)."""
    return {"id": ids, "score": per[primary], "variants": {k: v for k, v in per.items() if k != primary}}


RANDOM_IMAGE_STREAM = 0x52414E44  # the random-image control's generator stream, beside the cell seed
# what a reconstruction record's negative control is (Cell.expected: records without it are redone)
# How the intercepted updates are made; a reconstruction record carries it (``probe``) and one made otherwise is redone.
# Breaching's honest-but-curious case (Geiping et al. 2020's setting): the server ships its BatchNorm buffers and the
# user computes its update in eval mode. Batch-1 train-mode BatchNorm would be an instance norm at every layer, a
# function the model never computes at inference (measured on the default ResNet34, FedSGD, 300 iterations, the 4 photo
# targets, one run: mean SSIM 0.37 in eval mode, 0.06 in train mode, 0.01 for random images).
PROBE_PROTOCOL = "batch-1 round-0 update; BatchNorm with the global model's running statistics (eval mode)"
RANDOM_IMAGE_CONTROL = "ssim_random: SSIM of uniform random images against the same targets"


def run_reconstruction(
    task: Task, attack: Attack, probes: tuple[list[Observation], list[Any]], seed: int, artifact_dir: Path
) -> dict:
    observations, targets = probes
    if not targets:
        raise ValueError(f"task {task.id} has no reconstruction targets")
    ids = target_ids(task)
    if len(ids) != len(targets):
        raise ValueError(f"{len(targets)} probed targets but task {task.id} names {len(ids)}")
    torch.manual_seed(seed)
    outs = [o for o in attack.run_batch(observations) if isinstance(o, Reconstructions)]
    if len(outs) != len(observations):
        raise TypeError(f"reconstruction attack {attack.name} must return one Reconstructions per observation")
    recon = torch.cat([o.images for o in outs]).detach().float().cpu().numpy()
    truth = torch.stack([t[0] for t in targets]).float().numpy()
    if recon.shape != truth.shape:
        raise ValueError(f"reconstructions have shape {recon.shape}, targets {truth.shape}")
    image = task.api.image
    if image is None:
        raise ValueError(f"task {task.id} declares no image spec (api.image): reconstructions cannot be scored")
    r01, t01 = to_unit(recon, list(image.mean), list(image.std)), to_unit(truth, list(image.mean), list(image.std))
    per = reconstruction_metrics(r01, t01)
    # negative control: uniform random images scored against the same targets (bench.controls, reconstruction)
    noise = np.random.default_rng([seed, RANDOM_IMAGE_STREAM]).random(t01.shape)
    per["ssim_random"] = reconstruction_metrics(noise, t01)["ssim"]
    metrics = {k: mean_ci(v, seed=seed) for k, v in per.items()}
    labels = [o.labels for o in outs if o.labels is not None]
    if labels:
        got = torch.cat(labels).cpu().numpy()
        want = np.array([int(t[1]) for t in targets])
        per["label_correct"] = (got == want).astype(float).tolist()
        metrics["label_acc"] = mean_ci(per["label_correct"], seed=seed)
    notes = [o.details[k] for o in outs for k in ("failed", "note") if o.details.get(k)]
    from .figures import save_grid  # lazy: matplotlib (start-up)

    grid = save_grid(t01, r01, artifact_dir / "grid.png", title=f"{task.id} / {attack.name}", scores=per["ssim"])
    return {
        "metrics": metrics,
        "per_sample": per,
        "primary": "ssim",
        "per_candidate": per_target(per, ids),  # rows pair on target ids (bench.report.targets)
        "artifacts": {"grid": grid},
        "attack_notes": sorted(set(notes)),
    }
