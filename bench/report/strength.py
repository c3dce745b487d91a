"""Attack strength on the undefended baseline, the [RMIA] positive control: per task and membership view of the
baseline of its protocol (fedavg, fedsgd for FedSGD forms, lora for released models), does the reference-model
attack (offline RMIA, [RMIA], or its offline LiRA variant, [LiRA]: the one with the higher point TPR) beat the
best single-signal attack in TPR at the lowest FPR the non-members support?

Single-signal attacks: every configuration and score variant of loss_mia, max_renyi and gradient_mia, and the
``neg_loss`` of the rmia and ref_loss records. The best is the highest point TPR (ties: the one whose per-candidate
scores are kept, so the difference pairs); choosing it on the evaluated candidates favours it, so ``RMIA stronger``
is conservative. The FPR is the lowest of ``bench.metrics.FPRS`` with >= 10 / FPR non-members in every seed (the
gating of ``bench.bootstrap.tpr_unreported``). The stronger reference-model score minus the best single-signal one
is the paired bootstrap of ``bench.report.paired`` on the candidates and seeds both scored (both sides are the best
of their kind on those candidates, so the selection favours neither); a variant whose per-candidate scores the
record did not keep (records before 2026-11-25 kept only some) falls back to the unpaired difference, and the note
says so. Verdict: ``reference-model stronger`` (95% interval above 0), ``not stronger`` (at or below 0),
``inconclusive`` otherwise; ``not measured`` without both sides or a supported FPR.

Beside them, for information (no verdict reads it): the best of ``ref_loss``'s base-calibrated scores (attacks/
ref_loss.py: how much lower the target's loss is than the base model's, [Watson]; its ``neg_loss`` counts as single-
signal), the attack that needs no reference training, so a reader sees what the R reference runs buy over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from ..bootstrap import candidates, tpr_unreported
from ..metrics import FPRS
from .paired import paired_difference, unpaired_difference
from .ranking import protocol_baseline
from .results import BASELINES, VIEW_SHORT, Results
from .stats import Estimate

SINGLE_SIGNAL = ("loss_mia", "max_renyi", "gradient_mia")
RMIA = "rmia"
RMIA_SINGLE = ("neg_loss",)  # the rmia record's own single-signal score (minus the target's loss)
BASE_CALIBRATED = "ref_loss"  # calibrated against the base model (no reference training); its neg_loss is single
LIRA = "lira_offline"
STRONGER, NOT_STRONGER = "reference-model stronger", "not stronger"
INCONC, NOT_MEASURED = "inconclusive", "not measured"
COLUMNS = [
    "preset",
    "task",
    "baseline",
    "view",
    "n_nonmembers",
    "fpr",
    "best_single",
    "best_single.tpr",
    "best_single.tpr.ci_low",
    "best_single.tpr.ci_high",
    "rmia_attack",
    "rmia.a",
    "rmia.tpr",
    "rmia.tpr.ci_low",
    "rmia.tpr.ci_high",
    "lira_offline.tpr",
    "lira_offline.tpr.ci_low",
    "lira_offline.tpr.ci_high",
    "base_calibrated",
    "base_calibrated.tpr",
    "base_calibrated.tpr.ci_low",
    "base_calibrated.tpr.ci_high",
    "reference_best",
    "difference",
    "difference.ci_low",
    "difference.ci_high",
    "difference.method",
    "paired",
    "verdict",
    "note",
]


@dataclass
class Scorer:
    """One score of one cell (one record per seed): its primary score (``variant`` None) or a named variant."""

    label: str
    variant: str | None
    recs: list[dict]

    @property
    def name(self) -> str:
        return self.label if self.variant is None else f"{self.label}:{self.variant}"

    def estimate(self, res: Results, metric: str) -> Estimate | None:
        return res.metric(self.recs, metric if self.variant is None else f"variants:{self.variant}:{metric}")

    def pairable(self) -> bool:
        """Every seed kept this score's per-candidate values with candidate ids."""
        return all(candidates(r, self.variant) is not None for r in self.recs)


