"""FedRand ([FedRand], Park et al. 2025, Alg. 1-2, Eq. 5-10): each client sends only LoRA A or only B.

Client k draws u ~ U(0,1), a_k = 1{u < rho} (Eq. 5, one draw per client and round, for all layers). It
starts from the server's A and its own B of its previous round if a_k = 1, else from its own previous A
and the server's B (Eq. 6-7); trains both; caches both (Alg. 2 line 22); sends only the half it took from
the server. The server averages each half over the clients that sent it, normalised by
alpha / beta (Eq. 8-10), and keeps the previous value when nobody sent that half.

Where the paper is silent: a client that has no cache yet (first participation, or round 0 where Alg. 2
uses the server's initial A and zero B) starts from the server's A and B. Trainable parameters that are not
LoRA (none in the paper's setting) are always sent and sample-weighted averaged.

Ablations ([FedRand] Table 3): ``rho`` 0.3 / 0.7; ``normalize=False`` drops alpha / beta from Eq. 9-10
(coefficients n_k / m_r, summing to alpha < 1); ``past_params=False`` starts every client from the
server's full LoRA and still sends only A or B ("w/o past parameters").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import torch
from torch import Tensor

from bench.fl import current, load_state, local_train
from bench.lora_params import requires_lora, split_names
from bench.params import param
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, NotApplicable, RoundCtx, n_items


@register_defense
@dataclass
class FedRand(Defense):
    rho: float = param(0.5, ge=0.0, le=1.0)  # probability of choosing (and sending) A; [FedRand] s.4.1
    normalize: bool = True  # alpha / beta normalisation of Eq. 9-10
    past_params: bool = True  # private half initialised from the client's previous round (Eq. 6-7)

    grid = ({}, {"rho": 0.3}, {"rho": 0.7}, {"normalize": False}, {"past_params": False})
    paper = "[FedRand] (Park et al. 2025), Alg. 1-2, Eq. 5-10"
    requires = ("lora",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def __post_init__(self) -> None:
        if not 0.0 <= self.rho <= 1.0:
            raise ValueError(f"rho must be in [0, 1], got {self.rho}")

    def applies(self, task) -> str | None:
        return requires_lora(task)

    def fl_mode(self) -> str | None:
        return "fedavg"  # sends trained LoRA weights

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        if ctx.fl.mode != "fedavg":
            raise NotApplicable("FedRand sends LoRA weights after local training (needs fl.mode 'fedavg')")
        a_names, b_names, other = split_names(ctx.shared_names)
        if not a_names:
            raise NotApplicable("FedRand needs LoRA A/B parameters among the trainable parameters")
        u = float(torch.rand((), generator=ctx.generator))
        send_a = u < self.rho  # Eq. 5
        sent, private = (a_names, b_names) if send_a else (b_names, a_names)
        cache: dict[str, Tensor] | None = state.private.get("cache")
        if self.past_params and cache is not None:  # Eq. 6-7: the private half from the last round
            load_state(state.model, {n: cache[n] for n in private})
        local_train(state, ctx)  # both halves (and any other trainable) are updated, Alg. 2 l.16-21
        if self.past_params:
            state.private["cache"] = current(state.model, a_names + b_names)  # Alg. 2 l.22
        tensors = current(state.model, list(sent) + other)
        return Message(
            state.client, ctx.round, tensors, n_items(state.data), kind="weights", meta={"sent": "A" if send_a else "B"}
        )

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedrand_aggregate(global_state, msgs, normalize=self.normalize)


def fedrand_aggregate(
    global_state: dict[str, Tensor], msgs: Sequence[Message], *, normalize: bool = True
) -> dict[str, Tensor]:
    """Eq. 8-10 applied per parameter: with m_r = sum of n_k over all of the round's clients and
    alpha_p = sum of n_k / m_r over the clients that sent parameter p,
    p <- sum_{k sent p} n_k / (alpha_p m_r) p_k   (normalize)   or   sum_{k sent p} n_k / m_r p_k,
    and p keeps its previous value when alpha_p = 0. With one A/B choice per client this is exactly
    Eq. 9 for the A's (alpha) and Eq. 10 for the B's (beta). Non-LoRA parameters every client sent get
    the plain sample-weighted mean (normalised, as in FedAvg Eq. 3).
    """
    m_r = float(sum(m.num_samples for m in msgs))
    new = dict(global_state)
    if m_r <= 0:
        return new
    a_names, b_names, _ = split_names(global_state)
    lora = set(a_names) | set(b_names)
    for name, old in global_state.items():
        senders = [m for m in msgs if name in m.tensors]
        if not senders:
            continue  # alpha = 0 (or beta = 0): keep A_r (B_r)
        coef = sum(m.num_samples for m in senders) / m_r  # alpha or beta
        denom = coef * m_r if (normalize or name not in lora) else m_r
        agg = cast(Tensor, sum(m.tensors[name].to(torch.float64) * (m.num_samples / denom) for m in senders))
        new[name] = agg.to(old.dtype)
    return new
