"""Train once, attack many: a (task, defense, seed) training run cached by its config hash.

The cache holds the server's view (global state, each client's latest sent weights, the message
transcript's metadata), the utility of the global model, and costs: tensors as safetensors, the rest as
JSON with the tensors' checksum (bench/cachefile.py; no pickle). A damaged entry is quarantined and the run
retrained. A run in progress saves round checkpoints beside its entry (bench/checkpoint.py) and resumes from them.
A run that diverges under its defense leaves a marker instead (``divergence``): training is deterministic for a
configuration and seed, so the outcome is known and the next run records it without training again.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import cachefile
from .checkpoint import Checkpoint, path_for
from .fl import TrainingDiverged, TrainResult, client_model_state, load_state, run_federated, seeded_fedsgd
from .store import atomic_write_bytes, jsonable, stable_hash
from .task import Task
from .types import Defense, params_of

# Above this many shared parameters only the target client's reconstructed state is stored.
MAX_CLIENT_NUMEL = 5_000_000


def label(method) -> str:
    """``flrsp(R=0.8,form=fedsgd)``: name plus the parameters that differ from the defaults."""
    diffs = []
    for f in dataclasses.fields(method) if dataclasses.is_dataclass(method) else []:
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        v = getattr(method, f.name)
        if v != default:
            diffs.append(f"{f.name}={v}")
    return f"{method.name}({','.join(diffs)})" if diffs else method.name


def train_key(task: Task, defense: Defense, seed: int) -> str:
    desc: dict[str, Any] = {
        "task": task.id,
        "preset": task.preset,
        "config": task.config_hash(),
        "defense": defense.name,
        "params": params_of(defense),
        "seed": seed,
    }
    if seeded_fedsgd(task.fl, defense, seed):  # only then: runs whose batches did not change keep their keys
        desc["fedsgd_batches"] = "seeded"
    return stable_hash(desc)


def target_client(train: TrainResult, *, seed: int | None = None, num_clients: int | None = None) -> int:
    """The client the curious server reconstructs: ``seed % num_clients`` when given (fixed across defenses,
    so every defense's cell scores the same person's data), else the one that sent the most weight messages."""
    if seed is not None and num_clients:
        return seed % num_clients
    counts: dict[int, int] = {}
    for m in train.transcript:
        if m["kind"] == "weights":
            counts[m["client"]] = counts.get(m["client"], 0) + 1
    return min(counts, key=lambda k: (-counts[k], k)) if counts else 0


def build_trained_model(
    task: Task, defense: Defense, state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    model = defense.setup(task.api.build_model(), task.api)
    load_state(model, state, buffers)
    model.eval()
    return model


def _encode(res: TrainResult) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    groups = {
        "global": res.global_state,
        "buffers": res.global_buffers,
        **{f"client{k}": v for k, v in res.client_latest.items()},
    }
    tensors, order = cachefile.flatten(groups)
    meta = {k: v for k, v in asdict(res).items() if k not in ("global_state", "global_buffers", "client_latest")}
    return tensors, {**meta, "order": order, "clients": list(res.client_latest)}


def decode_run(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> TrainResult:
    groups = cachefile.unflatten(tensors, meta["order"])
    scalars = {f.name: meta[f.name] for f in dataclasses.fields(TrainResult) if f.name in meta}
    return TrainResult(
        global_state=groups["global"],
        global_buffers=groups["buffers"],
        client_latest={int(k): groups[f"client{k}"] for k in meta["clients"]},
        **scalars,
    )


def _legacy(blob: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A cache file of the former torch.save(asdict(TrainResult)) layout (read with weights_only=True)."""
    if not isinstance(blob, dict):
        raise TypeError(f"expected a dict, got {type(blob).__name__}")
    return _encode(TrainResult(**blob))


def cache_stem(task: Task, defense: Defense, seed: int, cache_root: Path) -> Path:
    """``<cache_root>/train/<train_key>``: the entry's JSON is ``<stem>.json`` (bench/cachefile.py)."""
    return cache_root / "train" / train_key(task, defense, seed)


def identity(task: Task, defense: Defense, seed: int, cache_root: Path) -> dict[str, Any] | None:
    """The cached run's identity, which membership records carry (``training``): its tensors' SHA-256 (16 hex
    digits) and its utility; None when it is not cached. Every cell of a (task, defense, seed) must score the
    same run: a record made from another (a run retrained after its cache was lost) is stale."""
    h = cachefile.head(cache_stem(task, defense, seed, cache_root))
    if h is None or not isinstance(h.get("sha256"), str):
        return None
    return {"sha256": h["sha256"][:16], "utility": h["meta"].get("utility", {})}


def made_from(record: dict[str, Any], ident: dict[str, Any]) -> bool:
    """Whether ``record`` was made from the run ``ident`` names: by the checksum it carries, or (records from
    before ``training``, schema revision 6) by its utility, which the cache stores exactly."""
    if isinstance(record.get("training"), dict):
        return record["training"].get("sha256") == ident["sha256"]
    return record.get("utility") == jsonable(ident["utility"])


def checkpoint_path(task: Task, defense: Defense, seed: int, cache_root: Path) -> Path:
    """``<cache_root>/train/<train_key>.ckpt``: the run's round checkpoint while it trains (bench/checkpoint.py)."""
    return path_for(cache_stem(task, defense, seed, cache_root))


def _quarantine_dir(cache_root: Path) -> Path:
    return cachefile.quarantine_for(cache_root / "train")


def cached(task: Task, defense: Defense, seed: int, cache_root: Path, *, readonly: bool = False) -> bool:
    """True when this training run's cache entry exists and is intact (checksum); a damaged one is
    quarantined now (``readonly``: reported, left in place), so a planner schedules the retraining."""
    qdir = None if readonly else _quarantine_dir(cache_root)
    return cachefile.verify(cache_stem(task, defense, seed, cache_root), quarantine_dir=qdir)


