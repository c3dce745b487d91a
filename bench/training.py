"""Train once, attack many: a (task, defense, seed) training run cached by its config hash.

The cache holds the server's view (global state, each client's latest sent weights, the message
transcript's metadata), the utility of the global model, and costs. Written atomically.
"""
from __future__ import annotations

import io
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .fl import TrainResult, client_model_state, load_state, run_federated
from .store import atomic_write_bytes, stable_hash
from .task import Task
from .types import Defense, params_of

# Above this many shared parameters only the target client's reconstructed state is stored.
MAX_CLIENT_NUMEL = 5_000_000


def label(method) -> str:
    """``flrsp(R=0.8,form=fedsgd)``: name plus the parameters that differ from the defaults."""
    import dataclasses

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
    return stable_hash({"task": task.id, "preset": task.preset, "config": task.config_hash(),
                        "defense": defense.name, "params": params_of(defense), "seed": seed})


def target_client(train: TrainResult) -> int:
    """The client the curious server reconstructs: the one that sent the most weight messages."""
    counts: dict[int, int] = {}
    for m in train.transcript:
        if m["kind"] == "weights":
            counts[m["client"]] = counts.get(m["client"], 0) + 1
    return min(counts, key=lambda k: (-counts[k], k)) if counts else 0


def build_trained_model(task: Task, defense: Defense, state: dict[str, torch.Tensor],
                        buffers: dict[str, torch.Tensor] | None = None) -> nn.Module:
    model = defense.setup(task.api.build_model(), task.api)
    load_state(model, state, buffers)
    model.eval()
    return model


def get_training(task: Task, defense: Defense, seed: int, cache_root: Path) -> TrainResult:
    """Load the cached run or train it now (and evaluate the global model's utility)."""
    path = cache_root / "train" / f"{train_key(task, defense, seed)}.pt"
    if path.exists():
        blob = torch.load(path, map_location="cpu", weights_only=False)
        return TrainResult(**blob)
    model, res = run_federated(task, defense, seed, desc=f"train {task.id} {label(defense)} s{seed}")
    numel = sum(t.numel() for t in res.global_state.values())
    if numel > MAX_CLIENT_NUMEL:  # large models: keep only the client the curious server targets
        keep = target_client(res)
        res.client_latest = {c: v for c, v in res.client_latest.items() if c == keep}
    model.eval()
    with torch.no_grad():
        res.utility = {k: float(v) for k, v in task.utility(model).items()}
    if task.extras.get("client_utility") and res.client_latest:
        # The target client's own model (papers/000 Table 1 reports client-side utility too).
        client = target_client(res)
        cmodel = build_trained_model(task, defense, client_model_state(res.global_state, res.client_latest.get(client, {})),
                                     res.global_buffers)
        with torch.no_grad():
            res.utility.update({f"client_{k}": float(v) for k, v in task.utility(cmodel).items()})
    buf = io.BytesIO()
    torch.save(asdict(res), buf)
    atomic_write_bytes(path, buf.getvalue())
    return res
