"""MP-LoRA / SMP-LoRA ([SMP-LoRA] Eq. 5, 6, 10; Alg. 1-2): the objectives and their gradients against
hand computation on toy tensors, the proxy's inner maximisation, and one run of each central LoRA
defense on the ldm-t2i smoke task."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bench.errors import UsageError
from bench.registry import DEFENSES, build
from bench.types import LoraSpec, TaskAPI
from defenses._lora_common import grad_norm, requires_ldm
from defenses.mp_lora import ProxyAttack, member_gain, mi_gain, mp_objective, signal_of, smp_objective

LAM, DELTA = 0.05, 1e-5


@pytest.fixture(scope="module")
def smoke_task():
    from bench.scenarios.ldm_t2i import build_task

    return build_task("smoke")


def test_mi_gain_matches_eq5_by_hand():
    # arrange: member logits give P(member) = 3/4 and 1/2; non-member logits give P(member) = 1/5
    lm = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    ln = torch.tensor([[math.log(4.0), 0.0]])
    # act
    g = mi_gain(lm, ln)
    # assert: 1/(2|S^m|) sum log h + 1/(2|S^nm|) sum log(1 - h)
    expected = 0.5 * (math.log(0.75) + math.log(0.5)) / 2 + 0.5 * math.log(0.8)
    assert float(g) == pytest.approx(expected, rel=1e-6)
    assert float(member_gain(lm)) == pytest.approx((math.log(0.75) + math.log(0.5)) / 2, rel=1e-6)


def test_mi_gain_is_zero_for_a_perfect_proxy_and_negative_otherwise():
    perfect = mi_gain(torch.tensor([[-50.0, 50.0]]), torch.tensor([[50.0, -50.0]]))
    chance = mi_gain(torch.zeros(3, 2), torch.zeros(3, 2))
    assert float(perfect) == pytest.approx(0.0, abs=1e-6)
    assert float(chance) == pytest.approx(math.log(0.5), rel=1e-6)


def _toy(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """L_ada = theta^2 + 1, G = log sigmoid(2 theta) (a proxy whose member logit margin is 2 theta)."""
    return theta.pow(2) + 1.0, F.logsigmoid(2 * theta)


def test_eq6_value_and_gradient_by_hand():
    theta = torch.tensor(0.3, requires_grad=True)
    loss, gain = _toy(theta)
    total = mp_objective(loss, gain, lam=LAM)
    (g,) = torch.autograd.grad(total, theta)
    t = 0.3
    sig = 1 / (1 + math.exp(-2 * t))
    assert float(total.detach()) == pytest.approx(t * t + 1 + LAM * math.log(sig), rel=1e-6)
    # d/dtheta: 2 theta + lambda * 2 (1 - sigmoid(2 theta))
    assert float(g) == pytest.approx(2 * t + LAM * 2 * (1 - sig), rel=1e-5)


def test_eq10_value_and_gradient_by_hand():
    theta = torch.tensor(-0.7, requires_grad=True)
    loss, gain = _toy(theta)
    total = smp_objective(loss, gain, lam=LAM, delta=DELTA)
    (g,) = torch.autograd.grad(total, theta)
    t = -0.7
    L, sig = t * t + 1, 1 / (1 + math.exp(-2 * t))
    G, dL, dG = math.log(sig), 2 * t, 2 * (1 - sig)
    D = 1 - LAM * G + DELTA
    assert float(total.detach()) == pytest.approx(L / D, rel=1e-6)
    # App. B / Eq. 13: mu' + nu' = dL / D + L * lambda * dG / D^2
    assert float(g) == pytest.approx(dL / D + L * LAM * dG / D**2, rel=1e-5)


def test_eq10_gradient_on_a_lora_pair_matches_eq15():
    # arrange: a 2x2 LoRA pair B A, L_ada = ||B A x - y||^2, G = mean log sigmoid(w . (B A x))
    torch.manual_seed(0)
    A = torch.randn(1, 2, requires_grad=True)
    B = torch.randn(2, 1, requires_grad=True)
    x, y, w = torch.randn(2, 1), torch.randn(2, 1), torch.randn(2)
    out = B @ A @ x
    L = (out - y).pow(2).sum()
    G = F.logsigmoid(w @ out.squeeze(1))
    # act
    gA, gB = torch.autograd.grad(smp_objective(L, G, lam=LAM, delta=DELTA), (A, B))
    # assert: with M = BA, dL_SPL/dB = (mu' + nu') A^T and dL_SPL/dA = B^T (mu' + nu') (Eq. 15)
    M = (B @ A).detach().requires_grad_(True)
    o = M @ x
    mu = torch.autograd.grad((o - y).pow(2).sum(), M, retain_graph=True)[0]
    nu = LAM * torch.autograd.grad(F.logsigmoid(w @ o.squeeze(1)), M)[0]
    D = 1 - LAM * float(G.detach()) + DELTA
    total = mu / D + float(L.detach()) * nu / D**2
    assert torch.allclose(gB, total @ A.detach().T, atol=1e-5)
    assert torch.allclose(gA, B.detach().T @ total, atol=1e-5)


def test_proxy_has_the_papers_shape_and_outputs_two_logits():
    h = ProxyAttack(256)
    linears = [m for m in h.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(256, 512), (512, 256), (256, 2)]
    assert h(torch.randn(5, 256)).shape == (5, 2)


def test_inner_maximisation_raises_the_gain_on_a_separable_signal():
    torch.manual_seed(0)
    h = ProxyAttack(4, dropout=0.0)
    opt = torch.optim.Adam(h.parameters(), lr=1e-2)
    xm, xn = torch.randn(32, 4) - 1.0, torch.randn(32, 4) + 1.0  # members have lower losses
    before = float(mi_gain(h(xm), h(xn)))
    for _ in range(100):
        g = mi_gain(h(xm), h(xn))
        opt.zero_grad()
        (-g).backward()
        opt.step()
    after = float(mi_gain(h(xm), h(xn)))
    assert before < math.log(0.5) + 0.2 and after > -0.2


def test_signal_shapes():
    err = torch.rand(3, 4, 2, 2)
    assert signal_of(err, "map").shape == (3, 16)
    assert torch.allclose(signal_of(err, "loss")[:, 0], err.flatten(1).mean(1))
    with pytest.raises(ValueError):
        signal_of(err, "nope")


def test_grad_norm_is_the_l2_norm_over_all_parameters():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0, 0.0])
    assert grad_norm([a, b]) == pytest.approx(5.0)


def test_defenses_are_registered_central_with_paper_defaults():
    for name in ("lora", "mp_lora", "smp_lora"):
        assert DEFENSES.get(name).setting == "central"
    mp, smp = build(DEFENSES.get("mp_lora"), {}, "defense"), build(DEFENSES.get("smp_lora"), {}, "defense")
    assert mp.lam == 0.05 and smp.lam == 0.05 and smp.delta == 1e-5
    with pytest.raises(UsageError, match="delta"):
        build(DEFENSES.get("smp_lora"), {"delta": "0"}, "defense")


def test_applies_only_to_ldm_tasks():
    api = TaskAPI(
        name="x",
        family="llm-text",
        loss=lambda m, b: None,
        per_sample_loss=lambda m, b: None,
        collate=list,
        build_model=lambda: None,
        lora=LoraSpec(r=4, alpha=8.0, targets=("q_proj",)),
    )
    for name in ("lora", "mp_lora", "smp_lora"):
        d = build(DEFENSES.get(name), {}, "defense")
        assert d.applies(api) is not None
    assert requires_ldm(api) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "mp_lora", "smp_lora"])
def test_one_central_run_on_smoke(name, smoke_task):
    from bench.fl import run_federated

    d = build(DEFENSES.get(name), {}, "defense")
    assert d.applies(smoke_task.api) is None
    base = smoke_task.api.build_model()
    model, res = run_federated(smoke_task, d, seed=0)
    steps = math.ceil(len(smoke_task.central_data) / smoke_task.fl.batch_size) * smoke_task.central_epochs
    assert set(res.global_state) == {n for n, p in base.named_parameters() if p.requires_grad}
    assert all("lora_" in n for n in res.global_state)
    assert len(res.logs["grad_norm"]) == steps and len(res.logs["loss_ada"]) == steps
    # the LoRA moved, the frozen base did not
    trained = dict(model.named_parameters())
    moved = any(not torch.equal(t, dict(base.named_parameters())[n]) for n, t in res.global_state.items())
    assert moved
    frozen = [n for n, p in base.named_parameters() if not p.requires_grad]
    assert all(torch.equal(trained[n], dict(base.named_parameters())[n]) for n in frozen[:20])
    if name != "lora":
        assert len(res.logs["mi_gain"]) == steps and all(g <= 0 for g in res.logs["mi_gain"])
    if name == "smp_lora":  # Table 3's factor from the logged G on the training batch
        for g, r in zip(res.logs["mi_gain_train"], res.logs["rescale_ada"]):
            assert r == pytest.approx(1 / (1 - 0.05 * g + 1e-5), rel=1e-5)
            assert 0 < r <= 1


def central_lora_run(checkpoint=None) -> None:
    """The shared LoRA loop (3 epochs x 4 batches) on a toy linear model, inside a unit whose main loop has one
    round (a central defense's whole training), with ``checkpoint`` as its epoch checkpoint."""
    from types import SimpleNamespace

    from torch import nn
    from torch.utils.data import TensorDataset

    from bench.progress import progress
    from bench.types import FLConfig
    from defenses._lora_common import lora_loop

    torch.manual_seed(0)
    fl = FLConfig(num_clients=1, clients_per_round=1, rounds=1, local_epochs=3, batch_size=2, lr=0.1)
    ctx = SimpleNamespace(
        shared_names=["weight", "bias"],
        fl=fl,
        generator=torch.Generator().manual_seed(0),
        task=SimpleNamespace(collate=None),
        log_value=lambda k, v: None,
        log={},
        round=0,
        checkpoint=checkpoint,
    )
    state = SimpleNamespace(model=nn.Linear(2, 1), data=TensorDataset(torch.randn(8, 2)), client=0)
    for _ in progress(range(1), desc="train", unit=True):
        lora_loop(state, ctx, lambda m, b: (m(b[0]).pow(2).mean(), {}))


def test_a_central_lora_run_moves_the_run_bar_within_its_one_round(monkeypatch):
    # arrange: reporting every step
    import bench.progress
    from bench.progress import unit_progress

    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)
    reports: list = []

    # act
    with unit_progress(reports.append):
        central_lora_run()

    # assert: the fraction moves through the 3 epochs x 4 batches, never backwards, never to the end
    fractions = [r for r in reports if isinstance(r, float)]
    assert len(fractions) >= 3 * 4
    assert fractions == sorted(fractions) and 0.0 < max(fractions) < 1.0


def test_a_resumed_central_run_reports_its_restored_epochs_as_done_before(tmp_path):
    # arrange: the run stopped after its first epoch's checkpoint
    from bench.checkpoint import Checkpoint, restored_share
    from bench.progress import Resumed, unit_progress
    from tests.test_checkpoint import Stop, StopAfterSave

    path = tmp_path / "k.ckpt"
    with pytest.raises(Stop), unit_progress(lambda f: None):
        central_lora_run(StopAfterSave(path, "k", 0.0))
    assert restored_share(path) == pytest.approx(1 / 3)  # what a plan reads of it: one epoch of three, one round
    reports: list = []
    # act
    with unit_progress(reports.append):
        central_lora_run(Checkpoint(path, "k", math.inf))
    # assert: the restored epoch is the unit's first third, reported as done before this run
    restored = [r for r in reports if isinstance(r, Resumed)]
    assert restored == [Resumed(pytest.approx(1 / 3))]
    assert all(r == 0.0 for r in reports[: reports.index(restored[0])])  # only the round loop's start before it
