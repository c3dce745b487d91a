"""What a leaderboard covers: the cells ``bench run --defense all --attack all --grid defaults`` applies at the
records' preset, and the seeds each one has a record for.

A leaderboard shows the rows it has records for; a defense that was never run leaves no row, and a row measured on
one seed looks like one measured on three. This table makes both visible: each applicable (task, defense, attack,
view) with its recorded seeds, ``not run`` where there is none. The applicable cells come from the registries and the
scenarios' static declarations (``bench.specs``: no data, no model), as ``bench list`` plans them; a scenario that
declares none at a preset is not planned here (its coverage says so) rather than built.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pandas as pd

from .markdown import md_escape
from .results import VIEW_SHORT, Results

FULL_SEEDS = 3  # seeds a cell needs to count as covered ([issue 11]: the default snapshot has >= 3 seeds)
Key = tuple[str, str, str, str]  # (task, defense label, attack label, view)
# in_grid: the default grid applies the cell (False: a recorded configuration outside it, e.g. a FedSGD form or an
# attack variant; None: the preset was not planned)
COLUMNS = ["preset", "task", "defense", "attack", "view", "in_grid", "seeds", "n_seeds", "coverage"]


def planned_cells(scenario: str, preset: str) -> set[Key] | None:
    """The (task, defense, attack, view) cells the default grid applies to ``scenario`` at ``preset``; None when
    the scenario is not registered here or declares no static tasks at that preset."""
    from bench.matrix import plan
    from bench.registry import ATTACKS, DEFENSES, SCENARIOS, expand
    from bench.specs import declared
    from bench.training import label

    if scenario not in SCENARIOS.names():
        return None
    tasks: list[Any] | None = declared(SCENARIOS.get(scenario), preset)  # DeclaredTask: what plan reads of a Task
    if tasks is None:
        return None
    # the installed methods only: the planned grid must not depend on what else this process registered
    defenses = expand(DEFENSES, ",".join(DEFENSES.installed_names()), full_grid=False)
    cells = plan(tasks, defenses, expand(ATTACKS, ",".join(ATTACKS.installed_names())), [0])
    return {(c.task.id, c.defense_label, label(c.attack), c.view) for c in cells if c.na is None and c.error is None}


def coverage_table(res: Results, scenario: str, planned: dict[str, set[Key] | None]) -> pd.DataFrame:
    """One row per applicable cell (``planned`` per preset) and per recorded one: whether the grid applies it, its
    seeds with an ok or failed record, and ``covered`` (>= FULL_SEEDS seeds), ``fewer seeds`` or ``not run``."""
    seeds: dict[tuple[str, Key], set[int]] = defaultdict(set)
    for r in res.records:
        if r["scenario"] == scenario and r["status"] in ("ok", "failed"):
            key = (r["task"], r["defense_label"], r["attack_label"], r["view"])
            seeds[(r["preset"], key)].add(int(r["seed"]))
    keys = set(seeds) | {(p, k) for p, cells in planned.items() for k in cells or ()}
    rows = []
    for preset, (task, defense, attack, view) in sorted(keys):
        got = sorted(seeds.get((preset, (task, defense, attack, view)), ()))
        status = "not run" if not got else "covered" if len(got) >= FULL_SEEDS else "fewer seeds"
        cells = planned.get(preset)
        in_grid = None if cells is None else (task, defense, attack, view) in cells
        rows.append([preset, task, defense, attack, view, in_grid, ",".join(map(str, got)), len(got), status])
    return pd.DataFrame(rows, columns=COLUMNS)


def _grid(cov: pd.DataFrame) -> pd.DataFrame:
    """The rows of the default grid's cells (``in_grid`` None, a preset not planned, counts with them)."""
    return cov[[v is not False for v in cov.in_grid]]


def summary(cov: pd.DataFrame) -> str:
    """One line: the grid's applicable cells, measured, covered at >= FULL_SEEDS seeds; recorded cells outside it."""
    grid = _grid(cov)
    extra = len(cov) - len(grid)
    outside = f" (and {extra} recorded outside the default grid)" if extra else ""
    if not len(grid):
        return "no applicable cell planned" + outside
    run = int((grid.n_seeds > 0).sum())
    full = int((grid.coverage == "covered").sum())
    return f"{run} of {len(grid)} cells measured, {full} at >= {FULL_SEEDS} seeds{outside}"


def markdown(cov: pd.DataFrame, scenario: str, unplanned: list[str]) -> list[str]:
    """The scenario page's coverage section: a line, then per defense row its cells measured / at full seeds and
    the attacks (views) it was not run with."""
    out = ["## Coverage", ""]
    line = (
        f"Cells `python -m bench run --defense all --attack all --grid defaults` applies at this preset, and the "
        f"seeds recorded for each: {summary(cov)} (`{scenario}_coverage.csv` lists every cell). A defense row or "
        f"an attack that is missing from the tables above was not run here; its absence says nothing about it."
    )
    if unplanned:
        line += f" Not planned here (no static task declarations): preset {', '.join(unplanned)}."
    out += [line, ""]
    if not len(cov):
        return out
    rows = []
    for (_, task, defense), g in cov.groupby(["preset", "task", "defense"], sort=True):
        grid = _grid(g)
        gaps = "; ".join(
            f"{md_escape(attack)} ({', '.join(sorted(VIEW_SHORT.get(v, v) for v in m.view))})"
            for attack, m in grid[grid.n_seeds == 0].groupby("attack", sort=True)
        )
        seeds = sorted({int(s) for x in g.seeds if x for s in x.split(",")})
        rows.append(
            f"| {md_escape(task)} | {md_escape(defense)} | {int((grid.n_seeds > 0).sum())} of {len(grid)} | "
            f"{int((grid.coverage == 'covered').sum())} | {','.join(map(str, seeds)) or '-'} | {gaps or '-'} | "
            f"{len(g) - len(grid)} |"
        )
    head = (
        f"| task | defense | grid cells measured | at >= {FULL_SEEDS} seeds | seeds | not run "
        f"| recorded outside the grid |"
    )
    return out + [head, "|---|---|---|---|---|---|---|", *rows, ""]
