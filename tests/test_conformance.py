"""Conformance: every registered defense and attack passes (no per-method test code needed), and the
checks catch broken ones (wrong shapes, NaN, raising, hidden randomness, in-place edits, bad epsilon)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from bench.conformance import (
    Report,
    attack_report,
    cap_budget,
    check_defense_config,
    defense_report,
    field_checks,
    utility_floor,
)
from bench.registry import ATTACKS, DEFENSES, build
from bench.types import Attack, Message, Observation, Reconstructions, Scores
from defenses.fedavg import FedAvg
from tests.toy import ToyLossMIA, ToyMeanRecon, toy_task


def _skip_if_nowhere(rep: Report) -> None:
    for c in rep.checks:
        if c.name == "applies" and c.status in ("FAIL", "SKIP") and "applies to no" in c.detail:
            pytest.skip(f"{rep.subject}: {c.detail}")


@pytest.mark.parametrize("name", DEFENSES.names())
def test_registered_defense_conforms(name):
    cls = DEFENSES.get(name)
    defense = build(cls, dict(cls.grid[0]), "defense")

    rep = defense_report(defense, None)

    _skip_if_nowhere(rep)
    assert not rep.failed, rep.render()
    assert {"train", "determinism", "shapes", "finite", "epsilon", "utility floor"} <= {c.name for c in rep.checks}


@pytest.mark.parametrize("name", ATTACKS.names())
def test_registered_attack_conforms(name):
    cls = ATTACKS.get(name)
    attack = build(cls, dict(cls.grid[0]), "attack")

    rep = attack_report(attack, None)

    _skip_if_nowhere(rep)
    assert not rep.failed, rep.render()
    assert any(c.name == "output" and c.status == "PASS" for c in rep.checks), rep.render()


# ----------------------------------------------------------------------------------------------
# the checks catch broken defenses (toy task: seconds)


@dataclass
class WrongShape(FedAvg):
    name = "wrong_shape"

    def client_step(self, state, ctx):
        msg = super().client_step(state, ctx)
        n = sorted(msg.tensors)[0]
        return Message(msg.client, msg.round, {**msg.tensors, n: msg.tensors[n].flatten()[:-1]}, msg.num_samples)


@dataclass
class NaNs(FedAvg):
    name = "nans"

    def client_step(self, state, ctx):
        msg = super().client_step(state, ctx)
        return Message(msg.client, msg.round, {k: v * math.nan for k, v in msg.tensors.items()}, msg.num_samples)


@dataclass
class Raising(FedAvg):
    name = "raising"

    def client_step(self, state, ctx):
        raise RuntimeError("client exploded")


@dataclass
class Unseeded(FedAvg):
    name = "unseeded"

    def client_step(self, state, ctx):
        msg = super().client_step(state, ctx)
        return Message(msg.client, msg.round, {k: v + random.random() for k, v in msg.tensors.items()}, msg.num_samples)


@dataclass
class InPlace(FedAvg):
    name = "in_place"

    def client_step(self, state, ctx):
        for t in ctx.global_state.values():
            t.add_(0.01)
        return super().client_step(state, ctx)


@dataclass
class BadEpsilon(FedAvg):
    name = "bad_epsilon"

    def epsilon(self, *, delta):
        return -1.0


@dataclass
class Scrambler(FedAvg):
    name = "scrambler"

    def aggregate(self, global_state, msgs, ctx):
        g = torch.Generator().manual_seed(ctx.round)
        return {n: 50 * torch.randn(t.shape, generator=g) for n, t in global_state.items()}


def _check(defense) -> Report:
    rep = Report(defense.name)
    check_defense_config(defense, toy_task(n=64), rep)
    return rep


def _status(rep: Report, name: str) -> str:
    return next(c.status for c in rep.checks if c.name == name)


def test_fedavg_passes_every_check_on_the_toy_task():
    rep = _check(FedAvg())

    assert not rep.failed, rep.render()
    assert _status(rep, "determinism") == "PASS" and _status(rep, "updates") == "PASS"


@pytest.mark.parametrize(
    "defense, check, needle",
    [
        (WrongShape(), "shapes", "has shape"),
        (NaNs(), "finite", "NaN"),
        (Raising(), "train", "client exploded"),
        (Unseeded(), "determinism", "differ between two runs"),
        (InPlace(), "isolation", "in place"),
        (BadEpsilon(), "epsilon", "must be None or >= 0"),
    ],
)
def test_broken_defense_is_reported_with_the_reason(defense, check, needle):
    rep = _check(defense)

    failed = {c.name: c.detail for c in rep.failed}
    assert check in failed, rep.render()
    assert needle in failed[check]
    assert "result: " in rep.render() and "check(s) failed" in rep.render()


def test_utility_floor_is_a_margin_on_the_held_out_loss():
    assert utility_floor(1.0, 2.0)[0] is True
    assert utility_floor(2.1, 2.0)[0] is True  # within 10%
    assert utility_floor(2.5, 2.0)[0] is False
    assert utility_floor(0.06, 0.0)[0] is False and utility_floor(0.04, 0.0)[0] is True  # absolute floor 0.05
    assert utility_floor(math.nan, 2.0)[0] is False


def test_utility_floor_fails_a_defense_that_destroys_the_model():
    rep = _check(Scrambler())

    assert "utility floor" in {c.name for c in rep.failed}, rep.render()


# ----------------------------------------------------------------------------------------------
# the checks catch broken attacks


@dataclass
class ShortScores(ToyLossMIA):
    name = "short_scores"

    def run(self, obs, candidates):
        return Scores({"s": torch.zeros(len(candidates) - 1)})


@dataclass
class NaNScores(ToyLossMIA):
    name = "nan_scores"

    def run(self, obs, candidates):
        return Scores({"s": torch.full((len(candidates),), math.nan)})


@dataclass
class WrongType(ToyLossMIA):
    name = "wrong_type"

    def run(self, obs, candidates):
        return Reconstructions(torch.zeros(1, 3, 8, 8))


@dataclass
class BadViews(Attack):
    name = "bad_views"
    views = ("the_server_database",)
    kind = "membership"

    def run(self, obs, candidates):
        return Scores({"s": torch.zeros(len(candidates))})


@dataclass
class BadResolved(ToyLossMIA):
    name = "bad_resolved"
    window: int = 3

    def resolved(self, task):  # a set field (window=3), so nothing is left to the task
        return {"window": 5}


@pytest.mark.parametrize(
    "attack, check, needle",
    [
        (ShortScores(), "output", "has shape"),
        (NaNScores(), "output", "NaN"),
        (WrongType(), "output", "expected Scores"),
        (BadViews(), "views", "the_server_database"),
        (BadResolved(), "resolved", "not a None field"),
    ],
)
def test_broken_attack_is_reported(attack, check, needle):
    rep = attack_report(attack, None)

    failed = {c.name: c.detail for c in rep.failed}
    assert check in failed, rep.render()
    assert needle in failed[check]


# ----------------------------------------------------------------------------------------------
# declarations on the Attack contract: budget caps, required task fields, run_batch


@dataclass
class Iterative(ToyLossMIA):
    name = "iterative"
    iterations: int | None = 500
    restarts: int = 4
    budget = {"iterations": 10}


@dataclass
class BadDeclarations(ToyLossMIA):
    name = "bad_declarations"
    budget = {"iterations": 10}  # not one of its fields
    requires = ("pixels",)  # not a TaskAPI field


def test_an_attack_is_capped_by_its_own_budget_declaration():
    capped, notes = cap_budget(Iterative())

    assert (capped.iterations, capped.restarts) == (10, 4) and notes == ["iterations 500->10"]
    assert cap_budget(Iterative(iterations=None))[0].iterations == 10  # None ("the scenario's") is capped too
    assert cap_budget(Iterative(iterations=3)) == (Iterative(iterations=3), [])
    assert cap_budget(ToyLossMIA()) == (ToyLossMIA(), [])  # declares no budget: unchanged


def test_bad_budget_and_requires_declarations_are_reported():
    rep = Report("bad")

    field_checks(rep, BadDeclarations, "attack")

    failed = {c.name: c.detail for c in rep.failed}
    assert "iterations=10" in failed["budget"] and "pixels" in failed["requires"]


def test_run_batch_defaults_to_run_on_each_observation():
    api = toy_task().api
    obs = [Observation("client_update", None, None, api, seed=s) for s in (0, 1)]

    outs = ToyMeanRecon().run_batch(obs)

    assert len(outs) == 2 and all(isinstance(o, Reconstructions) and o.images.shape == (1, 3, 8, 8) for o in outs)
