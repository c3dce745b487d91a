"""What the reconstruction attacks (inverting gradients, APRIL) read off a client's message, and the image prior
they share: the update direction of a gradient or weights message, the labels from the last layer's gradient
(iDLG, Zhao et al. 2020; Yin et al. 2021), the valid pixel box, total variation, and the attacker's copy of the
model in the mode the client used. Not an attack (``_*.py``: no registry key)."""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import replace_all_batch_norm_modules_

from bench.types import Observation, TaskAPI


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
    glob = dict(obs.public.global_state or {})
    model_params = dict(obs.model.named_parameters()) if obs.model is not None else {}
    lr = float(obs.public.lr or 1.0)
    steps = max(1, int(obs.public.local_steps or 1))
    out = {}
    for n, w in msg.tensors.items():
        g0 = glob.get(n, model_params.get(n))
        if g0 is None:
            continue
        out[n] = (g0.detach().float() - w.detach().float()) / (lr * steps)
    return out, {"kind": "weights", "lr": lr, "local_steps": steps, "zero_weights": zero_masks(msg.tensors)}


def signs_only(obs: Observation, kind: str, local_steps: int) -> bool:
    """Whether the message holds the client gradient's signs only: one local step of an Adam / AdamW client from
    fresh optimiser state (module doc), a weights message."""
    return kind == "weights" and local_steps == 1 and obs.public.optimizer in ("adam", "adamw")


def adaptive_client_note(obs: Observation, kind: str, similarity: str = "global") -> str:
    """Why a weights message from an Adam / AdamW client is a weaker signal (module doc), or ""."""
    opt = obs.public.optimizer
    if kind != "weights" or opt not in ("adam", "adamw"):
        return ""
    how = "matched by sign agreement" if similarity == "sign" else "matched as a plain-SGD update"
    return (
        f"client optimiser {opt}: a step from fresh {opt} state moves each weight by ~lr * sign(gradient), so the "
        f"update holds the gradient's signs only; {how}"
    )


def zero_masks(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
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


def infer_labels(
    grads: Mapping[str, Tensor], model: nn.Module, num_classes: int | None, num: int
) -> tuple[Tensor, str]:
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
    mean = torch.as_tensor(list(api.image.mean) if api.image else [0.0] * channels, dtype=torch.float).reshape(-1, 1, 1)
    std = torch.as_tensor(list(api.image.std) if api.image else [1.0] * channels, dtype=torch.float).reshape(-1, 1, 1)
    return (0 - mean) / std, (1 - mean) / std


def total_variation(x: Tensor) -> Tensor:
    """Anisotropic TV: mean absolute difference of vertical plus horizontal neighbours."""
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
    return dx + dy


def total_variation_grad(x: Tensor) -> Tensor:
    """The gradient of :func:`total_variation` w.r.t. ``x`` in closed form: each difference's sign over
    the number of differences, added to its later and subtracted from its earlier pixel (autograd's
    value, without building a graph each iteration)."""
    g = torch.zeros_like(x)
    for dim in (-2, -1):
        n = x.shape[dim]
        d = (x.narrow(dim, 1, n - 1) - x.narrow(dim, 0, n - 1)).sign_()
        d.div_(max(d.numel(), 1))
        g.narrow(dim, 1, n - 1).add_(d)
        g.narrow(dim, 0, n - 1).sub_(d)
    return g


def attacker_copy(model: nn.Module, mode: str) -> tuple[nn.Module, str]:
    """A frozen copy of the observed model for the double backward (the caller unfreezes the
    parameters it matches).

    Train mode: BatchNorm is switched to batch statistics without running-stat updates (the same
    forward as the client's, and the attack never changes the observed model). timm's fused
    attention lacks double backward on CPU, so the math path is used (same function).
    """
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.requires_grad_(False)
    for mod in m.modules():
        if hasattr(mod, "fused_attn"):
            mod.fused_attn = False  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
    m.train(mode == "train")
    if mode == "train":
        replace_all_batch_norm_modules_(m)
    return m, mode


def forward_ok(model: nn.Module, shape: Sequence[int], batch: int) -> bool:
    try:
        with torch.no_grad():
            model(torch.zeros(batch, *shape, device=next(model.parameters()).device))
        return True
    except ValueError as e:
        if "more than 1 value per channel" in str(e):
            return False
        raise
