"""The two halves of gradient matching (Geiping et al. 2020, "Inverting Gradients - How easy is it to break
privacy in federated learning?", NeurIPS, Eq. 4): the client's update as a differentiable function of a dummy
input (:class:`SimulatedUpdate`), and the matching loss with its derivative in closed form (:class:`Matcher`).
Used by attacks/inverting_gradients.py; attacks/_compiled_matching.py computes the same loss in one graph."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call


class SimulatedUpdate:
    """The client's update direction as a differentiable function of the dummy input ``x``: the
    loss gradient w.r.t. the matched parameters (``create_graph`` so the matching loss can be
    differentiated w.r.t. ``x``), or, for an unrolled weights message, ``(p0 - p_K) / (lr K)``."""

    def __init__(self, model: nn.Module, p0: dict[str, Tensor], *, unroll: int, lr: float):
        self.model, self.p0, self.unroll, self.lr = model, p0, unroll, lr

    def __call__(self, x: Tensor, y: Tensor, *, create_graph: bool = True) -> list[Tensor]:
        with torch.enable_grad():
            if self.unroll <= 1:  # the model's own parameters: no functional_call indirection
                loss = F.cross_entropy(self.model(x), y)
                return list(
                    torch.autograd.grad(
                        loss,
                        list(self.p0.values()),
                        create_graph=create_graph,
                        allow_unused=True,
                        materialize_grads=True,
                    )
                )
            p = self.p0
            for _ in range(self.unroll):  # the client's local SGD steps on its (single) batch
                loss = F.cross_entropy(functional_call(self.model, p, (x,), strict=False), y)
                g = torch.autograd.grad(
                    loss, list(p.values()), create_graph=True, allow_unused=True, materialize_grads=True
                )
                p = {n: w - self.lr * gi for (n, w), gi in zip(p.items(), g)}
            return [(self.p0[n] - p[n]) / (self.lr * self.unroll) for n in self.p0]


class Matcher:
    """``1 - cos(g, target)`` (Geiping et al. 2020 Eq. 4), the mean layer-wise cosine (``per_param``), or for a
    target of signs (``sign``: an Adam client's one-step update, module doc) ``1 - <g, t> / (|g|_1 |t|_inf)``,
    Hoelder's pairing, 0 exactly when g has t's signs. The target's flattening and norms are computed once;
    per-tensor dot products (``torch.dot``) instead of a concatenated gradient vector: no full-size copies per
    iteration; ``cotangents`` gives the loss's derivative in closed form for one vector-Jacobian product."""

    def __init__(self, targets: list[Tensor], masks: list[Tensor] | None, *, similarity: str = "global"):
        if similarity not in ("global", "per_param", "sign"):
            raise ValueError(f"similarity must be global, per_param or sign, got {similarity!r}")
        self.t = [t.detach().reshape(-1) for t in targets]  # float (update_direction) or the caller's dtype
        self.m = [m.reshape(-1).to(self.t[0].dtype) for m in masks] if masks is not None else None
        self.per_param, self.sign = similarity == "per_param", similarity == "sign"
        tn2 = torch.stack([torch.dot(t, t) for t in self.t])
        self.layers = [i for i in range(len(self.t)) if tn2[i] > 0] if self.per_param else list(range(len(self.t)))
        if self.sign:  # |t|_inf: the pairing's normaliser
            self.tn = torch.stack([t.abs().max() if t.numel() else t.new_zeros(()) for t in self.t]).max()
        else:
            self.tn = tn2[self.layers].sqrt() if self.per_param else tn2.sum().sqrt()

    def __call__(self, grads: list[Tensor]) -> Tensor:
        g = [grads[i].reshape(-1) for i in self.layers]
        if self.m is not None:
            g = [gi * self.m[i] for gi, i in zip(g, self.layers)]
        dots = torch.stack([torch.dot(gi, self.t[i]) for gi, i in zip(g, self.layers)])
        if self.sign:
            return 1 - dots.sum() / (torch.stack([gi.abs().sum() for gi in g]).sum() * self.tn + 1e-12)
        gns = torch.stack([torch.dot(gi, gi) for gi in g])
        if self.per_param:  # every parameter tensor with a non-zero target counts equally
            if not self.layers:
                return dots.new_zeros(())
            return (1 - dots / (gns.sqrt() * self.tn + 1e-12)).mean()
        return 1 - dots.sum() / (gns.sum().sqrt() * self.tn + 1e-12)

    @torch.no_grad()
    def cotangents(self, grads: list[Tensor]) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """The loss, the gradient tensors it uses and its derivative w.r.t. each of them, in closed form
        from two dot products per tensor: ``d cos / d g = t / D - cos |t| g / (D |g|)``, D = |g||t| + eps
        (``sign``: ``-t / D + <g, t> |t|_inf sign(g) / D^2``, D = |g|_1 |t|_inf + eps).
        The caller back-propagates these through the client's gradient (one vector-Jacobian product),
        so the cosine itself builds no autograd graph."""
        used = [grads[i] for i in self.layers]
        g = [gi.detach().reshape(-1) for gi in used]
        if self.m is not None:
            g = [gi * self.m[i] for gi, i in zip(g, self.layers)]
        t = [self.t[i] for i in self.layers]
        if not g:
            return torch.zeros(()), [], []
        dots = torch.stack([torch.dot(gi, ti) for gi, ti in zip(g, t)])
        if self.sign:
            den = torch.stack([gi.abs().sum() for gi in g]).sum() * self.tn + 1e-12
            loss = 1 - dots.sum() / den
            vs = torch._foreach_mul(torch._foreach_sign(g), float(dots.sum() * self.tn / den**2))
            torch._foreach_add_(vs, t, alpha=float(-1.0 / den))
            return loss, used, [v.view_as(u) for v, u in zip(vs, used)]
        gns = torch.stack([torch.dot(gi, gi) for gi in g])
        if self.per_param:
            gn = gns.sqrt()
            den = gn * self.tn + 1e-12
            cos = dots / den
            loss = (1 - cos).mean()
            n = len(g)
            alpha = (-1.0 / (den * n)).tolist()
            beta = (cos * self.tn / (den * gn.clamp_min(1e-30) * n)).tolist()
        else:
            gn = gns.sum().sqrt()
            den = gn * self.tn + 1e-12
            cos = dots.sum() / den
            loss = 1 - cos
            alpha = [float(-1.0 / den)] * len(g)
            beta = [float(cos * self.tn / (den * gn.clamp_min(1e-30)))] * len(g)
        if self.per_param:  # one call for every tensor, as torch's optimisers do
            vs = torch._foreach_mul(g, beta)
            torch._foreach_add_(vs, torch._foreach_mul(t, alpha))
        else:
            vs = torch._foreach_mul(g, beta[0])
            torch._foreach_add_(vs, t, alpha=alpha[0])
        return loss, used, [v.view_as(u) for v, u in zip(vs, used)]
