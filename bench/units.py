"""Work units and how a worker executes them: a training run, a reference run of its recipe ([RMIA]) or one attack
cell (:class:`Unit`), shipped to a worker by an executor (bench/executors.py; :class:`InlineExecutor` runs it in this
process) and run by :func:`execute_unit`, which writes the cell's record itself (atomically) and never raises but
for KeyboardInterrupt. The scheduler that orders the units is :func:`bench.runner.run`.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import cachefile, signal_cache
from .accounting import privacy_record
from .audit import audit_delta, record_bound
from .cells import run_membership
from .device import autocast, precision_of
from .matrix import Cell
from .one_run_audit import record_bound as one_run_record
from .params import check_privacy
from .progress import on_saved, unit_progress
from .recon_cells import probe_observations, run_reconstruction
from .reference import identities as reference_identities
from .reference import reference_count
from .run_state import resolve_delta
from .store import Store, stable_hash, utc_stamp
from .task import Task
from .training import get_training, identity, train_key
from .types import Attack, Defense, n_items


@dataclass(frozen=True)
class TaskRef:
    """A task as another process rebuilds it: its builder, id and configuration hash."""

    source: Any
    task_id: str
    config_hash: str


@dataclass
class Unit:
    """One piece of isolated work: a training run (``kind="train"``), a reference run of a training run's recipe
    (``"reference"``, [RMIA]: index ``ref_index``) or one attack cell (``"cell"``)."""

    kind: str
    key: str  # train key or cell id
    task: Any  # Task in this process; TaskRef when shipped to a worker
    defense: Defense | None
    attack: Attack | None = None
    view: str = ""
    seed: int = 0
    out: str = ""
    skeleton: dict | None = None
    cost: float = 1.0  # estimated seconds (progress weight)
    device: str = "cpu"  # where the worker builds models (bench.device; resolved by the CLI)
    registered: tuple[str, str] = ("", "")  # registry names of the defense / attack classes (see execute_unit)
    ref_index: int = -1  # a reference unit's reference run (bench.reference)
    gpu_mem_mb: int | None = None  # GPU memory the unit needs (its task's declaration; bench.executors.SlotPool)
    affinity: str = ""  # a cell's signal-sharing key (bench.runplan.share_key): such cells run one at a time

    def __post_init__(self) -> None:
        if self.gpu_mem_mb is None:
            self.gpu_mem_mb = getattr(self.task, "gpu_mem_mb", None)

    def portable(self) -> Unit:
        t = self.task
        if isinstance(t, Task):
            if t.source is None:
                raise ValueError(
                    f"task {t.id} has no `source` builder, so a worker process cannot rebuild it; "
                    f"run it with the inline executor"
                )
            t = TaskRef(t.source, t.id, t.config_hash())
        names = (
            self.defense.name if self.defense is not None else "",
            self.attack.name if self.attack is not None else "",
        )
        return replace(self, task=t, registered=names)


_TASKS: dict[tuple[str, str], Task] = {}  # per worker process: tasks rebuilt from their TaskRef
_TRAIN_LRU: dict[str, Any] = {}  # per process: the last training result loaded and its identity (a group shares it)
_SHARED: dict[str, Any] = {"key": None, "probes": None}  # per process: the last group's reconstruction probes


def resolve_task(t: Task | TaskRef) -> Task:
    if isinstance(t, Task):
        return t
    key = (t.task_id, t.config_hash)
    if key not in _TASKS:
        built = t.source()
        for b in built if isinstance(built, (list, tuple)) else [built]:
            _TASKS[(b.id, b.config_hash())] = b
    if key not in _TASKS:
        raise RuntimeError(
            f"rebuilding task {t.task_id} in the worker gave another configuration "
            f"(config hash {t.config_hash} not among {sorted(h for i, h in _TASKS if i == t.task_id)})"
        )
    return _TASKS[key]


def on_device(task: Task, device: str) -> Task:
    """``task`` whose ``api.build_model`` puts each model it builds on ``device``: every model of a unit (trained,
    attacked, base) is built through it, and the code after that follows the model's device."""
    if device == "cpu" or getattr(task.api.build_model, "device", None) == device:
        return task
    build = task.api.build_model

    def placed():
        return build().to(device)

    placed.device = device  # type: ignore[attr-defined]
    return replace(task, api=replace(task.api, build_model=placed))


