"""Federated-learning simulator: client splits, local training, standard FedAvg / FedSGD steps,
and the server's transcript of every message (docs/design.md s.2, s.4).

FedAvg: McMahan et al. 2017 (weights after local epochs, averaged by sample count).
FedSGD: one gradient per client per round, the server steps ``w <- w - lr * mean(g)``.
"""

from __future__ import annotations

import copy
import math
import resource
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from .checkpoint import Checkpoint, from_plain
from .progress import nested, progress, resumed
from .run_state import new_run
from .types import ClientState, Defense, FLConfig, Message, RoundCtx, n_items


class TrainingDiverged(FloatingPointError):
    """Training produced a non-finite loss or global model: an outcome of the defense and recipe at their budget
    (e.g. DP noise far above the clipped update), recorded as a diverged run (a failed record with
    ``failure: "diverged"``), not as a fault of the harness."""


# ----------------------------------------------------------------------------------------------
# data splits


def split_clients(
    labels: Sequence[int] | np.ndarray, num_clients: int, alpha: float | None, seed: int
) -> list[list[int]]:
    """IID (alpha None) or Dirichlet(alpha) label-skewed split of sample indices over clients.

    Dirichlet split as in Hsu et al. 2019: for each class, proportions ~ Dir(alpha) over clients.
    Every client is guaranteed at least one sample.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    n = len(labels)
    if num_clients > n:
        raise ValueError(f"cannot split {n} samples over {num_clients} clients")
    if alpha is None:
        perm = rng.permutation(n)
        return [sorted(p.tolist()) for p in np.array_split(perm, num_clients)]
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet([alpha] * num_clients)
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) > 0:
            return [sorted(p) for p in parts]
    raise ValueError(f"Dirichlet({alpha}) split left a client empty 100 times; use more data or a larger alpha")


# ----------------------------------------------------------------------------------------------
# client-side building blocks (defenses call these)


def make_optimizer(params: list[nn.Parameter], fl: FLConfig) -> torch.optim.Optimizer:
    if fl.optimizer == "sgd":
        return torch.optim.SGD(params, lr=fl.lr, weight_decay=fl.weight_decay)
    if fl.optimizer == "adam":
        return torch.optim.Adam(params, lr=fl.lr, weight_decay=fl.weight_decay)
    if fl.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=fl.lr, weight_decay=fl.weight_decay)
    raise ValueError(f"unknown optimizer {fl.optimizer!r}; valid: sgd, adam, adamw")


def round_lr(fl: FLConfig, r: int, rounds: int) -> float:
    """The learning rate of round ``r`` of ``rounds`` under ``fl.lr_schedule`` (cosine: Loshchilov & Hutter,
    "SGDR", ICLR 2017, without restarts, stepped once per round as the server announces it)."""
    if fl.lr_schedule == "constant":
        return fl.lr
    if fl.lr_schedule == "cosine":
        return fl.lr * 0.5 * (1.0 + math.cos(math.pi * r / max(1, rounds)))
    raise ValueError(f"unknown lr_schedule {fl.lr_schedule!r}; valid: constant, cosine")


def loader(data: Dataset, ctx: RoundCtx, *, shuffle: bool = True) -> DataLoader:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator)))
    return DataLoader(
        data, batch_size=ctx.fl.batch_size, shuffle=shuffle, generator=g, collate_fn=ctx.task.collate, drop_last=False
    )


def trainable(model: nn.Module, names: Sequence[str]) -> list[nn.Parameter]:
    params = dict(model.named_parameters())
    return [params[n] for n in names]


BATCHNORM_STATS = ("batch", "public")


def train_mode(model: nn.Module, fl: FLConfig) -> nn.Module:
    """``model.train()``, with BatchNorm layers in eval mode when ``fl.batchnorm_stats == "public"`` (they normalise
    with the global model's running statistics and leave them unchanged; see FLConfig)."""
    if fl.batchnorm_stats not in BATCHNORM_STATS:
        choices = ", ".join(BATCHNORM_STATS)
        raise ValueError(f"unknown batchnorm_stats {fl.batchnorm_stats!r}; expected one of {choices}")
    model.train()
    if fl.batchnorm_stats == "public":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return model


def local_train(
    state: ClientState,
    ctx: RoundCtx,
    *,
    names: Sequence[str] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> int:
    """Run the client's local epochs (capped by ``fl.max_local_steps``); returns the step count.

    ``loss_fn`` replaces the task loss (e.g. SMP-LoRA's ratio objective); ``on_step`` runs after each
    optimiser step (e.g. per-step clipping). Trains the parameters in ``names`` (default: shared).
    """
    names = list(names or ctx.shared_names)
    model = train_mode(state.model, ctx.fl)
    opt = make_optimizer(trainable(model, names), ctx.fl)
    loss_fn = loss_fn or ctx.task.loss
    steps = 0
    cap = ctx.fl.max_local_steps
    for _ in nested(range(ctx.fl.local_epochs)):  # nested(): the run's bar moves within a long round
        for batch in nested(loader(state.data, ctx)):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"training diverged: client {state.client}, round {ctx.round + 1} of {ctx.rounds}, local step "
                    f"{steps + 1}: non-finite training loss {loss.item()}"
                )
            loss.backward()
            opt.step()
            steps += 1
            if on_step:
                on_step(steps)
            if cap is not None and steps >= cap:
                return steps
    return steps


# FedSGD's batch order per (client, epoch) is seeded by the run's seed too: before it was, every seed of a FedSGD
# run trained the same model. Seed 0 keeps the order it had, and with it its cached runs (``seeded_fedsgd``).
BATCH_SEED_STRIDE = 1_000_003


def run_mode(fl: FLConfig, defense: Defense) -> str:
    """The protocol a training run of ``defense`` uses: ``fedavg`` or ``fedsgd`` (a central run trains as fedavg)."""
    return "fedavg" if defense.setting == "central" else (defense.fl_mode() or fl.mode)


def seeded_fedsgd(fl: FLConfig, defense: Defense, seed: int) -> bool:
    """Whether this run's FedSGD batches depend on its seed where they once did not (a later key marks it)."""
    return run_mode(fl, defense) == "fedsgd" and seed != 0


def batch_gradient(state: ClientState, ctx: RoundCtx, *, names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """FedSGD: the gradient of the task loss on this round's batch of the client's data (each epoch a permutation
    seeded by the client, the epoch and the run's seed)."""
    names = list(names or ctx.shared_names)
    data = state.data
    n = n_items(data)
    bs = min(ctx.fl.batch_size, n)
    nb = max(1, math.ceil(n / bs))
    epoch, b = divmod(ctx.round, nb)
    seed = ctx.run.seed if ctx.run is not None else 0
    perm = torch.randperm(
        n, generator=torch.Generator().manual_seed(1000 * state.client + epoch + BATCH_SEED_STRIDE * seed)
    )
    batch = ctx.task.collate([data[int(i)] for i in perm[b * bs : (b + 1) * bs]])
    model = train_mode(state.model, ctx.fl)
    params = trainable(model, names)
    loss = ctx.task.loss(model, batch)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)).detach().clone() for n, g, p in zip(names, grads, params)}


