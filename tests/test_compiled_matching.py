"""The compiled inverting-gradients iteration (attacks/_compiled_matching.py) against the eager one.

Both paths compute the same input gradient of the same matching loss; the compiled one reassociates
floating-point sums, so gradients agree to a tolerance (compared before the sign step, where a near-zero
component could flip). One compile of a tiny train-mode BatchNorm net runs in the default suite; the
weights-message and adaptive variants compile further graphs and are marked slow.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attacks import _compiled_matching as cm
from attacks.inverting_gradients import COMPILE_MIN_ITERATIONS, InvertingGradients
from tests.benchlib import one_thread  # noqa: F401 - the fixture
from tests.test_reconstruction_attacks import (
    _bn_observations,
    client_gradient,
    lenet,
    observe,
    photo,
    task_api,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py: tiny models, one intra-op thread


def _first_gradients(attack: InvertingGradients, obs) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration's unsigned input gradient from the eager and the compiled path, same start."""
    job = attack._prepare(obs)
    eager = attack.start(job, restart=0, iterations=10)
    fused = attack.start(job, restart=0, iterations=10, engine="compiled")
    assert fused.engine == "compiled" and fused.fused is not None
    _, used, vs = eager.match.cotangents(eager.update(eager.X, eager.y))
    keep = [k for k, u in enumerate(used) if u.requires_grad]
    want = torch.autograd.grad([used[k] for k in keep], [eager.X], grad_outputs=[vs[k] for k in keep])[0]
    got = fused._fused_grad(fused.X)
    assert got is not None, fused.engine
    return got, want


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max())), float((got - want).abs().max())


def test_compiled_iteration_equals_the_eager_one_on_train_mode_batchnorm():
    """Arrange a batch-1 client gradient of a BatchNorm CNN in train mode; act: one compiled and one eager
    iteration from the same start; assert the same input gradient and, after a few steps, nearby iterates."""
    model, _, grads, api = _bn_observations()
    attack = InvertingGradients(iterations=10, compiled="on")
    got, want = _first_gradients(attack, observe(model, grads, api))
    _close(got, want)
    job = attack._prepare(observe(model, grads, api))
    runs = [attack.start(job, restart=0, iterations=10, engine=e) for e in ("eager", "compiled")]
    for _ in range(3):
        for r in runs:
            r.step()
    assert runs[1].engine == "compiled"
    assert (runs[0].X - runs[1].X).abs().max() < 0.05  # signed steps of lr 0.1: agree but for rare sign flips


def test_auto_compiles_only_cells_with_enough_iterations():
    """``compiled="auto"``: a short run (smoke, conformance) stays eager, a cell reaching
    COMPILE_MIN_ITERATIONS compiles; the record's details say which engine ran."""
    model, _, grads, api = _bn_observations()
    short = InvertingGradients(iterations=2).run(observe(model, grads, api))
    assert short.details["engine"] == "eager"
    attack = InvertingGradients(iterations=COMPILE_MIN_ITERATIONS)
    job = attack._prepare(observe(model, grads, api))
    assert attack.start(job, restart=0, iterations=2, engine="compiled").engine == "compiled"
    off = InvertingGradients(iterations=COMPILE_MIN_ITERATIONS, compiled="off")
    assert off.start(job, restart=0, iterations=2).engine == "eager"


def test_without_a_compiler_auto_runs_eager_and_on_refuses(monkeypatch):
    model, _, grads, api = _bn_observations()
    monkeypatch.setattr(cm.shutil, "which", lambda name: None)
    job = InvertingGradients()._prepare(observe(model, grads, api))
    run = InvertingGradients(compiled="auto").start(job, restart=0, iterations=2, engine="compiled")
    assert run.fused is None and run.engine.startswith("eager (no C++ compiler")
    with pytest.raises(RuntimeError, match="compiled='on'"):
        InvertingGradients(compiled="on").start(job, restart=0, iterations=2, engine="compiled")


def test_a_failed_auto_compile_falls_back_to_eager_and_says_so():
    model, _, grads, api = _bn_observations()
    attack = InvertingGradients(iterations=3)
    run = attack.start(attack._prepare(observe(model, grads, api)), restart=0, iterations=3, engine="compiled")

    def broken(x):
        raise RuntimeError("inductor exploded")

    run.fused = broken
    run.step()
    assert run.fused is None and "compile failed: RuntimeError: inductor exploded" in run.engine
    strict = dataclasses.replace(attack, compiled="on")
    run = strict.start(strict._prepare(observe(model, grads, api)), restart=0, iterations=3, engine="compiled")
    run.fused = broken
    with pytest.raises(RuntimeError, match="inductor exploded"):
        run.step()


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["weights_unrolled", "masked", "per_param", "sign"])
def test_compiled_variants_equal_the_eager_ones(variant):
    """The weights message unrolled over local steps, FLRSP's adaptive zero mask, the sign pairing of an Adam
    client's one-step update, the layer-wise cosine (on a net without BatchNorm: with batch-1 train-mode
    BatchNorm the bias before it has a gradient of rounding noise, whose layer-wise cosine amplifies
    reassociation differences to O(1))."""
    model, x, grads, api = _bn_observations()
    if variant == "per_param":
        model = lenet()
        grads = client_gradient(model, x, 3)
        obs = observe(model, grads, task_api("cnn", lenet))
        attack = InvertingGradients(compiled="on", similarity="per_param")
    elif variant == "sign":  # an Adam client's one-step update: the gradient's signs
        glob = {n: p.detach().clone() for n, p in model.named_parameters()}
        weights = {n: glob[n] - 0.01 * grads[n].sign() for n in glob}
        obs = observe(model, weights, api, kind="weights", global_state=glob, lr=0.01, local_steps=1, optimizer="adam")
        attack = InvertingGradients(compiled="on")
    elif variant == "weights_unrolled":
        glob = {n: p.detach().clone() for n, p in model.named_parameters()}
        weights = {n: glob[n] - 0.01 * grads[n] for n in glob}
        obs = observe(model, weights, api, kind="weights", global_state=glob, lr=0.01, local_steps=2)
        attack = InvertingGradients(compiled="on")
    else:
        other = client_gradient(model, photo("astronaut"), 5)
        sent = {n: torch.where(torch.rand_like(g) > 0.5, other[n], torch.zeros(())) for n, g in grads.items()}
        obs = observe(model, sent, api)
        attack = InvertingGradients(compiled="on", mask_zeros=True)
    got, want = _first_gradients(attack, obs)
    _close(got, want)