def _seed_all(seed: int) -> None:
    """Every unit starts from the same RNG state wherever and after whatever it runs (jobs 1 == jobs N)."""
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 - code under test may draw from numpy's global RNG
    torch.manual_seed(seed)


def _training(task: Task, defense: Defense, seed: int, out: Path):
    key = f"{out.resolve()}:{train_key(task, defense, seed)}"
    if key not in _TRAIN_LRU:
        _TRAIN_LRU.clear()
        train = get_training(task, defense, seed, out / "cache")
        _TRAIN_LRU[key] = (train, identity(task, defense, seed, out / "cache"))  # read once per group
    return _TRAIN_LRU[key]


def failure_reason(e: BaseException) -> tuple[str, bool]:
    """The recorded reason for an exception at a unit boundary, and whether the worker should be replaced."""
    cap = os.environ.get("BENCH_MEM_CAP_MB", "")
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e)):
        where = f"exceeded memory cap ({cap} MB)" if cap else "out of memory"
        return f"{where}: {type(e).__name__}: {e}", True
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) raised inside the cell (the code called sys.exit)", False
    return f"{type(e).__name__}: {e}", False


def failure_kind(e: BaseException) -> str:
    """A failed record's ``failure`` (schema revision 12): ``diverged`` when training under the defense produced
    non-finite values (bench.fl.TrainingDiverged: the defense's outcome at its budget), else ``error``."""
    from .fl import TrainingDiverged

    return "diverged" if isinstance(e, TrainingDiverged) else "error"


def execute_unit(unit: Unit) -> dict:
    """Run one unit where it landed; a cell writes its own record (atomically). Never raises but for
    KeyboardInterrupt: any other BaseException (SystemExit included) becomes a failed outcome."""
    t0 = time.time()
    out = Path(unit.out)
    base = {"key": unit.key, "kind": unit.kind, "restart": False}
    try:
        for obj, key in ((unit.defense, unit.registered[0]), (unit.attack, unit.registered[1])):
            if obj is not None and key and not type(obj).name:  # an entry point's class is named by the
                type(obj).name = key  # parent's registry; a worker imports the bare class
        task = on_device(resolve_task(unit.task), unit.device)
        _seed_all(unit.seed)
        if unit.kind == "train":
            # not kept in memory: every cell reads the stored copy, so a cell's numbers never depend on
            # whether its worker also trained (in-memory and loaded tensors differ in alignment, and BLAS
            # rounding with it)
            _TRAIN_LRU.clear()
            assert unit.defense is not None  # a train unit trains a defense
            with autocast(task, unit.device):  # --precision (bench.device)
                train = get_training(task, unit.defense, unit.seed, out / "cache")
            return {**base, "status": "ok", "reason": "", "wall_s": time.time() - t0, "train_wall_s": train.wall_s}
        if unit.kind == "reference":  # cached, not kept: cells read the stored copy, as after a train unit
            from .reference import train_reference

            assert unit.defense is not None and unit.ref_index >= 0  # a reference run of a defense's recipe
            with autocast(task, unit.device):
                train_reference(task, unit.defense, unit.seed, unit.ref_index, out / "cache")
            return {**base, "status": "ok", "reason": "", "wall_s": time.time() - t0}
        with autocast(task, unit.device):
            return {**base, **_execute_cell(unit, task, out)}
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        reason, restart = failure_reason(e)
        res: dict[str, Any] = {
            **base,
            "status": "failed",
            "reason": reason,
            "failure": failure_kind(e),
            "traceback": traceback.format_exc(limit=8),
            "wall_s": time.time() - t0,
            "restart": restart,
            "written": False,
        }
        if unit.kind == "cell" and unit.skeleton is not None:
            try:
                write_failed(Store(out), unit.skeleton, reason, traceback=res["traceback"], failure=res["failure"])
                res["written"] = True
            except Exception:  # noqa: BLE001 - the parent writes it then
                pass
        return res


