"""What a leaderboard covers: every applicable cell of the default grid with its recorded seeds, ``not run`` where
there is none, so a missing row or a one-seed row cannot pass for a measured one."""

from __future__ import annotations

from bench.report import coverage
from bench.report.results import Results
from tests.test_leaderboard import rec

A = ("sc/a", "fedavg", "mia", "global_model")
B = ("sc/a", "dp", "mia", "global_model")
C = ("sc/a", "dp", "mia", "client_model")


def test_each_applicable_cell_shows_its_seeds_and_the_unrun_ones_are_listed():
    records = [rec(defense="fedavg", seed=s) for s in (0, 1, 2)]
    records += [rec(defense="dp", seed=0), rec(defense="dp", seed=1, status="n/a", reason="does not apply")]
    records += [rec(defense="extra", seed=0)]  # recorded, outside the planned grid: still shown
    res = Results(records)

    cov = coverage.coverage_table(res, "sc", {"smoke": {A, B, C}})
    md = "\n".join(coverage.markdown(cov, "sc", []))

    got = {(r.defense, r.view): (r.in_grid, r.seeds, r.coverage) for r in cov.itertuples()}
    assert got == {
        ("fedavg", "global_model"): (True, "0,1,2", "covered"),
        ("dp", "global_model"): (True, "0", "fewer seeds"),  # the n/a record of seed 1 is no measurement
        ("dp", "client_model"): (True, "", "not run"),
        ("extra", "global_model"): (False, "0", "fewer seeds"),
    }
    assert coverage.summary(cov) == "2 of 3 cells measured, 1 at >= 3 seeds (and 1 recorded outside the default grid)"
    assert "| sc/a | dp | 1 of 2 | 0 | 0 | mia (client) | 0 |" in md
    assert "| sc/a | fedavg | 1 of 1 | 1 | 0,1,2 | - | 0 |" in md
    assert "| sc/a | extra | 0 of 0 | 0 | 0 | - | 1 |" in md


def test_a_preset_without_static_declarations_is_said_to_be_unplanned():
    res = Results([rec(defense="fedavg", seed=0)])

    cov = coverage.coverage_table(res, "sc", {"smoke": None})
    md = "\n".join(coverage.markdown(cov, "sc", ["smoke"]))

    assert list(cov.coverage) == ["fewer seeds"] and list(cov.in_grid) == [None]
    assert coverage.summary(cov) == "1 of 1 cells measured, 0 at >= 3 seeds"
    assert "Not planned here (no static task declarations): preset smoke" in md


def test_the_planned_cells_are_the_registries_applicable_default_grid(monkeypatch):
    from bench.registry import DEFENSES
    from defenses.fedavg import FedAvg

    class Toy(FedAvg):  # registered at run time (a test's toy, a contributed file): not in the planned grid
        name = "toy_registered_at_run_time"

    monkeypatch.setitem(DEFENSES._items, "toy_registered_at_run_time", Toy)
    cells = coverage.planned_cells("llm-text", "smoke")

    assert cells is not None and ("llm-text", "fedavg", "loss_mia", "global_model") in cells
    assert ("llm-text", "base", "loss_mia", "global_model") in cells  # the base model's row too
    assert not any(attack in ("april", "inverting_gradients") for _, _, attack, _ in cells)  # n/a on text
    assert not any(defense.startswith("toy_") for _, defense, _, _ in cells)
    assert coverage.planned_cells("no-such-scenario", "smoke") is None
