"""LoRA: plain low-rank adaptation of a latent diffusion model on the private set, released as is
([SMP-LoRA] s.2 Eq. 2-3, the undefended baseline of Table 1; Hu et al. 2022).

A central defense: the harness runs one trainer on ``task.central_data`` (D_tr) for ``central_epochs``
epochs; AdamW at the scenario's lr and batch size minimises the adaptation loss (Eq. 3, fresh timestep
and noise per sample and step). The released model is the base + the trained LoRA. Per step it logs the
adaptation loss and the LoRA gradient norm sqrt(||dL/dB||^2 + ||dL/dA||^2) ([SMP-LoRA] App. C).

:func:`lora_loop` is the training loop MP-LoRA and SMP-LoRA share (their objectives plug into it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from bench.fl import current, loader, trainable
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, RoundCtx, TaskAPI

NEEDS_LDM = "needs a latent-diffusion LoRA task with auxiliary member / non-member sets (ldm-t2i)"

# objective(model, batch) -> (loss to minimise, values to log for this step)
Objective = Callable[[nn.Module, object], tuple[Tensor, dict[str, float]]]


def requires_ldm(api: TaskAPI) -> str | None:
    if api.family != "ldm-t2i" or not api.info.get("lora") or not api.info.get("aux_sets"):
        return NEEDS_LDM
    return None


def grad_norm(params: Sequence[nn.Parameter]) -> float:
    """sqrt(sum of squared gradient entries) over the trainable (LoRA) parameters ([SMP-LoRA] App. C)."""
    sq = sum(float(p.grad.detach().pow(2).sum()) for p in params if p.grad is not None)
    return sq ** 0.5


def lora_loop(state: ClientState, ctx: RoundCtx, objective: Objective, *,
              before_step: Callable[[int], dict[str, float]] | None = None) -> Message:
    """``ctx.fl.local_epochs`` epochs over ``state.data`` in batches of ``ctx.fl.batch_size`` (capped by
    ``max_local_steps``), AdamW(lr, weight decay of ``ctx.fl``) on the shared (LoRA) parameters.
    ``before_step(step)`` runs first each step (the proxy's inner maximisation, Alg. 1 lines 4-6).
    Returns the weights message with every shared parameter."""
    names = list(ctx.shared_names)
    model = state.model
    model.train()
    params = trainable(model, names)
    opt = torch.optim.AdamW(params, lr=ctx.fl.lr, weight_decay=ctx.fl.weight_decay)
    step, cap = 0, ctx.fl.max_local_steps
    for _ in range(ctx.fl.local_epochs):
        for batch in loader(state.data, ctx):
            logs = dict(before_step(step)) if before_step is not None else {}
            loss, more = objective(model, batch)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite training objective {float(loss.detach())} at step {step}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            logs.update(more)
            logs["grad_norm"] = grad_norm(params)
            opt.step()
            for k, v in logs.items():
                ctx.log_value(k, v)
            step += 1
            if cap is not None and step >= cap:
                return Message(state.client, ctx.round, current(model, names), len(state.data), kind="weights")
    return Message(state.client, ctx.round, current(model, names), len(state.data), kind="weights")


def take_single(global_state: dict[str, Tensor], msgs: Sequence[Message]) -> dict[str, Tensor]:
    """Central release: the one trainer's weights become the model."""
    if len(msgs) != 1:
        raise ValueError(f"a central defense expects exactly one message per round, got {len(msgs)}")
    new = dict(global_state)
    for n, t in msgs[0].tensors.items():
        new[n] = t.to(global_state[n].dtype)
    return new


@register_defense
@dataclass
class LoRA(Defense):
    setting = "central"
    paper = "[SMP-LoRA] s.2 (Eq. 2-3): LoRA-adapted LDM, no defense"

    def applies(self, task: TaskAPI) -> str | None:
        return requires_ldm(task)

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        def objective(model: nn.Module, batch) -> tuple[Tensor, dict[str, float]]:
            loss = ctx.task.loss(model, batch)
            return loss, {"loss_ada": float(loss.detach())}

        return lora_loop(state, ctx, objective)

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return take_single(global_state, msgs)
