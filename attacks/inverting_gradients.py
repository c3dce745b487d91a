"""Inverting gradients: optimise dummy images until their gradient points the same way as the client's.

Geiping et al. 2020, "Inverting Gradients - How easy is it to break privacy in federated learning?"
(NeurIPS): minimise ``1 - cos(grad L(x', y), g) + tv * TV(x')`` over x' with Adam on the *signed*
gradient, a step learning-rate schedule (x0.1 at 3/8, 5/8, 7/8 of the iterations) and the image
boxed to the valid pixel range; labels come from the last layer (Zhao et al. 2020, iDLG; Yin et al.
2021 for batches). papers/003 (FLRSP) Eq. 4-5 describe this attack as "adversarial optimisation" and
run it with Adam, lr 1e-4, 24,000 iterations; the defaults here follow the Inverting Gradients
preset (lr 0.1, step decay); the iteration count defaults to the scenario's
``info["inversion_iterations"]`` (300 where a task gives none).

All targets of one ``run_batch`` call are optimised jointly: ``torch.func.vmap`` over the targets of a
``grad`` of the cosine objective (itself built on a ``grad`` of the client's loss through
``functional_call``), so each target keeps its own gradient, batch statistics and cosine while every
iteration is one batched call (DESIGN.md s.7, "batch reconstruction attacks over targets").

Modelling choices (documented for the leaderboard reader):
- The model is inverted in the mode the client used: ``model_mode="auto"`` reads
  ``obs.public["model_mode"]`` and defaults to "train" (``bench.fl`` computes updates in train
  mode). Train-mode BatchNorm normalises with the batch's own statistics; when a layer has a single
  value per channel (batch 1, 1x1 feature map) torch refuses it in train mode, so the client could
  not have used it either: the attack then falls back to eval mode and says so. Note: with batch 1,
  train-mode BatchNorm is an instance norm at every layer and inversion converges far more slowly
  than against eval-mode BatchNorm (the setting of Geiping et al.'s own code).
- Only the parameters present in the message are matched (a defense may withhold some). Exact
  zeros are matched as zeros by default, as the standard attack the FLRSP paper ran does; the
  adaptive variant ``mask_zeros=True`` ignores them (an honest-but-curious server knows FLRSP's
  zeros mean "not sent": it averages non-zero entries only).
- A ``weights`` message (FedAvg) is turned into the update direction ``(global - weights) /
  (lr * local_steps)``; with several local SGD steps the client's steps are unrolled on the dummy
  (Geiping et al. 2020, s.5), which assumes a plain-SGD client.
- The loss is the cross-entropy of an image classifier (the image-cls scenarios' task loss).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, replace_all_batch_norm_modules_, vmap
from torch.nn import functional as F

from bench.progress import progress
from bench.registry import register_attack
from bench.types import Attack, Observation, Reconstructions, TaskAPI

# ----------------------------------------------------------------------------------------------
# helpers shared with attacks/april.py


def update_direction(obs: Observation) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The client's gradient by parameter name (FedSGD), or the update direction of a weights message.

    For ``kind == "weights"`` this is ``(global - weights) / (lr * local_steps)`` (the mean gradient
    for plain SGD). Returns the tensors (float, detached, on CPU) and facts about how they were made.
    """
    msg = obs.message
    if msg is None:
        raise ValueError("a client_update observation needs a message")
    if msg.kind == "gradient":
        return {n: t.detach().float() for n, t in msg.tensors.items()}, {"kind": "gradient", "local_steps": 1}
    if msg.kind != "weights":
        raise ValueError(f"unknown message kind {msg.kind!r}; expected 'gradient' or 'weights'")
    glob = dict(obs.public.get("global_state") or {})
    model_params = dict(obs.model.named_parameters()) if obs.model is not None else {}
    lr = float(obs.public.get("lr") or 1.0)
    steps = max(1, int(obs.public.get("local_steps") or 1))
    out = {}
    for n, w in msg.tensors.items():
        g0 = glob.get(n, model_params.get(n))
        if g0 is None:
            continue
        out[n] = (g0.detach().float() - w.detach().float()) / (lr * steps)
    return out, {"kind": "weights", "lr": lr, "local_steps": steps, "zero_weights": _zero_masks(msg.tensors)}


