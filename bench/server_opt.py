"""Server optimizers for federated training (the seven of [DP-FedLoRA] s.VII-A.2), each a small class.

Every optimizer sees the round as x (current global values) and ``target`` (the aggregate of the clients'
returned values, e.g. their sample-weighted mean); the pseudo-gradient is Delta = target - x.

- FedAvg (McMahan et al. 2017):      x <- x + lr * Delta (lr = 1: the average itself).
- FedProx (Li et al. 2020):          FedAvg at the server; the client minimises
                                     loss + mu/2 ||w - w_global||^2 (Eq. 2 of that paper).
- SCAFFOLD (Karimireddy et al. 2020, Alg. 1, option II): clients correct every local step by
                                     - lr_l (c - c_i); afterwards c_i+ = c_i - c + (x - y_i) / (K lr_l);
                                     server: x <- x + lr * Delta, c <- c + (1/N) sum_{i in S} (c_i+ - c_i).
- FedAvgM (Hsu et al. 2019):         v <- beta v + Delta; x <- x + lr * v.
- FedAdagrad / FedYogi / FedAdam (Reddi et al. 2021, Alg. 2):
                                     m <- b1 m + (1 - b1) Delta,
                                     Adagrad: v <- v + Delta^2,
                                     Yogi:    v <- v - (1 - b2) Delta^2 sign(v - Delta^2),
                                     Adam:    v <- b2 v + (1 - b2) Delta^2,
                                     x <- x + lr * m / (sqrt(v) + tau), with m_{-1} = 0, v_{-1} = tau^2.
Defaults for the adaptive ones (lr 1e-3, tau 1e-3, b1 0.9, b2 0.99), mu 0.01 and beta 0.9 are those of
OpenFedLLM, the code base DP-FedLoRA's experiments ran on. The FedAvg and FedAvgM server steps are the classes
:class:`ServerAvg` and :class:`ServerAvgM` (keys ``fedavg``, ``fedavgm``; ``defenses.fedavg.FedAvg`` is the defense).

State lives in the optimizer object (the server); call :meth:`reset` at the start of a training run; its
``state_dict()`` (the fields not set at construction) is what a round checkpoint saves.
Client-side hooks (FedProx, SCAFFOLD) take the client's ``ClientState`` and keep client state in
``state.private``. SCAFFOLD's control-variate traffic cannot travel in a ``Message`` (its tensors must be
model parameters), so clients hand their delta c_i to :meth:`Scaffold.after_local` and the message meta
records the bytes this costs (``extra_up_bytes`` / ``extra_down_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Sequence, cast

import torch
from torch import Tensor

State = dict[str, Tensor]


@dataclass
class ServerAvg:
    """x <- x + lr * (target - x); lr = 1 is plain FedAvg."""

    name: ClassVar[str] = "fedavg"
    lr: float = 1.0

    def reset(self) -> None:
        """Forget all server state (start of a training run)."""

    def state_dict(self) -> dict[str, Any]:
        """The server state a round checkpoint saves (bench/checkpoint.py): the fields not set at construction."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.init}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    # ---- client side -----------------------------------------------------------------------
    def local_hooks(self, state, ctx, names: Sequence[str]) -> dict[str, Callable]:
        """Keyword arguments for :func:`bench.fl.local_train` (``loss_fn`` / ``on_step``)."""
        return {}

    def after_local(self, state, ctx, names: Sequence[str], start: State, sent: State, steps: int) -> dict[str, Any]:
        """Client bookkeeping after local training; returns public message meta."""
        return {}

    # ---- server side -----------------------------------------------------------------------
    def step(self, x: State, target: State) -> State:
        return {k: x[k] + self.lr * (target[k] - x[k]) for k in x}

    @property
    def plain_average(self) -> bool:
        """True when :meth:`step` returns ``target`` itself (lets callers skip forming x)."""
        return type(self).step is ServerAvg.step and self.lr == 1.0

    def end_round(self, ctx) -> None:
        """Server bookkeeping after the round's step (SCAFFOLD's control update)."""


@dataclass
class FedProx(ServerAvg):
    """FedAvg server; clients add the proximal term mu/2 ||w - w_global||^2 to their loss."""

    name: ClassVar[str] = "fedprox"
    mu: float = 0.01

    def local_hooks(self, state, ctx, names):
        anchor = {n: ctx.global_state[n].detach().clone() for n in names}
        base = ctx.task.loss
        mu = self.mu

        def loss_fn(model, batch):
            return base(model, batch) + FedProx.proximal_term(dict(model.named_parameters()), anchor, mu)

        return {"loss_fn": loss_fn}

    @staticmethod
    def proximal_term(params: Mapping[str, Tensor], anchor: Mapping[str, Tensor], mu: float) -> Tensor:
        return 0.5 * mu * cast(Tensor, sum(((params[n] - anchor[n]) ** 2).sum() for n in anchor))


