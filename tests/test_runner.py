"""The harness end to end on a toy task: records, n/a, failures, caching and resume."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from bench.costs import CostModel
from bench.fl import TrainResult
from bench.runner import plan, run, write_failed
from bench.runplan import parse_time
from bench.store import Store
from defenses.fedavg import FedAvg
from defenses.fixed_position import FixedPosition
from defenses.flrsp import FLRSP
from tests.toy import ToyLossMIA, ToyMeanRecon, toy_task


@dataclass
class Exploding(FedAvg):
    name = "exploding"

    def client_step(self, state, ctx):
        raise RuntimeError("boom")


def records(out):
    return list(Store(out).records())


def test_matrix_records_every_cell_with_status(tmp_path):
    task = toy_task()
    defenses = [FedAvg(), FLRSP(R=0.8), FixedPosition(), Exploding()]
    attacks = [ToyLossMIA(), ToyMeanRecon()]

    summary = run([task], defenses, attacks, [0], tmp_path)

    recs = records(tmp_path)
    assert len(recs) == len(plan([task], defenses, attacks, [0]))
    by = {(r["defense_label"], r["attack"], r["view"]): r for r in recs}
    assert by[("fedavg", "toy_loss", "client_model")]["status"] == "ok"
    assert by[("fixed_position", "toy_recon", "client_update")]["status"] == "n/a"
    assert "positional" in by[("fixed_position", "toy_recon", "client_update")]["reason"]
    assert by[("exploding", "toy_loss", "global_model")]["status"] == "failed"
    assert "boom" in by[("exploding", "toy_loss", "global_model")]["reason"]
    assert by[("base", "toy_loss", "global_model")]["status"] == "ok"
    one = by[("fedavg", "toy_loss", "client_model")]["privacy"]["epsilon_one_run_lower_bound"]  # bench.one_run_audit
    assert one["pairs"] > 0 and one["value"] >= 0 and one["attack"] == "toy_loss"
    ok = by[("flrsp(R=0.8)", "toy_recon", "client_update")]
    assert ok["status"] == "ok" and 0 <= ok["metrics"]["ssim"]["value"] <= 1
    assert ok["cost"]["bytes_up_per_round"] > 0 and "accuracy" in ok["utility"]
    assert summary.counts["failed"] == sum(r["status"] == "failed" for r in recs)


def test_a_view_filter_runs_only_that_views_cells_and_a_later_full_run_adds_the_rest(tmp_path):
    task = toy_task()
    defenses, attacks = [FedAvg()], [ToyLossMIA()]
    everything = plan([task], defenses, attacks, [0])

    run([task], defenses, attacks, [0], tmp_path, views=("client_model",))
    first = {(r["defense_label"], r["view"]) for r in records(tmp_path)}
    summary = run([task], defenses, attacks, [0], tmp_path)

    assert {"client_model"} < {c.view for c in everything}  # the filter leaves cells out
    assert first == {(c.defense.name if c.defense else "base", c.view) for c in everything if c.view == "client_model"}
    assert summary.counts["skipped"] == len(first) and summary.counts["ok"] == len(everything) - len(first)


def test_rerun_skips_finished_and_redoes_lost_cells(tmp_path):
    task = toy_task()
    defenses, attacks = [FedAvg()], [ToyLossMIA()]
    run([task], defenses, attacks, [0], tmp_path)
    victim = next((tmp_path / "records").glob("*/*.json"))
    before = json.loads(victim.read_text())
    victim.unlink()  # as if the run was killed before this cell finished

    summary = run([task], defenses, attacks, [0], tmp_path)

    assert summary.counts["skipped"] == len(plan([task], defenses, attacks, [0])) - 1
    assert summary.counts["ok"] == 1
    after = json.loads(victim.read_text())
    assert after["metrics"]["auroc"]["value"] == pytest.approx(before["metrics"]["auroc"]["value"])


def test_training_is_cached_and_shared_by_attacks(tmp_path):
    task = toy_task()
    run([task], [FedAvg()], [ToyLossMIA()], [0], tmp_path)
    cached = list((tmp_path / "cache" / "train").glob("*.json"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime

    run([task], [FedAvg()], [ToyLossMIA(), ToyMeanRecon()], [0], tmp_path)

    assert cached[0].stat().st_mtime == mtime


def test_seeds_pool_from_per_candidate_scores_and_fedsgd_has_no_client_model(tmp_path):
    from bench.report.stats import membership_estimate
    from defenses.fedsgd import FedSGD

    task = toy_task()
    run([task], [FedAvg(), FedSGD()], [ToyLossMIA()], [0, 1], tmp_path)

    recs = records(tmp_path)
    ok = [r for r in recs if r["defense_label"] == "fedavg" and r["view"] == "global_model"]
    assert sorted(r["seed"] for r in ok) == [0, 1]
    for r in ok:
        pc = r["per_candidate"]
        assert len(pc["score"]) == len(pc["member"]) == r["n_candidates"]
        assert pc["variants"]["neg_loss_x2"] == pytest.approx([2 * v for v in pc["score"]])  # a kept variant
        assert set(pc["member"]) == {0, 1}
        assert r["privacy"]["sample_rate"] is None  # no DP
    pooled = membership_estimate(ok, "auroc")
    assert pooled.n_seeds == 2
    assert pooled.value == pytest.approx(sum(r["metrics"]["auroc"]["value"] for r in ok) / 2, abs=1e-6)
    sgd = [r for r in recs if r["defense_label"] == "fedsgd" and r["view"] == "client_model"]
    assert sgd and all(r["status"] == "n/a" and "gradients" in r["reason"] for r in sgd)


def test_client_view_nonmembers_follow_the_clients_label_histogram():
    from bench.cells import matched_nonmembers

    m_labels = [0, 0, 0, 1]  # a skewed client
    n_labels = [1, 1, 0, 2, 0, 0, 2, 1]
    chosen = matched_nonmembers([0, 1, 2, 3], m_labels, list(range(8)), n_labels)

    assert sorted(chosen) == list(range(8))  # a permutation: every non-member still available
    assert [n_labels[i] for i in chosen[:4]] == [0, 0, 0, 1]


def test_matched_nonmembers_tops_up_when_a_label_runs_out():
    from bench.cells import matched_nonmembers

    chosen = matched_nonmembers([0, 1, 2], [5, 5, 5], [0, 1, 2, 3], [5, 1, 1, 1])
    assert chosen[0] == 0 and len(set(chosen)) == 4


class RecordingBar:
    """Stands in for the run's tqdm bar: keeps every update."""

    def __init__(self, total, **_):
        self.total, self.updates, self.postfix = total, [], []

    def update(self, n):
        self.updates.append(n)

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def close(self):
        pass