def _zero_masks(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {n: t == 0 for n, t in tensors.items()}


def classifier_names(model: nn.Module, num_classes: int | None) -> tuple[str | None, str | None]:
    """Names of the last layer's weight and bias (timm ``get_classifier`` first, else the last
    2-D parameter with ``num_classes`` rows)."""
    params = dict(model.named_parameters())
    getc = getattr(model, "get_classifier", None)
    if callable(getc):
        head = getc()
        if isinstance(head, nn.Module):
            ids = {id(p) for p in head.parameters()}
            names = [n for n, p in params.items() if id(p) in ids]
            w = next((n for n in names if params[n].dim() == 2), None)
            b = next((n for n in names if params[n].dim() == 1), None)
            if w is not None:
                return w, b
    w = None
    for n, p in params.items():
        if p.dim() == 2 and (num_classes is None or p.shape[0] == num_classes):
            w = n
    if w is None:
        return None, None
    b = w[: -len("weight")] + "bias" if w.endswith("weight") else None
    return w, (b if b in params and params[b].dim() == 1 else None)


def infer_labels(grads: Mapping[str, Tensor], model: nn.Module, num_classes: int | None,
                 num: int) -> tuple[Tensor, str]:
    """Labels from the last layer's gradient (iDLG, Zhao et al. 2020; Yin et al. 2021 for ``num > 1``).

    With softmax cross-entropy the bias gradient is ``p - onehot(y)``: only the true class is
    negative. Without a usable bias gradient, the weight gradient is ``(p - onehot(y)) h^T`` (rank 1
    for batch 1) and the true class has the largest coefficient magnitude (``1 - p_y`` = the sum of
    all others), read off the top left singular vector. Assumes distinct labels when ``num > 1``.
    Returns the labels and which evidence was used.
    """
    wname, bname = classifier_names(model, num_classes)
    gb = grads.get(bname) if bname else None
    if gb is not None and int((gb < 0).sum()) >= num:
        return torch.argsort(gb.float())[:num].long(), "bias gradient (iDLG)"
    gw = grads.get(wname) if wname else None
    if gw is not None and torch.count_nonzero(gw) > 0:
        gw = gw.double().reshape(gw.shape[0], -1)
        if num == 1:
            u = torch.linalg.svd(gw, full_matrices=False).U[:, 0]
            return u.abs().argmax().reshape(1).long(), "weight gradient (rank-1 iDLG)"
        return torch.argsort(gw.min(dim=1).values)[:num].long(), "weight gradient (Yin et al. row minima)"
    return torch.zeros(num, dtype=torch.long), "unavailable (no classifier gradient; label 0 assumed)"


def box(api: TaskAPI, channels: int) -> tuple[Tensor, Tensor]:
    """Valid range of a normalised input: pixel values in [0, 1] through ``(v - mean) / std``."""
    mean = torch.as_tensor(api.info.get("mean", [0.0] * channels), dtype=torch.float).reshape(-1, 1, 1)
    std = torch.as_tensor(api.info.get("std", [1.0] * channels), dtype=torch.float).reshape(-1, 1, 1)
    return (0 - mean) / std, (1 - mean) / std


def total_variation(x: Tensor) -> Tensor:
    """Anisotropic TV: mean absolute difference of vertical plus horizontal neighbours."""
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    return dx + dy


def attacker_copy(model: nn.Module, mode: str) -> tuple[nn.Module, str]:
    """A frozen copy of the observed model for functional, vmapped double-backward.

    Train mode: BatchNorm is switched to batch statistics without running-stat updates (the same
    forward as the client's, and vmap-safe). timm's fused attention lacks double backward on CPU,
    so the math path is used (same function).
    """
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(False)
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False
    m.train(mode == "train")
    if mode == "train":
        replace_all_batch_norm_modules_(m)
    return m, mode


def _forward_ok(model: nn.Module, shape: Sequence[int], batch: int) -> bool:
    try:
        with torch.no_grad():
            model(torch.zeros(batch, *shape))
        return True
    except ValueError as e:
        if "more than 1 value per channel" in str(e):
            return False
        raise


# ----------------------------------------------------------------------------------------------
# the attack


@dataclass
class _Job:
    """One observation prepared for the batched optimisation."""

    obs: Observation
    targets: dict[str, Tensor]
    masks: dict[str, Tensor] | None
    labels: Tensor
    label_source: str
    info: dict[str, Any]
    names: tuple[str, ...]
    batch: int
    unroll: int
    lr: float
    mode: str


@register_attack
@dataclass
class InvertingGradients(Attack):
    """Cosine gradient matching + total variation (Geiping et al. 2020; papers/003 Eq. 4-5)."""

    views = ("client_update",)
    kind = "reconstruction"
    paper = "Geiping et al. 2020 (Inverting Gradients); papers/003 Eq. 4-5"

    iterations: int | None = None  # None: the scenario's (info["inversion_iterations"]; 24,000 in paper)
    lr: float = 0.1
    tv: float = 0.2
    restarts: int = 1
    signed: bool = True
    boxed: bool = True
    lr_decay: bool = True
    init: Literal["randn", "rand", "zeros"] = "randn"
    similarity: Literal["global", "per_param"] = "global"
    mask_zeros: bool = False
    model_mode: Literal["auto", "train", "eval"] = "auto"
    unroll_local_steps: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.iterations is not None and self.iterations < 1) or self.restarts < 1:
            raise ValueError("iterations and restarts must be >= 1")
        if self.lr <= 0 or self.tv < 0:
            raise ValueError("lr must be > 0 and tv >= 0")

    def applies(self, api: TaskAPI) -> str | None:
        if api.family != "image-cls":
            return f"inverting gradients here inverts image classifiers (family is {api.family})"
        if "input_shape" not in api.info:
            return "the task does not publish its input shape"
        return None

    def run(self, obs: Observation, candidates: Sequence[Any] | None = None) -> Reconstructions:
        return self.run_batch([obs])[0]

    def run_batch(self, observations: list[Observation]) -> list[Reconstructions]:
        """Reconstruct every observation's inputs; targets sharing a model are optimised jointly."""
        if not observations:
            return []
        jobs = [self._prepare(o) for o in observations]
        out: list[Reconstructions | None] = [None] * len(jobs)
        for idx in _groups(jobs):
            for i, rec in zip(idx, self._optimise([jobs[i] for i in idx])):
                out[i] = rec
        return out  # type: ignore[return-value]

    # -- preparation ------------------------------------------------------------------------

    def _prepare(self, obs: Observation) -> _Job:
        if obs.model is None or obs.message is None:
            raise ValueError("inverting gradients needs the global model and the client's message")
        targets, info = update_direction(obs)
        params = dict(obs.model.named_parameters())
        names = tuple(n for n in params if n in targets and targets[n].shape == params[n].shape)
        if not names:
            raise ValueError("the message holds none of the model's parameters")
        masks = None
        if self.mask_zeros:
            src = info.get("zero_weights") if info["kind"] == "weights" else None
            masks = {n: ~(src[n] if src is not None else targets[n] == 0) for n in names}
            targets = {n: torch.where(masks[n], targets[n], torch.zeros(())) for n in names}
        batch = int(obs.public.get("num_samples") or obs.message.num_samples or 1)
        labels, source = infer_labels(targets, obs.model, obs.api.info.get("num_classes"), batch)
        unroll = info["local_steps"] if (info["kind"] == "weights" and self.unroll_local_steps) else 1
        info.pop("zero_weights", None)
        mode = self.model_mode if self.model_mode != "auto" else str(obs.public.get("model_mode") or "train")
        if mode not in ("train", "eval"):
            raise ValueError(f"model_mode must be train or eval, got {mode!r}")
        return _Job(obs, {n: targets[n] for n in names}, masks, labels, source, info, names, batch, unroll,
                    float(info.get("lr", 1.0)), mode)

    # -- the batched optimisation -----------------------------------------------------------

    def _init(self, size: tuple[int, ...], restart: int, lo: Tensor, hi: Tensor) -> Tensor:
        """Restart r starts every target from the same draw (seed + r), so a target's result does
        not depend on which other targets share the batch."""
        gen = torch.Generator().manual_seed(self.seed + restart)
        if self.init == "randn":
            return torch.randn(size, generator=gen)
        if self.init == "rand":
            return lo + (hi - lo) * torch.rand(size, generator=gen)
        return torch.zeros(size)

    def _optimise(self, jobs: list[_Job]) -> list[Reconstructions]:
        api = jobs[0].obs.api
        shape = tuple(api.info["input_shape"])
        batch, unroll, step_lr, names = jobs[0].batch, jobs[0].unroll, jobs[0].lr, jobs[0].names
        model, mode = attacker_copy(jobs[0].obs.model, jobs[0].mode)
        mode_note = mode
        if mode == "train" and not _forward_ok(model, shape, batch):
            model, mode = attacker_copy(jobs[0].obs.model, "eval")
            mode_note = "eval (train-mode BatchNorm cannot normalise a single value per channel)"
        p0 = {n: p.detach() for n, p in model.named_parameters() if n in names}
        lo, hi = box(api, shape[0])
        tv_w = self.tv
        per_param = self.similarity == "per_param"

        def task_loss(p, x, y):
            return F.cross_entropy(functional_call(model, p, (x,), strict=False), y)

        def simulated_update(x, y):
            if unroll <= 1:
                return grad(task_loss)(p0, x, y)
            p = p0
            for _ in range(unroll):  # the client's local SGD steps on its (single) batch
                g = grad(task_loss)(p, x, y)
                p = {n: p[n] - step_lr * g[n] for n in names}
            return {n: (p0[n] - p[n]) / (step_lr * unroll) for n in names}

        def objective(x, y, target, mask):
            g = simulated_update(x, y)
            dots, gns, tns = [], [], []
            for n in names:
                gi = g[n] * mask[n] if mask is not None else g[n]
                dots.append((gi * target[n]).sum())
                gns.append(gi.pow(2).sum())
                tns.append(target[n].pow(2).sum())
            dot, gn, tn = torch.stack(dots), torch.stack(gns), torch.stack(tns)
            if per_param:  # every parameter tensor counts equally (layer-wise cosine)
                w = (tn > 0).float()
                match = ((1 - dot / (gn.sqrt() * tn.sqrt() + 1e-12)) * w).sum() / w.sum().clamp_min(1)
            else:  # Geiping et al. 2020 Eq. 4: one cosine over the whole gradient vector
                match = 1 - dot.sum() / (gn.sum().sqrt() * tn.sum().sqrt() + 1e-12)
            return match + tv_w * total_variation(x), match

        R, T = self.restarts, len(jobs)
        rep = lambda t: t.repeat_interleave(R, dim=0)  # noqa: E731  (targets x restarts, restarts inner)
        Y = rep(torch.stack([j.labels for j in jobs]))
        TG = {n: rep(torch.stack([j.targets[n] for j in jobs])) for n in names}
        masked = jobs[0].masks is not None
        MK = {n: rep(torch.stack([j.masks[n] for j in jobs]).float()) for n in names} if masked else None
        x0 = torch.stack([self._init((batch, *shape), r, lo, hi) for r in range(R)])  # [R, B, C, H, W]
        x0 = x0.repeat(T, *[1] * (x0.dim() - 1))  # [T*R, ...], restart index inner
        X = nn.Parameter(torch.max(torch.min(x0, hi), lo) if self.boxed else x0)
        step = vmap(grad_and_value(objective, has_aux=True), in_dims=(0, 0, 0, 0 if masked else None),
                    randomness="different")
        opt = torch.optim.Adam([X], lr=self.lr)
        its = self.iterations or int(jobs[0].obs.api.info.get("inversion_iterations", 300))
        milestones = [its * 3 // 8, its * 5 // 8, its * 7 // 8]
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1) if self.lr_decay else None
        for _ in progress(range(its), desc=f"inverting gradients ({T} target{'s' * (T > 1)})", leave=False):
            gx, (_, _) = step(X.detach(), Y, TG, MK)
            X.grad = gx.sign() if self.signed else gx
            opt.step()
            if sched is not None:
                sched.step()
            if self.boxed:
                with torch.no_grad():
                    X.copy_(torch.max(torch.min(X, hi), lo))
        with torch.no_grad():
            _, (total, match) = step(X.detach(), Y, TG, MK)
        match = match.reshape(T, R)
        best = match.argmin(dim=1)
        Xr = X.detach().reshape(T, R, batch, *shape)
        out = []
        for t, job in enumerate(jobs):
            b = int(best[t])
            details = {"gradient_cosine_loss": float(match[t, b]), "restart_losses": match[t].tolist(),
                       "iterations": its, "label_source": job.label_source, "model_mode": mode_note,
                       "matched_params": len(names), "message_kind": job.info["kind"],
                       "unrolled_steps": unroll, "mask_zeros": self.mask_zeros, "jointly_optimised": T}
            out.append(Reconstructions(images=Xr[t, b].clone(), labels=job.labels.clone(), details=details))
        return out


def _groups(jobs: list[_Job]) -> list[list[int]]:
    """Indices of jobs that can share one vmapped optimisation: same model weights, same matched
    parameter names, batch size, unrolling and masking."""
    groups: list[list[int]] = []
    for i, j in enumerate(jobs):
        for g in groups:
            k = jobs[g[0]]
            if (k.names, k.batch, k.unroll, k.lr, k.mode, k.masks is None) == \
                    (j.names, j.batch, j.unroll, j.lr, j.mode, j.masks is None) \
                    and _same_model(k.obs.model, j.obs.model):
                g.append(i)
                break
        else:
            groups.append([i])
    return groups


def _same_model(a: nn.Module, b: nn.Module) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or a.training != b.training:
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and torch.equal(sa[k], sb[k]) for k in sa)
