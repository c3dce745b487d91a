"""Per-column comparisons of the leaderboard table: the change from the un-fine-tuned base model on the same
candidates (the headline of a membership AUROC column), the comparison with the undefended baseline of the same
protocol, and the best group; plus utility collapse, which disqualifies a row from the best group.

Differences are paired where the rows share candidate ids (``bench.report.paired``); the ``.method`` columns
say whether they were. Utility collapse (``COLLAPSE``): perplexity above 10x the baseline's (or not finite),
accuracy within 0.05 of chance (1 / ``num_classes``, where the records carry it), FID above 3x the baseline's.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import numpy as np
import pandas as pd

from .paired import difference, is_paired, sign
from .results import BASELINES, Results
from .stats import Estimate

PERPLEXITY_FACTOR = 10.0
CHANCE_MARGIN = 0.05
FID_FACTOR = 3.0
COLLAPSE = (
    f"perplexity > {PERPLEXITY_FACTOR:g}x the baseline's; accuracy within {CHANCE_MARGIN} of chance "
    f"(1/num_classes); FID > {FID_FACTOR:g}x the baseline's"
)
VERDICT_TEXT = {-1: "less leakage", 0: "n.s.", 1: "more leakage"}


def protocol_baseline(label: str, view: str) -> str:
    """The undefended baseline of a row's protocol: lora for released models, fedsgd for FedSGD forms, else fedavg."""
    name = label.split("(", 1)[0]
    if view == "released_model":
        return "lora"
    return "fedsgd" if "form=fedsgd" in label or name == "fedsgd" else "fedavg"


def baseline_for(label: str, view: str, labels: Iterable[str]) -> str | None:
    """The undefended reference of a row (``protocol_baseline``), None for a baseline itself or when absent."""
    name = label.split("(", 1)[0]
    if name == "base" or name in BASELINES and "(" not in label:
        return None
    want = protocol_baseline(label, view)
    return want if want in set(labels) else None


def utility_reference(label: str, labels: Iterable[str]) -> str | None:
    """The baseline a row's utility is judged against (itself for a baseline: only chance then applies)."""
    labels = set(labels)
    if label.split("(", 1)[0] in BASELINES and "(" not in label:
        return label
    return baseline_for(label, "global_model", labels) or next((b for b in BASELINES if b in labels), None)


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _utility(row: pd.Series | None, name: str) -> float:
    """A row's utility ``name``, also under a key that names how it was measured (``utility.fid_effnetlite0`` for
    ``fid``: looking for ``utility.fid`` alone never found ldm-t2i's FID); NaN when absent."""
    if row is None:
        return math.nan
    keys = [f"utility.{name}"] + sorted(
        k for k in row.index if k.startswith(f"utility.{name}_") and not k.endswith((".ci_low", ".ci_high", "_std"))
    )
    return next((v for v in (_num(row.get(k)) for k in keys) if not math.isnan(v)), math.nan)


def collapse_reason(row: pd.Series, ref: pd.Series | None, num_classes: float) -> str:
    """Why a row's utility has collapsed, or "" (see ``COLLAPSE``)."""
    ppl = _num(row.get("utility.perplexity"))
    ref_ppl = _num(ref.get("utility.perplexity")) if ref is not None else math.nan
    if math.isinf(ppl):
        return "perplexity not finite"
    if not math.isnan(ppl) and not math.isnan(ref_ppl) and ppl > PERPLEXITY_FACTOR * ref_ppl:
        return f"perplexity {ppl:.3g} > {PERPLEXITY_FACTOR:g}x baseline {ref_ppl:.3g}"
    acc = _num(row.get("utility.accuracy"))
    if (
        not math.isnan(acc)
        and num_classes
        and not math.isnan(num_classes)
        and abs(acc - 1 / num_classes) <= CHANCE_MARGIN
    ):
        return f"accuracy {acc:.3f} within {CHANCE_MARGIN} of chance {1 / num_classes:.3f}"
    fid, ref_fid = _utility(row, "fid"), _utility(ref, "fid")
    if not math.isnan(fid) and not math.isnan(ref_fid) and fid > FID_FACTOR * ref_fid:
        return f"FID {fid:.3g} > {FID_FACTOR:g}x baseline {ref_fid:.3g}"
    return ""