def lowest_fpr(n_nonmembers: int | None, fprs: Sequence[float] = FPRS) -> float | None:
    """The lowest FPR whose TPR is reported with ``n_nonmembers`` non-members (>= 10 / FPR), None if none is."""
    ok = [f for f in fprs if n_nonmembers is not None and not tpr_unreported(f, n_nonmembers)]
    return min(ok) if ok else None


def verdict(d: Estimate | None) -> str:
    """RMIA minus the best single-signal attack -> the column's verdict (module docstring)."""
    if d is None or math.isnan(d.value):
        return NOT_MEASURED
    if not d.has_ci():
        return INCONC
    return STRONGER if d.lo > 0 else (NOT_STRONGER if d.hi <= 0 else INCONC)


def nonmembers(rec: dict) -> int | None:
    y = (rec.get("per_candidate") or {}).get("member")
    return len(y) - int(sum(y)) if y else rec.get("n_nonmembers")


def single_scorers(attack: str, label: str, recs: list[dict]) -> list[Scorer]:
    """The single-signal scores of one cell: a single-signal attack's primary and variants, the ``neg_loss`` of rmia
    and ref_loss."""
    names = _variant_names(recs)
    if attack in (RMIA, BASE_CALIBRATED):
        return [Scorer(label, v, recs) for v in RMIA_SINGLE if v in names]
    return [Scorer(label, None, recs)] + [Scorer(label, v, recs) for v in sorted(names)]


def calibrated_scorers(label: str, recs: list[dict]) -> list[Scorer]:
    """ref_loss's base-calibrated scores of one cell: its primary and its variants but the uncalibrated loss."""
    names = _variant_names(recs) - set(RMIA_SINGLE)
    return [Scorer(label, None, recs)] + [Scorer(label, v, recs) for v in sorted(names)]


def _variant_names(recs: list[dict]) -> set[str]:
    """The score variants every seed's record of a cell has, its primary score left out."""
    names = set.intersection(*(set(r.get("variants") or {}) for r in recs))
    return names - {r.get("primary") for r in recs}


def best_of(res: Results, scorers: list[Scorer], metric: str) -> tuple[Scorer, Estimate] | None:
    """The scorer with the highest point ``metric`` (ties: one whose per-candidate scores are kept), with it."""
    scored = [(s, e) for s in scorers if (e := s.estimate(res, metric)) is not None and not math.isnan(e.value)]
    return max(scored, key=lambda t: (t[1].value, t[0].pairable()), default=None)


def _why_missing(recs: list[dict], attacks: Sequence[str], what: str) -> str:
    bad = next((r for r in recs if r["attack"] in attacks and r["status"] != "ok"), None)
    return f"no {what}" + (f" ({bad['status']}: {bad.get('reason') or ''})" if bad else "")


def _put(row: dict, col: str, e: Estimate | None) -> None:
    row[col] = e.value if e is not None else math.nan
    row[f"{col}.ci_low"] = e.lo if e is not None else math.nan
    row[f"{col}.ci_high"] = e.hi if e is not None else math.nan


