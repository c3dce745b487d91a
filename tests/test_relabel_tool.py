"""tools/relabel_rmia_fixed_a.py: RMIA records of the fixed a = 0.3 become ``rmia(a=0.3)`` cells (one-off migration)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import relabel_rmia_fixed_a as tool  # noqa: E402


def _rec(**kw) -> dict:
    rec = {
        "attack": "rmia",
        "attack_label": "rmia",
        "attack_params": {"a": 0.3, "gamma": 1.0},
        "attack_details": {"rmia": {"a": 0.3, "gamma": 1.0}},
        "task": "t",
        "preset": "default",
        "provenance": {"config_hash": "c"},
        "defense_label": "fedavg",
        "view": "global_model",
        "seed": 0,
    }
    rec.update(kw)
    rec["cell_id"] = tool.cell_id(rec, rec["attack_label"])
    return rec


def test_fixed_a_records_move_to_the_rmia_a03_cell_and_tuned_ones_stay(tmp_path):
    d = tmp_path / "sc"
    d.mkdir()
    old, tuned = _rec(), _rec(seed=1, attack_params={"a": None}, attack_details={"rmia": {"a": 0.4, "a_from": {}}})
    for r in (old, tuned):
        (d / f"{r['cell_id']}.json").write_text(json.dumps(r))

    assert tool.relabel(tmp_path) == 1

    new_id = tool.cell_id(old, "rmia(a=0.3)")
    moved = json.loads((d / f"{new_id}.json").read_text())
    assert moved["attack_label"] == "rmia(a=0.3)" and moved["cell_id"] == new_id
    assert not (d / f"{old['cell_id']}.json").exists() and (d / f"{tuned['cell_id']}.json").exists()
    assert tool.relabel(tmp_path) == 0  # idempotent


def test_the_cell_id_is_the_harness_cell_id():
    from attacks.rmia import RMIA
    from bench.matrix import Cell
    from defenses.fedavg import FedAvg
    from tests.toy import toy_task

    task = toy_task()
    for attack in (RMIA(), RMIA(a=0.3)):
        cell = Cell(task, FedAvg(), attack, "global_model", 2)
        rec = {**cell.skeleton(), "attack_label": "rmia"}

        assert tool.cell_id(rec, cell.skeleton()["attack_label"]) == cell.id
