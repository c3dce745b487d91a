"""APRIL, closed form: read a ViT client's image straight out of its batch-1 gradient.

Lu et al. 2022, "APRIL: Finding the Achilles' Heel on Privacy for Vision Transformers" (CVPR),
as [FLRSP] Eq. 1-3 uses it. The embedded sequence is ``z = [cls; P W^T + b] + E_pos``
(``P``: the N flattened patches, ``W``: the patch-embedding weight, ``E_pos``: a learnable positional
embedding added once). For one sample:

- ``dL/dE_pos = dL/dz`` (Eq. 1: the positional-embedding gradient *is* the gradient at the
  embedded tokens, so nothing else about the network has to be known or inverted);
- ``dL/dW = sum_i dL/dz_i p_i^T = G_z^T P`` over the patch tokens (the first linear layer, Eq. 3);

so the patches solve the linear system ``G_z^T P = dL/dW`` (least squares, unique when the
embedding width D >= N patches and G_z has full rank), and the image is the patches re-tiled.
This route stays exact for timm's pre-norm, residual ViTs, where recovering ``z`` from the first
attention layer's Q/K/V gradients (APRIL's Eq. 1-2 variant) is only approximate. Class and register
tokens carry no patch; their rows of ``dL/dE_pos`` (when the embedding covers them) are dropped.

Without the positional-embedding gradient (the fixed-position defense) the patches cannot be
separated: the attack returns the zero (mean) image with ``details["failed"]`` set. FLRSP's random
zeros corrupt both sides of the system and the solution degrades ([FLRSP] s.4.3.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import Tensor

from attacks._client_update import box, infer_labels, update_direction
from bench.registry import register_attack
from bench.types import Attack, NotApplicable, Observation, Reconstructions, TaskSpec


@register_attack
@dataclass
class April(Attack):
    """Closed-form APRIL (Lu et al. 2022; [FLRSP] Eq. 1-3) for a ViT with a learnable position
    embedding and batch size 1."""

    views = ("client_update",)
    kind = "reconstruction"
    paper = "Lu et al. 2022 (APRIL); [FLRSP] Eq. 1-3"
    requires = ("image", "vit")  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    boxed: bool = True  # clamp the solution to the valid pixel range (the attacker knows it)
    # torch.linalg.lstsq driver (CPU; gelsd handles rank deficiency)
    driver: Literal["gels", "gelsy", "gelsd", "gelss"] = "gelsd"

    def applies(self, api: TaskSpec) -> str | None:
        if api.arch != "vit":
            return f"APRIL needs a vision transformer (arch is {api.arch!r})"
        if api.vit is None:
            return "APRIL needs a learnable positional embedding (the model has none)"
        if api.image is None:
            return "the task does not publish its input shape"
        return None

    def run(self, obs: Observation, candidates: Sequence[Any] | None = None) -> Reconstructions:
        reason = self.applies(obs.api)
        if reason:
            raise NotApplicable(reason)
        if obs.model is None or obs.message is None:
            raise ValueError("APRIL needs the global model and the client's message")
        batch = int(obs.public.num_samples or obs.message.num_samples or 1)
        if batch != 1:
            raise NotApplicable(f"closed-form APRIL needs a batch of one image (the update is from {batch})")
        image, vit = obs.api.image, obs.api.vit
        assert image is not None and vit is not None  # applies() checked both
        shape = tuple(image.input_shape)
        grads, how = update_direction(obs)
        labels, label_source = infer_labels(grads, obs.model, image.num_classes, 1)
        details: dict[str, Any] = {"message_kind": how["kind"], "label_source": label_source}
        if how["kind"] == "weights" and how["local_steps"] > 1:
            details["approximate"] = f"{how['local_steps']} local steps: the update is not one gradient"

        pos_name = vit.pos_embed_param
        patch_name = _weight_name(vit.patch_embed_param or "patch_embed.proj.weight", grads, obs.model)
        failure = None
        if pos_name not in grads:
            failure = "no positional-embedding gradient"
        elif torch.count_nonzero(grads[pos_name]) == 0:
            failure = "positional-embedding gradient is all zero"
        elif patch_name is None:
            failure = "no patch-embedding weight gradient"
        if failure or patch_name is None:
            details["failed"] = failure
            return Reconstructions(torch.zeros(1, *shape), labels, details)

        x, solve = self.solve(grads[pos_name], grads[patch_name], shape)
        details.update(solve)
        if self.boxed:
            lo, hi = box(obs.api, shape[0])
            x = torch.max(torch.min(x, hi), lo)
        return Reconstructions(x.unsqueeze(0), labels, details)

    def run_batch(self, observations: Sequence[Observation]) -> list[Reconstructions]:
        """Closed form: one small least-squares solve per target, no joint optimisation to gain."""
        return [self.run(o) for o in observations]

    def solve(self, g_pos: Tensor, g_patch: Tensor, shape: Sequence[int]) -> tuple[Tensor, dict[str, Any]]:
        """Patches from ``G_z^T P = dL/dW`` (float64 least squares), re-tiled to a [C, H, W] image."""
        c, h, w = shape
        d = g_patch.shape[0]
        k = g_patch[0].numel()
        p = int(round(math.sqrt(k // c)))
        if c * p * p != k or h % p or w % p:
            raise ValueError(f"patch-embedding weight {tuple(g_patch.shape)} does not tile a {tuple(shape)} image")
        gh, gw = h // p, w // p
        n = gh * gw
        gz = g_pos.detach().double().reshape(-1, d)
        prefix = gz.shape[0] - n  # class / register tokens in front (timm layout), none if the
        if prefix < 0:  # embedding covers the patches only (no_embed_class)
            raise ValueError(f"positional embedding has {gz.shape[0]} rows for {n} patches")
        gz = gz[prefix:]
        gw_mat = g_patch.detach().double().reshape(d, k)
        sol = torch.linalg.lstsq(gz.T, gw_mat, driver=self.driver)
        patches = sol.solution  # [N, C*p*p], row i = patch i in row-major grid order
        img = patches.reshape(gh, gw, c, p, p).permute(2, 0, 3, 1, 4).reshape(c, h, w).float()
        info = {
            "rank": int(sol.rank),
            "patches": n,
            "embed_dim": d,
            "prefix_tokens": prefix,
            "underdetermined": bool(int(sol.rank) < n),
        }
        return img, info


def _weight_name(name: str, grads: dict[str, Tensor], model) -> str | None:
    """Accept the parameter name or its module's name (``patch_embed.proj``)."""
    for cand in (name, f"{name}.weight"):
        if cand in grads:
            return cand
    return None