def current(model: nn.Module, names: Sequence[str]) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in names}


def standard_message(state: ClientState, ctx: RoundCtx, *, names: Sequence[str] | None = None) -> Message:
    """The undefended client: a gradient (FedSGD) or the weights after local training (FedAvg)."""
    names = list(names or ctx.shared_names)
    if ctx.fl.mode == "fedsgd":
        g = batch_gradient(state, ctx, names=names)
        return Message(state.client, ctx.round, g, min(ctx.fl.batch_size, n_items(state.data)), kind="gradient")
    local_train(state, ctx, names=names)
    return Message(state.client, ctx.round, current(state.model, names), n_items(state.data), kind="weights")


def weighted_mean(msgs: Sequence[Message], name: str) -> Tensor:
    total = sum(m.num_samples for m in msgs if name in m.tensors)
    # sum() of tensors is a tensor (mypy types an empty sum's 0 in)
    return cast(Tensor, sum(m.tensors[name] * (m.num_samples / total) for m in msgs if name in m.tensors))


def fedavg_aggregate(global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
    """FedAvg (sample-weighted mean of weights) or FedSGD (global step on the mean gradient)."""
    new = dict(global_state)
    for name in global_state:
        if not any(name in m.tensors for m in msgs):
            continue
        avg = weighted_mean(msgs, name)
        if msgs[0].kind == "gradient" and (ctx.fl.optimizer == "sgd" or ctx.run is None):
            new[name] = global_state[name] - ctx.fl.lr * avg
        elif msgs[0].kind == "gradient":
            new[name] = server_step(ctx, name, global_state[name], avg)
        else:
            new[name] = avg.to(global_state[name].dtype)
    return new


def server_step(ctx: RoundCtx, name: str, value: Tensor, grad: Tensor) -> Tensor:
    """FedSGD with the task's adaptive optimiser (Adam / AdamW): the server applies it to the mean gradient,
    i.e. central training with that optimiser; its moments live in the run's state across rounds."""
    assert ctx.run is not None
    states: dict[str, dict] = ctx.run.state.setdefault("server_opt_states", {})  # plain data: checkpoints save it
    p = nn.Parameter(value.detach().clone())
    opt = make_optimizer([p], ctx.fl)
    if name in states:
        opt.load_state_dict(states[name])  # the moments themselves, not copies (same dtype and device)
    p.grad = grad.detach().to(p.dtype).clone()
    for group in opt.param_groups:  # the round's scheduled rate (bench.fl.round_lr)
        group["lr"] = ctx.fl.lr
    opt.step()
    states[name] = opt.state_dict()
    return p.detach().clone()


# ----------------------------------------------------------------------------------------------
# the server loop


@dataclass
class TrainResult:
    global_state: dict[str, Tensor]  # shared/trainable parameters after the last round
    client_latest: dict[int, dict[str, Tensor]]  # per client: the latest weights it sent, per name
    transcript: list[dict]  # metadata of every message: client, round, kind, bytes, numel, meta
    bytes_down: list[int]  # per round: bytes the server sent to the selected clients
    utility: dict[str, float] = field(default_factory=dict)
    logs: dict[str, list] = field(default_factory=dict)
    wall_s: float = 0.0
    peak_mem_mb: float = 0.0
    # Floating-point buffers (BatchNorm running statistics), averaged by FedAvg as usual FL code does.
    # They bypass the defenses: a documented leak of the clients' input statistics.
    global_buffers: dict[str, Tensor] = field(default_factory=dict)


def load_state(model: nn.Module, state: dict[str, Tensor], buffers: dict[str, Tensor] | None = None) -> None:
    params = dict(model.named_parameters())
    bufs = dict(model.named_buffers())
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
        for n, t in (buffers or {}).items():
            bufs[n].copy_(t)


def float_buffers(model: nn.Module) -> dict[str, Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}


def run_federated(
    task,
    defense: Defense,
    seed: int,
    *,
    keep_clients: bool = True,
    desc: str = "",
    checkpoint: Checkpoint | None = None,
) -> tuple[nn.Module, TrainResult]:
    """Train ``task`` under ``defense``; returns the global model and the server's record.

    Central defenses (``setting == "central"``) run as one client holding ``task.central_data``
    for one round of ``task.central_epochs`` epochs: the released model is the result. ``checkpoint``:
    resume from it when it holds a saved round, and save to it between rounds (bench.checkpoint).
    """
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    fl = task.fl
    datasets = list(task.client_data)
    fl = replace(fl, mode=run_mode(fl, defense))  # a central run's other fields are set below
    if fl.mode == "fedsgd":  # same number of gradient evaluations as the FedAvg protocol
        fl = replace(fl, rounds=fl.rounds * local_steps_per_round(fl, datasets))
    if defense.setting == "central":
        fl = replace(fl, num_clients=1, clients_per_round=1, rounds=1, local_epochs=task.central_epochs, mode="fedavg")
        datasets = [task.central_data]
    model = defense.setup(task.api.build_model(), task.api)
    run = new_run(defense, task.api, seed=seed)  # this run's state: the defense config stays untouched
    names = tuple(task.shared_names(model))
    global_state = current(model, names)
    global_buffers = float_buffers(model)
    work = copy.deepcopy(model)
    privates: dict[int, dict] = {k: {} for k in range(len(datasets))}
    latest: dict[int, dict[str, Tensor]] = {}
    transcript: list[dict] = []
    bytes_down: list[int] = []
    logs: dict[str, list] = {}
    start, before = 0, 0.0
    saved = checkpoint.load(kind="round") if checkpoint is not None else None
    if saved is not None:  # random states are restored by load(); the rest of the simulator's state here
        start, before = saved["next_round"], saved["wall_s"]
        global_state, global_buffers, privates = saved["global_state"], saved["global_buffers"], saved["privates"]
        latest, transcript, bytes_down, logs = saved["latest"], saved["transcript"], saved["bytes_down"], saved["logs"]
        privates = from_plain(privates, {k: {} for k in privates}, "ClientState.private")
        run.state = from_plain(saved["run_state"], run.state, "DefenseRun.state")  # into start_run's fresh objects
        gen.set_state(saved["generator"])
        resumed(start, fl.rounds)  # the run's bar: these rounds are done, but not in this run's time
    t0 = time.time()
    for r in progress(range(fl.rounds), desc=desc or f"train {task.id} {defense.name}", leave=False, unit=True):
        if r < start:  # done before the checkpoint
            continue
        sel = sorted(torch.randperm(len(datasets), generator=gen)[: fl.clients_per_round].tolist())
        ctx = RoundCtx(
            round=r,
            rounds=fl.rounds,
            fl=fl if fl.lr_schedule == "constant" else replace(fl, lr=round_lr(fl, r, fl.rounds)),
            task=task.api,
            generator=gen,
            num_selected=len(sel),
            global_state=global_state,
            shared_names=names,
            log=logs,
            extras=task.extras,
            run=run,
            checkpoint=checkpoint,
        )
        msgs = []
        down_bytes = 0
        client_buffers = []
        for k in nested(sel):
            load_state(work, global_state, global_buffers)
            msg = defense.client_step(ClientState(k, work, datasets[k], privates[k]), ctx)
            client_buffers.append((len(datasets[k]), float_buffers(work)))
            _check_message(msg, global_state)
            msgs.append(msg)
            down = defense.downlink_names(ctx, k)
            down_bytes += sum(
                t.numel() * t.element_size() for n, t in global_state.items() if down is None or n in down
            ) + int(msg.meta.get("extra_down_bytes", 0))
            transcript.append(
                {
                    "client": k,
                    "round": r,
                    "kind": msg.kind,
                    "bytes": msg.nbytes() + int(msg.meta.get("extra_up_bytes", 0)),
                    "numel": msg.numel(),
                    "names": len(msg.tensors),
                    "meta": dict(msg.meta),
                }
            )
            if keep_clients and msg.kind == "weights":
                latest.setdefault(k, {}).update({n: t.detach().clone() for n, t in msg.tensors.items()})
        bytes_down.append(down_bytes)
        global_state = defense.aggregate(global_state, msgs, ctx)
        if global_buffers:
            total = sum(n for n, _ in client_buffers)
            global_buffers = {
                b: cast(Tensor, sum(bufs[b] * (n / total) for n, bufs in client_buffers)) for b in global_buffers
            }
        for n, t in global_state.items():
            if not torch.isfinite(t).all():
                raise TrainingDiverged(f"training diverged: round {r + 1} of {fl.rounds}: non-finite global {n}")
        if checkpoint is not None and checkpoint.due(last=r + 1 == fl.rounds):
            state = dict(global_state=global_state, global_buffers=global_buffers, privates=privates, latest=latest)
            state.update(transcript=transcript, bytes_down=bytes_down, logs=logs, run_state=run.state, kind="round")
            checkpoint.save(
                {
                    **state,
                    "next_round": r + 1,
                    "rounds": fl.rounds,
                    "generator": gen.get_state(),
                    "wall_s": before + time.time() - t0,
                }
            )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # process peak RSS
    load_state(model, global_state, global_buffers)
    res = TrainResult(
        global_state,
        latest,
        transcript,
        bytes_down,
        logs=logs,
        wall_s=before + time.time() - t0,
        peak_mem_mb=peak / 2**20,
        global_buffers=global_buffers,
    )
    return model, res


def local_steps_per_round(fl: FLConfig, datasets: Sequence[Dataset]) -> int:
    """Local optimiser steps one FedAvg round takes for an average client."""
    mean_n = sum(n_items(d) for d in datasets) / max(1, len(datasets))
    steps = fl.local_epochs * max(1, math.ceil(mean_n / fl.batch_size))
    return min(steps, fl.max_local_steps) if fl.max_local_steps else steps


def _check_message(msg: Message, global_state: dict[str, Tensor]) -> None:
    for n, t in msg.tensors.items():
        if n not in global_state:
            raise ValueError(f"message from client {msg.client} has unknown parameter {n!r}")
        if t.shape != global_state[n].shape:
            raise ValueError(
                f"message from client {msg.client}: {n} has shape {tuple(t.shape)}, "
                f"expected {tuple(global_state[n].shape)}"
            )
        if not torch.isfinite(t).all():
            raise FloatingPointError(f"message from client {msg.client}: non-finite values in {n}")


def client_model_state(global_state: dict[str, Tensor], latest: dict[str, Tensor]) -> dict[str, Tensor]:
    """The honest-but-curious server's reconstruction of a client ([FedRand] s.4.2): for each
    parameter the latest value that client sent, else the global value."""
    return {n: latest.get(n, t) for n, t in global_state.items()}
