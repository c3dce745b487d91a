"""FedSGD's server step: SGD keeps the plain update; an adaptive optimiser is central training on the mean gradient."""

import torch

from bench.fl import fedavg_aggregate
from bench.types import DefenseRun, FLConfig, Message, RoundCtx


def _round(fl: FLConfig, run: DefenseRun | None, state: dict, grads: list[torch.Tensor], r: int) -> dict:
    msgs = [Message(client=k, round=r, tensors={"w": g}, num_samples=1, kind="gradient") for k, g in enumerate(grads)]
    ctx = RoundCtx(round=r, rounds=3, fl=fl, task=None, generator=torch.Generator(), num_selected=2, run=run)  # type: ignore[arg-type]
    return fedavg_aggregate(state, msgs, ctx)


def test_fedsgd_with_adam_is_central_adam_on_the_mean_gradient():
    # arrange
    fl = FLConfig(lr=0.1, optimizer="adam", mode="fedsgd")
    run = DefenseRun(delta=1e-5)
    state = {"w": torch.tensor([1.0, -2.0])}
    grads = [[torch.tensor([1.0, 0.5]) * (4**r), torch.tensor([3.0, -0.5]) * (4**r)] for r in range(3)]
    ref = torch.nn.Parameter(state["w"].clone())
    opt = torch.optim.Adam([ref], lr=0.1)
    # act
    for r, g in enumerate(grads):
        state = _round(fl, run, state, g, r)
        ref.grad = (g[0] + g[1]) / 2
        opt.step()
    # assert: the moments carried over rounds (a fresh Adam each round would step by lr * sign)
    assert torch.allclose(state["w"], ref.detach(), atol=1e-7)
    fresh = torch.tensor([1.0, -2.0]) - 3 * 0.1 * torch.tensor([1.0, 0.0])  # lr * sign(g) per round
    assert not torch.allclose(state["w"], fresh, atol=1e-3)


def test_fedsgd_with_sgd_is_the_plain_step():
    fl = FLConfig(lr=0.5, optimizer="sgd", mode="fedsgd")
    out = _round(fl, DefenseRun(delta=1e-5), {"w": torch.tensor([1.0])}, [torch.tensor([2.0]), torch.tensor([4.0])], 0)
    assert torch.equal(out["w"], torch.tensor([1.0 - 0.5 * 3.0]))
