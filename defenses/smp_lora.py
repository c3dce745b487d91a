"""SMP-LoRA: stable membership-privacy-preserving LoRA ([SMP-LoRA] s.3 "Stabilizing MP-LoRA", Eq. 9-10,
Algorithm 1).

The same min-max game as MP-LoRA (:class:`defenses.mp_lora.ProxyMinMax`: the proxy h is first updated on
a balanced D_aux batch, Alg. 1 lines 4-6), but the LoRA minimises the ratio

    L_SPL = L_ada / (1 - lambda * G(h, D_tr) + delta)        (Eq. 10, lambda = 0.05, delta = 1e-5)

whose gradient is the adaptation gradient rescaled by 1 / (1 - lambda G + delta) plus the MI-gain gradient
rescaled by L_ada / (1 - lambda G + delta)^2 (App. B / D): the local smoothness is bounded by the
gradient norm (Proposition 2). Both factors are logged per step (``rescale_ada``, ``rescale_mi``; Table 3)
with the proxy's MI gain and the LoRA gradient norm (Fig. 1b).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from bench.params import param
from bench.registry import register_defense
from defenses.mp_lora import ProxyMinMax, smp_objective


@register_defense
@dataclass
class SMPLoRA(ProxyMinMax):
    delta: float = param(1e-5, gt=0.0, le=1.0)  # keeps Eq. 10's denominator away from 0 (not a DP delta)
    paper = "[SMP-LoRA] s.3 Eq. 9-10, Algorithm 1 (SMP-LoRA)"
    # [SMP-LoRA] Table 6 (App. F): the lambda ablation; 0.05 is the paper's default (the first entry here)
    grid = ({}, {"lam": 1.0}, {"lam": 0.5}, {"lam": 0.1}, {"lam": 0.01})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.delta <= 0:
            raise ValueError(f"delta must be > 0 (it keeps the denominator away from 0), got {self.delta}")

    def objective(self, loss_ada: Tensor, gain: Tensor) -> tuple[Tensor, dict[str, float]]:
        denom = float(1.0 - self.lam * gain.detach() + self.delta)
        logs = {"rescale_ada": 1.0 / denom, "rescale_mi": float(loss_ada.detach()) / denom**2}
        return smp_objective(loss_ada, gain, lam=self.lam, delta=self.delta), logs
