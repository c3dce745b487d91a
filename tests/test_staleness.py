"""The leaderboard's staleness check (bench.staleness): records the current code would redo, from records alone."""

from __future__ import annotations

from bench.matrix import Cell
from bench.registry import SCENARIOS
from bench.specs import declared
from bench.staleness import check
from bench.store import jsonable
from defenses.fedavg import FedAvg
from defenses.fedsgd import FedSGD
from tests.test_store import record


def _record(cell: Cell, **over) -> dict:
    """A finished record of ``cell`` as a run would write it (its skeleton), with ``over`` applied."""
    skel = {k: v for k, v in cell.skeleton().items() if k != "provenance"}
    return jsonable(record(**{**skel, "attack_kind": cell.attack.kind, **over}))


def test_records_made_under_an_earlier_protocol_budget_or_default_are_stale_and_unknown_ones_unchecked():
    # arrange: declared smoke image-cls cells (no task built) and records of them
    from attacks.inverting_gradients import InvertingGradients
    from attacks.loss_mia import LossMIA
    from attacks.rmia import RMIA

    task = next(t for t in declared(SCENARIOS.get("image-cls"), "smoke") if t.id.endswith("resnet34"))
    recon = Cell(task, FedSGD(), InvertingGradients(), "client_update", 0)
    member = Cell(task, FedAvg(), LossMIA(), "global_model", 1)
    refs = Cell(task, FedSGD(), RMIA(), "global_model", 1)
    current = [_record(c) for c in (recon, member, refs)]
    old_probe = _record(recon, probe="train-mode BatchNorm")  # an earlier probe protocol
    old_batches = {k: v for k, v in _record(refs).items() if k != "fedsgd_batches"}  # before seeded batches
    # made when the default batch size was 3: its label omits the parameter its params give another value
    old_default = _record(member, attack_params={**_record(member)["attack_params"], "batch_size": 3})
    toy = record()  # a scenario this code does not have

    # act
    fresh = check(current)
    found = check([old_probe, old_batches, old_default, toy])

    # assert
    assert fresh.stale == {} and fresh.unchecked == 0
    assert set(found.stale) == {f"image-cls/{recon.id}", f"image-cls/{refs.id}", f"image-cls/{member.id}"}
    assert found.stale[f"image-cls/{recon.id}"].startswith("probe:")
    assert found.stale[f"image-cls/{refs.id}"].startswith("fedsgd_batches:")
    assert found.stale[f"image-cls/{member.id}"].startswith("attack_params:")
    assert found.unchecked == 1  # the toy record


def test_a_record_of_a_non_default_configuration_stays_current_when_a_default_changes():
    """A label names the parameters set away from the defaults: a record of ``inverting_gradients(restarts=2)`` made
    before another field's default changed is stale (rebuilt as the grid builds it, its params differ), one made
    after is current."""
    from attacks.inverting_gradients import InvertingGradients

    task = next(t for t in declared(SCENARIOS.get("image-cls"), "smoke") if t.id.endswith("vit"))
    cell = Cell(task, FedSGD(), InvertingGradients(restarts=2), "client_update", 0)
    now = _record(cell)
    before = _record(cell, attack_params={**now["attack_params"], "init": "zeros"})

    assert check([now]).stale == {} and check([now]).unchecked == 0
    assert list(check([before]).stale.values())[0].startswith("attack_params:")


def test_the_leaderboard_leaves_stale_records_out_and_counts_them(tmp_path):
    # arrange: one current record and one made before seeded FedSGD batches, in a store
    from attacks.loss_mia import LossMIA
    from attacks.rmia import RMIA
    from bench.report.results import Results
    from bench.store import Store

    task = next(t for t in declared(SCENARIOS.get("image-cls"), "smoke") if t.id.endswith("vit"))
    member, refs = Cell(task, FedAvg(), LossMIA(), "global_model", 0), Cell(task, FedSGD(), RMIA(), "global_model", 1)
    store = Store(tmp_path)
    store.write(_record(member))
    store.write({k: v for k, v in _record(refs).items() if k != "fedsgd_batches"})

    # act
    res = Results.load(tmp_path)

    # assert
    assert [r["cell_id"] for r in res.records] == [member.id]
    assert res.stale == {(task.id, "smoke"): 1}
