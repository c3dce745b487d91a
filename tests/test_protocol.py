"""The membership protocol (bench/cells.py): candidates drawn from the seed alone and shared by every
defense, view and the base model; the attacker's aux split disjoint and handed only to attacks that use
it; the client view pools every client's own members; ASR thresholds chosen on aux data. Reconstruction
(bench/recon_cells.py): the targets are the task's, whatever the defense or seed, and records name them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from attacks.loss_mia import LossMIA
from bench.cells import assign_nonmembers, best_threshold, run_membership, split_candidates
from bench.fl import run_federated
from bench.matrix import Cell, plan
from bench.metrics import held_out_scores
from bench.recon_cells import PROBE_PROTOCOL, probe_observations, run_reconstruction, target_ids
from bench.types import Public, Reconstructions, Scores
from defenses.fedavg import FedAvg
from defenses.fixed_position import FixedPosition
from defenses.flrsp import FLRSP
from tests.toy import ToyLossMIA, toy_task


@dataclass
class Spy(ToyLossMIA):
    """The toy loss attack, recording what each call observed."""

    name = "spy"

    def __post_init__(self):
        self.calls = []

    def run(self, obs, candidates):
        self.calls.append({"public": obs.public, "candidates": list(candidates), "seed": obs.seed})
        return super().run(obs, candidates)


@dataclass
class AuxSpy(Spy):
    name = "aux_spy"
    uses_aux = True


@pytest.fixture(scope="module")
def trained():
    task = toy_task()
    return task, {d.name: (d, run_federated(task, d, seed=3)[1]) for d in (FedAvg(), FLRSP(R=0.5))}


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def test_split_depends_on_the_seed_only_and_keeps_aux_disjoint():
    # arrange / act
    a, b, c = split_candidates(300, 400, 250, 0), split_candidates(300, 400, 250, 0), split_candidates(300, 400, 250, 1)

    # assert: reproducible, seed-dependent, evaluation capped so the aux reserve stays, aux disjoint
    assert a == b and a.members != c.members
    assert len(a.members) == len(a.nonmembers) == 300 - 62
    assert not set(a.members) & set(a.aux_members) and not set(a.nonmembers) & set(a.aux_nonmembers)
    assert len(a.aux_members) == len(a.aux_nonmembers) == 62


def test_split_refuses_a_pool_too_small_to_leave_candidates():
    with pytest.raises(ValueError, match="too few candidates"):
        split_candidates(12, 400, 250, 0)


def test_every_defense_view_and_the_base_model_score_the_same_candidate_ids(trained):
    # arrange
    task, runs = trained
    ids = {}

    # act
    for view in ("global_model", "client_model"):
        ids[("base", view)] = run_membership(task, None, ToyLossMIA(), view, None, 3)["per_candidate"]["id"]
        for name, (d, res) in runs.items():
            ids[(name, view)] = run_membership(task, d, ToyLossMIA(), view, res, 3)["per_candidate"]["id"]

    # assert: one candidate list (same order) for every row; another seed draws other candidates
    first = next(iter(ids.values()))
    assert all(v == first for v in ids.values())
    assert len(first) == 2 * 16 and sum(i.startswith("m:") for i in first) == 16
    other = run_membership(task, None, ToyLossMIA(), "global_model", None, 4)["per_candidate"]["id"]
    assert other != first


def test_aux_split_reaches_only_attacks_that_use_it_and_is_disjoint_from_the_candidates(trained):
    # arrange
    task, runs = trained
    d, res = runs["fedavg"]
    plain, aux = Spy(), AuxSpy()

    # act
    run_membership(task, d, plain, "global_model", res, 3)
    run_membership(task, d, aux, "global_model", res, 3)

    # assert: the scoring call of the plain attack sees no aux data (its second call is the harness's
    # threshold calibration on the aux split); the aux attack's aux items are never candidates
    assert plain.calls[0]["public"] == Public()
    got = aux.calls[0]["public"]
    assert len(got.aux_members) == len(got.aux_nonmembers) == 8
    cands = aux.calls[0]["candidates"]
    for item in [*got.aux_members, *got.aux_nonmembers]:
        assert not any(_same(item, c) for c in cands)
    assert {c["seed"] for c in plain.calls + aux.calls} == {3}


@dataclass
class LiveModels(ToyLossMIA):
    """The toy loss attack, counting at each call how many of the models it was handed earlier are alive."""

    name = "live_models"

    def __post_init__(self):
        self.seen, self.alive = [], []

    def run(self, obs, candidates):
        import gc
        import weakref

        gc.collect()
        self.alive.append(sum(r() is not None for r in self.seen))
        self.seen.append(weakref.ref(obs.model))
        return super().run(obs, candidates)


def test_client_view_holds_one_clients_model_at_a_time(trained):
    # arrange
    task, runs = trained
    d, res = runs["fedavg"]
    spy = LiveModels()

    # act
    run_membership(task, d, spy, "client_model", res, 3)

    # assert: 3 clients, each scored twice (candidates, then the aux split for the ASR threshold); at each
    # call at most the current client's model is alive (a client view of an LLM holds one, not every client's)
    assert len(spy.seen) == 6
    assert spy.alive == [0, 1, 0, 1, 0, 1]


def test_client_view_pools_every_client_fixed_across_defenses(trained):
    # arrange
    task, runs = trained
    spies = {name: Spy() for name in runs}

    # act
    recs = {name: run_membership(task, d, spies[name], "client_model", res, 3) for name, (d, res) in runs.items()}

    # assert: every client scored, with the same candidates per client under both defenses
    assert all(r["clients"] == [0, 1, 2] for r in recs.values())
    per_call = {
        name: [[(c[0].sum().item(), c[1]) for c in call["candidates"]] for call in s.calls[::2]]
        for name, s in spies.items()
    }
    assert per_call["fedavg"] == per_call["flrsp"]
    assert sum(len(c) for c in per_call["fedavg"]) == 2 * 16


def test_asr_threshold_comes_from_aux_data_and_the_oracle_is_named(trained):
    # arrange
    task, runs = trained
    d, res = runs["fedavg"]

    # act
    plain = run_membership(task, d, ToyLossMIA(), "global_model", res, 3)["metrics"]
    aux = run_membership(task, d, AuxSpy(), "global_model", res, 3)["metrics"]
    proxy = run_membership(task, d, LossMIA(method="proxy", epochs=5), "global_model", res, 3)["metrics"]

    # assert: no "asr" picked on the evaluation set; asr_aux for the threshold attack; none for an attack
    # that trained on its aux data and exposed no held-out calibration scores; asr_aux for one that did
    assert "asr" not in plain and "asr_oracle" in plain
    assert 0 <= plain["asr_aux"]["ci_low"] <= plain["asr_aux"]["value"] <= plain["asr_aux"]["ci_high"] <= 1
    assert plain["asr_aux"]["value"] <= plain["asr_oracle"]["value"] + 1e-9
    assert "asr_aux" not in aux
    assert 0 <= proxy["asr_aux"]["value"] <= 1  # a classifier attack's held-out aux scores set its threshold


def test_calibration_scores_set_the_threshold():
    # arrange: aux members score 2..3, non-members 0..1: any threshold in (1, 2] separates them
    t = best_threshold(np.array([2.0, 3.0]), np.array([0.0, 1.0]))

    # assert
    assert 1.0 < t <= 2.0


def test_nonmembers_follow_each_client_label_histogram_one_per_member():
    # arrange: client 0 holds label-0 members, client 1 label-1 ones
    m_labels = {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}
    n_labels = {10: 1, 11: 0, 12: 1, 13: 0, 14: 1}

    # act
    out = assign_nonmembers([[0, 1], [2, 3, 4]], m_labels, [10, 11, 12, 13, 14], n_labels)

    # assert
    assert [[n_labels[i] for i in g] for g in out] == [[0, 0], [1, 1, 1]]


def test_plan_runs_the_base_model_in_every_membership_view():
    task = toy_task()
    cells = plan([task], [FedAvg()], [ToyLossMIA()], [0])
    assert sorted(c.view for c in cells if c.defense is None) == ["client_model", "global_model"]


def test_held_out_scores_score_every_aux_item_once_with_a_model_that_never_saw_it():
    # arrange: a scorer that memorises its training items (1 if seen as a member, else 0)
    xm, xn = np.arange(10.0), np.arange(100.0, 112.0)

    def memoriser(m, n):
        seen = set(m.tolist())
        return lambda x: np.array([1.0 if v in seen else 0.0 for v in x])

    def midpoint(m, n):
        t = (m.mean() + n.mean()) / 2
        return lambda x: (x < t).astype(float)

    # act
    held = held_out_scores(memoriser, xm, xn, seed=0)
    general = held_out_scores(midpoint, xm, xn, folds=3, seed=0)

    # assert: out-of-fold, memorising tells nothing (every score 0); a rule that generalises separates
    assert held is not None and general is not None
    assert held[0].shape == (10,) and held[1].shape == (12,)
    assert not held[0].any() and not held[1].any()
    assert (general[0] == 1).all() and (general[1] == 0).all()
    assert held_out_scores(midpoint, xm[:1], xn, seed=0) is None  # one aux member: no fold split


def test_scores_calibration_field_defaults_empty():
    assert Scores({"s": torch.zeros(2)}).calibration == {}


# ----------------------------------------------------------------------------------------------
# reconstruction: the same targets for every defense and seed, named by stable ids


@dataclass
class _Blank:
    """A reconstruction attack that returns blank images (the harness's bookkeeping only)."""

    name = "blank"
    kind = "reconstruction"

    def run_batch(self, observations):
        return [Reconstructions(torch.zeros(1, *o.api.image.input_shape)) for o in observations]


def test_reconstruction_targets_and_their_ids_do_not_depend_on_the_defense_or_seed(tmp_path):
    # arrange
    from tests.conftest import smoke_tasks

    task = next(t for t in smoke_tasks("image-cls") if t.variant == "vit")
    defenses = (FedAvg(), FixedPosition(), FLRSP(R=0.5))
    probes = {(d.name, seed): probe_observations(task, d, seed) for d in defenses for seed in (0, 1)}

    # act
    out = run_reconstruction(task, _Blank(), probes[("flrsp", 1)], 1, tmp_path)

    # assert: one target list for every (defense, seed), named by the task's pinned ids, kept per target
    ids = target_ids(task)
    assert ids == list(task.config["recon_targets"]["items"]) and len(set(ids)) == len(ids) == len(task.recon_targets)
    first = next(iter(probes.values()))[1]
    assert all(len(t) == len(first) and all(_same(a, b) for a, b in zip(t, first)) for _, t in probes.values())
    # each probe is a batch-1 update made with the global model's BatchNorm statistics, and says so
    assert {o.public.batchnorm_stats for obs, _ in probes.values() for o in obs} == {"public"}
    # ... and a reconstruction record made another way is stale (the runner redoes it)
    assert Cell(task, FedAvg(), _Blank(), "client_update", 0).expected()["probe"] == PROBE_PROTOCOL
    pc = out["per_candidate"]
    assert pc["id"] == ids and out["primary"] == "ssim" and "member" not in pc
    assert pc["score"] == out["per_sample"]["ssim"] and pc["variants"]["psnr"] == out["per_sample"]["psnr"]
    # the negative control: random images scored on the same targets, near SSIM 0 (bench.controls)
    assert len(pc["variants"]["ssim_random"]) == len(ids) and abs(out["metrics"]["ssim_random"]["value"]) < 0.1


def test_a_scenario_that_changes_the_inversion_budget_makes_earlier_records_stale(tmp_path):
    # arrange: a smoke image-cls task at its own budget and the same task with another one
    from dataclasses import replace

    from attacks.inverting_gradients import InvertingGradients
    from bench.store import Store
    from tests.conftest import smoke_tasks
    from tests.test_store import record

    task = next(t for t in smoke_tasks("image-cls") if t.variant == "vit")
    other = replace(task, api=replace(task.api, image=replace(task.api.image, inversion_iterations=77)))
    ig, fixed = InvertingGradients(), InvertingGradients(iterations=60)
    store = Store(tmp_path)

    # act: the records a run at each budget writes (the expected fields are the skeleton's)
    at_own, at_other = (Cell(t, FedAvg(), ig, "client_update", 0) for t in (task, other))
    store.write(record(cell_id="a" * 16, **{k: v for k, v in at_own.expected().items() if v is not None}))
    store.write(record(cell_id="b" * 16, **{k: v for k, v in at_other.expected().items() if v is not None}))

    # assert: the smoke budget (60) is the one earlier records were made with, so it is not written; 77 is
    assert at_own.expected()["attack_resolved"] is None
    assert at_other.expected()["attack_resolved"] == {"iterations": 77} == at_other.skeleton()["attack_resolved"]
    assert "attack_resolved" not in at_own.skeleton()
    assert store.finished("toy", "a" * 16, expect=at_own.expected())  # an earlier record stays valid
    assert not store.finished("toy", "a" * 16, expect=at_other.expected())  # ... until the budget changes
    assert not store.finished("toy", "b" * 16, expect=at_own.expected())  # and back: the 77 record is stale
    assert Cell(other, FedAvg(), fixed, "client_update", 0).expected()["attack_resolved"] is None  # set, not resolved


class _Labelled(list):
    """A toy dataset (a list of (x, y)) that exposes its classes, as the scenarios' datasets do."""

    @property
    def labels(self) -> list[int]:
        return [int(y) for _, y in self]


def test_membership_records_name_each_candidates_class_for_the_one_run_audit():
    # arrange: the toy task with datasets that expose their classes
    from dataclasses import replace

    base = toy_task()
    task = replace(
        base, client_data=[_Labelled(c) for c in base.client_data], nonmembers=_Labelled(base.nonmembers or [])
    )
    # act
    pc = run_membership(task, None, ToyLossMIA(), "global_model", None, 3)["per_candidate"]
    plain = run_membership(base, None, ToyLossMIA(), "global_model", None, 3)["per_candidate"]
    # assert: every candidate's class, by id, from the pool it came from; none where the datasets have no classes
    pool = [it for c in task.client_data for it in c]
    want = [pool[int(i[2:])][1] if i[0] == "m" else task.nonmembers[int(i[2:])][1] for i in pc["id"]]
    assert pc["label"] == want and len(set(want)) > 1
    assert "label" not in plain


def test_a_changed_preset_reference_count_makes_rmia_records_stale(monkeypatch):
    # arrange: an RMIA cell that leaves R to the preset, and one that sets it
    import bench.matrix as matrix
    from attacks.rmia import RMIA

    task = toy_task()
    left, fixed = (Cell(task, FedAvg(), a, "global_model", 0) for a in (RMIA(), RMIA(n_reference=4)))

    # act: the preset default as every record was made with, then changed
    before = left.expected()["attack_resolved"]
    monkeypatch.setattr(matrix, "default_count", lambda preset: 3)
    after = left.expected()["attack_resolved"]

    # assert: absent while R is what earlier records used; recorded (so earlier records are stale) once it changes
    assert task.preset == "smoke" and before is None
    assert after == {"n_reference": 3} and fixed.expected()["attack_resolved"] is None
