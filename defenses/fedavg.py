"""FedAvg / FedIT: the undefended baseline (McMahan et al. 2017; for LoRA, A and B averaged as in FedIT).

Clients send their full trainable state after local epochs (or, under the scenario's FedSGD protocol,
one gradient per round); the server takes the sample-weighted mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from bench.fl import fedavg_aggregate, standard_message
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx


@register_defense
@dataclass
class FedAvg(Defense):
    paper = "McMahan et al. 2017 (FedAvg); [FedRand] FedIT baseline"

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        return standard_message(state, ctx)

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedavg_aggregate(global_state, msgs, ctx)
