"""Stage-1 feature alignment of the small VLM's projector (LLaVA s.4.2, Liu et al. 2023): the projector is trained on
public captioned images with the language model frozen, checkpointed while it runs (a killed alignment resumes) and
cached by what it depends on (:func:`projector_key`), once per machine; the federated stage then trains the LoRA
only, as in [FedRand] s.4.1. The model itself: :mod:`models.vlm`."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from bench.assets import cache_dir
from bench.progress import progress
from models.vlm import SmallVLM, caption_loss


def pretrain_projector(
    model: SmallVLM,
    items: Sequence[Any],
    collate: Callable,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    desc: str = "projector alignment",
    checkpoint: Path | None = None,
    every: int = 10,
) -> tuple[dict[str, Tensor], dict]:
    """Train only the projector on public captioned images with the LM frozen (LLaVA stage 1): AdamW, linear
    warm-up over 5% of the steps then cosine decay. Returns (projector state, log).

    ``checkpoint``: a cache-entry stem (bench.cachefile: safetensors + JSON) written every ``every`` steps with
    the projector, the optimiser's moments, the sampler's state and the losses; a killed alignment resumes
    from it and ends with the same projector as an uninterrupted one (hours on a CPU: a kill loses minutes)."""
    params = list(model.projector.parameters())
    was = [p.requires_grad for p in params]
    lora = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("projector.")]
    for p in lora:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, steps - warm)))
    )
    g = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    start = _resume_alignment(checkpoint, model, opt, sched, g, losses, steps) if checkpoint else 0
    model.train()
    try:
        for step in progress(range(start, steps), desc=desc, leave=False):
            idx = torch.randint(0, len(items), (batch_size,), generator=g).tolist()
            loss = caption_loss(model, collate([items[i] for i in idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            if checkpoint is not None and (step + 1) % every == 0 and step + 1 < steps:
                _save_alignment(checkpoint, model, opt, g, losses, steps)
    finally:
        model.eval()
        for p, w in zip(params, was):
            p.requires_grad_(w)
        for p in lora:
            p.requires_grad_(True)
    k = max(1, len(losses) // 10)
    log = {
        "steps": steps,
        "batch_size": batch_size,
        "lr": lr,
        "loss_first": sum(losses[:k]) / k if losses else None,
        "loss_last": sum(losses[-k:]) / k if losses else None,
    }
    return {n: t.detach().clone() for n, t in model.projector.state_dict().items()}, log


def _save_alignment(
    stem: Path, model: SmallVLM, opt: torch.optim.Optimizer, g: torch.Generator, losses: list[float], steps: int
) -> None:
    """The alignment's state after ``len(losses)`` steps (see :func:`pretrain_projector`)."""
    from bench import cachefile

    moments = {}
    for i, p in enumerate(model.projector.parameters()):
        st = opt.state.get(p, {})
        for name in ("exp_avg", "exp_avg_sq", "step"):
            if name in st:
                moments[f"{i}.{name}"] = torch.as_tensor(st[name]).detach().clone()
    groups = {"projector": model.projector.state_dict(), "moments": moments, "rng": {"generator": g.get_state()}}
    tensors, order = cachefile.flatten(groups)
    cachefile.save(stem, tensors, {"done": len(losses), "steps": steps, "losses": list(losses), "order": order})


def _resume_alignment(
    stem: Path,
    model: SmallVLM,
    opt: torch.optim.Optimizer,
    sched: Any,
    g: torch.Generator,
    losses: list[float],
    steps: int,
) -> int:
    """Load a checkpoint of the same alignment (same cache key, same ``steps``); returns the steps done (0: none)."""
    from bench import cachefile

    got = cachefile.load(
        stem, lambda t, m: (cachefile.unflatten(t, m["order"]), m), quarantine_dir=stem.parent / "quarantine"
    )
    if got is None or got[1].get("steps") != steps:
        return 0
    groups, meta = got
    model.projector.load_state_dict(groups["projector"])
    for i, p in enumerate(model.projector.parameters()):
        st = {
            n: groups["moments"][f"{i}.{n}"]
            for n in ("exp_avg", "exp_avg_sq", "step")
            if f"{i}.{n}" in groups["moments"]
        }
        if st:
            opt.state[p] = {n: t.clone() for n, t in st.items()}
    g.set_state(groups["rng"]["generator"])
    done = int(meta["done"])
    with warnings.catch_warnings():  # the schedule is a function of the step count: replay it
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        for _ in range(done):
            sched.step()
    losses.extend(float(x) for x in meta["losses"])
    return done


def projector_key(spec: dict[str, Any], *, steps: int, batch_size: int, lr: float, seed: int) -> str:
    """The aligned projector's cache key: ``spec`` (model, grid, data), the schedule and the library versions."""
    import transformers

    from bench.store import stable_hash

    return stable_hash(
        {
            **spec,
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "seed": seed,
            "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__,
        }
    )


def projector_stem(
    spec: dict[str, Any], *, steps: int, batch_size: int, lr: float, seed: int, create: bool = True
) -> Path:
    """The aligned projector's cache entry: ``projector.json`` + ``projector-<sha12>.safetensors``
    (bench/cachefile.py: no pickle) in ``$BENCH_CACHE/vlm/<projector_key>`` (``create=False``: the path only)."""
    key = projector_key(spec, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    return cache_dir("vlm", key, create=create) / "projector"


def load_or_pretrain_projector(
    spec: dict[str, Any],
    make_model: Callable[[], SmallVLM],
    make_items: Callable[[], Sequence[Any]],
    collate: Callable,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> tuple[dict[str, Tensor], dict, Path]:
    """The cached aligned projector for ``spec`` (model + data + schedule) or pre-train it now; a file lock
    makes concurrent runs pre-train once, the file is written atomically. Returns (state, log, path)."""
    from bench import cachefile

    stem = projector_stem(spec, steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    d, key = stem.parent, stem.parent.name

    def decode(tensors: dict[str, Tensor], meta: dict[str, Any]) -> tuple[dict[str, Tensor], dict]:
        return cachefile.unflatten(tensors, meta["order"])["state"], meta["log"]

    def legacy(blob: Any) -> tuple[dict[str, Tensor], dict[str, Any]]:
        tensors, order = cachefile.flatten({"state": blob["state"]})
        return tensors, {"log": blob["log"], "order": order}

    with cachefile.file_lock(d / "lock"):
        cached = cachefile.load(stem, decode, quarantine_dir=d / "quarantine", legacy=(d / "projector.pt", legacy))
        if cached is not None:
            return cached[0], cached[1], d / "projector.json"
        t0 = time.monotonic()
        model = make_model()
        state, log = pretrain_projector(
            model,
            make_items(),
            collate,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            desc=f"projector alignment {key[:8]}",
            checkpoint=d / "partial",
        )
        log["spec"] = spec
        log["seconds"] = round(time.monotonic() - t0, 1)  # this build's (a resumed one: since the resume)
        tensors, order = cachefile.flatten({"state": state})
        cachefile.save(stem, tensors, {"log": log, "order": order})
        for f in d.glob("partial*"):  # the finished entry supersedes the checkpoint
            f.unlink()
    return state, log, d / "projector.json"
