"""Crossing the matrix: every (task, defense config, attack config, view, seed) cell runs once.

Incompatible cells are recorded ``n/a`` with the reason, a raising cell ``failed`` with the error, and
the run goes on. Training per (task, defense, seed) is cached; finished cells are skipped on re-run.
Membership attacks also run on the un-fine-tuned base model (defense ``base``) as the shift check.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cells import probe_observations, run_membership, run_reconstruction
from .progress import progress_bar
from .store import Store, provenance, stable_hash, utc_stamp
from .task import Task
from .training import get_training, label
from .types import Attack, Defense, params_of

FEDERATED_VIEWS = ("global_model", "client_model", "client_update")
CENTRAL_VIEWS = ("released_model",)


@dataclass
class Cell:
    task: Task
    defense: Defense | None  # None: the base model
    attack: Attack
    view: str
    seed: int
    na: str | None = None  # reason the cell does not apply

    @property
    def defense_label(self) -> str:
        return label(self.defense) if self.defense is not None else "base"

    @property
    def id(self) -> str:
        return stable_hash({"task": self.task.id, "preset": self.task.preset, "cfg": self.task.config_hash(),
                            "defense": self.defense_label, "attack": label(self.attack), "view": self.view,
                            "seed": self.seed})

    def skeleton(self) -> dict[str, Any]:
        return {"cell_id": self.id, "scenario": self.task.scenario, "task": self.task.id, "preset": self.task.preset,
                "defense": self.defense.name if self.defense else "base",
                "defense_params": params_of(self.defense) if self.defense else {},
                "defense_label": self.defense_label, "attack": self.attack.name,
                "attack_params": params_of(self.attack), "attack_label": label(self.attack),
                "attack_kind": self.attack.kind, "view": self.view, "seed": self.seed,
                "provenance": {**provenance(), "config_hash": self.task.config_hash(),
                               "started_at": utc_stamp()}}


def views_of(defense: Defense) -> tuple[str, ...]:
    return CENTRAL_VIEWS if defense.setting == "central" else FEDERATED_VIEWS


def plan(tasks: list[Task], defenses: list[Defense], attacks: list[Attack], seeds: list[int]) -> list[Cell]:
    cells: list[Cell] = []
    for task in tasks:
        for seed in seeds:
            for attack in attacks:
                a_na = attack.applies(task.api)
                if attack.kind == "membership" and "global_model" in attack.views:
                    cells.append(Cell(task, None, attack, "global_model", seed, na=a_na))
                for defense in defenses:
                    d_na = defense.applies(task.api)
                    views = [v for v in attack.views if v in views_of(defense)]
                    if not views:
                        cells.append(Cell(task, defense, attack, attack.views[0], seed,
                                          na=f"{attack.name} observes {'/'.join(attack.views)}; "
                                             f"{defense.name} exposes {'/'.join(views_of(defense))}"))
                        continue
                    for view in views:
                        mode = defense.fl_mode() or task.fl.mode
                        v_na = (f"client_model needs weight messages; {defense.name} sends gradients (FedSGD), "
                                f"so there is no client model to reconstruct") \
                            if view == "client_model" and mode == "fedsgd" else None
                        cells.append(Cell(task, defense, attack, view, seed, na=d_na or a_na or v_na))
    return cells


@dataclass
class RunSummary:
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "n/a": 0, "failed": 0, "skipped": 0})
    wall_s: float = 0.0


def run(tasks: list[Task], defenses: list[Defense], attacks: list[Attack], seeds: list[int], out: Path) -> RunSummary:
    store = Store(out)
    cells = plan(tasks, defenses, attacks, seeds)
    summary = RunSummary()
    t0 = time.time()
    todo = []
    for c in cells:
        if store.finished(c.task.scenario, c.id):
            summary.counts["skipped"] += 1
        else:
            todo.append(c)
    groups: dict[tuple, list[Cell]] = {}
    for c in todo:
        groups.setdefault((c.task.id, c.defense_label, c.seed), []).append(c)
    bar = progress_bar(total=len(todo), desc="cells")
    for (_, _, seed), group in groups.items():
        task, defense = group[0].task, group[0].defense
        train, train_err, shared = None, None, {"probes": None}
        for cell in group:
            rec = cell.skeleton()
            t1 = time.time()
            try:
                if cell.na:
                    rec.update(status="n/a", reason=cell.na)
                else:
                    if defense is not None and train is None and train_err is None:
                        try:
                            train = get_training(task, defense, seed, out / "cache")
                        except Exception as e:  # recorded as failed for every cell of the group
                            train_err = f"training failed: {type(e).__name__}: {e}"
                            rec["traceback"] = traceback.format_exc(limit=8)
                        t1 = time.time()  # the attack's time excludes training (cost.train_wall_s has it)
                    if train_err:
                        raise RuntimeError(train_err)
                    rec.update(_attack_cell(cell, train, store, shared))
                    rec["status"] = "ok"
            except Exception as e:
                rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
                rec.setdefault("traceback", traceback.format_exc(limit=8))
            rec["cost"] = {**_costs(train, defense), "attack_wall_s": time.time() - t1}
            rec["utility"] = dict(train.utility) if train is not None else {}
            # n/a cells never trained: the composed epsilon needs the trained message structure.
            rec["privacy"] = _privacy(task, defense, train) if not cell.na else {}
            try:
                store.write(rec)
            except (TypeError, ValueError) as e:  # an unserialisable result: keep the cell, as failed
                rec = {**cell.skeleton(), "status": "failed", "reason": f"record not serialisable: {e}"}
                store.write(rec)
            summary.counts[rec["status"]] += 1
            bar.update(1)
            bar.set_postfix_str(f"{cell.defense_label} x {cell.attack.name}/{cell.view}: {rec['status']}")
    bar.close()
    summary.wall_s = time.time() - t0
    return summary


def _attack_cell(cell: Cell, train, store: Store, shared: dict) -> dict:
    """Run one applicable cell; ``shared`` caches the group's reconstruction probes."""
    if cell.attack.kind == "membership":
        return run_membership(cell.task, cell.defense, cell.attack, cell.view, train, cell.seed)
    if cell.view != "client_update":
        raise ValueError(f"reconstruction attack {cell.attack.name} needs the client_update view")
    if shared["probes"] is None:
        shared["probes"] = probe_observations(cell.task, cell.defense, cell.seed)
    return run_reconstruction(cell.task, cell.attack, shared["probes"], cell.seed, store.artifact_dir(cell.id))


