"""Loss-based membership inference ([SMP-LoRA] s.4 and App. E): a threshold on the per-sample loss, or
a learned attack model h' on the loss signal.

- ``threshold``: score = -loss (white-box loss-based MIA of Hu & Pang 2023 / Matsumoto et al. 2023, as
  used by [SMP-LoRA]: members have a lower adaptation loss). With a diffusion timestep hook
  (``api.diffusion_ops``, see ``bench.signals``) the loss is taken at ``timesteps`` stratified
  steps: the mean is the primary score and each step's loss is reported as ``loss_t<step>``.
- ``proxy``: a fresh attack model h' of the proxy's shape, a 3-layer MLP [512, 256, 2] with a softmax
  output ([SMP-LoRA] App. E), trained for 100 epochs with Adam on D_aux = aux members vs aux
  non-members in member/non-member balanced batches, applied to the candidates; score = P(member).
  Its input is the per-sample loss signal (the loss, or the per-timestep loss vector), standardised
  with the attacker's aux statistics. Its out-of-fold scores on aux (5-fold, each fold's h' trained on the
  others) set the ``asr_aux`` threshold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from bench.loss_signals import cell_losses, loss_timesteps, seeded, single_thread
from bench.metrics import held_out_scores
from bench.params import param
from bench.registry import register_attack
from bench.types import Attack, Observation, Scores


class ProxyMLP(nn.Sequential):
    """The attack model of [SMP-LoRA] App. E: Linear-ReLU layers [512, 256] then 2 logits (softmax)."""

    def __init__(self, in_features: int, hidden: Sequence[int] = (512, 256)):
        layers: list[nn.Module] = []
        d = in_features
        for h in hidden:
            layers += [nn.Linear(d, h), nn.ReLU()]
            d = h
        layers.append(nn.Linear(d, 2))
        super().__init__(*layers)

    def member_prob(self, x: Tensor) -> Tensor:
        return torch.softmax(self(x), dim=-1)[:, 1]


def balanced_batches(n_m: int, n_nm: int, half: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """One epoch of batches with ``half`` members and ``half`` non-members each ([SMP-LoRA] App. E);
    an epoch covers the larger side once, the smaller side is cycled."""
    half = max(1, min(half, n_m, n_nm))
    steps = int(np.ceil(max(n_m, n_nm) / half))
    pm = np.resize(rng.permutation(n_m), steps * half)
    pn = np.resize(rng.permutation(n_nm), steps * half)
    return [(pm[i * half : (i + 1) * half], pn[i * half : (i + 1) * half]) for i in range(steps)]


def fit_attack_mlp(
    x_members: Tensor,
    x_nonmembers: Tensor,
    *,
    hidden: Sequence[int] = (512, 256),
    epochs: int = 100,
    lr: float = 1e-5,
    batch_size: int = 32,
    seed: int = 0,
):
    """Train h' on aux members (label 1) vs aux non-members (label 0); returns ``x -> P(member)``.

    Inputs are standardised with the aux mean / std; cross-entropy on the 2-way softmax, Adam.
    """
    if len(x_members) == 0 or len(x_nonmembers) == 0:
        raise ValueError("the proxy attack model needs aux members and aux non-members")
    xa = torch.cat([x_members, x_nonmembers]).float()
    mu, sd = xa.mean(0), xa.std(0).clamp(min=1e-8)
    xm, xn = (x_members.float() - mu) / sd, (x_nonmembers.float() - mu) / sd
    with seeded(seed):
        model = ProxyMLP(xa.shape[1], hidden)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    half = max(1, batch_size // 2)
    with single_thread():
        for _ in range(epochs):
            for im, inn in balanced_batches(len(xm), len(xn), half, rng):
                x = torch.cat([xm[im], xn[inn]])
                y = torch.cat([torch.ones(len(im)), torch.zeros(len(inn))]).long()
                opt.zero_grad(set_to_none=True)
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    model.eval()

    @torch.no_grad()
    def predict(x: Tensor) -> Tensor:
        return model.member_prob((x.float() - mu) / sd).double()

    return predict


def aux_sets(obs: Observation, attack: str) -> tuple[list[Any], list[Any]]:
    m = list(obs.public.aux_members)
    n = list(obs.public.aux_nonmembers)
    if not m or not n:
        raise ValueError(
            f"{attack} needs attacker-known labelled data: obs.public.aux_members and "
            f"obs.public.aux_nonmembers (got {len(m)} and {len(n)} items)"
        )
    return m, n


@register_attack
@dataclass
class LossMIA(Attack):
    method: Literal["threshold", "proxy"] = "threshold"
    timesteps: int = param(10, ge=0, le=1000)  # diffusion steps the loss is taken at (only with api.diffusion_ops)
    epochs: int = param(100, ge=1, le=10_000)  # h' training epochs ([SMP-LoRA] App. E)
    lr: float = param(1e-5, gt=0.0, le=10.0)  # Adam learning rate of h' ([SMP-LoRA] App. E)
    train_batch: int = param(32, ge=2, le=4096)  # h' batch (half members, half non-members)
    hidden: tuple[int, ...] = param((512, 256), ge=1, le=65_536)  # hidden widths of h'
    batch_size: int = param(16, ge=1, le=4096)  # candidates per forward pass

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    grid = ({"method": "threshold"}, {"method": "proxy"})
    paper = "[SMP-LoRA] (Luo et al.), s.4 and App. E: loss-based MIA and the [512, 256, 2] attack model"
    budget = {"epochs": 5}  # a conformance run's caps (bench.conformance.cap_budget)

    @property
    def uses_aux(self) -> bool:  # type: ignore[override]
        """Only the proxy attack model h' trains on the attacker's aux members / non-members."""
        return self.method == "proxy"

    def __post_init__(self) -> None:
        if self.method not in ("threshold", "proxy"):
            raise ValueError(f"method must be 'threshold' or 'proxy', got {self.method!r}")
        if self.epochs < 1 or self.lr <= 0 or self.train_batch < 2:
            raise ValueError("epochs >= 1, lr > 0 and train_batch >= 2 are required")

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        if obs.model is None:
            raise ValueError(f"loss_mia needs a model in the observation (view {obs.view!r})")
        target = obs.model
        items = list(candidates or [])
        if not items:
            raise ValueError("loss_mia needs candidates to score")
        steps = loss_timesteps(obs.api, self.timesteps)

        def losses(xs: list[Any], what: str) -> Tensor:
            return cell_losses(obs, target, xs, timesteps=steps, batch_size=self.batch_size, desc=f"loss_mia {what}")

        cand = losses(items, "candidates")
        scores: dict[str, Tensor] = {"neg_loss": -cand.mean(1)}
        if steps:
            scores.update({f"neg_loss_t{t}": -cand[:, j] for j, t in enumerate(steps)})
        if self.method == "threshold":
            return Scores(scores, primary="neg_loss")
        aux_m, aux_n = aux_sets(obs, "loss_mia:method=proxy")
        aux = losses(aux_m + aux_n, "aux")  # one call: the same as the harness's aux pass of the threshold
        am, an = aux[: len(aux_m)], aux[len(aux_m) :]

        def fit(xm: Tensor, xn: Tensor):
            h, e, lr, b = self.hidden, self.epochs, self.lr, self.train_batch
            return fit_attack_mlp(xm, xn, hidden=h, epochs=e, lr=lr, batch_size=b, seed=obs.seed)

        scores = {"proxy": fit(am, an)(cand), **scores}
        held = held_out_scores(fit, am, an, seed=obs.seed)  # after the fit above: its scores are unchanged
        cal = {"proxy": (torch.from_numpy(held[0]), torch.from_numpy(held[1]))} if held is not None else {}
        return Scores(scores, primary="proxy", calibration=cal)