def strength_row(res: Results, key: tuple[str, str, str, str], recs: list[dict]) -> dict | None:
    """The row of one (preset, task, baseline, view) from its rmia and single-signal records, None if none is ok."""
    ok = [r for r in recs if r["status"] == "ok"]
    if not ok:
        return None
    row: dict = dict(zip(("preset", "task", "baseline", "view"), key))
    blank = {"best_single": "", "rmia_attack": "", "rmia.a": "", "base_calibrated": "", "reference_best": ""}
    blank["difference.method"] = ""
    row.update({c: math.nan for c in COLUMNS[4:]} | blank)
    row.update(paired=False, verdict=NOT_MEASURED, note="")
    cells: dict[tuple[str, str], list[dict]] = {}
    for r in ok:
        cells.setdefault((r["attack"], r["attack_label"]), []).append(r)
    counts = [n for r in ok if (n := nonmembers(r)) is not None]
    n0 = min(counts) if counts else None
    fpr = lowest_fpr(n0)
    row["n_nonmembers"], row["fpr"] = (math.nan if n0 is None else n0), (math.nan if fpr is None else fpr)
    if fpr is None:
        row["note"] = tpr_unreported(max(FPRS), n0) if n0 is not None else "no non-member count"
        return row
    metric = f"tpr@{fpr:g}fpr"
    best = best_of(res, [s for (a, lab), rs in sorted(cells.items()) for s in single_scorers(a, lab, rs)], metric)
    calibrated = [s for (a, lab), rs in cells.items() if a == BASE_CALIBRATED for s in calibrated_scorers(lab, rs)]
    if (cal := best_of(res, calibrated, metric)) is not None:
        row["base_calibrated"] = cal[0].name
        _put(row, "base_calibrated.tpr", cal[1])
    rmias = sorted(lab for a, lab in cells if a == RMIA)
    notes = []
    if len(rmias) > 1:
        notes.append(f"rmia configurations {', '.join(rmias)}: {RMIA if RMIA in rmias else rmias[0]} shown")
    rmia = cells[(RMIA, RMIA if RMIA in rmias else rmias[0])] if rmias else None
    if best is not None:
        row["best_single"] = best[0].name
        _put(row, "best_single.tpr", best[1])
    ref: tuple[str | None, Estimate | None] = (None, None)  # the stronger reference-model score: (variant, TPR)
    if rmia is not None:
        row["rmia_attack"], row["rmia.a"] = rmia[0]["attack_label"], offline_a(rmia)
        ref = stronger_reference(res, rmia, metric)
        _put(row, "rmia.tpr", res.metric(rmia, metric))
        _put(row, "lira_offline.tpr", res.metric(rmia, f"variants:{LIRA}:{metric}"))
        row["reference_best"] = ref[0] or RMIA
    if rmia is None or best is None:
        missing = [_why_missing(recs, (RMIA,), "rmia record")] if rmia is None else []
        missing += [_why_missing(recs, SINGLE_SIGNAL, "single-signal record")] if best is None else []
        row["note"] = "; ".join(notes + missing)
        return row
    s, e = best
    d = None
    variant, ref_e = ref
    if s.pairable() and Scorer(RMIA, variant, rmia).pairable():
        k = ("strength", *key, s.name, variant or RMIA)
        d = paired_difference(rmia, s.recs, metric, key=k, variant_a=variant, variant_b=s.variant)
        if d is None:
            notes.append("no shared candidate ids: unpaired")
    else:
        notes.append(f"per-candidate scores of {s.name if not s.pairable() else variant} not kept: unpaired")
    if d is None:
        d = unpaired_difference(ref_e, e)
    if d is not None:
        _put(row, "difference", d)
        row["difference.method"], row["paired"] = d.method, d.method.startswith("paired")
    row["verdict"], row["note"] = verdict(d), "; ".join(notes)
    return row


def offline_a(rmia: list[dict]) -> str:
    """The offline ``a`` each seed's RMIA record used (tuned per cell, attacks/rmia.py), in seed order, e.g.
    ``0.4, 0.5, 0.4``; a client-view record tunes it per client (``0.9/1``, its distinct values); ``?`` for a
    record that does not state it."""

    def of(r: dict) -> str:
        d = r.get("attack_details") or {}
        parts = [d] if "rmia" in d else list((d.get("per_client") or {}).values())
        got = sorted({p["rmia"]["a"] for p in parts if isinstance(p.get("rmia"), dict) and "a" in p["rmia"]})
        return "/".join(f"{a:g}" for a in got) or "?"

    return ", ".join(of(r) for r in sorted(rmia, key=lambda r: r.get("seed", 0)))


def stronger_reference(res: Results, rmia: list[dict], metric: str) -> tuple[str | None, Estimate | None]:
    """RMIA's primary score (variant None) or its offline-LiRA variant, whichever has the higher point ``metric``
    (ties: RMIA), with that estimate."""
    r, lira = res.metric(rmia, metric), res.metric(rmia, f"variants:{LIRA}:{metric}")
    if lira is not None and not math.isnan(lira.value) and (r is None or math.isnan(r.value) or lira.value > r.value):
        return LIRA, lira
    return None, r


