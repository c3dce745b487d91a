"""Fixed-position defense for ViTs (Lu et al. 2022, APRIL paper; [FLRSP] s.2.3).

The positional-embedding update is never sent (nor trained locally): the server's positional
embedding stays fixed, which breaks APRIL's closed form. Everything else is FedAvg / FedSGD.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.fl import standard_message
from bench.registry import register_defense
from bench.types import ClientState, Message, RoundCtx, TaskSpec
from defenses.fedavg import FedAvg


@register_defense
@dataclass
class FixedPosition(FedAvg):
    paper = "Lu et al. 2022 (APRIL) defense; [FLRSP] s.2.3"
    requires = ("vit",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def applies(self, task: TaskSpec) -> str | None:
        if task.vit is None:
            return "needs a ViT with a learnable positional embedding"
        return None

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        vit = ctx.task.vit
        assert vit is not None  # applies() checked it
        pos = vit.pos_embed_param
        names = [n for n in ctx.shared_names if n != pos]
        return standard_message(state, ctx, names=names)
