"""Shared by the central LDM LoRA defenses (``lora``, ``mp_lora``, ``smp_lora``): the applicability check,
the training loop their objectives plug into, and the single-trainer release ([SMP-LoRA] s.2, Alg. 1).

Not a defense itself: the registry skips module names starting with ``_``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from bench.fl import TrainingDiverged, current, load_state, loader, train_mode, trainable
from bench.progress import nested, resumed
from bench.types import ClientState, Message, RoundCtx, TaskSpec, n_items

NEEDS_LDM = "needs a latent-diffusion LoRA task with auxiliary member / non-member sets (ldm-t2i)"

# objective(model, batch) -> (loss to minimise, values to log for this step)
Objective = Callable[[nn.Module, object], tuple[Tensor, dict[str, float]]]
# (get, set) of the state an objective keeps across steps (MP-LoRA's proxy and sampler), for epoch checkpoints
LoopState = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]


def requires_ldm(api: TaskSpec) -> str | None:
    """``Defense.applies`` of the central LDM LoRA defenses: None on a latent-diffusion LoRA task with the
    auxiliary member / non-member sets, else the reason."""
    if api.family != "ldm-t2i" or api.lora is None or not api.aux_sets:
        return NEEDS_LDM
    return None


def grad_norm(params: Sequence[nn.Parameter]) -> float:
    """sqrt(sum of squared gradient entries) over the trainable (LoRA) parameters ([SMP-LoRA] App. C)."""
    sq = sum(float(p.grad.detach().pow(2).sum()) for p in params if p.grad is not None)
    return sq**0.5


def lora_loop(
    state: ClientState,
    ctx: RoundCtx,
    objective: Objective,
    *,
    before_step: Callable[[int], dict[str, float]] | None = None,
    loop_state: LoopState | None = None,
) -> Message:
    """``ctx.fl.local_epochs`` epochs over ``state.data`` in batches of ``ctx.fl.batch_size`` (capped by
    ``max_local_steps``), AdamW(lr, weight decay of ``ctx.fl``) on the shared (LoRA) parameters.
    ``before_step(step)`` runs first each step (the proxy's inner maximisation, Alg. 1 lines 4-6).
    Saves an epoch checkpoint when due and resumes from one (``ctx.checkpoint``, bench/checkpoint.py), with
    ``loop_state``: what the objective keeps across steps. Returns the weights message with every shared
    parameter."""
    names = list(ctx.shared_names)
    model = train_mode(state.model, ctx.fl)
    params = trainable(model, names)
    opt = torch.optim.AdamW(params, lr=ctx.fl.lr, weight_decay=ctx.fl.weight_decay)
    step, cap, first = 0, ctx.fl.max_local_steps, 0
    ckpt, where = ctx.checkpoint, {"kind": "epoch", "round": ctx.round, "client": state.client}
    saved = ckpt.load(**where) if ckpt is not None else None
    if saved is not None:  # the torch / NumPy / Python random states are restored by load()
        load_state(model, saved["params"])
        opt.load_state_dict(saved["opt"])
        if loop_state is not None:
            loop_state[1](saved["loop"])
        ctx.generator.set_state(saved["generator"])
        ctx.log.clear()
        ctx.log.update(saved["log"])
        step, first = saved["step"], saved["epoch"]
        resumed(first, ctx.fl.local_epochs)  # the run's bar: these epochs are done, but not in this run's time
    for epoch in nested(range(ctx.fl.local_epochs)):  # the run's bar moves within a central run's one round
        if epoch < first:  # done before the checkpoint
            continue
        for batch in nested(loader(state.data, ctx)):
            logs = dict(before_step(step)) if before_step is not None else {}
            loss, more = objective(model, batch)
            if not torch.isfinite(loss):
                raise TrainingDiverged(
                    f"training diverged: non-finite training objective {float(loss.detach())} at step {step}"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            logs.update(more)
            logs["grad_norm"] = grad_norm(params)
            opt.step()
            for k, v in logs.items():
                ctx.log_value(k, v)
            step += 1
            if cap is not None and step >= cap:
                return Message(state.client, ctx.round, current(model, names), n_items(state.data), kind="weights")
        if ckpt is not None and ckpt.due(last=epoch + 1 == ctx.fl.local_epochs):
            mine = {"params": current(model, names), "opt": opt.state_dict(), "generator": ctx.generator.get_state()}
            loop = loop_state[0]() if loop_state is not None else None
            ckpt.save(
                {
                    **where,
                    **mine,
                    "epoch": epoch + 1,
                    "step": step,
                    "rounds": ctx.fl.rounds,
                    "epochs": ctx.fl.local_epochs,
                    "loop": loop,
                    "log": ctx.log,
                }
            )
    return Message(state.client, ctx.round, current(model, names), n_items(state.data), kind="weights")


def take_single(global_state: dict[str, Tensor], msgs: Sequence[Message]) -> dict[str, Tensor]:
    """Central release: the one trainer's weights become the model."""
    if len(msgs) != 1:
        raise ValueError(f"a central defense expects exactly one message per round, got {len(msgs)}")
    new = dict(global_state)
    for n, t in msgs[0].tensors.items():
        new[n] = t.to(global_state[n].dtype)
    return new