def test_the_bar_moves_within_a_training_unit_and_never_beyond_the_work(tmp_path, monkeypatch):
    import bench.progress
    import bench.workbar

    bars = []
    monkeypatch.setattr(bench.workbar, "progress_bar", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)  # report at every step of the toy run
    task = toy_task(rounds=3)

    run([task], [FedAvg()], [ToyLossMIA()], [0], tmp_path)

    (bar,) = bars
    train_cost = CostModel().train_cost(task, FedAvg())
    within = [u for u in bar.updates if u < train_cost / 10]  # shares of the training unit's cost
    assert len(within) >= 3 * 3 * 2, bar.updates  # rounds x clients x local epochs, at least
    assert all(u > 0 for u in bar.updates)
    assert sum(bar.updates) == pytest.approx(bar.total)  # no unit moved the bar beyond its own cost


@dataclass
class SlowSetUp(FedAvg):
    """FedAvg whose model set-up runs a long loop before training (as the VLM projector's alignment does)."""

    name = "slow_setup"

    def setup(self, model, api):
        from bench.progress import progress

        for _ in progress(range(4), desc="align projector"):
            pass
        return super().setup(model, api)


def test_a_units_set_up_loop_shows_on_the_bar(tmp_path, monkeypatch):
    import bench.progress
    import bench.workbar

    bars = []
    monkeypatch.setattr(bench.workbar, "progress_bar", lambda **kw: bars.append(RecordingBar(**kw)) or bars[-1])
    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)

    run([toy_task(rounds=2)], [SlowSetUp()], [ToyLossMIA()], [0], tmp_path)

    (bar,) = bars
    shown = [p for p in bar.postfix if p.startswith("align projector")]
    assert shown[:4] == [f"align projector {i}/4" for i in range(4)]  # (attack cells rebuild the model too)
    assert sum(bar.updates) == pytest.approx(bar.total)  # a set-up step never moves the bar
    # once the training's main loop reports, the postfix names the running unit, not the finished set-up step
    after = bar.postfix[bar.postfix.index("align projector 3/4") + 1 :]
    assert after and after[0] == "training slow_setup seed 0", bar.postfix


def test_cost_model_learns_base_model_cells_apart_from_defended_ones(tmp_path):
    from types import SimpleNamespace

    from bench.store import Store
    from tests.test_store import record

    store = Store(tmp_path)
    for i, (defense, wall) in enumerate([("base", 10.0), ("base", 12.0), ("fedavg", 1200.0), ("fedrand", 1400.0)]):
        store.write(
            record(cell_id=f"{i:016x}", defense=defense, attack="rmia", cost={"attack_wall_s": wall, "rounds": 2})
        )
    costs = CostModel.from_records(tmp_path)
    cell = lambda defense: SimpleNamespace(  # noqa: E731
        task=SimpleNamespace(id="toy/mlp"), attack=SimpleNamespace(name="rmia"), view="global_model", defense=defense
    )

    assert costs.cell_cost(cell(None)) == 11.0
    assert costs.cell_cost(cell(FedAvg())) == 1300.0


def test_cost_model_scales_records_made_on_another_cpu_by_the_speed_probes(tmp_path, monkeypatch):
    import bench.machine
    from bench.store import Store
    from tests.test_store import record

    monkeypatch.setattr(bench.machine, "probe_s", lambda: 0.2)  # this machine: 0.2 CPU seconds per probe
    machine = lambda probe, version=bench.machine.PROBE_VERSION: {
        "cpu": "x",
        "probe_s": probe,
        "probe_version": version,
    }  # noqa: E731
    prov = {"code_version": "abc", "config_hash": "h", "started_at": "2026-11-23T12:00:00Z"}
    cases = [  # (defense, its record's provenance): each trained in 100 s where it ran
        ("fedavg", {**prov, "machine": machine(0.1)}),  # a CPU twice as fast: 200 s here
        ("fedrand", {**prov, "machine": machine(0.21)}),  # the same machine within the probe's noise
        ("fedper", {**prov, "machine": machine(0.1, version=-1)}),  # another probe: not comparable
        ("fedpara", prov),  # written before probes were recorded
        ("fedsgd", {**prov, "device": "cuda", "machine": machine(0.1)}),  # a GPU run: a CPU probe says nothing
        # this CPU and instruction set: its probe moved with the load it was taken under, the time did not
        ("fedbuff", {**prov, "machine": {**machine(0.1), **bench.machine.cpu_here()}}),
    ]
    store = Store(tmp_path)
    for i, (defense, pr) in enumerate(cases):
        store.write(
            record(
                cell_id=f"{i:016x}", defense=defense, defense_label=defense, provenance=pr, cost={"train_wall_s": 100.0}
            )
        )

    costs = CostModel.from_records(tmp_path)
    on_gpu = CostModel.from_records(tmp_path, device="cuda")

    assert costs.train_s[("toy/mlp", "fedavg")] == pytest.approx(200.0)
    assert [costs.train_s[("toy/mlp", d)] for d, _ in cases[1:]] == [100.0] * 5
    assert (costs.n_scaled, costs.factors) == (1, (2.0,))
    assert on_gpu.train_s[("toy/mlp", "fedavg")] == 100.0 and on_gpu.n_scaled == 0


