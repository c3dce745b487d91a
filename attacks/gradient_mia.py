"""Gradient-based membership inference, GSA1 of Pang et al. 2023 ("White-box Membership Inference
Attacks against Diffusion Models") as replicated in [SMP-LoRA] App. G.

For each sample: the loss (for a diffusion model averaged over ten uniformly spaced timesteps, via the
``api.diffusion_ops`` hook of ``bench.signals``; else ``api.per_sample_loss``) is
back-propagated once; the L2 norm of the gradient of every trainable parameter tensor (the LoRA
matrices of an adapted model; all parameters if none is trainable) is one feature. A gradient-boosted
tree classifier (scikit-learn's, standing in for the paper's XGBoost) is trained on aux members vs aux
non-members; score = P(member); its out-of-fold scores on aux (5-fold) set the ``asr_aux`` threshold.
``neg_grad_norm`` (minus the total gradient norm, no training needed) is reported beside it: members sit
nearer a minimum of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from attacks.loss_mia import aux_sets
from bench.loss_signals import loss_timesteps, per_sample_grad_norms
from bench.metrics import held_out_scores
from bench.params import param
from bench.registry import register_attack
from bench.types import Attack, Observation, Scores


def gradient_features(norms: torch.Tensor) -> np.ndarray:
    """Per-layer gradient norms -> classifier features (log scale; trees are invariant, it eases reading)."""
    return torch.log(norms.double().clamp(min=1e-30)).numpy()


@register_attack
@dataclass
class GradientMIA(Attack):
    timesteps: int = param(10, ge=0, le=1000)  # GSA: ten uniformly spaced diffusion steps (only with the timestep hook)
    n_estimators: int = param(100, ge=1, le=10_000)
    max_depth: int = param(3, ge=1, le=64)
    learning_rate: float = param(0.1, gt=0.0, le=10.0)
    batch_size: int = param(8, ge=1, le=4096)  # samples per vmap call
    use_vmap: bool = True  # torch.func per-sample gradients; falls back to a per-sample loop

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    paper = "[SMP-LoRA] App. G (GSA1 of Pang et al. 2023): per-layer gradient norms + gradient boosting"
    uses_aux = True  # the classifier trains on the attacker's aux members / non-members
    budget = {"n_estimators": 10}  # a conformance run's caps (bench.conformance.cap_budget)

    def __post_init__(self) -> None:
        if self.n_estimators < 1 or self.max_depth < 1 or self.learning_rate <= 0:
            raise ValueError("n_estimators >= 1, max_depth >= 1 and learning_rate > 0 are required")

    def norms(self, obs: Observation, items: list[Any], what: str) -> torch.Tensor:
        """Per-sample per-tensor gradient norms, seeded by the cell, computed once per (model, candidates)
        in the cell group (``obs.signals``)."""
        if obs.model is None:
            raise ValueError(f"gradient_mia needs a model in the observation (view {obs.view!r})")
        steps = loss_timesteps(obs.api, self.timesteps)
        feats, _ = per_sample_grad_norms(
            obs.api,
            obs.model,
            items,
            batch_size=self.batch_size,
            timesteps=steps,
            use_vmap=self.use_vmap,
            desc=f"gradient_mia {what}",
            seed=obs.seed,
            cache=obs.signals,
        )
        return feats

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        if obs.model is None:
            raise ValueError(f"gradient_mia needs a model in the observation (view {obs.view!r})")
        items = list(candidates or [])
        if not items:
            raise ValueError("gradient_mia needs candidates to score")
        aux_m, aux_n = aux_sets(obs, "gradient_mia")
        fa, fc = self.norms(obs, aux_m + aux_n, "aux"), self.norms(obs, items, "candidates")
        fm, fn = fa[: len(aux_m)], fa[len(aux_m) :]
        xm, xn = gradient_features(fm), gradient_features(fn)
        p = torch.from_numpy(self._fit(xm, xn, obs.seed)(gradient_features(fc)))
        held = held_out_scores(lambda m, n: self._fit(m, n, obs.seed), xm, xn, seed=obs.seed)
        cal = {"gsa": (torch.from_numpy(held[0]), torch.from_numpy(held[1]))} if held is not None else {}
        return Scores({"gsa": p, "neg_grad_norm": -fc.norm(dim=1)}, primary="gsa", calibration=cal)

    def _fit(self, xm: np.ndarray, xn: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        """The classifier trained on aux members (1) vs aux non-members (0); returns x -> P(member)."""
        from sklearn.ensemble import GradientBoostingClassifier  # lazy (start-up)

        clf = GradientBoostingClassifier(
            n_estimators=self.n_estimators,
            max_depth=self.max_depth,
            learning_rate=self.learning_rate,
            random_state=seed,
        )
        clf.fit(np.concatenate([xm, xn]), np.r_[np.ones(len(xm)), np.zeros(len(xn))])
        return lambda x: clf.predict_proba(x)[:, 1]
