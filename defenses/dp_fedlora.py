"""DP-FedLoRA ([DP-FedLoRA], Xu et al.): clip and Gaussian-noise each client's LoRA A and B, stack at the server.

Client (Alg. 1): train the LoRA locally; clip every A and every B matrix to Frobenius norm C_A / C_B
(Eq. 6); add N(0, sigma^2 I) with sigma = C sqrt(2 ln(1.25/delta)) / epsilon (Eq. 7-11); send both.

Server, ``aggregation="stack"`` (Eq. 12-14): per adapted module, B~ = [p_1 B~_1, ..., p_K B~_K] and
A~ = [A~_1; ...; A~_K], so B~ A~ = sum_k p_k B~_k A~_k exactly (p_k = n_k / sum n: FedAvg weights; the
paper's Eq. 3 is the plain sum of fresh per-round adapters, ours start from the global one). The paper
then broadcasts the rank-(sum r_k) pair and never maps it back to rank r; a fixed-shape global LoRA needs
that step, and we take the best rank-r approximation of the stacked product (truncated SVD, Eckart-Young;
B = U_r S_r, A = V_r^T; computed from the stacked factors by QR, without forming the product). This is
lossless when sum r_k <= r, otherwise the relative truncation error is logged as ``dp_fedlora/svd_rel_err``.
Server optimizers other than plain averaging act on the dense product Delta W = B A of each module
(pseudo-gradient = stacked product - current B A), so their state does not depend on the factorisation;
that path needs an SVD of the dense result (randomized above 256 rows/columns, see bench.lora_params.factor_rank_r).
``aggregation="average"`` instead averages A and B separately with the optimizer acting on the factors,
which is what the authors' released code does (OpenFedLLM's global_aggregate).

``server_opt`` selects one of FedAvg / FedProx / SCAFFOLD / FedAvgM / FedAdagrad / FedYogi / FedAdam
([DP-FedLoRA] s.VII-A.2; :mod:`bench.server_opt`). SCAFFOLD's client control variate is computed from the
privatised message (post-processing), so the DP guarantee of the message is unaffected.

Privacy: :meth:`epsilon` is the paper's per-release epsilon of one noised matrix (Eq. 9-11). A client's
message holds one noised A and B per adapted module; :meth:`epsilon_composed` treats the whole message as
one Gaussian release (noise multiplier 1 / sqrt(sum_i (S_i / sigma_i)^2)) with client-level sampling over
all rounds (opacus RDP), the honest number. The unit of privacy is a client's whole local data set (clipping
bounds the trained matrices, not per-sample gradients). The paper's S = C holds when one neighbouring output
is zero; two clipped matrices can differ by 2C (``sensitivity_factor=2`` calibrates sigma for that). Eq. 9 is
proven for epsilon < 1 only (Dwork & Roth, Thm. A.1), so at the paper's epsilon = 25 only the composed RDP
number is a guarantee.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from torch import Tensor

from bench.accounting import combined_noise_multiplier, composed_epsilon, gaussian_epsilon, gaussian_sigma
from bench.fl import current, local_train
from bench.lora_params import (
    factor_rank_r,
    factor_stacked_rank_r,
    lora_pairs,
    lora_product,
    requires_lora,
    split_names,
    stack_pairs,
)
from bench.params import param
from bench.registry import register_defense
from bench.run_state import run_of
from bench.server_opt import ServerAvg, make_server_opt
from bench.types import ClientState, Defense, DefenseRun, Message, NotApplicable, RoundCtx, n_items

ServerOptName = Literal["fedavg", "fedprox", "scaffold", "fedavgm", "fedadagrad", "fedyogi", "fedadam"]


def clip_frobenius(t: Tensor, c: float) -> Tensor:
    """t * min(1, c / ||t||_F) ([DP-FedLoRA] Alg. 1, Eq. 6)."""
    norm = float(t.norm())
    return t * (c / norm) if norm > c else t.clone()


@register_defense
@dataclass
class DPFedLoRA(Defense):
    # per-matrix epsilon ([DP-FedLoRA] s.VII-B: 25 with clip 0.1 is the default)
    target_epsilon: float = param(25.0, ge=1e-3, le=1e4)
    delta: float = param(1e-5, gt=0.0, lt=1.0)  # the authors' code default
    clip_a: float = param(0.1, gt=0.0, le=1e6)  # C_A (Eq. 6)
    clip_b: float = param(0.1, gt=0.0, le=1e6)  # C_B (Eq. 6)
    aggregation: Literal["stack", "average"] = "stack"
    server_opt: ServerOptName = "fedavg"
    # None: 1.0 for fedavg/fedprox/scaffold/fedavgm, 1e-3 for the adaptive ones
    server_lr: float | None = param(None, gt=0.0, le=1e3)
    prox_mu: float = param(0.01, ge=0.0, le=1e3)
    server_momentum: float = param(0.9, ge=0.0, lt=1.0)
    beta1: float = param(0.9, ge=0.0, lt=1.0)
    beta2: float = param(0.99, ge=0.0, lt=1.0)
    tau: float = param(1e-3, gt=0.0, le=10.0)  # adaptivity of FedAdagrad/FedYogi/FedAdam
    # L2 sensitivity = factor * clip norm (1: the paper's S = C)
    sensitivity_factor: float = param(1.0, gt=0.0, le=10.0)

    grid = ({"target_epsilon": 25.0}, {"target_epsilon": 15.0}, {"target_epsilon": 5.0})
    paper = "[DP-FedLoRA] (Xu et al.), Eq. 6-14, Alg. 1"
    requires = ("lora",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    def __post_init__(self) -> None:
        if self.target_epsilon <= 0 or not 0 < self.delta < 1:
            raise ValueError(f"need target_epsilon > 0 and 0 < delta < 1, got {self.target_epsilon}, {self.delta}")
        if self.clip_a <= 0 or self.clip_b <= 0 or self.sensitivity_factor <= 0:
            raise ValueError("clip_a, clip_b and sensitivity_factor must be > 0")
        self._make_opt()  # bad optimiser settings fail at construction, not in round 0

    # ---- privacy ---------------------------------------------------------------------------
    @property
    def sigma_a(self) -> float:
        return gaussian_sigma(self.target_epsilon, self.delta, self.sensitivity_factor * self.clip_a)  # Eq. 11

    @property
    def sigma_b(self) -> float:
        return gaussian_sigma(self.target_epsilon, self.delta, self.sensitivity_factor * self.clip_b)  # Eq. 10

    def dp_delta(self) -> float | None:
        return self.delta

    def sensitivity_note(self) -> str:
        s = self.sensitivity_factor
        relation = (
            "add/remove one client (neighbour output zero)"
            if s == 1
            else "replace one client"
            if s == 2
            else f"sensitivity factor {s:g}"
        )
        return (
            f"client-level, {relation}: each noised A (B) matrix has L2 sensitivity {s:g} x C_A={self.clip_a:g} "
            f"({s:g} x C_B={self.clip_b:g}); one message = all of a client's matrices ([DP-FedLoRA] Eq. 6-11)"
        )

    def epsilon(self, *, delta: float) -> float | None:
        """The paper's per-release epsilon of one noised A (or B) matrix at ``delta`` (Eq. 9)."""
        return gaussian_epsilon(self.sigma_a, delta, self.sensitivity_factor * self.clip_a)

    def epsilon_composed(
        self, *, delta: float, rounds: int, sample_rate: float, names: Sequence[str] | None = None
    ) -> float | None:
        """Client-level epsilon of all messages over ``rounds`` with client sampling (opacus RDP).

        The message structure (how many A and B matrices are noised) comes from ``names`` (the shared
        parameter names, which the harness passes); without them it is unknown and None is returned with
        a warning.
        """
        a, b, _ = split_names(names) if names is not None else ((), (), ())
        num_a, num_b = len(a), len(b)
        if not (num_a and num_b):
            warnings.warn(
                "DPFedLoRA.epsilon_composed: message structure unknown (pass names=, the shared "
                "parameter names); returning None",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        s = self.sensitivity_factor
        z = combined_noise_multiplier(
            [s * self.clip_a] * num_a + [s * self.clip_b] * num_b, [self.sigma_a] * num_a + [self.sigma_b] * num_b
        )
        return composed_epsilon(z, sample_rate, rounds, delta)

    # ---- protocol --------------------------------------------------------------------------
    def _make_opt(self) -> ServerAvg:
        return make_server_opt(
            self.server_opt,
            lr=self.server_lr,
            mu=self.prox_mu,
            momentum=self.server_momentum,
            beta1=self.beta1,
            beta2=self.beta2,
            tau=self.tau,
        )

    def applies(self, task) -> str | None:
        return requires_lora(task)

    def fl_mode(self) -> str | None:
        return "fedavg"

    def setup(self, model, task):
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        other = split_names(names)[2]
        if other:
            raise NotApplicable(f"DP-FedLoRA privatises LoRA A/B only, but the model also trains {other[:3]}...")
        lora_pairs(names)  # every A has its B
        return model

    def start_run(self, run: DefenseRun) -> None:
        run.state["server_opt"] = self._make_opt()  # fresh server state for this training run

    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        if ctx.fl.mode != "fedavg":
            raise NotApplicable("DP-FedLoRA sends LoRA weights after local training (needs fl.mode 'fedavg')")
        names = list(ctx.shared_names)
        a_names, b_names, other = split_names(names)
        if other or not a_names:
            raise NotApplicable("DP-FedLoRA needs a model whose trainable parameters are LoRA A/B only")
        opt = run_of(self, ctx).state["server_opt"]
        steps = local_train(state, ctx, **opt.local_hooks(state, ctx, names))
        trained = current(state.model, names)
        g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=ctx.generator)))
        a_set = set(a_names)
        sent, clipped = {}, 0
        for n in names:
            c, sigma = (self.clip_a, self.sigma_a) if n in a_set else (self.clip_b, self.sigma_b)
            clipped += int(float(trained[n].norm()) > c)
            t = clip_frobenius(trained[n], c)  # Eq. 6
            sent[n] = t + sigma * torch.randn(t.shape, generator=g, dtype=t.dtype)  # Eq. 7-8
        ctx.log_value("dp_fedlora/clipped_fraction", clipped / len(names))
        meta = opt.after_local(state, ctx, names, {n: ctx.global_state[n] for n in names}, sent, steps)
        return Message(state.client, ctx.round, sent, n_items(state.data), kind="weights", meta=meta)

    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        if not msgs:
            return dict(global_state)
        total = float(sum(m.num_samples for m in msgs))
        w = [m.num_samples / total for m in msgs]
        opt = run_of(self, ctx).state["server_opt"]
        new = dict(global_state)
        if self.aggregation == "average":
            target = {n: sum(wk * m.tensors[n] for wk, m in zip(w, msgs)) for n in global_state}
            new.update(opt.step({n: global_state[n] for n in global_state}, target))
        else:
            pairs = lora_pairs(global_state)
            stacks = {}
            for p in pairs:  # Eq. 12-13, with B~ A~ = sum_k p_k B~_k A~_k
                stacks[p.module] = stack_pairs([m.tensors[p.b] for m in msgs], [m.tensors[p.a] for m in msgs], w)
            if not opt.plain_average:  # the optimizer steps on the dense products Delta W
                x = {p.module: lora_product(global_state[p.b], global_state[p.a]) for p in pairs}
                dense = opt.step(x, {k: b_s @ a_s for k, (b_s, a_s) in stacks.items()})
            errs = []
            for p in pairs:
                a_old, b_old = global_state[p.a], global_state[p.b]
                if opt.plain_average:
                    b_new, a_new, err = factor_stacked_rank_r(*stacks[p.module], a_old.shape[0])
                else:
                    b_new, a_new, err = factor_rank_r(dense[p.module], a_old.shape[0])
                new[p.b] = b_new.reshape(b_old.shape).to(b_old.dtype)
                new[p.a] = a_new.reshape(a_old.shape).to(a_old.dtype)
                errs.append(err)
            ctx.log_value("dp_fedlora/svd_rel_err", max(errs) if errs else 0.0)
        opt.end_round(ctx)
        return new