def test_cost_model_keeps_a_methods_configurations_apart_and_falls_back_to_the_method(tmp_path):
    # arrange: dp_gaussian in its FedSGD form trains 10x longer than in its FedAvg form
    from types import SimpleNamespace

    from attacks.inverting_gradients import InvertingGradients
    from bench.store import Store
    from defenses.dp_gaussian import DPGaussian
    from tests.test_store import record

    runs = [("dp_gaussian", 60.0), ("dp_gaussian", 80.0), ("dp_gaussian(form=fedsgd)", 700.0)]
    attacks = [("inverting_gradients", 50.0), ("inverting_gradients(restarts=4)", 200.0)]
    store = Store(tmp_path)
    for i, (lab, wall) in enumerate(runs):
        store.write(record(cell_id=f"{i:016x}", defense="dp_gaussian", defense_label=lab, cost={"train_wall_s": wall}))
    for i, (lab, wall) in enumerate(attacks, start=len(runs)):
        store.write(
            record(cell_id=f"{i:016x}", attack="inverting_gradients", attack_label=lab, cost={"attack_wall_s": wall})
        )
    task = SimpleNamespace(id="toy/mlp", preset="default", api=SimpleNamespace(family="image-cls"))
    ig = lambda **kw: SimpleNamespace(  # noqa: E731 - a cell as the cost model sees it
        task=task, attack=InvertingGradients(**kw), view="global_model", defense=FedAvg()
    )

    # act
    costs = CostModel.from_records(tmp_path)

    # assert: each configuration its own median; one without records, every configuration's
    assert costs.train_cost(task, DPGaussian()) == 70.0
    assert costs.train_cost(task, DPGaussian(form="fedsgd")) == 700.0
    assert costs.train_cost(task, DPGaussian(clip=0.5)) == 80.0  # the median of 60, 80, 700
    assert costs.cell_cost(ig()) == 50.0 and costs.cell_cost(ig(restarts=3)) == 125.0


def test_cost_model_estimates_a_changed_configuration_from_its_own_runs_else_scales_by_rounds(tmp_path):
    # arrange: FedAvg trained at an older 4-round configuration (100 s per round) and once at the current one
    from types import SimpleNamespace

    from bench.store import Store
    from bench.types import FLConfig
    from defenses.dp_gaussian import DPGaussian
    from tests.test_store import record

    prov = lambda h: {"code_version": "abc", "config_hash": h, "started_at": "2026-11-23T12:00:00Z"}  # noqa: E731
    runs = [("old", 4, 400.0), ("old", 4, 440.0), ("old", 40, 700.0)]  # the 40-round run: FedSGD's rounds
    store = Store(tmp_path)
    for i, (h, rounds, wall) in enumerate(runs):
        label = "fedavg" if rounds == 4 else "dp_gaussian(form=fedsgd)"
        store.write(
            record(
                cell_id=f"{i:016x}",
                defense=label.split("(")[0],
                defense_label=label,
                provenance=prov(h),
                cost={"train_wall_s": wall, "rounds": rounds},
            )
        )
    task = lambda h: SimpleNamespace(  # noqa: E731 - the task spec as the planner holds it
        id="toy/mlp", preset="smoke", fl=FLConfig(rounds=6), config_hash=lambda: h, api=SimpleNamespace(family="toy")
    )

    # act
    costs = CostModel.from_records(tmp_path)

    # assert: the old configuration's own runs; a 6-round configuration: 6 of the old runs' rounds; a FedSGD-form
    # run is not scaled by the FedAvg rounds (its rounds are steps), so it keeps its measured time
    assert costs.train_cost(task("old"), FedAvg()) == pytest.approx(420.0)
    assert costs.train_cost(task("new"), FedAvg()) == pytest.approx(630.0)
    assert costs.train_cost(task("new"), DPGaussian(form="fedsgd")) == pytest.approx(700.0)
    assert costs.train_cost(SimpleNamespace(**{**vars(task("new")), "preset": "default"}), FedAvg()) == 420.0


def test_a_reference_model_cell_without_records_is_estimated_from_its_base_model_cell(tmp_path):
    # arrange: only the base-model rmia cells were measured (their reference models are the base model)
    from types import SimpleNamespace

    from attacks.rmia import RMIA
    from bench.store import Store
    from tests.test_store import record

    store = Store(tmp_path)
    for i, view in enumerate(("global_model", "client_model")):
        store.write(
            record(cell_id=f"{i:016x}", defense="base", attack="rmia", view=view, cost={"attack_wall_s": 110.0})
        )
    task = SimpleNamespace(
        id="toy/mlp",
        preset="default",
        api=SimpleNamespace(family="llm-text"),
        max_membership=250,  # 500 candidates
        population=list(range(1200)),  # a z pool of 600
        fl=SimpleNamespace(num_clients=4),
    )
    fedavg = FedAvg()
    cell = lambda view, defense=fedavg: SimpleNamespace(  # noqa: E731
        task=task, attack=RMIA(), view=view, defense=defense
    )

    # act
    costs = CostModel.from_records(tmp_path)

    # assert: target + 4 reference models score 500 + 600 items, each reference 256 tuning items (global); in the
    # client view each of the 4 clients' models scores all 600 z samples and tunes on its own
    assert costs.cell_cost(cell("global_model", None)) == 110.0
    assert costs.cell_cost(cell("global_model")) == pytest.approx(110.0 * (5 * 1100 + 4 * 256) / 1100)
    assert costs.cell_cost(cell("client_model")) == pytest.approx(110.0 * (5 * (500 + 4 * 600) + 16 * 256) / 1100)
    store.write(record(cell_id=f"{9:016x}", defense="fedavg", attack="rmia", cost={"attack_wall_s": 999.0}))
    assert CostModel.from_records(tmp_path).cell_cost(cell("global_model")) == 999.0  # measured wins


def test_without_records_a_cell_costs_its_attacks_default_else_its_kinds():
    from types import SimpleNamespace

    task = SimpleNamespace(id="image-cls/vit", preset="default", api=SimpleNamespace(family="image-cls"))
    cell = lambda name, kind: SimpleNamespace(  # noqa: E731
        task=task, attack=SimpleNamespace(name=name, kind=kind), view="client_update", defense=FedAvg()
    )
    costs = CostModel()

    assert costs.cell_cost(cell("april", "reconstruction")) < costs.cell_cost(
        cell("inverting_gradients", "reconstruction")
    )
    assert costs.cell_cost(cell("my_recon", "reconstruction")) == costs.cell_cost(
        cell("inverting_gradients", "reconstruction")
    )
    assert costs.train_cost(task, FedAvg()) > costs.cell_cost(cell("loss_mia", "membership"))


