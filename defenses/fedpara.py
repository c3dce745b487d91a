"""FedPara in a LoRA setting ([FedRand] s.4.1 and App. A.3; pFedPara of Hyeon-Woo et al. 2022, s.3.3).

Every LoRA-adapted linear layer gets a second, private LoRA pair (B_p, A_p) that never leaves the client
and is combined element-wise (Hadamard) with the global pair:
    W = W0 + G (.) (B_p A_p + 1),   G = scaling * B_g A_g   (peft's global LoRA),
which is pFedPara's W = W1 (.) (W2 + 1) (global W1, personal W2) with the global factor being LoRA's
update. The "+1" makes a client whose private pair is zero behave exactly as the server model W0 + G, so
the server model is the global LoRA alone, as [FedRand] evaluates it; the literal G (.) (B_p A_p) would
start at a dead point (G = 0 and B_p A_p = 0 give zero gradients to both). B_p starts at zero and A_p
like peft's A (Kaiming-uniform), per client, at its first participation. Only the global pair is sent;
the server averages it (FedAvg, [FedRand] s.4.1).

The private pair is added by :meth:`FedPara.setup` as a ``fedpara_private`` sub-module of each peft LoRA
layer (parameters ``...q_proj.fedpara_private.A`` / ``.B``, ``requires_grad=False`` so they are not among
the shared names) with a forward hook that adds x (G (.) B_p A_p)^T to peft's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.fl import current, fedavg_aggregate, load_state, local_train
from bench.lora_params import lora_pairs, requires_lora
from bench.params import param
from bench.registry import register_defense
from bench.types import ClientState, Defense, Message, NotApplicable, RoundCtx, n_items

PRIVATE = "fedpara_private"


class PrivatePair(nn.Module):
    """The client's private LoRA pair of one layer: P = B @ A, shape [out, in]."""

    def __init__(self, out_features: int, in_features: int, rank: int, adapter: str):
        super().__init__()
        self.adapter = adapter
        self.A = nn.Parameter(torch.zeros(rank, in_features), requires_grad=False)
        self.B = nn.Parameter(torch.zeros(out_features, rank), requires_grad=False)

    def reset(self, generator: torch.Generator) -> None:
        """B = 0, A ~ Kaiming-uniform(a=sqrt(5)) as peft initialises lora_A."""
        bound = 1.0 / math.sqrt(self.A.shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]
        with torch.no_grad():
            self.A.copy_((torch.rand(self.A.shape, generator=generator) * 2 - 1) * bound)
            self.B.zero_()


def _lora_weights(module: nn.Module, adapter: str) -> tuple[Tensor, Tensor]:
    """(A, B) weights of a peft LoRA layer's ``adapter``; only ``nn.Linear`` pairs are wrapped (see ``setup``)."""
    a = cast(nn.ModuleDict, module.lora_A)[adapter]
    b = cast(nn.ModuleDict, module.lora_B)[adapter]
    assert isinstance(a, nn.Linear) and isinstance(b, nn.Linear)
    return a.weight, b.weight


def _hadamard_hook(module: nn.Module, args, kwargs, output):
    """Add x (G (.) P)^T: peft already added x G^T, so the layer computes W0 + G (.) (P + 1)."""
    pair: PrivatePair = getattr(module, PRIVATE)
    ad = pair.adapter
    if module.disable_adapters or module.merged or ad not in cast(list, module.active_adapters):
        return output
    x = args[0] if args else kwargs["x"]
    a_g, b_g = _lora_weights(module, ad)
    g = (b_g @ a_g) * cast(dict, module.scaling)[ad]
    extra = F.linear(x.to(g.dtype), g * (pair.B @ pair.A))
    return output + extra.to(output.dtype)


@register_defense
@dataclass
class FedPara(Defense):
    # rank of the private pair; 0 = the global LoRA rank ("an additional pair", App. A.3)
    private_rank: int = param(0, ge=0, le=4096)

    grid = ({},)
    paper = "[FedRand] (Park et al. 2025), s.4.1 baselines and App. A.3; Hyeon-Woo et al. 2022 (pFedPara)"
    requires = ("lora",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def applies(self, task) -> str | None:
        return requires_lora(task)

    def fl_mode(self) -> str | None:
        return "fedavg"  # sends trained LoRA weights

    def setup(self, model: nn.Module, task) -> nn.Module:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        pairs = lora_pairs(names)
        added = 0
        for pair in pairs:
            mod = model.get_submodule(pair.module)
            if hasattr(mod, PRIVATE) or not isinstance(cast(nn.ModuleDict, mod.lora_A)[pair.adapter], nn.Linear):
                continue  # already wrapped, or an embedding / conv LoRA layer (not supported)
            a_g, b_g = _lora_weights(mod, pair.adapter)
            rank = self.private_rank or a_g.shape[0]
            setattr(mod, PRIVATE, PrivatePair(b_g.shape[0], a_g.shape[1], rank, pair.adapter).to(a_g.device))
            mod.register_forward_hook(_hadamard_hook, with_kwargs=True)
            added += 1
        if not added:
            raise NotApplicable("FedPara needs peft LoRA linear layers to pair with a private LoRA")
        return model

    @staticmethod
    def private_names(model: nn.Module) -> list[str]:
        return [n for n, _ in model.named_parameters() if f".{PRIVATE}." in n]

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        if ctx.fl.mode != "fedavg":
            raise NotApplicable("FedPara sends LoRA weights after local training (needs fl.mode 'fedavg')")
        model = state.model
        priv = self.private_names(model)
        if not priv:
            raise NotApplicable("the model was not prepared by FedPara.setup (no private LoRA pairs)")
        if "pair" in state.private:
            load_state(model, state.private["pair"])
        else:
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator))
            g = torch.Generator().manual_seed(seed)
            for m in model.modules():
                if isinstance(m, PrivatePair):
                    m.reset(g)
        params = dict(model.named_parameters())
        for n in priv:
            params[n].requires_grad_(True)
        try:
            local_train(state, ctx, names=list(ctx.shared_names) + priv)
        finally:
            for n in priv:
                params[n].requires_grad_(False)
        state.private["pair"] = current(model, priv)
        return Message(state.client, ctx.round, current(model, ctx.shared_names), n_items(state.data), kind="weights")

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        return fedavg_aggregate(global_state, msgs, ctx)
