"""Positive control of a task: does its undefended baseline leak clearly enough for "this defense stops the
attack" to mean anything? (Pure numpy over the records; the runner calls it after a run, the leaderboard marks
the tasks that fail and makes the leakage clauses measured in a failing view ``inconclusive``.)

Criterion, per task and membership view of its undefended baseline (``fedavg``, else ``lora``, else ``fedsgd``,
default configuration): the strongest membership attack (highest AUROC of its primary score) reaches AUROC >=
``AUROC_MIN`` and the 95% interval of its AUROC minus the un-fine-tuned base model's AUROC on the same
candidates has its lower end >= ``GAP_MIN`` (paired bootstrap over seeds and shared candidate ids; unpaired
when the records carry no ids, and the result says so). The base model is scored in the global view only; a
client or released view is compared with it on the candidates both scored.

Reconstruction (:func:`reconstruction_controls`), per task x reconstruction attack x undefended form (``fedsgd``,
``fedavg``): the attack's SSIM must lie clearly above that of uniform random images on the same targets (the
negative control every reconstruction record carries); a claim's reconstruction clause against a baseline that
fails or lacks this control is ``inconclusive``, never ``contradicted``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import partial
from typing import Iterable

import numpy as np

from .bootstrap import (
    AUROC,
    Drawn,
    auroc_rows,
    draw_stat,
    hierarchical,
    mean_of_draws,
    percentile_interval,
    target_values,
)
from .pigeonhole import aligned, crossed, pigeonhole, points, record_seeds

AUROC_MIN = 0.75
GAP_MIN = 0.10
BASELINE_ORDER = ("fedavg", "lora", "fedsgd")
N_BOOT = 1000


@dataclass(frozen=True)
class Control:
    """The positive control of one task x membership view: ``passed``, or ``reason`` why not."""

    task: str
    preset: str
    view: str
    baseline: str
    attack: str
    passed: bool
    reason: str
    auroc: float = float("nan")
    gap: float = float("nan")
    gap_lo: float = float("nan")
    paired: bool = False
    kind: str = "membership"

    def line(self) -> str:
        where = f"{self.task} [{self.preset}] {self.baseline} {self.view}"
        if self.kind == "reconstruction":
            where += f" {self.attack} (reconstruction)"
        return f"{where}: {'passed' if self.passed else 'FAILED'} ({self.reason})"


def _groups(recs: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for r in sorted(recs, key=lambda r: r.get("seed", 0)):
        pc = r.get("per_candidate") or {}
        s, y = np.asarray(pc.get("score") or [], float), np.asarray(pc.get("member") or [], int)
        if len(s) and len(s) == len(y) and (y == 1).any() and (y == 0).any():
            out.append((s[y == 1], s[y == 0]))
    return out


def _auroc(recs: list[dict], rng: np.random.Generator) -> tuple[float, np.ndarray] | None:
    groups = _groups(recs)
    if not groups:
        return None
    value = float(np.mean([auroc_rows(p[None], n[None])[0] for p, n in groups]))
    return value, hierarchical([Drawn(p, n) for p, n in groups], partial(draw_stat, AUROC), rng, N_BOOT)


def _gap(mine: list[dict], base: list[dict], rng: np.random.Generator) -> tuple[float, float, bool] | None:
    """(AUROC gap over the base model, its interval's lower end, paired?)."""
    seeds = record_seeds([mine, base], [None, None])
    if seeds is not None:
        a, b = points(seeds, AUROC)
        ra, rb = pigeonhole(seeds, AUROC, rng, N_BOOT)
        return a - b, percentile_interval(ra - rb)[0], True
    ea, eb = _auroc(mine, rng), _auroc(base, rng)
    if ea is None or eb is None:
        return None
    return ea[0] - eb[0], percentile_interval(ea[1] - eb[1])[0], False


def _bare(r: dict) -> bool:
    return "(" not in r.get("defense_label", "")


def _near(x: float, threshold: float) -> str:
    """``x`` to 3 decimals, or to as many as it takes not to print it equal to the threshold it is compared with."""
    for digits in range(3, 8):
        if round(x, digits) != round(threshold, digits):
            break
    return f"{x:+.{digits}f}"


def positive_controls(records: Iterable[dict]) -> list[Control]:
    """One ``Control`` per (preset, task, membership view of the task's baseline); sorted."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("attack_kind") == "membership"]
    out = []
    for preset, task in sorted({(r.get("preset", ""), r.get("task", "")) for r in ok}):
        recs = [r for r in ok if (r.get("preset", ""), r.get("task", "")) == (preset, task)]
        names = {r["defense"] for r in recs if _bare(r)}
        baseline = next((b for b in BASELINE_ORDER if b in names), None)
        if baseline is None:
            continue
        base = [r for r in recs if r["defense"] == "base"]
        mine = [r for r in recs if r["defense"] == baseline and _bare(r)]
        for view in sorted({r["view"] for r in mine}):
            rng = np.random.default_rng(zlib.crc32(f"{preset}|{task}|{view}".encode()))  # deterministic
            cells: dict[str, list[dict]] = {}
            for r in mine:
                if r["view"] == view:
                    cells.setdefault(r["attack_label"], []).append(r)
            scored = {a: e for a, rs in sorted(cells.items()) if (e := _auroc(rs, rng)) is not None}
            if not scored:
                continue
            attack = max(scored, key=lambda a: (scored[a][0], a))
            auroc = scored[attack][0]
            head = dict(task=task, preset=preset, view=view, baseline=baseline, attack=attack, auroc=auroc)
            # attacks may have run on different seeds (e.g. a costly one on fewer): say how many the judged one had
            seeds = f"{len({r.get('seed') for r in cells[attack]})} seed(s)"
            if auroc < AUROC_MIN:
                out.append(
                    Control(
                        **head,
                        passed=False,
                        reason=f"strongest attack {attack} AUROC {auroc:.3f} < {AUROC_MIN} ({seeds})",
                    )
                )
                continue
            b = [r for r in base if r["attack_label"] == attack]
            b = [r for r in b if r["view"] == view] or b  # the base model is scored in the global view
            gap = _gap(cells[attack], b, rng) if b else None
            if gap is None:
                out.append(Control(**head, passed=False, reason=f"no base-model score of {attack} to compare with"))
                continue
            g, lo, paired = gap
            how = "paired" if paired else "unpaired: no shared candidate ids"
            passed = lo >= GAP_MIN
            reason = (
                f"{attack} AUROC {auroc:.3f}; minus the base model's on the same candidates {g:+.3f}, "
                f"interval lower end {_near(lo, GAP_MIN)} {'>=' if passed else '<'} {GAP_MIN} ({how}, {seeds})"
            )
            out.append(Control(**head, passed=passed, reason=reason, gap=g, gap_lo=lo, paired=paired))
    return out


# ----------------------------------------------------------------------------------------------
# reconstruction: the undefended baseline's reconstructions against uniform random images on the same targets

SSIM_GAP_MIN = 0.10
RECON_BASELINES = ("fedsgd", "fedavg")  # both undefended forms: a defense is compared with its own form
NOT_CHECKED = "not checked"


def reconstruction_controls(records: Iterable[dict]) -> list[Control]:
    """One ``Control`` per (preset, task, reconstruction attack, undefended baseline, view): passed when the 95%
    interval of the attack's SSIM minus the SSIM of uniform random images on the same targets (the record's
    ``ssim_random``, bench.cells) has its lower end >= ``SSIM_GAP_MIN`` (paired per target; every seed attacks the
    same targets, so seeds and targets are resampled independently, ``bench.pigeonhole.crossed``; else seeds, then
    targets). Records without ``ssim_random`` (written before it was kept) give a control ``not checked``."""
    ok = [
        r
        for r in records
        if r.get("status") == "ok"
        and r.get("attack_kind") == "reconstruction"
        and r.get("defense") in RECON_BASELINES
        and _bare(r)
    ]
    out = []
    keys = sorted({(r.get("preset", ""), r["task"], r["attack_label"], r["defense"], r["view"]) for r in ok})
    for preset, task, attack, baseline, view in keys:
        recs = [
            r
            for r in ok
            if (r.get("preset", ""), r["task"], r["attack_label"], r["defense"], r["view"])
            == (preset, task, attack, baseline, view)
        ]
        head = dict(task=task, preset=preset, view=view, baseline=baseline, attack=attack, kind="reconstruction")
        groups, maps = [], []
        for r in sorted(recs, key=lambda r: r.get("seed", 0)):
            s, z = target_values(r, "ssim"), target_values(r, "ssim_random")
            if s and z and set(s) == set(z):
                maps.append({i: s[i] - z[i] for i in s})
                groups.append(np.array([maps[-1][i] for i in sorted(s)]))
        if not groups:
            why = f"{NOT_CHECKED}: no random-image control (ssim_random) in the records; re-run the cells"
            out.append(Control(**head, passed=False, reason=why))
            continue
        rng = np.random.default_rng(zlib.crc32(f"{preset}|{task}|{attack}|{baseline}|{view}".encode()))
        gap = float(np.mean([g.mean() for g in groups]))
        table = aligned(maps)
        if table is not None:  # every seed attacked the same targets: seeds and targets resampled independently
            (reps,) = crossed([table], rng, N_BOOT)
        else:
            reps = hierarchical(groups, mean_of_draws, rng, N_BOOT)
        lo = percentile_interval(reps)[0]
        passed = lo >= SSIM_GAP_MIN
        reason = (
            f"{attack} SSIM minus random images' on the same targets {gap:+.3f}, interval lower end "
            f"{_near(lo, SSIM_GAP_MIN)} {'>=' if passed else '<'} {SSIM_GAP_MIN} "
            f"({len(groups)} seed(s) x {'the same ' if table is not None else ''}{len(groups[0])} targets)"
        )
        out.append(Control(**head, passed=passed, reason=reason, gap=gap, gap_lo=lo, paired=True))
    return out


def failures(records: Iterable[dict]) -> list[str]:
    """Warning lines for the tasks whose baseline fails its positive control (empty when all pass), membership
    and reconstruction (a reconstruction control that could not be checked is not a failure line)."""
    records = list(records)
    recon = [c for c in reconstruction_controls(records) if not c.passed and not c.reason.startswith(NOT_CHECKED)]
    return [c.line() for c in positive_controls(records) if not c.passed] + [c.line() for c in recon]
