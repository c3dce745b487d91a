"""MP-LoRA: membership-privacy-preserving LoRA as a min-max game with a proxy attack model ([SMP-LoRA]
s.3, Eq. 4-6, Algorithm 2; after Nasr et al. 2018's adversarial regularisation).

Each training step (Alg. 2):
  1. inner maximisation (lines 4-6): sample S^m from D_aux^m and S^nm from D_aux^nm, compute the MI gain
     (Eq. 5)  G* = 1/2 mean_{S^m} log h(l(x)) + 1/2 mean_{S^nm} log(1 - h(l(x)))  with the LDM fixed, and
     take an Adam ascent step on the proxy h's parameters (lr eta_1);
  2. outer minimisation (lines 7-9): on a fresh D_tr batch minimise
     L_PL = L_ada + lambda * G(h, D_tr)   (Eq. 6)
     over the LoRA parameters (AdamW, the scenario's lr eta_2), where G(h, D_tr) = mean log h(l(x)) over
     the batch (all members): minimising it makes the proxy mistake members for non-members.

The proxy h is a 3-layer MLP [512, 256, 2] with a softmax output (App. E; dropout 0.5 between layers
as in the paper's released code). Its input ``l(x)`` is the per-sample loss signal: ``signal="map"``
(default, the released code) the flattened per-element squared denoising error at the step's random
timestep and noise, which is also what the adaptation loss averages (one UNet pass serves both);
``signal="loss"`` the scalar per-sample loss (Eq. 5 read literally).

Logged per step ([SMP-LoRA] Fig. 1b, Table 3): ``mi_gain`` (the proxy's G* on the aux batch, before its
update), ``mi_gain_train`` (G on the training batch), ``loss_ada``, ``objective``, ``grad_norm``.

Proxy learning rate: the paper's eta_1 = 1e-5 (Table 5) is for ~160k steps (400 epochs x 400 images, batch
1); our scaled presets take a few hundred steps, so the default is 1e-3 (``proxy_lr=1e-5`` reproduces
Table 5). lambda = 0.05 (App. F: "set at 0.05 for both MP-LoRA and SMP-LoRA").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.checkpoint import from_plain
from bench.params import param
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx, TaskSpec
from defenses._lora_common import NEEDS_LDM, lora_loop, requires_ldm, take_single

# ----------------------------------------------------------------------------------------------
# the proxy attack model and the objectives (pure functions, unit-tested on toy tensors)


class ProxyAttack(nn.Module):
    """h_omega: Linear-ReLU-Dropout layers [512, 256] then 2 logits; softmax[:, 1] = P(member) (App. E)."""

    def __init__(self, in_features: int, hidden: Sequence[int] = (512, 256), dropout: float = 0.5):
        super().__init__()
        layers: list[nn.Module] = []
        d = in_features
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU(), nn.Dropout(dropout)]
            d = h
        layers.append(nn.Linear(d, 2))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def mi_gain(logits_members: Tensor, logits_nonmembers: Tensor) -> Tensor:
    """Eq. 5: 1/(2|S^m|) sum log h(x) + 1/(2|S^nm|) sum log(1 - h(x)), h = softmax(logits)[:, 1]."""
    return (
        0.5 * F.log_softmax(logits_members, -1)[:, 1].mean() + 0.5 * F.log_softmax(logits_nonmembers, -1)[:, 0].mean()
    )


def member_gain(logits_members: Tensor) -> Tensor:
    """G(h, D_tr) on a batch of training samples (all members): mean log h(x) = minus the proxy's
    cross-entropy at label 'member' (what the paper's code computes for its ``loss_adversarial``)."""
    return F.log_softmax(logits_members, -1)[:, 1].mean()


def mp_objective(loss_ada: Tensor, gain: Tensor, *, lam: float) -> Tensor:
    """Eq. 6: L_PL = L_ada + lambda * G."""
    return loss_ada + lam * gain


def smp_objective(loss_ada: Tensor, gain: Tensor, *, lam: float, delta: float) -> Tensor:
    """Eq. 10: L_SPL = L_ada / (1 - lambda * G + delta)."""
    return loss_ada / (1.0 - lam * gain + delta)


def signal_of(err: Tensor, kind: str) -> Tensor:
    """Per-sample proxy input from the per-element squared error [B, ...]: flattened map or scalar loss."""
    if kind == "map":
        return err.flatten(1)
    if kind == "loss":
        return err.flatten(1).mean(1, keepdim=True)
    raise ValueError(f"unknown signal {kind!r}; valid: map, loss")


# ----------------------------------------------------------------------------------------------
# the min-max training shared by MP-LoRA and SMP-LoRA


@dataclass
class ProxyMinMax(Defense):
    """Alg. 1 / Alg. 2 with the outer objective left to subclasses (:meth:`objective`). Not registered."""

    lam: float = param(0.05, ge=0.0, le=100.0)  # weight of the membership gain (Eq. 4-6)
    proxy_lr: float = param(1e-3, gt=0.0, le=10.0)
    proxy_weight_decay: float = param(1e-4, ge=0.0, le=10.0)  # the released code's Adam weight decay
    proxy_dropout: float = param(0.5, ge=0.0, lt=1.0)  # a dropout probability
    proxy_steps: int = param(1, ge=0, le=1000)  # inner-maximisation steps per LoRA step (the released code's k_steps)
    signal: Literal["map", "loss"] = "map"
    setting = "central"
    requires = ("lora", "diffusion", "diffusion_ops")  # the TaskAPI fields it reads

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ValueError(f"lam must be >= 0, got {self.lam}")
        if self.proxy_steps < 0:
            raise ValueError(f"proxy_steps must be >= 0, got {self.proxy_steps}")
        if self.signal not in ("map", "loss"):
            raise ValueError(f"signal must be 'map' or 'loss', got {self.signal!r}")

    def applies(self, task: TaskSpec) -> str | None:
        if requires_ldm(task) or task.diffusion is None:
            return NEEDS_LDM
        return None

    def objective(self, loss_ada: Tensor, gain: Tensor) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        aux_m, aux_nm = list(ctx.extras.get("aux_members", ())), list(ctx.extras.get("aux_nonmembers", ()))
        if not aux_m or not aux_nm:
            raise ValueError(
                f"{self.name} needs the defender's D_aux^m and D_aux^nm in ctx.extras "
                f"('aux_members', 'aux_nonmembers'); got {sorted(ctx.extras)}"
            )
        if ctx.task.diffusion_ops is None:
            raise ValueError(f"{self.name} needs the task's denoising error (api.diffusion_ops.denoise_error)")
        error_fn = ctx.task.diffusion_ops.denoise_error
        collate = ctx.task.collate
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator))
        rng = np.random.default_rng(seed)
        half = max(1, ctx.fl.batch_size // 2)
        proxy: dict[str, Any] = {}

        def make_proxy(dim: int) -> None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                h = ProxyAttack(dim, dropout=self.proxy_dropout)
            proxy["h"] = h
            proxy["opt"] = torch.optim.Adam(h.parameters(), lr=self.proxy_lr, weight_decay=self.proxy_weight_decay)
            proxy["dim"] = dim

        def get_state() -> dict[str, Any]:
            """What an epoch checkpoint saves of this loop: the aux sampler and the proxy (made on first use)."""
            return {"rng": rng.bit_generator.state, "proxy": dict(proxy)}

        def set_state(saved: dict[str, Any]) -> None:
            rng.bit_generator.state = saved["rng"]
            if "dim" in saved["proxy"]:
                make_proxy(saved["proxy"]["dim"])
                from_plain(saved["proxy"], proxy, "proxy")  # loads into the fresh proxy and its optimiser

        def signals(model: nn.Module, items: list) -> Tensor:
            with torch.no_grad():
                return signal_of(error_fn(model, collate(items)), self.signal)

        def inner_max(step: int) -> dict[str, float]:
            """Alg. 1 lines 4-6: ascend the proxy on G* over a balanced aux batch (LDM fixed)."""
            gains = []
            for _ in range(self.proxy_steps):
                pick_m = rng.choice(len(aux_m), min(half, len(aux_m)), replace=False)
                xm = signals(state.model, [aux_m[i] for i in pick_m])
                pick_nm = rng.choice(len(aux_nm), min(half, len(aux_nm)), replace=False)
                xn = signals(state.model, [aux_nm[i] for i in pick_nm])
                if "h" not in proxy:
                    make_proxy(xm.shape[1])
                h, opt = proxy["h"], proxy["opt"]
                h.train()
                gain = mi_gain(h(xm), h(xn))
                opt.zero_grad(set_to_none=True)
                (-gain).backward()
                opt.step()
                gains.append(float(gain.detach()))
            return {"mi_gain": float(np.mean(gains))} if gains else {}

        def outer_objective(model: nn.Module, batch) -> tuple[Tensor, dict[str, float]]:
            """Alg. 1 lines 7-8: the LoRA objective on a D_tr batch, through the fixed proxy."""
            err = error_fn(model, batch)
            loss_ada = err.mean()
            x = signal_of(err, self.signal)
            if "h" not in proxy:
                make_proxy(x.shape[1])
            h = proxy["h"]
            h.eval()
            for p in h.parameters():
                p.requires_grad_(False)
            try:
                gain = member_gain(h(x))
            finally:
                for p in h.parameters():
                    p.requires_grad_(True)
            total, logs = self.objective(loss_ada, gain)
            logs.update(
                {
                    "loss_ada": float(loss_ada.detach()),
                    "mi_gain_train": float(gain.detach()),
                    "objective": float(total.detach()),
                }
            )
            return total, logs

        return lora_loop(state, ctx, outer_objective, before_step=inner_max, loop_state=(get_state, set_state))

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return take_single(global_state, msgs)


@register_defense
@dataclass
class MPLoRA(ProxyMinMax):
    paper = "[SMP-LoRA] s.3 Eq. 4-6, Algorithm 2 (MP-LoRA)"

    def objective(self, loss_ada: Tensor, gain: Tensor) -> tuple[Tensor, dict[str, float]]:
        return mp_objective(loss_ada, gain, lam=self.lam), {}
