"""Crossing the matrix: every (task, defense config, attack config, view, seed) cell runs once.

Incompatible cells are recorded ``n/a`` with the reason, a raising cell ``failed`` with the error, and
the run goes on. Training per (task, defense, seed) is cached; finished cells are skipped on re-run.
Membership attacks also run on the un-fine-tuned base model (defense ``base``) as the shift check.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import os
import random
import time
import traceback
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .accounting import privacy_record
from .audit import audit_delta, record_bound
from .cells import probe_observations, run_membership, run_reconstruction
from .device import autocast, precision_of
from .matrix import Cell, plan
from .one_run_audit import record_bound as one_run_record
from .params import check_privacy
from .progress import REPORT_S, unit_progress
from .reference import identities as reference_identities
from .reference import reference_count
from .run_state import resolve_delta
from .store import Store, stable_hash, utc_stamp
from .task import Task
from .training import get_training, identity, train_key
from .types import Attack, Defense, n_items
from .workbar import WorkBar


@dataclass
class RunSummary:
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "n/a": 0, "failed": 0, "skipped": 0})
    wall_s: float = 0.0
    trained: int = 0  # training runs executed (or loaded) by this run
    by_phase: dict[str, float] = field(default_factory=dict)  # worker seconds: training, reference runs, attacks
    failed: list[str] = field(default_factory=list)  # one line per cell this run recorded failed, with the reason

    def fail(self, skeleton: dict[str, Any], reason: str) -> None:
        self.counts["failed"] += 1
        self.failed.append(
            f"{skeleton['task']} {skeleton['defense_label']} x {skeleton['attack_label']}/{skeleton['view']} "
            f"seed {skeleton['seed']}: {reason}"
        )


# ----------------------------------------------------------------------------------------------
# work units: what an executor ships to a worker (bench/executors.py)


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
            "traceback": traceback.format_exc(limit=8),
            "wall_s": time.time() - t0,
            "restart": restart,
            "written": False,
        }
        if unit.kind == "cell" and unit.skeleton is not None:
            try:
                write_failed(Store(out), unit.skeleton, reason, traceback=res["traceback"])
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
    restart = False
    try:
        rec.update(_attack_cell(cell, train, store))
        rec["status"] = "ok"
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        reason, restart = failure_reason(e)
        rec.update(status="failed", reason=reason, traceback=traceback.format_exc(limit=8))
    rec["cost"] = {**_costs(train, defense), "attack_wall_s": time.time() - t1}
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
            "cost": {"attack_wall_s": rec["cost"]["attack_wall_s"]},
        }
        store.write(rec)
    return {
        "status": rec["status"],
        "reason": rec.get("reason", ""),
        "wall_s": rec["cost"]["attack_wall_s"],
        "restart": restart,
        "written": True,
    }


def write_failed(store: Store, skeleton: dict, reason: str, *, traceback: str = "") -> None:
    """A failed record for a cell whose worker could not write one (timeout, crash, failed training); it replaces
    a finished record only one older than the unit (a stale or --redo-before record), as a failure inside the
    worker does, so the next run retries the cell."""
    from .runplan import started

    since = started(skeleton)
    if store.finished(skeleton["scenario"], skeleton["cell_id"], accept=lambda rec: started(rec) >= since):
        return  # the worker finished it before it was stopped
    rec = {**skeleton, "status": "failed", "reason": reason, "cost": {}, "utility": {}, "privacy": {}}
    if traceback:
        rec["traceback"] = traceback
    store.write(rec)


def write_na(store: Store, cell: Cell) -> None:
    """n/a cells need no compute (and no training): the scheduler writes them itself."""
    store.write({**cell.skeleton(), "status": "n/a", "reason": cell.na, "cost": {}, "utility": {}, "privacy": {}})


# ----------------------------------------------------------------------------------------------
# the scheduler: training units first, each group's cells once its training is cached


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


def run(
    tasks: list[Task],
    defenses: list[Defense],
    attacks: list[Attack],
    seeds: list[int],
    out: Path,
    *,
    executor=None,
    estimator=None,
    on_plan=None,
    device: str = "cpu",
    redo_before: datetime | None = None,
    views: Collection[str] | None = None,
) -> RunSummary:
    """Run every unfinished cell of the matrix through ``executor`` (default: in this process).

    ``estimator`` (bench.runplan.CostModel) weights the progress bar; ``on_plan(plan)`` is called with the
    plan (bench.runplan.Plan) before anything runs; ``redo_before``: cells whose records started before it run
    again (bench.runplan.Done); ``views``: only the cells in these threat views. Records are written by whoever
    finishes a cell."""
    from .runplan import CostModel, Done, group_key, make_plan, share_key, uses_reference

    out = Path(out)
    store = Store(out)
    executor = executor or InlineExecutor()
    estimator = estimator or CostModel.from_records(out, device=device)
    cells = plan(tasks, defenses, attacks, seeds, views=views)
    broken = [c for c in cells if c.error]  # recorded failed below, never run
    pl = make_plan([c for c in cells if not c.error], store, estimator, jobs=executor.jobs, redo_before=redo_before)
    if on_plan is not None:
        on_plan(pl)
    summary = RunSummary()
    summary.counts["skipped"] = pl.done
    t0 = time.time()
    portable = executor.name != "inline"
    ship = (lambda u: u.portable()) if portable else (lambda u: u)

    def cell_unit(c: Cell) -> Unit:
        return Unit(
            "cell",
            c.id,
            c.task,
            c.defense,
            c.attack,
            c.view,
            c.seed,
            str(out),
            c.skeleton(),
            estimator.cell_cost(c),
            device,
            affinity=share_key(c),
        )

    wb = WorkBar(pl.est_total_s)
    pending: dict[Any, tuple[Unit, list[Cell]]] = {}

    if hasattr(executor, "on_progress"):
        executor.on_progress = wb.advance
    poll = getattr(executor, "poll_progress", None)

    # cells wait for the units they need (their group's training run; a reference-model attack's cells
    # also the group's reference runs): {"keys": unit keys not finished, "cells": ..., "failed": bool}
    blocked: dict[str, list[dict]] = {}  # unit key -> the waiting entries it holds back
    ready: list[list[Cell]] = []  # entries with nothing to wait for, fanned out once every unit is submitted

    def wait_for(keys: set[str], cells: list[Cell], *, recheck: bool = False) -> None:
        """``cells`` run once the units ``keys`` have finished; ``recheck``: they have finished records, which
        are checked again then (Plan.recheck) and redone only if made from other runs."""
        if not cells or (recheck and not keys):
            return
        if not keys:
            ready.append(cells)
            return
        entry: dict[str, Any] = {"keys": set(keys), "cells": cells, "failed": False, "recheck": recheck}
        for k in keys:
            blocked.setdefault(k, []).append(entry)

    def stale(cells: list[Cell]) -> list[Cell]:
        """Of finished cells whose runs were just trained, those whose records came from other weights: added
        to the run (bar and counts)."""
        fresh = Done(store, redo_before=redo_before)
        again = [c for c in cells if not fresh(c)]
        summary.counts["skipped"] -= len(again)
        wb.grow(sum(estimator.cell_cost(c) for c in again))
        return again

    def unblock(key: str, failure: str | None, traceback_: str = "") -> None:
        """Unit ``key`` finished: fan out the cells it was the last to hold back, or fail its cells."""
        for entry in blocked.pop(key, []):
            if entry["failed"]:
                continue
            if failure is not None:
                entry["failed"] = True
                if entry["recheck"]:  # the finished records stay as they are
                    continue
                for c in entry["cells"]:
                    skel = c.skeleton()
                    write_failed(store, skel, failure, traceback=traceback_)
                    summary.fail(skel, failure)
                    wb.move(estimator.cell_cost(c))
                continue
            entry["keys"].discard(key)
            if not entry["keys"]:
                fanout(stale(entry["cells"]) if entry["recheck"] else entry["cells"])

    # units wait here until a worker is free, the most finished work first: cells (their runs are ready), then
    # the training and reference runs group by group, so an interrupted run leaves whole groups recorded
    backlog: list[tuple[tuple, int, Unit, list[Cell]]] = []
    seq = itertools.count()
    order: dict[tuple, int] = {}  # group key -> its place in the plan

    def submit(u: Unit, group: list[Cell]) -> None:
        rank = (0,) if u.kind == "cell" else (1, order.get(group_key(group[0]), 0), u.kind != "train", u.ref_index)
        heapq.heappush(backlog, (rank, next(seq), u, group))

    running: Counter[str] = Counter()  # share keys of the cell units in flight

    def pump() -> None:
        """Hand the executor the next units while it has a free worker (an inline executor runs each now). A cell
        whose signals a running cell is computing (same ``affinity``) waits for it, then reads them from the
        worker's cache: running both side by side would compute the same signals twice for no earlier finish."""
        held = []
        while backlog and len(pending) < max(1, executor.jobs):
            item = heapq.heappop(backlog)
            if item[2].affinity and running[item[2].affinity]:
                held.append(item)
                continue
            launch(item[2], item[3])
        for item in held:
            heapq.heappush(backlog, item)

    def launch(u: Unit, group: list[Cell]) -> None:
        label = ""
        if u.kind != "cell" and group:
            what = "training" if u.kind == "train" else f"reference run {u.ref_index}"
            label = f"{what} {group[0].defense_label} seed {u.seed}"
        wb.start(u, label)
        try:
            pending[executor.submit(ship(u))] = (u, group)
            running[u.affinity] += 1
        except ValueError as e:  # the unit cannot be shipped (no task source): fail its cells
            wb.drop(u.key)
            if u.kind != "cell":
                unblock(u.key, f"not run: {e}")
                return
            for c in [c for c in group if c.id == u.key]:
                skel = c.skeleton()
                write_failed(store, skel, f"not run: {e}")
                summary.fail(skel, f"not run: {e}")

    def fanout(group: list[Cell]) -> None:
        for c in group:
            submit(cell_unit(c), [c])

    try:
        for c in broken:
            skel = c.skeleton()
            write_failed(store, skel, c.error or "")  # a broken cell has its error
            summary.fail(skel, c.error or "")
        for c in pl.na_cells:
            write_na(store, c)
            summary.counts["n/a"] += 1
        units: list[tuple[Unit, list[Cell]]] = []  # training runs first, then reference runs ([RMIA])
        refs: list[tuple[Unit, list[Cell]]] = []
        for key, group in pl.groups.items():
            task, defense, seed = group[0].task, group[0].defense, group[0].seed
            deps: set[str] = set()
            if key in pl.needs_training:
                tkey = train_key(task, defense, seed)
                deps.add(tkey)
                units.append(
                    (
                        Unit(
                            "train",
                            tkey,
                            task,
                            defense,
                            seed=seed,
                            out=str(out),
                            cost=estimator.train_cost(task, defense),
                            device=device,
                        ),
                        group,
                    )
                )
            ref_deps = set()
            for r in pl.needs_reference.get(key, []):  # a base-model group has none (and no training key)
                u = Unit(
                    "reference",
                    f"{train_key(task, defense, seed)}/reference/{r}",
                    task,
                    defense,
                    seed=seed,
                    out=str(out),
                    cost=estimator.train_cost(task, defense),
                    device=device,
                    ref_index=r,
                )
                ref_deps.add(u.key)
                refs.append((u, group))
            again = pl.recheck.get(key, [])
            wait_for(deps, [c for c in group if not uses_reference(c)])
            wait_for(deps | ref_deps, [c for c in group if uses_reference(c)])
            wait_for(deps, [c for c in again if not uses_reference(c)], recheck=True)
            wait_for(deps | ref_deps, [c for c in again if uses_reference(c)], recheck=True)
        order.update((k, i) for i, k in enumerate(pl.groups))
        for u, group in units + refs:
            submit(u, group)
        for cells_ in ready:  # base-model groups and groups whose training (and references) are cached
            fanout(cells_)
        pump()
        while pending:
            done, _ = cf.wait(list(pending), timeout=REPORT_S if poll else None, return_when=cf.FIRST_COMPLETED)
            for key, fraction in poll() if poll else ():
                wb.advance(key, fraction)
            for fut in done:
                unit, group = pending.pop(fut)
                running[unit.affinity] -= 1
                try:
                    res = fut.result()
                except Exception as e:  # noqa: BLE001 - an executor-level error (e.g. a Ray worker lost)
                    res = {"status": "failed", "reason": f"executor error: {type(e).__name__}: {e}", "written": False}
                wb.finish(unit)
                phase = {"train": "training", "reference": "reference runs"}.get(unit.kind) or unit.attack.name  # type: ignore[union-attr]
                summary.by_phase[phase] = summary.by_phase.get(phase, 0.0) + float(res.get("wall_s") or 0.0)
                if unit.kind != "cell":
                    summary.trained += unit.kind == "train"
                    what = "training failed" if unit.kind == "train" else f"reference run {unit.ref_index} failed"
                    ok = res["status"] == "ok"
                    unblock(unit.key, None if ok else f"{what}: {res['reason']}", res.get("traceback", ""))
                    continue
                assert unit.skeleton is not None and unit.attack is not None  # a cell unit
                if not res.get("written"):
                    write_failed(store, unit.skeleton, res["reason"], traceback=res.get("traceback", ""))
                if res["status"] == "failed":
                    summary.fail(unit.skeleton, res["reason"])
                else:
                    summary.counts[res["status"]] += 1
                wb.note(f"{group[0].defense_label} x {unit.attack.name}/{unit.view}: {res['status']}")
            pump()
    except KeyboardInterrupt:  # finished records stay; the rest is redone by the next run
        executor.shutdown(kill=True)
        raise
    finally:
        wb.close()
        executor.shutdown()
    summary.wall_s = time.time() - t0
    return summary


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
