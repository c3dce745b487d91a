"""FedSGD: the undefended baseline of [FLRSP] (one gradient per client per round, averaged)."""

from __future__ import annotations

from dataclasses import dataclass

from bench.registry import register_defense
from defenses.fedavg import FedAvg


@register_defense
@dataclass
class FedSGD(FedAvg):
    paper = "McMahan et al. 2017 (FedSGD); [FLRSP] s.2.1"

    def fl_mode(self) -> str | None:
        return "fedsgd"