def test_the_speed_probe_is_recorded_and_compares_a_machine_with_itself():
    from bench.machine import PROBE_VERSION, machine_info, speed_factor
    from bench.store import provenance

    info = provenance()["machine"]

    assert info == machine_info() and info["probe_s"] > 0 and info["probe_version"] == PROBE_VERSION
    assert speed_factor(info) == pytest.approx(1.0, rel=1e-3)  # the probe is measured once per process
    assert speed_factor({**info, "probe_version": PROBE_VERSION + 1}) is None and speed_factor(None) is None


def test_a_record_is_from_this_cpu_only_with_the_same_name_and_instruction_set():
    from bench.machine import machine_info, same_cpu

    here = machine_info()

    assert same_cpu(dict(here), here)
    assert not same_cpu({**here, "isa": "another ISA"}, here)  # one CPU name, AVX2 or AVX512 (seen here)
    assert not same_cpu({k: v for k, v in here.items() if k != "isa"}, here)  # before revision 9: cannot tell
    assert not same_cpu({**here, "cpu": "another CPU"}, here) and not same_cpu(None, here)


def _retrain_in_cache(cache: Path) -> None:
    """Replace the one cached training run by another (as a retraining after a lost cache makes: in another
    process, so this one holds no copy of the former run)."""
    from bench import cachefile, units

    (head,) = (cache / "train").glob("*.json")
    stem = head.with_suffix("")
    tensors, meta = cachefile.load(stem, lambda t, m: (t, m), quarantine_dir=cache / "q")
    name = next(iter(tensors))
    tensors = {**tensors, name: tensors[name] + 1.0}
    meta["utility"] = {k: v + 0.01 for k, v in meta["utility"].items()}
    cachefile.save(stem, tensors, meta)
    units._TRAIN_LRU.clear()


def test_redo_before_reruns_older_records_once_and_a_resume_keeps_the_redone_ones(tmp_path):
    # arrange: a finished matrix whose records all started before ``cut``
    task, defenses, attacks = toy_task(), [FedAvg()], [ToyLossMIA(), ToyMeanRecon()]
    run([task], defenses, attacks, [0], tmp_path)
    first = {r["cell_id"]: r["provenance"]["started_at"] for r in records(tmp_path)}
    ok_cells = sum(r["status"] == "ok" for r in records(tmp_path))
    cut = max(parse_time(t) for t in first.values()) + timedelta(seconds=1)
    time.sleep(1.1)  # stamps have whole seconds: the redone records start after ``cut``

    # act: redo, then resume with the same time, then run without it
    plans: list = []
    redone = run([task], defenses, attacks, [0], tmp_path, redo_before=cut, on_plan=plans.append)
    again = run([task], defenses, attacks, [0], tmp_path, redo_before=cut)
    plain = run([task], defenses, attacks, [0], tmp_path)

    # assert: every finished ok record is redone once (n/a records need no compute and stay)
    n_cells = len(plan([task], defenses, attacks, [0]))
    assert redone.counts["ok"] == ok_cells and plans[0].stale == ok_cells
    assert "or before --redo-before" in plans[0].render()
    assert again.counts["skipped"] == n_cells and plain.counts["skipped"] == n_cells
    after = {r["cell_id"]: r for r in records(tmp_path)}
    assert all(parse_time(r["provenance"]["started_at"]) >= cut for r in after.values() if r["status"] == "ok")


def test_a_unit_that_dies_replaces_an_older_record_and_keeps_one_its_worker_wrote(tmp_path):
    # arrange: one finished record; skeletons of a unit planned after it and of one planned before it
    task = toy_task()
    run([task], [FedAvg()], [ToyLossMIA()], [0], tmp_path)
    rec = next(r for r in records(tmp_path) if r["status"] == "ok")
    store, when = Store(tmp_path), parse_time(rec["provenance"]["started_at"])
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    skeleton = lambda t: {**rec, "provenance": {**rec["provenance"], "started_at": stamp(t)}}  # noqa: E731

    # act: the unit planned before the record was written (its worker wrote it), then a later one (a redo)
    write_failed(store, skeleton(when - timedelta(seconds=5)), "killed")
    kept = store.load(store.record_path(rec["scenario"], rec["cell_id"]))
    write_failed(store, skeleton(when + timedelta(seconds=5)), "killed")
    replaced = store.load(store.record_path(rec["scenario"], rec["cell_id"]))

    # assert
    assert kept is not None and kept["status"] == "ok"
    assert replaced is not None and replaced["status"] == "failed" and replaced["reason"] == "killed"


def test_records_made_from_a_run_no_longer_cached_are_redone_and_flagged(tmp_path):
    # arrange: a finished matrix; one membership record stripped of ``training`` (as before revision 6)
    task, defenses, attacks = toy_task(), [FedAvg()], [ToyLossMIA(), ToyMeanRecon()]
    run([task], defenses, attacks, [0], tmp_path)
    (head,) = (tmp_path / "cache" / "train").glob("*.json")
    first = json.loads(head.read_text())["sha256"][:16]
    made = {(r["attack"], r["view"]): r.get("training") for r in records(tmp_path) if r["defense"] == "fedavg"}
    legacy = next(
        p
        for p in (tmp_path / "records").glob("*/*.json")
        if (json.loads(p.read_text())["defense"], json.loads(p.read_text())["view"]) == ("fedavg", "client_model")
    )
    rec = json.loads(legacy.read_text())
    del rec["training"]
    legacy.write_text(json.dumps(rec))
    n_cells, n_membership = len(plan([task], defenses, attacks, [0])), sum(a == "toy_loss" for a, _ in made)

    # act: re-run as is (the legacy record matches by its utility), then after the run is retrained
    same = run([task], defenses, attacks, [0], tmp_path)
    _retrain_in_cache(tmp_path / "cache")
    plans: list = []
    redone = run([task], defenses, attacks, [0], tmp_path, on_plan=plans.append)

    # assert: only the membership records of the replaced run are redone (the reconstruction cell attacks
    # round-0 probes, the base model has no training); every record names the run it scored
    assert all(t == {"sha256": first} for t in made.values())
    assert same.counts["skipped"] == n_cells
    assert redone.counts["ok"] == n_membership and redone.counts["skipped"] == n_cells - n_membership
    assert plans[0].stale == n_membership and f"({n_membership} of them redo a stale record" in plans[0].render()
    now = json.loads(head.read_text())["sha256"][:16]
    after = {(r["attack"], r["view"]): r.get("training") for r in records(tmp_path) if r["defense"] == "fedavg"}
    assert now != first and after[("toy_recon", "client_update")] == {"sha256": first}
    assert all(after[k] == {"sha256": now} for k in made if k[0] == "toy_loss")