def strength_table(res: Results, scenario: str) -> pd.DataFrame:
    """One row per (preset, task, undefended baseline, membership view) of ``scenario``, sorted."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for r in res.select(scenario=scenario, kind="membership", status=None):
        name, label = r["defense"], r["defense_label"]
        if name not in BASELINES or "(" in label or protocol_baseline(label, r["view"]) != name:
            continue
        if r["attack"] in SINGLE_SIGNAL + (RMIA, BASE_CALIBRATED):
            groups.setdefault((r["preset"], r["task"], label, r["view"]), []).append(r)
    rows = [row for k in sorted(groups) if (row := strength_row(res, k, groups[k])) is not None]
    return pd.DataFrame(rows, columns=COLUMNS)


def _est(r, col: str) -> str:
    v = r[col]
    if isinstance(v, float) and math.isnan(v):
        return "-"
    e = Estimate(float(v), float(r[f"{col}.ci_low"]), float(r[f"{col}.ci_high"]))
    if col != "difference":
        return e.fmt()
    return f"{e.value:+.3f}" + (f" [{e.lo:+.3f}, {e.hi:+.3f}]" if e.has_ci() else " (no interval)")


def markdown(df: pd.DataFrame, scenario: str) -> str:
    """The section of the scenario page (empty when the scenario has no row)."""
    if df.empty:
        return ""
    from tabulate import tabulate

    from .markdown import md_escape

    presets = df.preset.nunique() > 1  # noqa: PD101 -- counts distinct presets of a small table
    head = (["preset"] if presets else []) + ["task", "baseline/view", "non-members", "FPR", "best single-signal"]
    head += ["its TPR", "RMIA TPR", "LiRA-offline TPR", "base-calibrated TPR", "stronger of the two - best"]
    head += ["verdict", "note"]
    rows = []
    for _, r in df.iterrows():
        fpr = "n/a" if math.isnan(r.fpr) else f"{r.fpr:.1%}".replace(".0%", "%")
        n0 = "" if math.isnan(r.n_nonmembers) else f"{r.n_nonmembers:.0f}"
        diff = _est(r, "difference") + ("" if r.paired or r["difference.method"] == "" else " (unpaired)")
        diff = f"{r.reference_best}: {diff}" if r.reference_best else diff
        cells = ([r.preset] if presets else []) + [r.task, f"{r.baseline}/{VIEW_SHORT.get(r.view, r.view)}", n0, fpr]
        rmia_tpr = _est(r, "rmia.tpr") + (f" (a {r['rmia.a']})" if r["rmia.a"] else "")
        cells += [r.best_single or "-", _est(r, "best_single.tpr"), rmia_tpr, _est(r, "lira_offline.tpr")]
        cells += [f"{r.base_calibrated}: {_est(r, 'base_calibrated.tpr')}" if r.base_calibrated else "-"]
        cells += [diff, f"**{r.verdict}**", r.note]
        rows.append([md_escape(c) for c in cells])
    return "\n".join(
        [
            "## Attack strength on the undefended baseline: reference-model attacks vs the best single-signal attack",
            "",
            "Per task and membership view of the undefended baseline of each protocol (fedavg, fedsgd for FedSGD "
            "forms, lora for released models): TPR at the lowest FPR the non-members support (>= 10 / FPR per "
            "seed) of the best single-signal attack (loss_mia, max_renyi, gradient_mia and their score variants, "
            "the `neg_loss` of rmia and ref_loss; highest point TPR), of RMIA (with each seed's offline a, tuned per "
            "cell), of offline LiRA and, for information, of the best base-calibrated score of ref_loss (the "
            "target's loss against the base model's: no reference training), with 95% intervals, and the "
            "stronger of RMIA and offline LiRA (highest point TPR, named) minus the best single-signal attack "
            "(paired bootstrap over the shared candidates and seeds; `(unpaired)` where a variant's per-candidate "
            "scores were not kept). **reference-model stronger**: the difference's interval lies above 0; "
            "**not stronger**: at or below 0; else **inconclusive**. Both sides are the best of their kind on the "
            f"same candidates. CSV: `{md_escape(scenario)}_attack_strength.csv`.",
            "",
            tabulate(rows, headers=[md_escape(h) for h in head], tablefmt="github", disable_numparse=True),
            "",
        ]
    )
