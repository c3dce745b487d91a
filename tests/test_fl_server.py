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


def test_cosine_schedule_starts_at_lr_halves_midway_and_decays():
    from bench.fl import round_lr

    fl = FLConfig(lr=0.2, lr_schedule="cosine")
    lrs = [round_lr(fl, r, 10) for r in range(10)]
    assert lrs[0] == 0.2 and abs(lrs[5] - 0.1) < 1e-12
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert round_lr(FLConfig(lr=0.2), 7, 10) == 0.2  # constant


def test_unknown_schedule_names_the_choices():
    import pytest

    from bench.fl import round_lr

    with pytest.raises(ValueError, match="constant, cosine"):
        round_lr(FLConfig(lr_schedule="step"), 0, 3)


def test_the_server_optimiser_follows_the_rounds_rate():
    # arrange: FedSGD with server Adam, the second round at half the rate
    fl = FLConfig(lr=0.1, optimizer="adam", mode="fedsgd")
    run = DefenseRun(delta=1e-5)
    state = {"w": torch.tensor([0.0])}
    state = _round(fl, run, state, [torch.tensor([1.0]), torch.tensor([1.0])], 0)
    # act
    half = FLConfig(lr=0.05, optimizer="adam", mode="fedsgd")
    after = _round(half, run, state, [torch.tensor([1.0]), torch.tensor([1.0])], 1)
    # assert: Adam's step with a constant gradient is lr * sign: 0.1 then 0.05
    assert torch.allclose(after["w"], torch.tensor([-0.15]), atol=1e-6)


def test_the_default_schedule_keeps_earlier_config_hashes():
    from bench.task import config_hash

    # the value before lr_schedule existed (records and caches are keyed by it)
    assert config_hash("t", "smoke", FLConfig(), {"a": 1}) == "543b17deb92cf736"
    assert config_hash("t", "smoke", FLConfig(lr_schedule="cosine"), {"a": 1}) != "543b17deb92cf736"


def test_the_run_seed_reaches_fedsgd_training_and_seed_0_keeps_its_batches_and_cache_key():
    # arrange: the toy task's model starts from the same weights for every seed (like a pretrained one)
    from bench.fl import run_federated
    from bench.store import stable_hash
    from bench.training import train_key
    from defenses.fedsgd import FedSGD
    from tests.toy import toy_task

    task, defense = toy_task(rounds=3), FedSGD()

    # act
    states = {s: run_federated(task, defense, s)[1].global_state for s in (0, 1, 2)}

    # assert: every seed trains its own model (once, all three were the same)
    for a, b in ((0, 1), (1, 2)):
        assert any(not torch.equal(states[a][k], states[b][k]) for k in states[a]), (a, b)
    legacy = {"task": task.id, "preset": task.preset, "config": task.config_hash(), "defense": "fedsgd"}
    assert train_key(task, defense, 0) == stable_hash({**legacy, "params": {}, "seed": 0})
    assert train_key(task, defense, 1) != stable_hash({**legacy, "params": {}, "seed": 1})