def get_training(task: Task, defense: Defense, seed: int, cache_root: Path) -> TrainResult:
    """Load the cached run or train it now (and evaluate the global model's utility).

    A damaged cache entry is moved to ``<cache_root>/../quarantine/cache/train/`` and the run retrained."""
    stem = cache_stem(task, defense, seed, cache_root)
    qdir = _quarantine_dir(cache_root)
    legacy = (stem.with_name(stem.name + ".pt"), _legacy)
    hit = cachefile.load(stem, decode_run, quarantine_dir=qdir, legacy=legacy)
    if hit is not None:
        return hit
    with cachefile.building(stem):  # another run training it: wait, then read its entry
        hit = cachefile.load(stem, decode_run, quarantine_dir=qdir, legacy=legacy)
        if hit is not None:
            return hit
        known = read_divergence(stem)
        if known is not None:
            raise TrainingDiverged(
                f"{known['reason']} (recorded {known['at']} and not retrained: the same configuration and seed; "
                "`bench run --redo-before` a later time trains it again)"
            )
        try:
            return _train(task, defense, seed, stem)
        except TrainingDiverged as e:
            _mark_diverged(stem, str(e), run_key(task, defense, seed))
            raise


def divergence_path(stem: Path) -> Path:
    """``<stem>.diverged.json``: the marker a run that diverged under its defense leaves instead of an entry."""
    return stem.with_name(stem.name + ".diverged.json")


def read_divergence(stem: Path) -> dict[str, str] | None:
    """The recorded divergence of the run at ``stem`` (``reason``, ``at``: ISO 8601 UTC), or None (none, or a
    marker that cannot be read: the run is then trained, which rewrites it)."""
    try:
        rec = json.loads(divergence_path(stem).read_bytes())
    except (OSError, ValueError):
        return None
    if not (isinstance(rec, dict) and all(isinstance(rec.get(k), str) for k in ("reason", "at"))):
        return None
    try:
        aware = datetime.fromisoformat(rec["at"]).tzinfo is not None  # compared with --redo-before's UTC time
    except ValueError:
        return None
    return {"reason": rec["reason"], "at": rec["at"]} if aware else None


def forget_divergence(stem: Path, before: datetime) -> bool:
    """Remove the run's divergence marker when it was recorded before ``before`` (``bench run --redo-before``,
    e.g. after fixing the defense), so the run trains again; True when one was removed."""
    known = read_divergence(stem)
    if known is None or datetime.fromisoformat(known["at"]) >= before:
        return False
    divergence_path(stem).unlink(missing_ok=True)
    return True


def _mark_diverged(stem: Path, reason: str, key: dict[str, Any]) -> None:
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    data = json.dumps({"reason": reason, "at": at, "key": key}, indent=1).encode()
    try:
        atomic_write_bytes(divergence_path(stem), data)
    except OSError as e:  # the outcome is still recorded in the cells; the run is only trained again next time
        print(f"warning: divergence marker not written: {type(e).__name__}: {e}", file=sys.stderr)  # noqa: T201


def _train(task: Task, defense: Defense, seed: int, stem: Path) -> TrainResult:
    """Train the run now (resuming from its round checkpoint), evaluate its utility and cache it at ``stem``."""
    ckpt = Checkpoint(path_for(stem), key=stem.name)
    model, res = run_federated(task, defense, seed, desc=f"train {task.id} {label(defense)} s{seed}", checkpoint=ckpt)
    keep_target_client(res, task, seed)
    model.eval()
    with torch.no_grad():
        res.utility = {k: float(v) for k, v in task.utility(model).items()}
    if task.extras.get("client_utility") and res.client_latest:
        # The target client's own model ([FedRand] Table 1 reports client-side utility too).
        client = target_client(res, seed=seed, num_clients=len(task.client_data))
        cstate = client_model_state(res.global_state, res.client_latest.get(client, {}))
        cmodel = build_trained_model(task, defense, cstate, res.global_buffers)
        with torch.no_grad():
            res.utility.update({f"client_{k}": float(v) for k, v in task.utility(cmodel).items()})
    save_run(stem, res, run_key(task, defense, seed), f"training cache for {label(defense)} seed {seed}")
    ckpt.clear()
    return res


def keep_target_client(res: TrainResult, task: Task, seed: int) -> None:
    """Large models: keep only the latest state of the client the curious server targets (``target_client``), so
    a run's cache entry stays near one model's size."""
    if sum(t.numel() for t in res.global_state.values()) > MAX_CLIENT_NUMEL:
        keep = target_client(res, seed=seed, num_clients=len(task.client_data))
        res.client_latest = {c: v for c, v in res.client_latest.items() if c == keep}


def run_key(task: Task, defense: Defense, seed: int) -> dict[str, Any]:
    """What a cached run's metadata records as its key (read by people and tools, not by the cache lookup)."""
    return {"task": task.id, "preset": task.preset, "defense": defense.name, "params": params_of(defense), "seed": seed}


def save_run(stem: Path, res: TrainResult, key: dict[str, Any], what: str) -> None:
    """Cache a finished run at ``stem`` (atomically, bench/cachefile.py) with ``key`` in its metadata. A failed write
    warns naming ``what``: the run itself is fine, so it is used now and retrained next time."""
    tensors, meta = _encode(res)
    meta["key"] = key
    try:
        cachefile.save(stem, tensors, meta)
    except (TypeError, ValueError, OSError) as e:
        print(f"warning: {what} not written: {type(e).__name__}: {e}", file=sys.stderr)  # noqa: T201