def mark_collapse(res: Results, df: pd.DataFrame) -> None:
    """Adds ``utility_collapse`` (the reason, "" when the utility holds) to every row."""
    reasons = []
    for _, row in df.iterrows():
        task_rows = df[(df.preset == row.preset) & (df.task == row.task)]
        ref_label = utility_reference(row.defense, task_rows.defense)
        ref = task_rows[task_rows.defense == ref_label].iloc[0] if ref_label in set(task_rows.defense) else None
        if ref is not None and ref.defense == row.defense:
            ref = None
        classes = [
            (r.get("utility") or {}).get("num_classes")
            for r in res.records
            if (r.get("preset"), r.get("task")) == (row.preset, row.task)
        ]
        n = next((float(c) for c in classes if c), math.nan)
        reasons.append("" if row.defense == "base" else collapse_reason(row, ref, n))
    df["utility_collapse"] = reasons


def _base_recs(cell_recs: dict, rk: tuple, col: str, meta: dict) -> list[dict] | None:
    """The base model's records of the same attack: the same view, else the global view (the only one it has)."""
    base_rk = (rk[0], rk[1], "base")
    same = cell_recs.get((base_rk, col))
    if same:
        return same
    glob = f"{meta['attack']}/global_model:{meta['metric']}"
    return cell_recs.get((base_rk, glob))


def rank_columns(
    res: Results,
    df: pd.DataFrame,
    cols_meta: dict[str, dict],
    est: dict[tuple, Estimate],
    cell_recs: dict[tuple, list[dict]],
) -> pd.DataFrame:
    """``df`` with, per column: ``.vs_base`` (membership AUROC: change from the base model, with interval and
    method), ``.best`` (1 = in the best group; collapsed rows never are), ``.vs_baseline`` and its ``.method``
    (the new columns joined at once: inserting them one by one fragments the frame)."""
    mark_collapse(res, df)
    new: dict[str, Any] = {}
    labels = set(df.defense)
    collapsed = {(r.preset, r.task, r.defense) for _, r in df.iterrows() if r.utility_collapse}
    for col in sorted(cols_meta):
        meta = cols_meta[col]
        metric = meta["metric"]
        best, vs, vs_method = [], [], []
        dv, dlo, dhi, dmethod = [], [], [], []
        for _, row in df.iterrows():
            rk = (row.preset, row.task, row.defense)
            mine = cell_recs.get((rk, col))
            # the headline of a membership AUROC column: the change from the base model on the same candidates
            d = None
            if mine and meta["kind"] == "membership" and metric == "auroc" and row.defense != "base":
                base = _base_recs(cell_recs, rk, col, meta)
                d = difference(res, mine, base, metric, leak=False, key=("base",) + rk + (col,)) if base else None
            dv.append(d.value if d else math.nan)
            dlo.append(d.lo if d else math.nan)
            dhi.append(d.hi if d else math.nan)
            dmethod.append(d.method if d else "")
            peers = [
                k[0] for k in est if k[1] == col and k[0][:2] == rk[:2] and k[0][2] != "base" and k[0] not in collapsed
            ]
            if mine is None or row.defense == "base" or not peers:
                best.append(math.nan)
            elif rk in collapsed:
                best.append(0.0)
            else:
                top = min(
                    peers,
                    key=lambda k: (est[(k, col)].value if metric != "auroc" else abs(est[(k, col)].value - 0.5), k[2]),
                )
                s = (
                    0
                    if top == rk
                    else sign(difference(res, mine, cell_recs[(top, col)], metric, key=("best",) + rk + (col,)))
                )
                best.append(float(s <= 0))
            ref = baseline_for(row.defense, meta["view"], labels)
            theirs = cell_recs.get(((row.preset, row.task, ref), col)) if ref else None
            if mine is None or not theirs:
                vs.append("")
                vs_method.append("")
            else:
                c = difference(res, mine, theirs, metric, key=("baseline",) + rk + (col,))
                vs.append(VERDICT_TEXT[sign(c)])
                vs_method.append("paired" if is_paired(c) else (c.method if c else ""))
        if meta["kind"] == "membership" and metric == "auroc":
            new[f"{col}.vs_base"], new[f"{col}.vs_base.ci_low"], new[f"{col}.vs_base.ci_high"] = dv, dlo, dhi
            new[f"{col}.vs_base.method"] = dmethod
        new[f"{col}.best"] = np.array(best, dtype=float)
        new[f"{col}.vs_baseline"] = vs
        new[f"{col}.vs_baseline.method"] = vs_method
    return pd.concat([df, pd.DataFrame(new, index=df.index)], axis=1)
