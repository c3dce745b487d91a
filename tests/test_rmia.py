"""RMIA / offline LiRA ([RMIA], [LiRA]): the score functions on constructed likelihoods, the reference
models' cache and population split, and positive / negative controls on a toy task with population data."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_curve

from attacks.loss_mia import LossMIA
from attacks.rmia import (
    RMIA,
    augmented,
    lira_offline_scores,
    logit_from_loss,
    offline_pr,
    queries_of,
    rmia_scores,
    tune_a,
)
from bench import reference as ref
from bench.cells import run_membership
from bench.fl import run_federated, split_clients
from bench.signal_cache import fingerprint
from bench.training import label
from bench.types import params_of
from defenses.fedavg import FedAvg
from tests.toy import toy_task

# ----------------------------------------------------------------------------------------------
# score functions on constructed likelihoods (hand-computed values in the comments)


def test_offline_pr_is_the_papers_linear_approximation():
    p_refs = torch.tensor([[0.4]])  # one candidate, one OUT model: p = 0.4

    got = offline_pr(p_refs, 0.5)

    assert got.item() == pytest.approx(0.5 * (1.5 * 0.4 + 0.5))  # ((1+a) p_out + (1-a)) / 2 = 0.55


def test_rmia_scores_count_the_z_with_a_likelihood_ratio_above_gamma():
    p_x, p_x_refs = torch.tensor([0.8, 0.2]), torch.tensor([[0.4], [0.4]])
    p_z, p_z_refs = torch.tensor([0.5, 0.1]), torch.tensor([[0.5], [0.5]])
    # Pr(x) = 0.55 -> ratio_x = [1.4545, 0.3636]; Pr(z) = 0.625 -> ratio_z = [0.8, 0.16]
    # LR(x1, .) = [1.818, 9.091]; LR(x2, .) = [0.4545, 2.273]

    g1 = rmia_scores(p_x, p_x_refs, p_z, p_z_refs, a=0.5, gamma=1.0)
    g2 = rmia_scores(p_x, p_x_refs, p_z, p_z_refs, a=0.5, gamma=2.0)

    assert g1.tolist() == [1.0, 0.5]
    assert g2.tolist() == [0.5, 0.5]


def test_rmia_a_equal_one_uses_the_mean_of_the_reference_models():
    p_x, p_x_refs = torch.tensor([0.3]), torch.tensor([[0.2, 0.4]])  # Pr(x) = 0.3: ratio_x = 1
    p_z, p_z_refs = torch.tensor([0.1, 0.5, 0.9]), torch.tensor([[0.2, 0.2], [0.5, 0.5], [0.3, 0.3]])
    # ratio_z = [0.5, 1.0, 3.0]; LR = [2, 1, 1/3] >= 1 for two of three

    got = rmia_scores(p_x, p_x_refs, p_z, p_z_refs, a=1.0, gamma=1.0)

    assert got.item() == pytest.approx(2 / 3)


def _lm_like(n: int, seed: int):
    """Reference-model likelihoods of an LM-like signal (p ~ 0.01-0.1): an item's difficulty moves every model's
    p alike; a member's own model (column 0) gains a factor 1.3 on it. z: 200 OUT items."""
    g = torch.Generator().manual_seed(seed)
    hard = torch.empty(n).uniform_(-4.5, -2.3, generator=g)  # log p of the item under any OUT model
    member = torch.arange(n) < n // 2
    noise = 0.05 * torch.randn(n, 3, generator=g)
    p = torch.exp(hard[:, None] + noise)
    p[:, 0] *= torch.where(member, 1.3, 1.0)
    z = torch.exp(torch.empty(200).uniform_(-4.5, -2.3, generator=g)[:, None] + 0.05 * torch.randn(200, 3, generator=g))
    return p, member, z


def test_tuning_a_picks_the_reference_calibrated_ratio_for_small_likelihoods():
    p, member, pz = _lm_like(400, 0)
    out = torch.ones(400, 2, dtype=torch.bool)

    a, aurocs = tune_a(p, out, member, pz, gamma=1.0)

    # a = 0.3 leaves Pr(x) ~ 0.35 for every x: RMIA is the loss attack (the items' difficulty swamps the 1.3);
    # a = 1 divides the difficulty out
    assert a == 1.0 and set(aurocs) == {f"{i / 10:.1f}" for i in range(11)}
    assert aurocs["1.0"] > 0.95 and aurocs["0.3"] < 0.7, aurocs


