"""FedPer in a LoRA setting ([FedRand] s.4.1 and App. A.3; Arivazhagan et al. 2019).

As [FedRand] adapts it: the LoRA A and B of the top ``shared_layers`` transformer layers (the last ones,
nearest the output) are shared with the server and FedAvg-averaged; the LoRA of all other layers is
client-specific and never shared. (The original FedPer keeps the *top* layers personal; [FedRand]
inverts this for LoRA, and we follow [FedRand].) "The LoRA A and B matrices of these non-shared layers
were initialized using the aggregation results from the first round": with ``warmup_round`` (default)
round 0 is a full-LoRA FedAvg round, and a client's private layers start from that round-0 aggregate
(which the server keeps unchanged afterwards) until it has trained its own. Trainable parameters that are
not LoRA, and LoRA parameters without a layer index, count as shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from torch import Tensor

from bench.fl import current, fedavg_aggregate, load_state, local_train
from bench.lora_params import is_lora, layer_index, num_layers, requires_lora
from bench.params import param
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, NotApplicable, RoundCtx, n_items


@register_defense
@dataclass
class FedPer(Defense):
    shared_layers: int = param(2, ge=1, le=1000)  # [FedRand] reports 2 and 4
    warmup_round: bool = True  # round 0 shares all LoRA; private layers start from its aggregate (App. A.3)

    grid = ({"shared_layers": 2}, {"shared_layers": 4})
    paper = "[FedRand] (Park et al. 2025), s.4.1 baselines and App. A.3; Arivazhagan et al. 2019"
    requires = ("lora",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def __post_init__(self) -> None:
        if self.shared_layers < 1:
            raise ValueError(f"shared_layers must be >= 1, got {self.shared_layers}")

    def applies(self, task) -> str | None:
        reason = requires_lora(task)
        depth = task.num_layers
        if reason is None and depth and self.shared_layers >= int(depth):
            reason = (
                f"FedPer shares the top {self.shared_layers} layers but the model has only {depth}: "
                "nothing would stay private (it would be FedAvg)"
            )
        return reason

    def fl_mode(self) -> str | None:
        return "fedavg"  # sends trained LoRA weights

    def split(self, names: Sequence[str], depth: int | None = None) -> tuple[list[str], list[str]]:
        """(shared names, private names): LoRA of layers >= L - shared_layers is shared (L: ``depth``, the
        task's ``num_layers``, else inferred from the LoRA names)."""
        depth = num_layers(names, depth)
        if self.shared_layers > depth:
            raise NotApplicable(f"FedPer shares the top {self.shared_layers} layers but the model has {depth}")
        shared: list[str] = []
        private: list[str] = []
        for n in names:
            li = layer_index(n) if is_lora(n) else None
            (private if li is not None and li < depth - self.shared_layers else shared).append(n)
        return shared, private

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        if ctx.fl.mode != "fedavg":
            raise NotApplicable("FedPer sends LoRA weights after local training (needs fl.mode 'fedavg')")
        shared, private = self.split(ctx.shared_names, ctx.task.num_layers)
        warm = self.warmup_round and ctx.round == 0
        if not warm and "layers" in state.private:
            load_state(state.model, state.private["layers"])
        local_train(state, ctx)  # shared and private layers are both trained locally
        if warm:
            sent = list(ctx.shared_names)  # round 0: the private layers are initialised from this aggregate
        else:
            state.private["layers"] = current(state.model, private)
            sent = shared
        return Message(
            state.client,
            ctx.round,
            current(state.model, sent),
            n_items(state.data),
            kind="weights",
            meta={"warmup": warm},
        )

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedavg_aggregate(global_state, msgs, ctx)  # names nobody sent keep their global value
