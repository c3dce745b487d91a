"""Run state lives off the defense configs: one config crossed with tasks of different deltas records each
task's own delta and epsilon, and the config object is never mutated (issue 14 s.2)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench.accounting import composed_epsilon, gaussian_sigma, privacy_record
from bench.fl import run_federated
from bench.run_state import new_run, resolve_delta, run_of
from bench.runner import run
from bench.store import Store
from bench.types import FLConfig, RoundCtx
from defenses.dp_fedlora import DPFedLoRA
from defenses.dp_gaussian import DPGaussian
from defenses.fedavg import FedAvg
from defenses.smp_lora import SMPLoRA
from tests.toy import ToyLossMIA, toy_task

DELTAS = {"loose": 0.5, "tight": 1e-5}  # loose first: the old bug carried 0.5 into the next task


def task_with_delta(variant: str, delta: float):
    """The toy task under another variant name, with a scenario dp_delta and client sampling 2 of 3."""
    t = toy_task(rounds=2)
    api = dataclasses.replace(t.api, dp_delta=delta)
    return dataclasses.replace(
        t,
        variant=variant,
        api=api,
        fl=dataclasses.replace(t.fl, clients_per_round=2),
        config={**t.config, "dp_delta": delta},
    )


def locked(defense):
    """The same configuration, as an instance that raises on any attribute write (a frozen config)."""

    def refuse(self, name, value):
        raise dataclasses.FrozenInstanceError(f"run state written onto the config: {name}")

    cls = type(f"Locked{type(defense).__name__}", (type(defense),), {"__setattr__": refuse, "__delattr__": refuse})
    obj = object.__new__(cls)
    obj.__dict__.update(vars(defense))
    return obj


def test_two_tasks_with_different_deltas_through_one_defense_instance(tmp_path):
    tasks = [task_with_delta(v, d) for v, d in DELTAS.items()]
    defense = DPGaussian(eps=2.0)
    before = dataclasses.asdict(defense)

    run(tasks, [locked(defense)], [ToyLossMIA()], [0], tmp_path)

    recs = [r for r in Store(tmp_path).records() if r["defense"] == "dp_gaussian"]
    assert {r["task"] for r in recs} == {"toy/loose", "toy/tight"}
    for r in recs:
        assert r["status"] == "ok", r.get("reason")
        delta = DELTAS[r["task"].split("/")[1]]
        pv = r["privacy"]
        z = gaussian_sigma(2.0, delta, 1.0) / 1.0  # sigma calibrated at this task's delta, clip 1
        assert pv["delta"] == delta and pv["epsilon"] == 2.0
        assert pv["sample_rate"] == pytest.approx(2 / 3) and pv["rounds"] == 2
        assert pv["epsilon_composed"] == pytest.approx(composed_epsilon(z, 2 / 3, 2, delta), rel=1e-9)
        assert pv["epsilon_composed_no_amplification"] == pytest.approx(composed_epsilon(z, 1.0, 2, delta), rel=1e-9)
        assert pv["epsilon_composed_no_amplification"] > pv["epsilon_composed"]
        assert "client-level" in pv["sensitivity"]
        assert ("no meaningful guarantee" in pv["note"]) == (delta == 0.5)
    assert dataclasses.asdict(defense) == before
    assert set(vars(defense)) == {f.name for f in dataclasses.fields(defense)}  # no private attributes


def test_each_training_run_calibrates_sigma_at_its_own_delta():
    defense = locked(DPGaussian(eps=1.0, clip=0.5))
    for variant, delta in DELTAS.items():
        _, res = run_federated(task_with_delta(variant, delta), defense, seed=0)
        sigmas = [m["meta"]["sigma"] for m in res.transcript]
        assert sigmas and sigmas == pytest.approx([gaussian_sigma(1.0, delta, 0.5)] * len(sigmas))


def test_a_configured_delta_wins_over_the_scenarios():
    loose = task_with_delta("loose", 0.5)
    assert resolve_delta(DPGaussian(delta=1e-3), loose.api) == 1e-3
    assert resolve_delta(DPGaussian(), loose.api) == 0.5
    assert resolve_delta(DPGaussian(), None) == 1e-5
    # SMP-LoRA's delta is Eq. 10's stabiliser, not a DP delta: it must not become the run's delta
    assert resolve_delta(SMPLoRA(delta=0.3), loose.api) == 0.5


def test_server_optimizer_state_lives_in_the_run_not_the_config():
    d = DPFedLoRA(server_opt="fedavgm")
    before = dataclasses.asdict(d)
    r1, r2 = new_run(d, None), new_run(d, None)
    assert r1.state["server_opt"] is not r2.state["server_opt"]
    ctx = RoundCtx(round=0, rounds=1, fl=FLConfig(), task=None, generator=None, num_selected=1)
    assert ctx.run is None
    lone = run_of(d, ctx)  # a context without a run (a probe round) gets a fresh one, kept for the round
    assert run_of(d, ctx) is lone and lone.delta == d.delta
    assert dataclasses.asdict(d) == before
    assert set(vars(d)) == {f.name for f in dataclasses.fields(d)}
    hash(tuple(sorted(before.items())))  # plain values only: a config can be frozen and hashed


def test_privacy_record_without_dp_and_without_sampling():
    assert privacy_record(FedAvg(), delta=1e-5, rounds=3, sample_rate=0.5, names=None, n_samples=100) == {
        "epsilon": None,
        "epsilon_composed": None,
        "epsilon_composed_no_amplification": None,
        "delta": None,
        "sample_rate": None,
        "rounds": None,
        "sensitivity": "",
        "note": "",
    }
    pv = privacy_record(DPGaussian(eps=1.0), delta=1e-5, rounds=3, sample_rate=1.0, names=None, n_samples=100)
    assert pv["epsilon_composed"] == pv["epsilon_composed_no_amplification"]
    assert math.isfinite(pv["epsilon_composed"]) and pv["note"] == ""