def test_tuning_a_uses_only_each_items_out_references_and_ties_keep_the_smallest_a():
    p, member, pz = _lm_like(400, 1)
    out = torch.ones(400, 2, dtype=torch.bool)
    out[:, 1] = False  # the second other reference trained on every item: its column must not count
    p_bad = p.clone()
    p_bad[:, 2] = 1.0  # ... however wrong its likelihoods

    assert tune_a(p_bad, out, member, pz, gamma=1.0) == tune_a(p, out, member, pz, gamma=1.0)
    # constant likelihoods: every a ranks the same, the first (smallest) is kept
    flat = torch.full((4, 3), 0.5)
    a, _ = tune_a(flat, torch.ones(4, 2, dtype=torch.bool), torch.tensor([1, 1, 0, 0]).bool(), flat, gamma=1.0)
    assert a == 0.0
    with pytest.raises(ValueError, match="members and non-members"):
        tune_a(p, torch.zeros(400, 2, dtype=torch.bool), member, pz, gamma=1.0)


def test_logit_from_loss_is_the_logit_of_the_likelihood():
    loss = torch.tensor([math.log(2.0), -math.log(0.8)], dtype=torch.float64)  # p = 0.5 and 0.8

    got = logit_from_loss(loss)

    assert got.tolist() == pytest.approx([0.0, math.log(4.0)])


def test_lira_offline_is_a_one_sided_gaussian_test():
    phi_refs = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    sd = math.sqrt(2.0)  # per-candidate std of [0, 2] (unbiased)
    phi = torch.tensor([1.0 + sd, 1.0])
    # global std over [0, 2, 1, 1] (unbiased) = sqrt(2 / 3)
    g = math.sqrt(2 / 3)

    per = lira_offline_scores(phi[:1], phi_refs[:1], global_variance=False)
    glob = lira_offline_scores(phi, phi_refs, global_variance=True)

    assert per.item() == pytest.approx(math.log(0.8413447460685429))  # Phi(1)
    assert glob.tolist() == pytest.approx([math.log(0.5 * (1 + math.erf(sd / g / math.sqrt(2)))), math.log(0.5)])


# ----------------------------------------------------------------------------------------------
# population split and the reference cache


def test_population_split_is_disjoint_and_needs_two_training_sets():
    split = ref.population_split(20, 8, seed=3)
    r0, r1 = ref.reference_indices(split, 8, 3, 0), ref.reference_indices(split, 8, 3, 1)

    assert not set(split.train_pool) & set(split.z_pool)
    assert set(r0) <= set(split.train_pool) and len(set(r0)) == 8 and r0 != r1
    with pytest.raises(ValueError, match="population has 15 items"):
        ref.population_split(15, 8, seed=3)


def _population_task(*, n_members: int = 96, n_non: int = 96, n_pop: int = 256, seed: int = 0, rounds: int = 2):
    """The toy task of tests/toy.py with random-label members, non-members, test and population items of
    the same distribution (disjoint by construction)."""
    base = toy_task()
    g = torch.Generator().manual_seed(seed + 11)
    total = n_members + n_non + 32 + n_pop
    x, y = torch.randn(total, 3, 8, 8, generator=g), torch.randint(0, 4, (total,), generator=g).tolist()
    items = list(zip(x, y))
    train, non = items[:n_members], items[n_members : n_members + n_non]
    test, pop = items[n_members + n_non : n_members + n_non + 32], items[n_members + n_non + 32 :]
    parts = split_clients([t[1] for t in train], 3, None, seed)
    api = replace(base.api, population_size=n_pop)
    return replace(
        base,
        api=api,
        fl=replace(base.fl, rounds=rounds, local_epochs=3),
        client_data=[[train[i] for i in p] for p in parts],
        test_data=test,
        nonmembers=non,
        population=pop,
        max_membership=64,
        config={"test_rmia": seed, "rounds": rounds},
    )


