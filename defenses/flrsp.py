"""FLRSP: federated learning with randomly selected model parameters ([FLRSP], Sawada et al.).

Each client zeroes every element of what it sends with probability ``R`` (a fresh binary sequence per
client and round, Eq. 7 / 9); the server averages each element over the clients that sent it non-zero
only (FedSGD Eq. 8, FedAvg Eq. 10), so R=0 reduces to standard FL. The message keeps its zeros, as the paper's
clients send them (s.3, Fig. 3: "some of the gradients are replaced with zero values"), so its communication is
counted dense, as FedAvg's; a sparse encoding (values and a bitmask) would send about (1 - R) of it, which the
paper neither claims nor uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

from bench.fl import standard_message
from bench.params import param
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx


def random_select(tensors: dict[str, Tensor], *, R: float, generator: torch.Generator) -> dict[str, Tensor]:
    """Zero each element independently with probability R ([FLRSP] Eq. 7 and 9)."""
    return {n: t * (torch.rand(t.shape, generator=generator) >= R).to(t.dtype) for n, t in tensors.items()}


def nonzero_mean(values: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Element-wise mean over the non-zero entries, and the mask of elements anyone sent (Eq. 8/10)."""
    stack = torch.stack(list(values))
    count = (stack != 0).sum(0)
    mean = stack.sum(0) / count.clamp(min=1)
    return mean, count > 0


@register_defense
@dataclass
class FLRSP(Defense):
    R: float = param(0.5, ge=0.0, lt=1.0)  # fraction of each update's entries not sent (Eq. 7)
    form: Literal["fedavg", "fedsgd"] = "fedavg"
    grid = tuple({"R": r, "form": f} for f in ("fedavg", "fedsgd") for r in (0.2, 0.5, 0.8))
    paper = "[FLRSP] (Sawada, Imaizumi, Kiya), Eq. 7-10"

    def __post_init__(self) -> None:
        if not 0.0 <= self.R < 1.0:
            raise ValueError(f"R must be in [0, 1), got {self.R}")

    def fl_mode(self) -> str | None:
        return self.form

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        msg = standard_message(state, ctx)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator))
        masked = random_select(msg.tensors, R=self.R, generator=torch.Generator().manual_seed(seed))
        return Message(msg.client, msg.round, masked, msg.num_samples, kind=msg.kind, meta={"R": self.R})

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        new = dict(global_state)
        for name, g in global_state.items():
            sent = [m.tensors[name] for m in msgs if name in m.tensors]
            if not sent:
                continue
            mean, any_sent = nonzero_mean(sent)
            if msgs[0].kind == "gradient":  # Eq. 8: w <- w - eta * mean of non-zero gradients
                new[name] = g - ctx.fl.lr * mean
            else:  # Eq. 10: mean of non-zero parameters; elements nobody sent keep the global value
                new[name] = torch.where(any_sent, mean.to(g.dtype), g)
        return new
