"""The plan of a run before it starts: what is planned, applicable, done, and how long the rest should take.

Estimates come from the cost model of bench.costs (seconds per training run and per attack cell on one worker,
learned from earlier records in the same ``--out``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .costs import CostModel


def group_key(cell) -> tuple[str, str, int]:
    """Cells sharing one training run: (task and its configuration, defense config, seed)."""
    return (f"{cell.task.id}@{cell.task.config_hash()}", cell.defense_label, cell.seed)


def share_key(cell) -> str:
    """Cells that compute the same per-candidate signals (bench.signal_cache): one attack, whatever its
    parameters, on one model and candidate set: a defense's view, or the base model, which scores the same
    candidates in every view of one member pool (bench.cells.pool_kind). The scheduler runs them one after
    another on one worker (the cache lives in the worker), so all but the first are cache hits instead of the
    same work done twice side by side."""
    from .cells import pool_kind

    task, defense, seed = group_key(cell)
    scope = pool_kind(cell.task, cell.view) if cell.defense is None else cell.view
    return f"{task}|{defense}|{seed}|{cell.attack.name}|{scope}"


def _share_key(cell) -> str | None:
    """:func:`share_key`, or None for a declared task (bench.specs: no data to tell its member pools apart),
    whose cells are then estimated as cells that compute their signals."""
    return share_key(cell) if hasattr(cell.task, "client_data") else None


@dataclass
class Plan:
    planned: int = 0
    applicable: int = 0
    done: int = 0
    na_cells: list = field(default_factory=list)  # n/a cells not yet recorded
    groups: dict[tuple, list] = field(default_factory=dict)  # applicable unfinished cells by group_key
    needs_training: set = field(default_factory=set)  # group keys whose training run is not cached
    resumable: int = 0  # of them, runs with a round or epoch checkpoint to resume from (bench/checkpoint.py)
    known_diverged: int = 0  # of them, runs that diverged before (bench.training.read_divergence): not trained
    resumable_refs: int = 0  # of the reference runs to train, those with a checkpoint to resume from
    resumable_cells: int = 0  # of the cells to run, those a killed run left spilled model passes of
    restored_s: float = 0.0  # of ``est_total_s``, the shares checkpoints and spilled passes hold (done before this run)
    trainings: int = 0  # distinct training runs the applicable unfinished cells use
    references: int = 0  # reference runs ([RMIA]) the applicable unfinished cells use
    needs_reference: dict[tuple, list[int]] = field(default_factory=dict)  # group key -> reference runs to train
    est_total_s: float = 0.0  # summed over units (one worker)
    cell_s: dict[str, float] = field(default_factory=dict)  # each cell to run's estimate, by cell id
    followers: int = 0  # cells to run whose signals an earlier cell of the run computes (share_key)
    est_by_phase: dict[str, float] = field(default_factory=dict)  # the same sum by phase (see ``add``)
    jobs: int = 1
    learned_from: int = 0
    scaled: int = 0  # of them, records made on another CPU and scaled to this one (CostModel.n_scaled)
    scale_text: str = ""  # the scale factors applied, e.g. "2.4" or "1.3-2.4"
    unplannable: list[str] = field(default_factory=list)  # groups whose reference runs cannot be planned, why
    stale: int = 0  # of the cells to run, those with a finished record that is stale (Done)
    # finished membership cells of the groups whose training (or, for a reference-model cell, reference) runs are
    # trained by this run: their records were made from runs no longer cached, so the runner checks them again
    # once the new runs exist and redoes those made from other weights (another CPU or thread count)
    recheck: dict[tuple, list] = field(default_factory=dict)
    # of them, those whose record names another CPU than this one (or none): retraining here is unlikely to give
    # the same weights, so they are likely redone; their estimated work, not in ``est_total_s`` (the bar grows)
    likely_redo: int = 0
    likely_redo_s: float = 0.0
    preparations: list = field(default_factory=list)  # uncached one-off builds the work needs (bench.preparations)

    def add(self, phase: str, seconds: float) -> None:
        """Count ``seconds`` of estimated work to ``phase``: "training", "reference runs" or an attack's name."""
        self.est_total_s += seconds
        self.est_by_phase[phase] = self.est_by_phase.get(phase, 0.0) + seconds

    @property
    def to_run(self) -> int:
        return sum(len(g) for g in self.groups.values())

    @property
    def to_recheck(self) -> int:
        return sum(len(g) for g in self.recheck.values())

    @property
    def to_train_references(self) -> int:
        return sum(len(v) for v in self.needs_reference.values())

    @property
    def prep_s(self) -> float:
        """The pending one-off preparations' seconds: outside ``est_total_s`` (the work bar's units), added
        whole to the wall estimate (a worker needing one waits for it while another builds it)."""
        return sum(p.seconds for p in self.preparations)

    @property
    def est_wall_s(self) -> float:
        """The work left (checkpointed shares of runs out) over the workers, and the one-off preparations."""
        return (self.est_total_s - self.restored_s) / max(1, self.jobs) + self.prep_s

    def render(self) -> str:
        src = (
            f"medians of {self.learned_from} earlier records where they exist, rough defaults otherwise"
            if self.learned_from
            else "rough per-family defaults (no earlier records in --out)"
        )
        if self.scaled:
            src += f"; {self.scaled} of them made on another CPU, scaled by its speed probe (x{self.scale_text})"
        refs = (
            [
                f"      reference runs: {self.references} used by the cells to run, {self.to_train_references} to "
                f"train ({self.references - self.to_train_references} cached"
                + (f", {self.resumable_refs} resume from a checkpoint)" if self.resumable_refs else ")")
            ]
            if self.references
            else []
        )
        return "\n".join(
            [
                f"plan: {self.planned} cells planned, {self.applicable} applicable "
                f"({self.planned - self.applicable} n/a), {self.done} already done, {self.to_run} to run"
                + (f" ({self.resumable_cells} resume from spilled model passes)" if self.resumable_cells else "")
                + (
                    f" ({self.stale} of them redo a stale record: made under an earlier protocol or budget, or from "
                    f"a training or reference run no longer cached, or before --redo-before)"
                    if self.stale
                    else ""
                ),
                f"      training runs: {self.trainings} used by the cells to run, {len(self.needs_training)} to train "
                f"({self.trainings - len(self.needs_training)} cached"
                + (f", {self.resumable} resume from a checkpoint" if self.resumable else "")
                + (
                    f", {self.known_diverged} diverged under their defense before: recorded again without training"
                    if self.known_diverged
                    else ""
                )
                + ")",
                *refs,
                *(
                    [
                        "      one-off preparations (built once per machine and cached, inside the first unit that "
                        "needs them): " + ", ".join(f"{p.what} ~{fmt_duration(p.seconds)}" for p in self.preparations)
                    ]
                    if self.preparations
                    else []
                ),
                *(
                    [
                        f"      {self.to_recheck} recorded cell(s) of the runs to train are checked again once they "
                        f"are trained, and redone if made from other weights (e.g. trained on another CPU)"
                        + (
                            f"; {self.likely_redo} of them name another CPU or instruction set (or none) "
                            "and are likely redone: "
                            f"~{fmt_duration(self.likely_redo_s / max(1, self.jobs))} more with {self.jobs} job(s), "
                            f"not in the estimate below"
                            if self.likely_redo
                            else ""
                        )
                    ]
                    if self.recheck
                    else []
                ),
                f"      estimated time: {fmt_duration(self.est_wall_s)} with {self.jobs} job(s) "
                f"({fmt_duration(self.est_total_s - self.restored_s)} of work"
                + (f" left, {fmt_duration(self.restored_s)} more done in checkpoints" if self.restored_s else "")
                + (f" + {fmt_duration(self.prep_s)} of one-off preparations" if self.preparations else "")
                + f"; {src})",
                *([f"      work by phase: {by_phase(self.est_by_phase)}"] if self.est_by_phase else []),
                *(
                    [
                        f"      {self.followers} of the cells to run reuse the signals another cell of theirs "
                        "computes (the same attack, model and candidates): estimated from earlier such cells "
                        "where there are records, else as cells that compute them"
                    ]
                    if self.followers
                    else []
                ),
                *(
                    f"      reference runs cannot be planned (its reference-model cells will fail): {u}"
                    for u in self.unplannable
                ),
            ]
        )