def test_reference_runs_are_cached_and_reused(tmp_path):
    task, defense = _population_task(rounds=1), FedAvg()
    ref._MEMO.clear()

    first = ref.get_reference(task, defense, 0, 0, tmp_path)
    ref._MEMO.clear()
    files = sorted(p.name for p in (tmp_path / "reference").iterdir() if p.suffix != ".lock")
    again = ref.get_reference(task, defense, 0, 0, tmp_path)
    other = ref.get_reference(task, defense, 0, 1, tmp_path)

    assert sorted(f.rsplit(".", 1)[1] for f in files) == ["json", "safetensors"]  # one entry
    assert all(torch.equal(first.global_state[k], again.global_state[k]) for k in first.global_state)
    assert any(not torch.equal(first.global_state[k], other.global_state[k]) for k in first.global_state)


def test_reference_training_data_is_population_only():
    task, defense = _population_task(rounds=1), FedAvg()
    split = ref.population_split(len(task.population), 96, 0)
    items = [task.population[i] for i in ref.reference_indices(split, 96, 0, 0)]
    candidates = {fingerprint(it) for ds in (*task.client_data, task.nonmembers) for it in ds}

    rtask = ref.reference_task(task, defense, items)

    assert [len(c) for c in rtask.client_data] == [len(c) for c in task.client_data]
    assert not {fingerprint(it) for c in rtask.client_data for it in c} & candidates


def test_applies_needs_population_data():
    assert RMIA().applies(toy_task().api) is not None
    assert RMIA().applies(_population_task(rounds=1).api) is None


# ----------------------------------------------------------------------------------------------
# controls (toy task: seconds)


def _tpr_at(scores, member, fpr_max: float) -> float:
    fpr, tpr, _ = roc_curve(member, scores)
    return float(tpr[fpr <= fpr_max + 1e-12].max())


@pytest.fixture(scope="module")
def trained():
    task, defense = _population_task(), FedAvg()
    _, train = run_federated(task, defense, 0)
    return task, defense, train


def test_positive_control_rmia_beats_the_loss_threshold_on_the_undefended_toy(trained, tmp_path):
    task, defense, train = trained

    got = run_membership(task, defense, RMIA(), "global_model", train, 0, cache_root=tmp_path)
    base = run_membership(task, defense, LossMIA(), "global_model", train, 0)

    y = np.array(got["per_candidate"]["member"])
    n_non = int((y == 0).sum())
    lowest = 10 / n_non  # the lowest FPR with >= 10 expected false positives among the non-members
    tpr_rmia = _tpr_at(got["per_candidate"]["score"], y, lowest)
    tpr_loss = _tpr_at(base["per_candidate"]["score"], np.array(base["per_candidate"]["member"]), lowest)
    assert got["metrics"]["auroc"]["ci_low"] > 0.55, got["metrics"]["auroc"]
    assert got["metrics"]["auroc"]["value"] >= base["metrics"]["auroc"]["value"]
    assert tpr_rmia >= tpr_loss, (tpr_rmia, tpr_loss)
    assert got["reference"]["n_reference"] == 2 and got["reference"]["setting"] == "offline"


def test_positive_control_with_augmented_queries(trained, tmp_path):
    task, defense, train = trained

    got = run_membership(task, defense, RMIA(queries=4), "global_model", train, 0, cache_root=tmp_path)

    # members are detected; not asserted to beat the loss attack here: the toy images are random noise, whose
    # mirror or shift is just another noise image (on natural images the queries carry the member's signal)
    assert got["metrics"]["auroc"]["ci_low"] > 0.55, got["metrics"]["auroc"]
    assert len(got["attack_details"]["queries"]) == 4


@pytest.mark.parametrize("queries", [1, 4])
def test_negative_control_a_target_that_never_saw_the_members_is_at_chance(trained, tmp_path, queries):
    task, defense, _ = trained
    other = replace(task, client_data=[task.population[:32], task.population[32:64], task.population[64:96]])
    _, train_other = run_federated(other, defense, 0)  # trained on data disjoint from every candidate

    got = run_membership(task, defense, RMIA(queries=queries), "global_model", train_other, 0, cache_root=tmp_path)

    auroc = got["metrics"]["auroc"]
    assert auroc["ci_low"] <= 0.5 <= auroc["ci_high"], auroc


