"""Gradient-based membership inference, GSA1 of Pang et al. 2023 ("White-box Membership Inference
Attacks against Diffusion Models") as replicated in papers/004 App. G.

For each sample: the loss (for a diffusion model averaged over ten uniformly spaced timesteps, via the
``api.info["loss_at_timestep"]`` hook of ``bench.signals``; else ``api.per_sample_loss``) is
back-propagated once; the L2 norm of the gradient of every trainable parameter tensor (the LoRA
matrices of an adapted model; all parameters if none is trainable) is one feature. A gradient-boosted
tree classifier (scikit-learn's, standing in for the paper's XGBoost) is trained on aux members vs aux
non-members; score = P(member). ``neg_grad_norm`` (minus the total gradient norm, no training needed)
is reported beside it: members sit nearer a minimum of the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from sklearn.ensemble import GradientBoostingClassifier

from attacks.loss_mia import aux_sets
from bench.registry import register_attack
from bench.signals import loss_timesteps, per_sample_grad_norms, seeded
from bench.types import Attack, Observation, Scores


def gradient_features(norms: torch.Tensor) -> np.ndarray:
    """Per-layer gradient norms -> classifier features (log scale; trees are invariant, it eases reading)."""
    return torch.log(norms.double().clamp(min=1e-30)).numpy()


@register_attack
@dataclass
class GradientMIA(Attack):
    timesteps: int = 10  # GSA: ten uniformly spaced diffusion steps (only with the timestep hook)
    n_estimators: int = 100
    max_depth: int = 3
    learning_rate: float = 0.1
    batch_size: int = 8  # samples per vmap call
    use_vmap: bool = True  # torch.func per-sample gradients; falls back to a per-sample loop
    seed: int = 0

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    paper = "papers/004 App. G (GSA1 of Pang et al. 2023): per-layer gradient norms + gradient boosting"

    def __post_init__(self) -> None:
        if self.n_estimators < 1 or self.max_depth < 1 or self.learning_rate <= 0:
            raise ValueError("n_estimators >= 1, max_depth >= 1 and learning_rate > 0 are required")

    def norms(self, obs: Observation, items: list[Any], what: str) -> torch.Tensor:
        steps = loss_timesteps(obs.api, self.timesteps)
        with seeded(self.seed):
            feats, _ = per_sample_grad_norms(obs.api, obs.model, items, batch_size=self.batch_size, timesteps=steps,
                                             use_vmap=self.use_vmap, desc=f"gradient_mia {what}")
        return feats

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        if obs.model is None:
            raise ValueError(f"gradient_mia needs a model in the observation (view {obs.view!r})")
        items = list(candidates or [])
        if not items:
            raise ValueError("gradient_mia needs candidates to score")
        aux_m, aux_n = aux_sets(obs, "gradient_mia")
        fm, fn, fc = (self.norms(obs, xs, w) for xs, w in
                      ((aux_m, "aux members"), (aux_n, "aux non-members"), (items, "candidates")))
        x = np.concatenate([gradient_features(fm), gradient_features(fn)])
        y = np.concatenate([np.ones(len(fm)), np.zeros(len(fn))])
        clf = GradientBoostingClassifier(n_estimators=self.n_estimators, max_depth=self.max_depth,
                                         learning_rate=self.learning_rate, random_state=self.seed)
        clf.fit(x, y)
        p = torch.from_numpy(clf.predict_proba(gradient_features(fc))[:, 1])
        return Scores({"gsa": p, "neg_grad_norm": -fc.norm(dim=1)}, primary="gsa")