def _execute_cell(unit: Unit, task: Task, out: Path) -> dict:
    store = Store(out)
    defense = unit.defense
    assert unit.attack is not None and unit.skeleton is not None  # a cell unit
    cell = Cell(task, defense, unit.attack, unit.view, unit.seed)
    rec = {
        **unit.skeleton,
        "provenance": {
            **unit.skeleton["provenance"],
            "started_at": utc_stamp(),
            "device": unit.device,
            "precision": precision_of(task),
        },
    }
    train, ident = _training(task, defense, unit.seed, out) if defense is not None else (None, None)
    t1 = time.time()  # the attack's time excludes loading the training run (cost.train_wall_s has it)
    locked0 = cachefile.locked_s()  # and one-off preparations (a base-model cell builds the model it scores)
    signals0 = dict(signal_cache.TOTALS)
    restart = False
    marker = signal_cache.marker_path(out / "cache", cell.id)  # the share its spilled passes hold, for a later plan
    try:
        with on_saved(lambda f: signal_cache.write_marker(marker, f)):
            rec.update(_attack_cell(cell, train, store))
        rec["status"] = "ok"
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        reason, restart = failure_reason(e)
        rec.update(status="failed", reason=reason, failure=failure_kind(e), traceback=traceback.format_exc(limit=8))
    prep = cachefile.locked_s() - locked0
    rec["cost"] = {**_costs(train, defense), "attack_wall_s": max(0.0, time.time() - t1 - prep), "preparation_s": prep}
    if cell.attack.kind == "membership":  # how much of its signal work earlier cells had done (bench.runplan)
        for k in ("reused", "computed", "loaded"):
            rec["cost"][f"signals_{k}"] = signal_cache.TOTALS[k] - signals0[k]
    rec["utility"] = dict(train.utility) if train is not None else {}
    if ident is not None:  # the run the cell scored (bench.runplan.Done: a record of another run is stale)
        rec["training"] = {"sha256": ident["sha256"]}
        if rec.get("status") == "ok" and getattr(cell.attack, "uses_reference", False):  # and its reference runs
            assert defense is not None  # ident names a defense's training run
            refs = reference_identities(task, defense, unit.seed, reference_count(task, [cell.attack]), out / "cache")
            if refs is not None:
                rec["training"]["references"] = refs
    rec["privacy"] = _privacy(task, defense, train)
    if rec.get("status") == "ok" and cell.attack.kind == "membership" and rec.get("per_candidate"):  # bench.audit
        delta = audit_delta(rec["privacy"].get("delta"))
        attack = rec["attack_label"]
        rec["privacy"]["epsilon_lower_bound"] = record_bound(rec["per_candidate"], delta=delta, attack=attack)
        one = one_run_record(rec, delta=delta)  # Steinke et al. 2023, on member / non-member pairs
        rec["privacy"]["epsilon_one_run_lower_bound"] = {**one.as_dict(), "attack": attack}
    try:
        store.write(rec)
    except (TypeError, ValueError) as e:  # unserialisable or failing the schema: keep the cell, as failed
        rec = {
            **unit.skeleton,
            "status": "failed",
            "reason": f"record not written: {e}",
            "failure": "error",
            "cost": {"attack_wall_s": rec["cost"]["attack_wall_s"]},
        }
        store.write(rec)
    if rec["status"] == "ok":
        marker.unlink(missing_ok=True)
    return {
        "status": rec["status"],
        "reason": rec.get("reason", ""),
        "failure": rec.get("failure", ""),
        "wall_s": rec["cost"]["attack_wall_s"],
        "restart": restart,
        "written": True,
    }