def test_the_tuning_data_are_reference_zeros_members_against_pool_items_it_did_not_draw():
    task, defense = _population_task(), FedAvg()
    for view, client in (("global_model", None), ("client_model", 1)):
        r = ref.Reference(task, defense, view, client, seed=0)
        n_train = sum(ref.training_sizes(task, defense))
        split = ref.population_split(len(task.population), n_train, 0)
        drawn = [ref.reference_indices(split, n_train, 0, k) for k in range(3)]
        pos = {fingerprint([x]): i for i, x in enumerate(task.population)}

        if view == "client_model":
            r._client_index = lambda k: 1  # type: ignore[method-assign] - no reference run trained in this test
        got = r.tuning(3, 10_000)

        mem = [pos[fingerprint([x])] for x in got.members]
        non = [pos[fingerprint([x])] for x in got.nonmembers]
        own = (
            drawn[0]
            if view == "global_model"
            else [drawn[0][i] for i in ref.client_parts(ref.training_sizes(task, defense), None, None, 0)[1]]
        )
        assert sorted(mem) == sorted(own)
        assert set(non) == set(split.train_pool) - set(drawn[0])
        assert got.out.tolist() == [[i not in drawn[1], i not in drawn[2]] for i in mem + non]
    assert ref.Reference(task, None, "global_model", None, seed=0).tuning(3, 10) is None  # base model: nothing to tune
    assert ref.Reference(task, defense, "global_model", None, seed=0).tuning(1, 10) is None


def test_a_tuned_rmia_record_states_the_a_it_chose_and_why(trained, tmp_path):
    task, defense, train = trained

    got = run_membership(task, defense, RMIA(), "global_model", train, 0, cache_root=tmp_path)
    fixed = run_membership(task, defense, RMIA(a=0.3), "global_model", train, 0, cache_root=tmp_path)

    rm = got["attack_details"]["rmia"]
    assert rm["a"] in [i / 10 for i in range(11)] and set(rm["a_from"]["auroc_by_a"]) == {
        f"{i / 10:.1f}" for i in range(11)
    }
    assert rm["a_from"]["auroc_by_a"][f"{rm['a']:.1f}"] == max(rm["a_from"]["auroc_by_a"].values())
    assert fixed["attack_details"]["rmia"]["a"] == 0.3 and fixed["attack_details"]["rmia"]["a_from"] == "set"
    assert "reference 0 as the target" in got["reference"]["a_tuning"]


def test_a_training_pool_every_reference_model_draws_whole_leaves_a_untuned(tmp_path):
    task = _population_task(n_members=24, n_non=24, n_pop=48, rounds=1)  # pool of 24 = one training set
    defense = FedAvg()
    _, train = run_federated(task, defense, 0)

    got = run_membership(task, defense, RMIA(), "global_model", train, 0, cache_root=tmp_path)

    rm = got["attack_details"]["rmia"]
    assert rm["a"] == 0.3 and rm["a_from"].startswith("not tuned (no member and non-member"), rm


def test_base_model_cells_use_the_base_model_as_reference(trained):
    task, _, _ = trained

    got = run_membership(task, None, RMIA(n_reference=1), "global_model", None, 0)

    auroc = got["metrics"]["auroc"]
    assert auroc["ci_low"] <= 0.5 <= auroc["ci_high"], auroc
    assert got["reference"]["recipe"].startswith("base model")


# ----------------------------------------------------------------------------------------------
# constants, budget and what the record states


def test_gamma_moves_saturation_but_never_reorders_candidates():
    g = torch.Generator().manual_seed(0)
    p_x, p_x_refs = torch.rand(40, generator=g), torch.rand(40, 2, generator=g)
    p_z, p_z_refs = torch.rand(30, generator=g), torch.rand(30, 2, generator=g)

    s1 = rmia_scores(p_x, p_x_refs, p_z, p_z_refs, a=0.3, gamma=1.0)
    s2 = rmia_scores(p_x, p_x_refs, p_z, p_z_refs, a=0.3, gamma=2.0)

    above = s1[:, None] > s1[None, :]  # every pair gamma = 1 orders strictly ...
    assert (s2[:, None] >= s2[None, :])[above].all()  # ... gamma = 2 never orders the other way
    assert (s2 <= s1).all() and (s2 < s1).any()  # a stricter threshold: fewer z beaten


def test_the_defaults_are_the_authors_and_a_conformance_run_caps_the_budget():
    from bench.conformance import cap_budget

    capped, notes = cap_budget(RMIA())

    assert (RMIA().gamma, RMIA().a, RMIA().n_population) == (1.0, None, None)  # a: tuned per cell, as the code does
    assert (capped.n_reference, capped.n_population, capped.timesteps) == (1, 64, 2), notes