def listing(pl: Plan) -> str:
    """The work a plan schedules, one line per training run's group (``bench run --dry-run --verbose``): what
    is trained, how many reference runs, and the cells to run and to check again by attack and view."""
    from .training import label

    lines = []
    for key in sorted(set(pl.groups) | set(pl.recheck), key=str):
        task, defense, seed = key
        cells = pl.groups.get(key, [])
        what = ["train" if key in pl.needs_training else ""]
        what.append(f"{len(pl.needs_reference[key])} reference run(s)" if key in pl.needs_reference else "")
        todo = ", ".join(f"{label(c.attack)}/{c.view}" for c in cells)
        again = ", ".join(f"{label(c.attack)}/{c.view}" for c in pl.recheck.get(key, []))
        lines.append(
            f"  {task.split('@')[0]} {defense} seed {seed}"
            + "".join(f" [{w}]" for w in what if w)
            + (f": {todo}" if todo else "")
            + (f"; checked again: {again}" if again else "")
        )
    return "\n".join(lines)


def by_phase(seconds: dict[str, float]) -> str:
    """``phase duration (share)`` for each phase, the largest first: where a run's time goes."""
    total = sum(seconds.values()) or 1.0
    ranked = sorted(seconds.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {fmt_duration(v)} ({v / total:.0%})" for k, v in ranked)


def fmt_duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s" if m else f"{sec} s"


def training_cached(task, defense, seed: int, out: Path, *, readonly: bool = False) -> bool:
    from .training import cached, train_key

    # cached() checks the entry's checksum and quarantines a damaged one (its training is then scheduled);
    # ``readonly`` (a dry run): reported and left in place
    legacy = Path(out) / "cache" / "train" / f"{train_key(task, defense, seed)}.pt"
    return cached(task, defense, seed, Path(out) / "cache", readonly=readonly) or legacy.exists()


def started(record: dict) -> datetime:
    """When the record's run started (``provenance.started_at``, UTC); the earliest time when it says nothing."""
    raw = (record.get("provenance") or {}).get("started_at")
    try:
        return parse_time(str(raw))
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)