def _membership_records(out: Path) -> dict[str, Path]:
    return {
        p.name: p
        for p in (out / "records").glob("*/*.json")
        if json.loads(p.read_text())["defense"] == "fedavg" and json.loads(p.read_text())["attack"] == "toy_loss"
    }


def _drop_training_cache(out: Path) -> None:
    from bench import units

    for f in (out / "cache" / "train").glob("*"):
        f.unlink()
    units._TRAIN_LRU.clear()


def test_records_of_a_run_retrained_in_the_same_run_are_checked_again_and_redone_if_made_from_other_weights(
    tmp_path,
):
    # arrange: finished membership records whose training run is gone from the cache and which name another
    # run (as records trained on another CPU do); a reconstruction cell of the same run is still to do
    task, defenses = toy_task(), [FedAvg()]
    run([task], defenses, [ToyLossMIA()], [0], tmp_path)
    paths = _membership_records(tmp_path)
    for p in paths.values():
        rec = json.loads(p.read_text())
        prov = {**rec["provenance"], "machine": {**rec["provenance"]["machine"], "cpu": "another CPU"}}
        p.write_text(json.dumps({**rec, "training": {"sha256": "0" * 16}, "provenance": prov}))
    _drop_training_cache(tmp_path)

    # act: the run trains the run again for the new cell
    plans: list = []
    summary = run([task], defenses, [ToyLossMIA(), ToyMeanRecon()], [0], tmp_path, on_plan=plans.append)

    # assert: the plan said so, and the records from the other run were redone on the new one in the same run
    (head,) = (tmp_path / "cache" / "train").glob("*.json")
    now = json.loads(head.read_text())["sha256"][:16]
    assert plans[0].to_recheck == len(paths) > 0 and f"{len(paths)} recorded cell(s)" in plans[0].render()
    assert (
        plans[0].likely_redo == len(paths)
        and f"{len(paths)} of them name another CPU or instruction set" in plans[0].render()
    )
    assert all(json.loads(p.read_text())["training"] == {"sha256": now} for p in paths.values())
    assert summary.counts["ok"] == len(paths) + 1 and summary.counts["failed"] == 0
    n_cells = len(plan([task], defenses, [ToyLossMIA(), ToyMeanRecon()], [0]))
    assert summary.counts["skipped"] + summary.counts["ok"] + summary.counts["n/a"] == n_cells


def test_records_of_a_run_retrained_to_the_same_weights_stay(tmp_path):
    # arrange: finished membership records whose training run is gone from the cache (retrained here, it comes
    # back bit for bit)
    task, defenses = toy_task(), [FedAvg()]
    run([task], defenses, [ToyLossMIA()], [0], tmp_path)
    before = {name: p.read_text() for name, p in _membership_records(tmp_path).items()}
    _drop_training_cache(tmp_path)

    # act
    plans: list = []
    summary = run([task], defenses, [ToyLossMIA(), ToyMeanRecon()], [0], tmp_path, on_plan=plans.append)

    # assert: the records were checked, not redone (made on this CPU, the plan did not expect them redone)
    assert plans[0].to_recheck == len(before) > 0 and plans[0].likely_redo == 0
    assert {name: p.read_text() for name, p in _membership_records(tmp_path).items()} == before
    assert summary.counts["ok"] == 1


def test_units_run_group_by_group_so_an_interrupted_run_leaves_whole_groups_recorded(tmp_path):
    # arrange: an executor that logs what it is handed (in order), over a matrix of two defenses x two seeds
    from bench.runner import InlineExecutor

    class Logging(InlineExecutor):
        def __init__(self) -> None:
            super().__init__()
            self.log: list[tuple[str, str, int]] = []

        def submit(self, unit):
            self.log.append((unit.kind, unit.defense.name if unit.defense else "base", unit.seed))
            return super().submit(unit)

    ex = Logging()

    # act
    run([toy_task()], [FedAvg(), FLRSP()], [ToyLossMIA()], [0, 1], tmp_path, executor=ex)

    # assert: each training run's cells run before the next training run starts
    trains = [i for i, (kind, _, _) in enumerate(ex.log) if kind == "train"]
    assert len(trains) == 4
    for start, end in zip(trains, trains[1:] + [len(ex.log)]):
        _, defense, seed = ex.log[start]
        between = ex.log[start + 1 : end]
        assert between and all((d, s) == (defense, seed) for kind, d, s in between if d != "base")


def test_the_leaderboard_flags_a_defense_seed_whose_membership_records_come_from_two_runs(tmp_path):
    # arrange: one finished matrix, and the same records with one membership record from another run
    from bench.report.results import Results

    run([toy_task()], [FedAvg()], [ToyLossMIA()], [0], tmp_path)
    recs = records(tmp_path)
    mixed = [dict(r) for r in recs]
    one = next(r for r in mixed if r["defense"] == "fedavg" and r["status"] == "ok")
    one["training"] = {"sha256": "0" * 16}

    i = next(i for i, r in enumerate(recs) if r["defense"] == "fedavg" and r["status"] == "ok")
    other = {k: v for k, v in recs[i].items() if k != "training"}  # before the checksum, another run's utility
    other["utility"] = {k: v + 0.01 for k, v in other["utility"].items()}
    legacy = [*recs[:i], other, *recs[i + 1 :]]

    # act
    clean, flagged = Results(recs).mixed_trainings(), Results(mixed).mixed_trainings()
    same_utility = Results([{k: v for k, v in r.items() if k != "training"} for r in recs[:1]] + recs[1:])

    # assert: a record without the checksum joins the run of its utility
    assert clean == [] and same_utility.mixed_trainings() == []
    assert flagged == [(one["preset"], one["task"], "fedavg", 0, 2)]
    assert Results(legacy).mixed_trainings() == flagged