class _Labeled(list):
    """A list dataset with per-item labels (as the scenarios' datasets carry them)."""

    def __init__(self, items):
        super().__init__(items)
        self.labels = [int(y) for _, y in items]


def _dirichlet_task(alpha: float | None = 0.5):
    task = _population_task(rounds=1)
    return replace(task, fl=replace(task.fl, dirichlet_alpha=alpha), population=_Labeled(task.population))


def test_reference_clients_follow_a_dirichlet_target_split():
    task, defense = _dirichlet_task(0.5), FedAvg()
    spec = ref.reference_spec(task, defense, 0, 1)
    want = split_clients(spec.labels, 3, 0.5, ref.ref_seed(0, 1))  # the target's split function and alpha

    rtask = ref.reference_task(task, defense, spec.items, labels=spec.labels, split_seed=ref.ref_seed(0, 1))

    got = [[y for _, y in c] for c in rtask.client_data]
    assert got == [[spec.labels[i] for i in part] for part in want]
    assert [len(c) for c in got] != [len(c) for c in task.client_data]  # not the IID chunks of the target's sizes
    assert spec.key != ref.reference_spec(_dirichlet_task(None), defense, 0, 1).key  # its own cache entry


def test_iid_reference_keys_and_chunks_are_unchanged_by_the_labels():
    task, defense = _dirichlet_task(None), FedAvg()
    spec = ref.reference_spec(task, defense, 0, 0)

    rtask = ref.reference_task(task, defense, spec.items)

    assert spec.labels is None
    assert [len(c) for c in rtask.client_data] == [len(c) for c in task.client_data]


def test_a_dirichlet_target_needs_population_labels():
    task = replace(_dirichlet_task(0.5), population=list(_population_task(rounds=1).population))

    with pytest.raises(ValueError, match="no `labels`"):
        ref.reference_spec(task, FedAvg(), 0, 0)


def test_train_reference_caches_once_and_keeps_nothing_in_memory(tmp_path):
    task, defense = _population_task(rounds=1), FedAvg()
    ref._MEMO.clear()

    first = ref.train_reference(task, defense, 0, 0, tmp_path)
    again = ref.train_reference(task, defense, 0, 0, tmp_path)

    assert (first, again) == (True, False) and not ref._MEMO
    assert ref.reference_cached(task, defense, 0, 0, tmp_path)
    assert not ref.reference_cached(task, defense, 0, 1, tmp_path)


# ----------------------------------------------------------------------------------------------
# the engine: reference runs are units of their own, scheduled before the cells that need them


class _Recording:
    """The inline executor, noting each unit it runs (kind, key, reference index) in order."""

    name = "inline"
    jobs = 1

    def __init__(self, fail_reference: bool = False, fail_train: bool = False):
        from bench.runner import InlineExecutor

        self.inner, self.seen = InlineExecutor(), []
        self.fail = {"reference"} if fail_reference else set()
        self.fail |= {"train"} if fail_train else set()

    def submit(self, unit):
        self.seen.append((unit.kind, unit.key, unit.ref_index))
        if unit.kind in self.fail:
            import concurrent.futures as cf

            fut = cf.Future()
            fut.set_result({"key": unit.key, "kind": unit.kind, "status": "failed", "reason": "boom", "written": False})
            return fut
        return self.inner.submit(unit)

    def shutdown(self, *, kill: bool = False) -> None:
        pass