def parse_time(raw: str) -> datetime:
    """An ISO 8601 date or time (``2026-11-28``, ``2026-11-28T07:00``, ``...Z`` or ``...+01:00``), UTC unless it
    gives an offset; ValueError otherwise."""
    s = raw.strip()
    t = datetime.fromisoformat(s[:-1] + "+00:00" if s[-1:] in ("Z", "z") else s)
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


class Done:
    """Whether a cell's record is finished and current: its resolved fields as the cell expects, and a
    membership record made from the training run now cached (``bench.training.identity``; reconstruction cells
    attack round-0 probes, which no training changes) and, for a reference-model attack, scored against the
    reference runs now cached (``bench.reference.identities``); with ``redo_before`` (``bench run --redo-before``),
    a record started at or after that time. Caches each run's identity for one plan."""

    def __init__(self, store, *, redo_before: datetime | None = None) -> None:
        self.store = store
        self.redo_before = redo_before
        self._ids: dict[tuple, Any] = {}

    def __call__(self, c) -> bool:
        checks: list = []
        if self.redo_before is not None:
            when = self.redo_before
            checks.append(lambda rec: started(rec) >= when)
        if c.defense is not None and c.attack.kind == "membership":
            from .reference import made_with
            from .training import made_from

            ident = self._identity(c)
            if ident is not None:
                checks.append(lambda rec: made_from(rec, ident))
            refs = self._references(c) if uses_reference(c) else None
            if refs is not None:
                checks.append(lambda rec: made_with(rec, refs))
        accept = (lambda rec: all(ok(rec) for ok in checks)) if checks else None
        return self.store.finished(c.task.scenario, c.id, expect=c.expected(), accept=accept)

    def _identity(self, c):
        from .training import identity, train_key

        key = (id(c.task), train_key(c.task, c.defense, c.seed))
        return self._once(key, lambda: identity(c.task, c.defense, c.seed, Path(self.store.out) / "cache"))

    def _references(self, c):
        from .reference import identities, reference_count
        from .training import train_key

        n = reference_count(c.task, [c.attack])

        def read():
            try:
                return identities(c.task, c.defense, c.seed, n, Path(self.store.out) / "cache")
            except ValueError:  # no population: the cell fails with that reason when it runs
                return None

        return self._once((id(c.task), train_key(c.task, c.defense, c.seed), n), read)

    def _once(self, key: tuple, read):
        if key not in self._ids:
            self._ids[key] = read()
        return self._ids[key]