def write_failed(store: Store, skeleton: dict, reason: str, *, traceback: str = "", failure: str = "error") -> None:
    """A failed record for a cell whose worker could not write one (timeout, crash, failed training); it replaces
    a finished record only one older than the unit (a stale or --redo-before record), as a failure inside the
    worker does, so the next run retries the cell."""
    from .runplan import started

    since = started(skeleton)
    if store.finished(skeleton["scenario"], skeleton["cell_id"], accept=lambda rec: started(rec) >= since):
        return  # the worker finished it before it was stopped
    rec = {
        **skeleton,
        "status": "failed",
        "reason": reason,
        "failure": failure,
        "cost": {},
        "utility": {},
        "privacy": {},
    }
    if traceback:
        rec["traceback"] = traceback
    store.write(rec)


def write_na(store: Store, cell: Cell) -> None:
    """n/a cells need no compute (and no training): the scheduler writes them itself."""
    store.write({**cell.skeleton(), "status": "n/a", "reason": cell.na, "cost": {}, "utility": {}, "privacy": {}})


class InlineExecutor:
    """Runs each unit at once in this process: no isolation (library use, quick tests)."""

    name = "inline"

    def __init__(self) -> None:
        self.jobs = 1
        self.on_progress = None  # (unit key, done fraction) -> None, called while a unit runs (bench.progress)

    def submit(self, unit) -> cf.Future:
        fut: cf.Future = cf.Future()
        report = self.on_progress
        try:
            with unit_progress((lambda f: report(unit.key, f)) if report is not None else None):
                fut.set_result(execute_unit(unit))
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # execute_unit catches the unit's own errors; this is the harness's
            fut.set_exception(e)
        return fut

    def shutdown(self, *, kill: bool = False) -> None:
        pass


def _attack_cell(cell: Cell, train, store: Store) -> dict:
    """Run one applicable cell; this process keeps the last group's reconstruction probes."""
    if cell.attack.kind == "membership":
        return run_membership(
            cell.task, cell.defense, cell.attack, cell.view, train, cell.seed, cache_root=store.out / "cache"
        )  # reference models ([RMIA]) cache beside training
    if cell.view != "client_update":
        raise ValueError(f"reconstruction attack {cell.attack.name} needs the client_update view")
    key = stable_hash(
        {"task": cell.task.id, "cfg": cell.task.config_hash(), "defense": cell.defense_label, "seed": cell.seed}
    )
    if _SHARED["key"] != key:
        _SHARED.update(key=None, probes=None)
        assert cell.defense is not None  # reconstruction cells attack a defense's client update
        _SHARED.update(probes=probe_observations(cell.task, cell.defense, cell.seed), key=key)
    return run_reconstruction(cell.task, cell.attack, _SHARED["probes"], cell.seed, store.artifact_dir(cell.id))


def _costs(train, defense) -> dict[str, Any]:
    if train is None:
        return {}
    rounds = max(1, len(train.bytes_down))
    return {
        "bytes_up_per_round": sum(m["bytes"] for m in train.transcript) / rounds,
        "params_up_per_round": sum(m["numel"] for m in train.transcript) / rounds,
        "bytes_down_per_round": sum(train.bytes_down) / rounds,
        "rounds": len(train.bytes_down),
        "train_wall_s": train.wall_s,
        "peak_mem_mb": train.peak_mem_mb,
    }


def _privacy(task: Task, defense: Defense | None, train) -> dict[str, Any]:
    if defense is None:
        return {"epsilon": None, "epsilon_composed": None, "delta": None, "sample_rate": None, "note": ""}
    # delta is the harness's (the one run_federated's DefenseRun used), never state read off the defense
    fl = task.fl
    central = defense.setting == "central"
    rec = privacy_record(
        defense,
        delta=resolve_delta(defense, task.api),
        rounds=len(train.bytes_down) if train is not None else fl.rounds,
        sample_rate=1.0 if central else fl.clients_per_round / fl.num_clients,
        names=tuple(train.global_state) if train is not None else None,
        n_samples=sum(n_items(d) for d in task.client_data),
    )
    check_privacy(rec, defense.name)  # a NaN / negative / infinite epsilon fails the cell with the reason
    return rec