def test_the_leaderboard_flags_recorded_cells_whose_training_run_failed_to_retrain(tmp_path):
    # arrange: a finished matrix; then one cell failed because retraining the run failed (it diverged here)
    from bench.report.markdown import training_banner
    from bench.report.results import Results

    run([toy_task()], [FedAvg()], [ToyLossMIA()], [0], tmp_path)
    recs = records(tmp_path)
    fedavg = [i for i, r in enumerate(recs) if r["defense"] == "fedavg" and r["status"] == "ok"]
    diverged = "training failed: FloatingPointError: training diverged: client 0, round 3 of 3: non-finite loss nan"
    failed = lambda reason: {**recs[fedavg[0]], "status": "failed", "reason": reason}  # noqa: E731
    unreproduced = [failed(diverged) if i == fedavg[0] else r for i, r in enumerate(recs)]
    ref_failed = [
        failed("reference run 1 failed: OSError: disk full") if i == fedavg[0] else r for i, r in enumerate(recs)
    ]
    all_failed = [failed(diverged) if i in fedavg else r for i, r in enumerate(recs)]

    # act
    flagged = Results(unreproduced).unreproduced_trainings()
    banner = training_banner(Results(unreproduced), recs[0]["scenario"])

    # assert: only a failed retraining beside recorded cells is flagged, with the cells and the reason
    assert flagged == [(recs[0]["preset"], recs[0]["task"], "fedavg", 0, len(fedavg) - 1, diverged)]
    assert Results(recs).unreproduced_trainings() == [] and Results(ref_failed).unreproduced_trainings() == []
    assert Results(all_failed).unreproduced_trainings() == []
    assert len(banner) == 1 and banner[0].startswith("> **Training not reproduced: ") and "diverged" in banner[0]


def test_a_run_diverging_under_its_defense_is_recorded_and_shown_as_diverged_not_as_a_fault(tmp_path):
    # arrange: SGD at lr 1e30 overflows in the first steps (a defense's noise far above its update would too)
    import pandas as pd

    from bench.report.leaderboards import write_leaderboards

    task = toy_task(lr=1e30)

    # act
    summary = run([task], [FedAvg(), Exploding()], [ToyLossMIA()], [0], tmp_path)
    write_leaderboards(tmp_path)

    # assert: the diverged run's cells say so (schema revision 12), a fault stays an error, both stay failed
    recs = [r for r in records(tmp_path) if r["defense"] != "base" and r["status"] != "n/a"]
    by = {r["defense"]: r for r in recs}
    assert by["fedavg"]["status"] == "failed" and by["fedavg"]["failure"] == "diverged"
    assert "TrainingDiverged: training diverged" in by["fedavg"]["reason"]
    assert by["exploding"]["status"] == "failed" and by["exploding"]["failure"] == "error"
    n_diverged = sum(r["failure"] == "diverged" for r in recs)
    assert summary.counts["failed"] == len(recs) and summary.diverged == n_diverged and n_diverged > 0
    md = (tmp_path / "leaderboards" / f"{recs[0]['scenario']}.md").read_text()
    listed, failed = md.split("## Diverged training runs")[1].split("## Failed cells")
    assert "fedavg seed 0:" in listed and "exploding" not in listed
    assert "boom" in failed and "fedavg" not in failed
    assert "client diverged: training failed: TrainingDiverged: training diverged" in md
    cells = pd.read_csv(tmp_path / "leaderboards" / f"{recs[0]['scenario']}_cells.csv")
    assert set(cells.loc[cells.defense_label == "fedavg", "failure"]) == {"diverged"}


def test_a_run_that_diverged_is_recorded_again_without_training_until_redo_before_a_later_time(tmp_path, monkeypatch):
    # arrange: a run that diverges, then a counter on every training from here on
    from datetime import datetime, timezone

    from bench import training

    task, defenses, attacks = toy_task(lr=1e30), [FedAvg()], [ToyLossMIA()]
    run([task], defenses, attacks, [0], tmp_path)
    trained, real = [], training.run_federated
    monkeypatch.setattr(training, "run_federated", lambda *a, **k: trained.append(1) or real(*a, **k))
    plans = []

    # act: run again (the known outcome), then again with --redo-before a time after the divergence
    again = run([task], defenses, attacks, [0], tmp_path, on_plan=plans.append)
    later = datetime.now(timezone.utc) + timedelta(seconds=1)
    redo = run([task], defenses, attacks, [0], tmp_path, redo_before=later)

    # assert: the second run's cells are recorded diverged with the first reason and nothing trained; the third trains
    assert again.diverged > 0 and again.diverged == redo.diverged and len(trained) == 1
    assert plans[0].known_diverged == 1 and "diverged under their defense before" in plans[0].render()
    recs = [r for r in records(tmp_path) if r["defense"] == "fedavg" and r["status"] != "n/a"]
    assert recs and all(r["failure"] == "diverged" and "training diverged" in r["reason"] for r in recs)


@pytest.mark.parametrize(
    "text", ["{", "[]", '{"reason": "x"}', '{"reason": "x", "at": "yesterday"}', '{"reason": "x", "at": "2026-12-07"}']
)
def test_a_divergence_marker_that_cannot_be_read_is_ignored_so_the_run_trains(tmp_path, text):
    from bench.training import divergence_path, read_divergence

    # arrange
    stem = tmp_path / "run"
    divergence_path(stem).write_text(text)
    # act / assert
    assert read_divergence(stem) is None


def test_redo_before_forgets_only_a_divergence_recorded_before_it(tmp_path):
    from datetime import datetime, timezone

    from bench.training import divergence_path, forget_divergence, read_divergence

    # arrange: a marker recorded at noon
    stem = tmp_path / "run"
    divergence_path(stem).write_text('{"reason": "training diverged: round 3", "at": "2026-12-07T12:00:00+00:00"}')
    # act
    kept = forget_divergence(stem, datetime(2026, 12, 7, 11, tzinfo=timezone.utc))
    known = read_divergence(stem)
    forgot = forget_divergence(stem, datetime(2026, 12, 7, 13, tzinfo=timezone.utc))
    # assert
    assert not kept and known == {"reason": "training diverged: round 3", "at": "2026-12-07T12:00:00+00:00"}
    assert forgot and not divergence_path(stem).exists() and read_divergence(stem) is None


