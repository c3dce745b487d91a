"""Top-k sparsification of the client update: a worked example of a contributed defense (CONTRIBUTING.md).

Each client sends only the ``keep`` fraction of largest-magnitude entries of its update (per tensor)
and zeroes the rest; the server averages as FedAvg. Zhu, Liu & Han, "Deep Leakage from Gradients",
NeurIPS 2019, s.5 ("gradient compression and sparsification"): pruning more than 20% of the smallest
gradient entries stopped their attack; top-k selection as in Aji & Heafield, EMNLP 2017. No formal
guarantee (``epsilon`` stays None). The suite counts dense bytes: a real deployment would send indices
and values. Run it without copying it anywhere:

    python -m bench check --defense examples/topk_sparsification.py
    python -m bench run --scenario image-cls --preset smoke --defense examples/topk_sparsification.py --attack all
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from bench.fl import fedavg_aggregate, standard_message
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx


def topk_keep(t: Tensor, keep: float) -> Tensor:
    """``t`` with all but its ceil(keep * numel) largest-magnitude entries set to zero."""
    k = max(1, math.ceil(keep * t.numel()))
    if k >= t.numel():
        return t.clone()
    flat = t.flatten()
    idx = torch.topk(flat.abs(), k, largest=True, sorted=False).indices
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(t)


@register_defense
@dataclass
class TopKSparsification(Defense):
    keep: float = 0.2  # fraction of the update's entries sent, per tensor
    grid = ({"keep": 0.5}, {"keep": 0.2}, {"keep": 0.05})
    paper = "Zhu et al. 2019 (Deep Leakage from Gradients) s.5; Aji & Heafield 2017 (top-k sparsification)"

    def __post_init__(self) -> None:
        if not 0.0 < self.keep <= 1.0:
            raise ValueError(f"keep must be in (0, 1], got {self.keep}")

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        msg = standard_message(state, ctx)  # local training (FedAvg) or one gradient (FedSGD)
        if msg.kind == "gradient":
            sparse = {n: topk_keep(g, self.keep) for n, g in msg.tensors.items()}
        else:  # send the global weights plus the sparsified change
            sparse = {
                n: ctx.global_state[n] + topk_keep(w - ctx.global_state[n], self.keep) for n, w in msg.tensors.items()
            }
        return Message(msg.client, msg.round, sparse, msg.num_samples, kind=msg.kind, meta={"keep": self.keep})

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedavg_aggregate(global_state, msgs, ctx)
