"""DP baseline of [FLRSP]: clip each client's update and add Gaussian noise (Eq. 6).

sigma = sqrt(2 ln(1.25/delta)) * C / epsilon (the classic Gaussian mechanism, Dwork & Roth Thm. A.1,
valid for epsilon < 1). The update is the gradient (FedSGD) or the weight change (FedAvg), clipped to L2
norm C over all sent tensors. ``epsilon`` is per release; ``epsilon_composed`` is client-level DP over
all rounds with client sampling (opacus RDP accountant). [FLRSP] uses delta = 0.5 (``paper`` preset),
which gives no meaningful guarantee; elsewhere delta defaults to 1e-5.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

from bench.fl import fedavg_aggregate, standard_message
from bench.params import param
from bench.registry import register_defense
from bench.run_state import run_of
from bench.types import ClientState, Defense, Message, RoundCtx


def clip_by_global_norm(tensors: dict[str, Tensor], clip: float) -> tuple[dict[str, Tensor], float]:
    """Scale all tensors together so their joint L2 norm is at most ``clip``; returns the old norm."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))
    scale = min(1.0, clip / (norm + 1e-12))
    return {n: t * scale for n, t in tensors.items()}, norm


@register_defense
@dataclass
class DPGaussian(Defense):
    eps: float = param(1.0, ge=1e-3, le=1e4)  # below 1e-3 the noise std exceeds 1000 x clip
    delta: float | None = param(None, gt=0.0, lt=1.0)  # None: the scenario's (0.5 in [FLRSP]'s own setting, else 1e-5)
    clip: float = param(1.0, gt=0.0, le=1e6)  # L2 bound of a client's update
    form: Literal["fedavg", "fedsgd"] = "fedavg"
    grid = tuple({"eps": e} for e in (1.0, 2.0, 4.0))
    paper = "[FLRSP] Eq. 6 (Gaussian DP baseline)"

    def __post_init__(self) -> None:
        if self.eps <= 0 or self.clip <= 0:
            raise ValueError("eps and clip must be positive")

    def fl_mode(self) -> str | None:
        return self.form

    def dp_delta(self) -> float | None:
        return self.delta

    def sigma(self, *, delta: float) -> float:
        """Noise std calibrated for (eps, ``delta``): this configuration's delta if it fixes one, else the
        run's (the scenario's, resolved by the harness and passed in)."""
        from bench.accounting import gaussian_sigma

        return gaussian_sigma(
            epsilon=self.eps, delta=self.delta if self.delta is not None else delta, sensitivity=self.clip
        )

    def sensitivity_note(self) -> str:
        return (
            f"client-level, add/remove one client: its update, clipped to L2 norm C={self.clip:g}, is one "
            f"release of L2 sensitivity C (replace-one would be 2C); [FLRSP] Eq. 6"
        )

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        msg = standard_message(state, ctx)
        sigma = self.sigma(delta=run_of(self, ctx).delta)
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator)))
        if msg.kind == "gradient":
            upd = msg.tensors
        else:
            upd = {n: t - ctx.global_state[n] for n, t in msg.tensors.items()}
        clipped, norm = clip_by_global_norm(upd, self.clip)
        ctx.log_value("dp_update_norm", norm)
        noisy = {n: t + sigma * torch.randn(t.shape, generator=gen, dtype=t.dtype) for n, t in clipped.items()}
        if msg.kind == "weights":
            noisy = {n: ctx.global_state[n] + t for n, t in noisy.items()}
        return Message(
            msg.client, msg.round, noisy, msg.num_samples, kind=msg.kind, meta={"sigma": sigma, "clip": self.clip}
        )

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedavg_aggregate(global_state, msgs, ctx)

    def epsilon(self, *, delta: float) -> float | None:
        return self.eps

    def epsilon_composed(self, *, delta: float, rounds: int, sample_rate: float, names=None) -> float | None:
        from bench.accounting import composed_epsilon

        return composed_epsilon(
            noise_multiplier=self.sigma(delta=delta) / self.clip, sample_rate=sample_rate, steps=rounds, delta=delta
        )
