"""Benchmark: inverting gradients on N=4 targets in one batched optimisation vs one target at a time.

    python -m pytest tests/bench_inversion.py --benchmark-only -q

Same model (a narrow timm BasicBlock ResNet, 32 px, eval-mode BatchNorm), same targets, same number
of iterations; the second benchmark prints the ratio loop / batched (> 1 means batching pays).
Not collected by the default suite (the file name does not match ``test_*.py``). Runs with one
intra-op thread: on a shared 2-core machine, oversubscribed OpenMP threads made both variants an
order of magnitude slower and the ratio noise.
"""
from __future__ import annotations

import pytest
import torch

from attacks.inverting_gradients import InvertingGradients
from tests.test_reconstruction_attacks import client_gradient, observe, photo, task_api, tiny_resnet

N_TARGETS = 4
ITERATIONS = 10
_MEANS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def observations(one_thread):
    model = tiny_resnet()
    api = task_api("resnet34", tiny_resnet)
    obs = []
    for i, name in enumerate(("chelsea", "astronaut", "coffee", "rocket")[:N_TARGETS]):
        grads = client_gradient(model, photo(name), i, train=False)
        obs.append(observe(model, grads, api, model_mode="eval"))
    return obs


def _run(benchmark, fn, key: str) -> None:
    out = benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)
    assert len(out) == N_TARGETS and all(r.images.shape[0] == 1 for r in out)
    _MEANS[key] = benchmark.stats.stats.mean


@pytest.mark.benchmark(group="inverting_gradients")
def test_bench_batched_targets(benchmark, observations):
    attack = InvertingGradients(iterations=ITERATIONS)
    _run(benchmark, lambda: attack.run_batch(observations), "batched")


@pytest.mark.benchmark(group="inverting_gradients")
def test_bench_one_target_at_a_time(benchmark, observations, capsys):
    attack = InvertingGradients(iterations=ITERATIONS)
    _run(benchmark, lambda: [attack.run(o) for o in observations], "loop")
    if "batched" in _MEANS:
        ratio = _MEANS["loop"] / _MEANS["batched"]
        benchmark.extra_info["loop_over_batched"] = ratio
        with capsys.disabled():
            print(f"\ninverting gradients, {N_TARGETS} targets x {ITERATIONS} iterations: "
                  f"batched {_MEANS['batched']:.2f} s, one at a time {_MEANS['loop']:.2f} s, "
                  f"ratio loop/batched = {ratio:.2f}x")