def test_reference_runs_are_units_before_their_cells_and_planned(tmp_path, monkeypatch):
    import shutil

    from bench import signal_cache
    from bench.costs import CostModel
    from bench.runner import plan, run
    from bench.runplan import make_plan
    from bench.store import Store

    task, ex = _population_task(rounds=1), _Recording()
    cells = plan([task], [FedAvg()], [RMIA()], [0])
    pl = make_plan(cells, Store(tmp_path), CostModel(), jobs=2)
    markers: list = []  # what the cells' spilled passes held as they ran, for a plan after a kill
    write = signal_cache.write_marker
    monkeypatch.setattr(signal_cache, "write_marker", lambda p, f: (markers.append((p.stem, f)), write(p, f)))

    summary = run([task], [FedAvg()], [RMIA()], [0], tmp_path, executor=ex)
    assert markers and all(0 < f <= 1 for _, f in markers) and {k for k, _ in markers} <= {c.id for c in cells}
    assert not list((tmp_path / "cache" / "signals" / "cells").glob("*"))  # an ok cell's marker goes
    rec = next(r for r in Store(tmp_path).records() if r["defense"] == "fedavg" and r["view"] == "global_model")
    shutil.rmtree(tmp_path / "records")  # the cells lost, the training and reference runs cached
    again = make_plan(cells, Store(tmp_path), CostModel(), jobs=2)

    order = {key: i for i, (_, key, _) in enumerate(ex.seen)}
    refs = [(i, r) for i, (k, _, r) in enumerate(ex.seen) if k == "reference"]
    fedavg_cells = [order[c.id] for c in cells if c.defense is not None]
    assert (pl.references, pl.to_train_references) == (2, 2)
    assert "reference runs: 2 used by the cells to run, 2 to train (0 cached)" in pl.render()
    assert sorted(r for _, r in refs) == [0, 1] and max(i for i, _ in refs) < min(fedavg_cells)
    assert summary.counts["failed"] == 0 and summary.counts["ok"] == len(cells)
    assert (again.references, again.to_train_references, len(again.needs_training)) == (2, 0, 0)
    # the estimate and the measured worker time, each split by phase (training, reference runs, each attack)
    assert set(pl.est_by_phase) == {"training", "reference runs", "rmia"}
    assert sum(pl.est_by_phase.values()) == pytest.approx(pl.est_total_s)
    assert "work by phase: " in pl.render() and "reference runs " in pl.render()
    assert set(summary.by_phase) == {"training", "reference runs", "rmia"} and min(summary.by_phase.values()) > 0
    assert "reference runs: 2 used by the cells to run, 0 to train (2 cached)" in again.render()
    knows = rec["attack_details"]["attacker_knowledge"]
    assert knows["n_reference"] == 2 and knows["population_size"] == 256 and knows["reference_train_size"] == 96


def test_records_name_their_reference_runs_and_are_redone_when_one_is_retrained(tmp_path):
    # arrange: a finished RMIA matrix (training and 2 reference runs cached)
    from bench import cachefile
    from bench.runner import plan, run
    from bench.store import Store

    task = _population_task(rounds=1)
    run([task], [FedAvg()], [RMIA(), LossMIA()], [0], tmp_path)
    first = ref.identities(task, FedAvg(), 0, 2, tmp_path / "cache")
    stem = tmp_path / "cache" / "reference" / ref.reference_spec(task, FedAvg(), 0, 1).key
    n_rmia = sum(c.defense is not None and c.attack.name == "rmia" for c in plan([task], [FedAvg()], [RMIA()], [0]))

    # act: reference run 1 replaced (as retrained after a lost cache), then the matrix re-run
    tensors, meta = cachefile.load(stem, lambda t, m: (t, m), quarantine_dir=tmp_path / "q")
    name = next(iter(tensors))
    cachefile.save(stem, {**tensors, name: tensors[name] + 1.0}, meta)
    ref._MEMO.clear()
    plans: list = []
    again = run([task], [FedAvg()], [RMIA(), LossMIA()], [0], tmp_path, on_plan=plans.append)

    # assert: each fedavg RMIA record named both runs; only those are redone, now naming the new run 1
    now = ref.identities(task, FedAvg(), 0, 2, tmp_path / "cache")
    recs = [r for r in Store(tmp_path).records() if r["defense"] == "fedavg"]
    assert first is not None and now is not None and now[0] == first[0] and now[1] != first[1]
    assert again.counts["ok"] == n_rmia > 0 and plans[0].stale == n_rmia
    assert all(r["training"]["references"] == now for r in recs if r["attack"] == "rmia")
    assert all("references" not in r["training"] for r in recs if r["attack"] == "loss_mia")
    assert ref.made_with({"training": {"sha256": "0" * 16}}, now)  # a record from before revision 7