def _costs(train, defense) -> dict[str, Any]:
    if train is None:
        return {}
    rounds = max(1, len(train.bytes_down))
    return {"bytes_up_per_round": sum(m["bytes"] for m in train.transcript) / rounds,
            "params_up_per_round": sum(m["numel"] for m in train.transcript) / rounds,
            "bytes_down_per_round": sum(train.bytes_down) / rounds,
            "rounds": len(train.bytes_down), "train_wall_s": train.wall_s, "peak_mem_mb": train.peak_mem_mb}


def _privacy(task: Task, defense: Defense | None, train) -> dict[str, Any]:
    if defense is None:
        return {"epsilon": None, "epsilon_composed": None, "delta": None, "sample_rate": None, "note": ""}
    delta = getattr(defense, "_delta", None) or getattr(defense, "delta", None) or task.api.info.get("dp_delta", 1e-5)
    eps = defense.epsilon(delta=delta)
    fl = task.fl
    central = defense.setting == "central"
    rounds = len(train.bytes_down) if train is not None else fl.rounds
    rate = 1.0 if central else fl.clients_per_round / fl.num_clients
    names = tuple(train.global_state) if train is not None else None
    comp = defense.epsilon_composed(delta=delta, rounds=rounds, sample_rate=rate, names=names) \
        if eps is not None else None
    n = sum(len(d) for d in task.client_data)
    note = ""
    if eps is not None and delta >= 1.0 / max(1, n):
        note = f"delta={delta:g} >= 1/n: no meaningful guarantee"
    return {"epsilon": eps, "epsilon_composed": comp, "delta": delta if eps is not None else None,
            "sample_rate": rate if eps is not None else None, "note": note}
