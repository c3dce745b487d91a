"""LoRA: plain low-rank adaptation of a latent diffusion model on the private set, released as is
([SMP-LoRA] s.2 Eq. 2-3, the undefended baseline of Table 1; Hu et al. 2022).

A central defense: the harness runs one trainer on ``task.central_data`` (D_tr) for ``central_epochs``
epochs; AdamW at the scenario's lr and batch size minimises the adaptation loss (Eq. 3, fresh timestep
and noise per sample and step). The released model is the base + the trained LoRA. Per step it logs the
adaptation loss and the LoRA gradient norm sqrt(||dL/dB||^2 + ||dL/dA||^2) ([SMP-LoRA] App. C).

:func:`defenses._lora_common.lora_loop` is the training loop MP-LoRA and SMP-LoRA share (their objectives
plug into it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor, nn

from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx, TaskSpec
from defenses._lora_common import lora_loop, requires_ldm, take_single


@register_defense
@dataclass
class LoRA(Defense):
    setting = "central"
    paper = "[SMP-LoRA] s.2 (Eq. 2-3): LoRA-adapted LDM, no defense"
    requires = ("lora",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def applies(self, task: TaskSpec) -> str | None:
        return requires_ldm(task)

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        def objective(model: nn.Module, batch) -> tuple[Tensor, dict[str, float]]:
            loss = ctx.task.loss(model, batch)
            return loss, {"loss_ada": float(loss.detach())}

        return lora_loop(state, ctx, objective)

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return take_single(global_state, msgs)
