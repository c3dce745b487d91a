"""Crossing the matrix: every (task, defense config, attack config, view, seed) cell runs once.

Incompatible cells are recorded ``n/a`` with the reason, a raising cell ``failed`` with the error, and
the run goes on. Training per (task, defense, seed) is cached; finished cells are skipped on re-run.
Membership attacks also run on the un-fine-tuned base model (defense ``base``) as the shift check.

:func:`run` is the scheduler: training and reference runs first, each group's cells once its runs are cached. The
units it hands an executor, and how a worker runs them, are in :mod:`bench.units`.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .matrix import Cell, plan
from .progress import REPORT_S
from .store import Store
from .task import Task
from .training import train_key
from .types import Attack, Defense
from .units import (  # re-exported: the run's units, as callers and tests name them from here
    InlineExecutor,
    TaskRef,
    Unit,
    execute_unit,
    on_device,
    write_failed,
    write_na,
)
from .workbar import WorkBar, unit_label

__all__ = [
    "InlineExecutor",
    "RunSummary",
    "TaskRef",
    "Unit",
    "execute_unit",
    "on_device",
    "plan",
    "run",
    "write_failed",
    "write_na",
]


@dataclass
class RunSummary:
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "n/a": 0, "failed": 0, "skipped": 0})
    wall_s: float = 0.0
    trained: int = 0  # training runs executed (or loaded) by this run
    by_phase: dict[str, float] = field(default_factory=dict)  # worker seconds: training, reference runs, attacks
    failed: list[str] = field(default_factory=list)  # one line per cell this run recorded failed, with the reason
    diverged: int = 0  # of them, cells whose training run diverged under the defense (``failure: diverged``)

    def fail(self, skeleton: dict[str, Any], reason: str, failure: str = "error") -> None:
        self.counts["failed"] += 1
        self.diverged += failure == "diverged"
        self.failed.append(
            f"{skeleton['task']} {skeleton['defense_label']} x {skeleton['attack_label']}/{skeleton['view']} "
            f"seed {skeleton['seed']}: {reason}"
        )


# ----------------------------------------------------------------------------------------------
# the scheduler: training units first, each group's cells once its training is cached


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

    ``estimator`` (bench.costs.CostModel) weights the progress bar; ``on_plan(plan)`` is called with the
    plan (bench.runplan.Plan) before anything runs; ``redo_before``: cells whose records started before it run
    again (bench.runplan.Done); ``views``: only the cells in these threat views. Records are written by whoever
    finishes a cell."""
    from .costs import CostModel
    from .runplan import Done, group_key, make_plan, share_key, uses_reference

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

    def estimate(c: Cell) -> float:
        """The plan's estimate of the cell (follower cells included), else the cost model's."""
        return pl.cell_s[c.id] if c.id in pl.cell_s else estimator.cell_cost(c)

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
            estimate(c),
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

    def unblock(key: str, failure: str | None, traceback_: str = "", kind: str = "error") -> None:
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
                    write_failed(store, skel, failure, traceback=traceback_, failure=kind)
                    summary.fail(skel, failure, kind)
                    wb.move(estimate(c))  # what the plan counted
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
            if orphaned(item[2]):  # its cells failed with their training run: nothing waits for it
                blocked.pop(item[2].key, None)
                wb.move(item[2].cost)
                continue
            if item[2].affinity and running[item[2].affinity]:
                held.append(item)
                continue
            launch(item[2], item[3])
        for item in held:
            heapq.heappush(backlog, item)

    def orphaned(u: Unit) -> bool:
        """A reference run not started whose every waiting cell has failed already (e.g. the target's training
        diverged): training it would only fill the cache."""
        entries = blocked.get(u.key, [])
        return u.kind == "reference" and bool(entries) and all(e["failed"] for e in entries)

    def launch(u: Unit, group: list[Cell]) -> None:
        wb.start(u, unit_label(u, group))
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
                    unblock(
                        unit.key,
                        None if ok else f"{what}: {res['reason']}",
                        res.get("traceback", ""),
                        res.get("failure") or "error",
                    )
                    continue
                assert unit.skeleton is not None and unit.attack is not None  # a cell unit
                if not res.get("written"):
                    write_failed(
                        store,
                        unit.skeleton,
                        res["reason"],
                        traceback=res.get("traceback", ""),
                        failure=res.get("failure") or "error",
                    )
                if res["status"] == "failed":
                    summary.fail(unit.skeleton, res["reason"], res.get("failure") or "error")
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