@dataclass
class Scaffold(ServerAvg):
    """SCAFFOLD with control variates on the client's trained parameters (option II update)."""

    name: ClassVar[str] = "scaffold"
    c: State = field(default_factory=dict, init=False, repr=False)
    _pending: list[State] = field(default_factory=list, init=False, repr=False)

    def reset(self) -> None:
        self.c = {}
        self._pending = []

    def _server_c(self, names, ref: Mapping[str, Tensor]) -> State:
        for n in names:
            if n not in self.c:
                self.c[n] = torch.zeros_like(ref[n])
        return self.c

    def local_hooks(self, state, ctx, names):
        c = self._server_c(names, ctx.global_state)
        ci = state.private.setdefault("scaffold_c", {})
        for n in names:
            ci.setdefault(n, torch.zeros_like(ctx.global_state[n]))
        corr = {n: c[n] - ci[n] for n in names}
        lr = ctx.fl.lr
        params = dict(state.model.named_parameters())

        def on_step(_step: int) -> None:
            with torch.no_grad():
                for n in names:
                    params[n].sub_(lr * corr[n])

        return {"on_step": on_step}

    def after_local(self, state, ctx, names, start, sent, steps):
        c = self._server_c(names, start)
        ci = state.private["scaffold_c"]
        k = max(int(steps), 1)
        delta = {}
        for n in names:
            new = ci[n] - c[n] + (start[n] - sent[n]) / (k * ctx.fl.lr)
            delta[n] = new - ci[n]
            ci[n] = new
        self._pending.append(delta)
        nbytes = int(sum(t.numel() * t.element_size() for t in delta.values()))
        return {"extra_up_bytes": nbytes, "extra_down_bytes": nbytes}

    def end_round(self, ctx) -> None:
        n_total = ctx.fl.num_clients
        for d in self._pending:
            for n, t in d.items():
                self.c[n] = self.c.get(n, torch.zeros_like(t)) + t / n_total
        self._pending = []


@dataclass
class ServerAvgM(ServerAvg):
    """Server momentum (Hsu et al. 2019): v <- beta v + Delta, x <- x + lr v."""

    name: ClassVar[str] = "fedavgm"
    momentum: float = 0.9
    v: State = field(default_factory=dict, init=False, repr=False)

    def reset(self) -> None:
        self.v = {}

    def step(self, x, target):
        out = {}
        for k in x:
            d = target[k] - x[k]
            self.v[k] = self.momentum * self.v[k] + d if k in self.v else d
            out[k] = x[k] + self.lr * self.v[k]
        return out


@dataclass
class _Adaptive(ServerAvg):
    """Reddi et al. 2021, Alg. 2 (no bias correction; v starts at tau^2)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    m: State = field(default_factory=dict, init=False, repr=False)
    v: State = field(default_factory=dict, init=False, repr=False)

    def reset(self) -> None:
        self.m, self.v = {}, {}

    def _second(self, v: Tensor, d2: Tensor) -> Tensor:
        raise NotImplementedError

    def step(self, x, target):
        out = {}
        for k in x:
            d = target[k] - x[k]
            m = self.m.get(k, torch.zeros_like(d))
            v = self.v.get(k, torch.full_like(d, self.tau**2))
            m = self.beta1 * m + (1 - self.beta1) * d
            v = self._second(v, d * d)
            self.m[k], self.v[k] = m, v
            out[k] = x[k] + self.lr * m / (v.sqrt() + self.tau)
        return out


@dataclass
class FedAdagrad(_Adaptive):
    name: ClassVar[str] = "fedadagrad"

    def _second(self, v, d2):
        return v + d2


@dataclass
class FedYogi(_Adaptive):
    name: ClassVar[str] = "fedyogi"

    def _second(self, v, d2):
        return v - (1 - self.beta2) * d2 * torch.sign(v - d2)


@dataclass
class FedAdam(_Adaptive):
    name: ClassVar[str] = "fedadam"

    def _second(self, v, d2):
        return self.beta2 * v + (1 - self.beta2) * d2


SERVER_OPTIMIZERS: dict[str, type[ServerAvg]] = {
    c.name: c for c in (ServerAvg, FedProx, Scaffold, ServerAvgM, FedAdagrad, FedYogi, FedAdam)
}


def make_server_opt(name: str, **params: Any) -> ServerAvg:
    """Build a server optimizer by name; ``params`` not accepted by that optimizer and None values are ignored
    (so a defense can pass all its optimizer fields)."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"unknown server optimizer {name!r}; valid: {', '.join(SERVER_OPTIMIZERS)}")
    cls = SERVER_OPTIMIZERS[name]
    accepted = {f.name for f in fields(cls) if f.init}
    return cls(**{k: v for k, v in params.items() if k in accepted and v is not None})