def test_records_scored_against_reference_runs_the_run_retrains_are_checked_again_after_them(tmp_path):
    # arrange: the global view's RMIA records, which name other reference runs (as records made on another CPU);
    # reference run 1 gone from the cache; the client view's RMIA cells still to do
    import json

    from bench.runner import run
    from bench.store import Store

    task = _population_task(rounds=1)
    run([task], [FedAvg()], [RMIA()], [0], tmp_path, views={"global_model"})
    paths = [p for p in (tmp_path / "records").glob("*/*.json") if json.loads(p.read_text())["defense"] == "fedavg"]
    for p in paths:
        rec = json.loads(p.read_text())
        p.write_text(json.dumps({**rec, "training": {**rec["training"], "references": ["0" * 16, "1" * 16]}}))
    for f in (tmp_path / "cache" / "reference").glob(ref.reference_spec(task, FedAvg(), 0, 1).key + "*"):
        f.unlink()
    ref._MEMO.clear()

    # act: the full matrix trains reference run 1 again for the client view's cells
    plans: list = []
    summary = run([task], [FedAvg()], [RMIA()], [0], tmp_path, on_plan=plans.append)

    # assert: the global view's records were redone against the runs now cached, in the same run
    now = ref.identities(task, FedAvg(), 0, 2, tmp_path / "cache")
    recs = [r for r in Store(tmp_path).records() if r["defense"] == "fedavg"]
    assert plans[0].to_recheck == len(paths) > 0 and plans[0].to_train_references == 1
    assert summary.counts["failed"] == 0 and len(recs) > len(paths)
    assert summary.counts["skipped"] == 1  # the base model's global-view record alone (no reference runs)
    assert now is not None and all(r["training"]["references"] == now for r in recs)


def test_a_failed_reference_run_fails_only_the_cells_that_need_it(tmp_path):
    from bench.runner import run
    from bench.store import Store

    task = _population_task(rounds=1)

    run([task], [FedAvg()], [RMIA(), LossMIA()], [0], tmp_path, executor=_Recording(fail_reference=True))

    status = {
        (r["defense"], r["attack"], r["view"]): (r["status"], r.get("reason", "")) for r in Store(tmp_path).records()
    }
    got, why = status[("fedavg", "rmia", "global_model")]
    assert got == "failed" and why.startswith("reference run ") and why.endswith(" failed: boom"), why
    assert status[("fedavg", "loss_mia", "global_model")][0] == "ok"
    assert status[("base", "rmia", "global_model")][0] == "ok"  # the base model is its own reference


def test_a_reference_run_whose_cells_failed_with_their_training_run_is_not_trained(tmp_path):
    from bench.runner import run
    from bench.store import Store

    # arrange: the target's training run fails (as one diverging under its defense would)
    task, ex = _population_task(rounds=1), _Recording(fail_train=True)

    # act
    summary = run([task], [FedAvg()], [RMIA()], [0], tmp_path, executor=ex)

    # assert: its cells are failed with the training run's reason, and no reference run was started
    recs = [r for r in Store(tmp_path).records() if r["defense"] == "fedavg"]
    assert recs and all(r["status"] == "failed" and r["reason"].startswith("training failed") for r in recs)
    assert [k for k, _, _ in ex.seen if k != "cell"] == ["train"] and summary.counts["failed"] == len(recs)


# ----------------------------------------------------------------------------------------------
# augmented queries


def test_queries_are_the_image_its_mirror_then_one_pixel_shifts_of_both():
    qs = queries_of(18)

    assert qs[:4] == [(False, 0, 0), (True, 0, 0), (False, -1, -1), (True, -1, -1)]
    assert len(set(qs)) == 18 and queries_of(1) == [(False, 0, 0)]


def test_an_augmented_query_mirrors_and_shifts_with_a_reflected_border():
    x = torch.arange(2 * 4 * 5, dtype=torch.float32).reshape(2, 4, 5)

    mirrored, _ = augmented((x, 3), (True, 0, 0))
    right, label = augmented((x, 3), (False, 1, 0))
    down, _ = augmented((x, 3), (False, 0, 1))

    assert torch.equal(mirrored, x.flip(-1)) and label == 3
    assert torch.equal(right[..., 1:], x[..., :-1]) and torch.equal(right[..., 0], x[..., 1])  # reflected
    assert torch.equal(down[:, 1:], x[:, :-1]) and right.shape == x.shape == down.shape
    with pytest.raises(ValueError, match="image"):
        augmented(("a caption", 3), (True, 0, 0))


def test_queries_is_left_out_of_the_parameters_at_its_default_so_earlier_records_stay_valid():
    assert "queries" not in params_of(RMIA()) and label(RMIA()) == "rmia"
    assert params_of(RMIA(queries=18))["queries"] == 18 and label(RMIA(queries=18)) == "rmia(queries=18)"