def make_plan(cells: list, store, model: CostModel, *, jobs: int = 1, redo_before: datetime | None = None) -> Plan:
    from .checkpoint import restored_share  # imported when planning (bench list stays light)
    from .reference import reference_checkpoint
    from .signal_cache import marker_path, spilled_share
    from .training import cache_stem, checkpoint_path, forget_divergence, read_divergence

    f = model.factors
    span = (f"{f[0]:.2g}" if f[0] == f[-1] else f"{f[0]:.2g}-{f[-1]:.2g}") if f else ""
    pl = Plan(planned=len(cells), jobs=jobs, learned_from=model.n_records, scaled=model.n_scaled, scale_text=span)
    done = Done(store, redo_before=redo_before)
    finished: dict[tuple, list] = {}
    shared: set[str | None] = set()  # share keys of the cells to run so far: the first computes, the others reuse
    for c in cells:
        pl.applicable += c.na is None
        if done(c):
            pl.done += 1
            if c.na is None and c.defense is not None and c.attack.kind == "membership":
                finished.setdefault(group_key(c), []).append(c)
        elif c.na is not None:
            pl.na_cells.append(c)
        else:
            pl.groups.setdefault(group_key(c), []).append(c)
            sk = _share_key(c)
            follows = sk is not None and sk in shared
            shared.add(sk)
            pl.followers += follows
            pl.cell_s[c.id] = model.cell_cost(c, follower=follows)
            pl.add(c.attack.name, pl.cell_s[c.id])
            share = spilled_share(marker_path(Path(store.out) / "cache", c.id))  # a killed cell's spilled passes
            pl.resumable_cells += share > 0
            pl.restored_s += pl.cell_s[c.id] * share
            pl.stale += store.finished(c.task.scenario, c.id)
    for key, group in pl.groups.items():
        c = group[0]
        if c.defense is None:
            continue
        pl.trainings += 1
        readonly = getattr(store, "readonly", False)
        if not training_cached(c.task, c.defense, c.seed, store.out, readonly=readonly):
            pl.needs_training.add(key)
            stem = cache_stem(c.task, c.defense, c.seed, Path(store.out) / "cache")
            if redo_before is not None and not readonly:
                forget_divergence(stem, redo_before)
            if read_divergence(stem) is not None:  # the unit only records the known outcome
                pl.known_diverged += 1
                continue
            cost = model.train_cost(c.task, c.defense)
            pl.add("training", cost)  # the unit's whole cost (the work bar shows a restored share as done before)
            ckpt = checkpoint_path(c.task, c.defense, c.seed, Path(store.out) / "cache")
            pl.resumable += ckpt.exists()
            pl.restored_s += cost * restored_share(ckpt)
        try:
            todo = references_to_train(group, store.out, readonly=readonly)
        except ValueError as e:  # none scheduled: the group's reference-model cells will fail with this reason
            pl.unplannable.append(f"{c.task.id} {c.defense_label} seed {c.seed}: {e}")
            continue
        pl.references += todo[0]
        if todo[1]:
            pl.needs_reference[key] = todo[1]
            cost = model.train_cost(c.task, c.defense)  # the target's recipe
            pl.add("reference runs", len(todo[1]) * cost)
            for r in todo[1]:
                ckpt = reference_checkpoint(c.task, c.defense, c.seed, r, Path(store.out) / "cache")
                pl.resumable_refs += ckpt.exists()
                pl.restored_s += cost * restored_share(ckpt)
    from .preparations import pending

    pl.preparations = pending((c.task.id, c.task.preset) for group in pl.groups.values() for c in group)
    from .machine import cpu_isa, cpu_name

    here = {"cpu": cpu_name(), "isa": cpu_isa()}  # read once per plan, not once per rechecked cell
    for key, group in finished.items():
        again = [c for c in group if key in pl.needs_training or (key in pl.needs_reference and uses_reference(c))]
        if again:
            pl.recheck[key] = again
            elsewhere = [c for c in again if not made_here(store, c, here)]
            pl.likely_redo += len(elsewhere)
            pl.likely_redo_s += sum(model.cell_cost(c) for c in elsewhere)
    return pl


def made_here(store, cell, here: dict) -> bool:
    """Whether the cell's finished record names this machine's CPU and instruction set (``provenance.machine``,
    bench.machine.same_cpu): only then can retraining here be expected to give the weights it was scored on
    (thread counts aside); ``here``: this machine's."""
    path = store.record_path(cell.task.scenario, cell.id)
    try:
        rec = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    from .machine import same_cpu

    return same_cpu((rec.get("provenance") or {}).get("machine") if isinstance(rec, dict) else None, here)


def uses_reference(cell) -> bool:
    """Whether the cell's attack scores against reference runs ([RMIA])."""
    return bool(getattr(cell.attack, "uses_reference", False))


def references_to_train(group: list, out: Path, *, readonly: bool = False) -> tuple[int, list[int]]:
    """(R, the reference runs not cached) a group's reference-model cells ([RMIA]) need. Raises ValueError when
    they cannot be planned (e.g. too small a population): none is scheduled and the cells fail with the reason."""
    from .reference import reference_cached, reference_count

    c = group[0]
    n = reference_count(c.task, [x.attack for x in group]) if c.defense is not None else 0
    if not n or c.task.population is None:
        return 0, []
    cache = Path(out) / "cache"
    return n, [r for r in range(n) if not reference_cached(c.task, c.defense, c.seed, r, cache, readonly=readonly)]