def _small_run() -> TrainResult:
    return TrainResult(
        global_state={"w": torch.arange(6.0).reshape(2, 3)},
        client_latest={1: {"w": torch.ones(2, 3)}},
        transcript=[{"client": 1, "round": 0, "kind": "weights", "bytes": 24, "numel": 6, "meta": {}}],
        bytes_down=[24],
        utility={"test_loss": 1.5},
    )


def test_a_saved_run_reads_back_with_its_key(tmp_path):
    from bench import cachefile
    from bench.training import decode_run, save_run

    # arrange
    stem, res, key = tmp_path / "run", _small_run(), {"task": "t", "seed": 3, "reference": 1}
    # act
    save_run(stem, res, key, "training cache for t seed 3")
    back = cachefile.load(stem, decode_run, quarantine_dir=tmp_path / "quarantine")
    # assert
    assert cachefile.head(stem)["meta"]["key"] == key
    assert back is not None and torch.equal(back.global_state["w"], res.global_state["w"])
    assert back.client_latest.keys() == {1} and back.utility == {"test_loss": 1.5}


def test_a_run_whose_cache_write_fails_warns_and_is_not_lost(tmp_path, monkeypatch, capsys):
    from bench import cachefile, training

    # arrange: the disk refuses the write
    def refuse(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(cachefile, "save", refuse)
    # act
    training.save_run(tmp_path / "run", _small_run(), {"seed": 0}, "reference cache 2 for fedavg seed 0")
    # assert: a warning naming the entry and the cause, nothing raised, nothing half-written
    err = capsys.readouterr().err
    assert "warning: reference cache 2 for fedavg seed 0 not written: OSError: No space left on device" in err
    assert not list(tmp_path.iterdir())


def test_a_cell_whose_signals_an_earlier_cell_computed_records_that_it_computed_none(tmp_path):
    # arrange: two configurations of the loss attack whose threshold scores read the same per-candidate losses
    from attacks.loss_mia import LossMIA
    from bench.store import Store

    # act
    run([toy_task(rounds=2)], [FedAvg()], [LossMIA(), LossMIA(epochs=5)], [0], tmp_path)

    # assert: in each view, one cell computed the losses and the other reused them all
    recs = [r for r in Store(tmp_path).records() if r["defense"] == "fedavg"]
    for view in {r["view"] for r in recs}:
        costs = sorted(
            ((r["cost"]["signals_computed"], r["cost"]["signals_reused"]) for r in recs if r["view"] == view),
            key=lambda c: c[0],
        )
        assert len(costs) == 2 and costs[0][0] == 0 and costs[0][1] > 0 and costs[1][0] > 0, (view, costs)
    assert all(r["cost"]["signals_loaded"] == 0 for r in recs)  # one process: none read back from cache/signals


def test_cost_model_learns_cells_that_computed_no_signal_apart_and_the_plan_uses_them(tmp_path):
    # arrange: rmia(a=0.3) once computed its signals (1,100 s) and once found them computed (20 s)
    from types import SimpleNamespace

    from attacks.rmia import RMIA
    from bench.store import Store
    from tests.test_store import record

    cases = [("rmia", 1000.0, 5, 0), ("rmia(a=0.3)", 1100.0, 5, 0), ("rmia(a=0.3)", 20.0, 0, 5)]
    store = Store(tmp_path)
    for i, (lab, wall, computed, reused) in enumerate(cases):
        cost = {"attack_wall_s": wall, "signals_computed": computed, "signals_reused": reused}
        store.write(record(cell_id=f"{i:016x}", attack="rmia", attack_label=lab, cost=cost))
    task = SimpleNamespace(id="toy/mlp", preset="default", api=SimpleNamespace(family="llm-text"))
    cell = lambda **kw: SimpleNamespace(task=task, attack=RMIA(**kw), view="global_model", defense=FedAvg())  # noqa: E731

    # act
    costs = CostModel.from_records(tmp_path)

    # assert: the cheap cell does not lower the median of cells that compute; as a follower it is the estimate,
    # for another configuration of the method too; a follower without such records costs a full cell
    assert costs.cell_cost(cell(a=0.3)) == 1100.0 and costs.cell_cost(cell()) == 1000.0
    assert costs.cell_cost(cell(a=0.3), follower=True) == 20.0 == costs.cell_cost(cell(a=0.5), follower=True)
    assert CostModel().cell_cost(cell(a=0.3), follower=True) == CostModel().cell_cost(cell(a=0.3))


def test_cost_model_does_not_learn_from_a_cell_that_resumed_part_way(tmp_path):
    # arrange: rmia once ran whole (1,000 s), once resumed after a kill with 3 of its 5 passes read back (300 s)
    from types import SimpleNamespace

    from attacks.rmia import RMIA
    from bench.store import Store
    from tests.test_store import record

    store = Store(tmp_path)
    for i, (wall, computed, reused, loaded) in enumerate([(1000.0, 5, 0, 0), (300.0, 2, 3, 3)]):
        cost = {"attack_wall_s": wall, "signals_computed": computed, "signals_reused": reused, "signals_loaded": loaded}
        store.write(record(cell_id=f"{i:016x}", attack="rmia", cost=cost))
    task = SimpleNamespace(id="toy/mlp", preset="default", api=SimpleNamespace(family="llm-text"))
    cell = SimpleNamespace(task=task, attack=RMIA(), view="global_model", defense=FedAvg())

    # act
    costs = CostModel.from_records(tmp_path)

    # assert: the partial time does not pull the estimate down
    assert costs.cell_cost(cell) == 1000.0


def test_the_plan_estimates_cells_that_reuse_an_earlier_cells_signals_as_followers(tmp_path):
    # arrange: two loss_mia configurations on one model and candidate set; a measured follower costs 2 s
    from attacks.loss_mia import LossMIA
    from bench.runplan import make_plan, share_key
    from bench.store import Store

    task = toy_task(rounds=2)
    cells = [c for c in plan([task], [FedAvg()], [LossMIA(), LossMIA(epochs=5)], [0]) if c.na is None]
    views = {c.view for c in cells}
    costs = CostModel(follower_s={("cell", task.id, "loss_mia", v, base): 2.0 for v in views for base in (False, True)})

    # act
    pl = make_plan(cells, Store(tmp_path), costs)

    # assert: per share key the first cell is estimated in full, the others as followers; the total adds them up
    by_key: dict[str, list] = {}
    for c in cells:
        by_key.setdefault(share_key(c), []).append(c)
    for group in by_key.values():
        assert len(group) >= 2 and pl.cell_s[group[0].id] == costs.cell_cost(group[0]) != 2.0
        assert [pl.cell_s[c.id] for c in group[1:]] == [2.0] * (len(group) - 1)
    assert pl.followers == sum(len(v) - 1 for v in by_key.values()) and "reuse the signals" in pl.render()
    assert pl.est_total_s == pytest.approx(sum(pl.cell_s.values()) + costs.train_cost(task, FedAvg()))


def test_a_cells_time_in_a_shared_cache_build_is_recorded_apart_from_its_attack_time(tmp_path, monkeypatch):
    # arrange: a loss attack that first spends 100 s inside a cache entry's lock, as the first base-model cell on a
    # fresh machine builds the VLM's aligned projector (~40 min) before it scores anything; one fake clock for the
    # cell's timer and the lock's, which only that build advances
    from types import SimpleNamespace

    import bench.units
    from bench import cachefile

    clock = [1e9]
    fake = SimpleNamespace(time=lambda: clock[0], monotonic=lambda: clock[0])
    monkeypatch.setattr(bench.units, "time", fake)
    monkeypatch.setattr(cachefile, "time", fake)

    class BuildsFirst(ToyLossMIA):
        def run(self, obs, candidates):
            with cachefile.file_lock(tmp_path / "entry" / "lock"):
                clock[0] += 100.0
            return super().run(obs, candidates)

    # act
    run([toy_task(rounds=1)], [FedAvg()], [BuildsFirst()], [0], tmp_path / "out")

    # assert: every cell records the build as preparation and leaves it out of its attack time
    costs = [r["cost"] for r in Store(tmp_path / "out").records() if r["status"] == "ok"]
    assert costs and all(c["preparation_s"] >= 100.0 and c["attack_wall_s"] == 0.0 for c in costs), costs


def test_nested_cache_locks_count_their_time_once(tmp_path):
    from bench import cachefile

    before = cachefile.locked_s()
    with cachefile.file_lock(tmp_path / "a.lock"), cachefile.file_lock(tmp_path / "b.lock"):
        time.sleep(0.2)

    assert 0.2 <= cachefile.locked_s() - before < 0.4


def test_a_resumed_units_restored_share_is_on_the_bar_but_not_in_its_eta(monkeypatch):
    from types import SimpleNamespace

    import bench.workbar
    from bench.progress import Resumed, progress_bar

    monkeypatch.delenv("BENCH_QUIET", raising=False)  # a live tqdm bar (a disabled one keeps no count)
    made = []
    monkeypatch.setattr(bench.workbar, "progress_bar", lambda **kw: made.append(progress_bar(**kw)) or made[-1])
    wb = bench.workbar.WorkBar(300.0)
    unit = SimpleNamespace(key="t", cost=300.0)
    wb.start(unit, "training")
    # act: the unit resumes at a third, then reports half
    wb.advance("t", Resumed(1 / 3))
    wb.advance("t", 0.5)
    # assert: 150 s on the bar, 100 of them from before this run; the ETA comes from the other 50
    shown = made[0].format_dict
    wb.close()
    assert (shown["n"], shown["initial"]) == pytest.approx((150.0, 100.0))
    remaining = made[0].format_meter(**{**shown, "elapsed": 50.0, "bar_format": "{remaining_s}"})
    assert float(remaining) == pytest.approx(150.0)  # 150 s left at 1 s of work per second, not 50 s


def test_a_quiet_bar_takes_a_resumed_units_restored_share(monkeypatch):
    """BENCH_QUIET=1 disables the bar; a disabled tqdm has no ``initial``: a resumed unit's report failed its cell."""
    from types import SimpleNamespace

    import bench.workbar
    from bench.progress import Resumed

    monkeypatch.setenv("BENCH_QUIET", "1")
    wb = bench.workbar.WorkBar(300.0)
    unit = SimpleNamespace(key="t", cost=300.0)
    wb.start(unit, "training")

    wb.advance("t", Resumed(1 / 3))
    wb.finish(unit)
    wb.close()

    assert wb._moved == pytest.approx(300.0)


def test_the_postfix_names_the_running_cell_not_a_finished_reference_run(monkeypatch):
    from types import SimpleNamespace

    import bench.workbar
    from bench.progress import progress_bar

    monkeypatch.delenv("BENCH_QUIET", raising=False)  # a live tqdm bar keeps its postfix
    made = []
    monkeypatch.setattr(bench.workbar, "progress_bar", lambda **kw: made.append(progress_bar(**kw)) or made[-1])
    group = [SimpleNamespace(defense_label="fedavg")]
    ref = SimpleNamespace(key="r", cost=10.0, kind="reference", ref_index=3, seed=0)
    cell = SimpleNamespace(
        key="c", cost=10.0, kind="cell", attack=SimpleNamespace(name="rmia"), view="client_model", seed=0
    )
    wb = bench.workbar.WorkBar(20.0)
    wb.start(ref, bench.workbar.unit_label(ref, group))
    wb.advance("r", 0.5)
    named_ref = made[0].postfix
    # act: the reference run ends, its cell starts and reports
    wb.finish(ref)
    wb.start(cell, bench.workbar.unit_label(cell, group))
    wb.advance("c", 0.1)
    # assert
    named_cell = made[0].postfix
    wb.close()
    assert "reference run 3 fedavg seed 0" in named_ref
    assert "fedavg x rmia/client_model seed 0" in named_cell and "reference run" not in named_cell