def test_augmented_queries_need_an_image_classifier():
    api = _population_task(rounds=1).api

    assert RMIA(queries=2).applies(api) is None
    assert "image classifier" in RMIA(queries=2).applies(replace(api, family="llm-text"))
    assert RMIA().applies(replace(api, family="llm-text")) is None


@pytest.mark.parametrize("preset", ["smoke", "default"])
@pytest.mark.parametrize("module", ["vlm_caption", "llm_text"])
def test_each_population_holds_a_reference_training_set_and_as_many_z(module, preset):
    import importlib

    scenario = importlib.import_module(f"bench.scenarios.{module}")

    n = scenario.N_POPULATION[preset]

    assert n == 0 or n // 2 >= scenario.SPECS[preset].n_members  # bench.reference.population_split's requirement


def test_a_population_too_small_for_reference_runs_is_named_in_the_plan(tmp_path):
    from bench.costs import CostModel
    from bench.runner import plan
    from bench.runplan import make_plan
    from bench.store import Store

    task = _population_task(n_pop=64, rounds=1)  # 96 members: a reference training pool needs 96 of 32
    cells = plan([task], [FedAvg()], [RMIA()], [0])

    pl = make_plan(cells, Store(tmp_path), CostModel())

    assert pl.references == 0 and not pl.needs_reference
    assert len(pl.unplannable) == 1 and "population has 64 items" in pl.unplannable[0]
    assert "reference runs cannot be planned" in pl.render()


@pytest.mark.parametrize("view", ["global_model", "client_model"])
def test_a_running_rmia_cell_reports_a_fraction_that_only_grows(trained, tmp_path, monkeypatch, view):
    # arrange: a cell inside a work unit that reports at every step (bench.runner's bar follows the fractions),
    # its reference runs already cached (bench.runner trains them as units of their own, before the cell)
    import bench.progress
    from bench.progress import unit_progress

    task, defense, train = trained
    run_membership(task, defense, RMIA(), view, train, 0, cache_root=tmp_path)
    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)
    reports: list = []

    # act
    with unit_progress(reports.append):
        run_membership(task, defense, RMIA(), view, train, 0, cache_root=tmp_path)

    # assert: fractions, not set-up text, through every part (client) and pass (target, reference models, tuning)
    fractions = [r for r in reports if isinstance(r, float)]
    assert not [r for r in reports if isinstance(r, str)]
    assert len(fractions) >= 2 + 2 * 2 + 2 and fractions == sorted(fractions) and 0.0 <= max(fractions) < 1.0
    assert max(fractions) > 0.9  # the last pass of the last part is reported, not only the first ones


def test_a_cell_run_again_reads_its_spilled_model_passes_instead_of_recomputing(trained, tmp_path, monkeypatch):
    """A killed RMIA cell resumes from the model passes it finished: they are spilled under <cache>/signals."""
    import bench.progress
    from bench import signal_cache

    task, defense, train = trained
    first = run_membership(task, defense, RMIA(), "global_model", train, 0, cache_root=tmp_path)
    spilled = sorted((tmp_path / "signals").rglob("*.json"))
    spilled[0].unlink()  # the pass a kill interrupted
    monkeypatch.setitem(signal_cache._CURRENT, "cache", None)  # a new process: nothing in memory
    before = dict(signal_cache.TOTALS)

    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)  # every report reaches the bar
    reports: list = []
    with bench.progress.unit_progress(reports.append):
        again = run_membership(task, defense, RMIA(), "global_model", train, 0, cache_root=tmp_path)

    # the target's and the 2 reference models' (smoke's R) passes over candidates, z samples and tuning data
    assert len(spilled) > 3
    # the bar takes the read-back passes as done before this run (out of its ETA's rate): most of the cell, now
    # that its model building is a small step (it was a third, bench.cells._part_steps)
    shown, restored = 0.0, 0.0
    for r in reports:
        v = r.fraction if isinstance(r, bench.progress.Resumed) else r
        if isinstance(v, float) and v > shown:
            restored += (v - shown) if isinstance(r, bench.progress.Resumed) else 0.0
            shown = v
    assert restored >= 0.75, restored
    assert signal_cache.TOTALS["computed"] - before["computed"] == 1  # only the missing pass
    assert signal_cache.TOTALS["reused"] - before["reused"] >= len(spilled) - 1
    assert again["per_candidate"]["score"] == first["per_candidate"]["score"]
    assert again["metrics"] == first["metrics"]
