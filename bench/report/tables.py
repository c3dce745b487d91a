"""The leaderboard tables of one scenario: one row per defense configuration (``scenario_table``: utility,
epsilon, cost and per attack x view the headline metrics with intervals, best group, comparison with the
undefended baseline), the cross-matrix (``matrix_table``) and one row per record (``cells_table``). Rows and
columns are sorted and floats written with ``%.6g``: the same records give byte-identical CSVs."""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .audit import row_audit
from .ranking import rank_columns
from .results import HEADLINE, VIEW_SHORT, Results, _defense_order, diverged, is_utility, row_key
from .stats import Estimate

FLOAT_FORMAT = "%.6g"


# ----------------------------------------------------------------------------------------------
# tables


def _status_text(recs: Sequence[dict]) -> str:
    bad = [r for r in recs if r["status"] != "ok"]
    if not bad:
        return ""
    st = "diverged" if all(diverged(r) for r in bad) else bad[0]["status"]
    seeds = sorted({r["seed"] for r in bad})
    where = "" if len(bad) == len(recs) else f" (seed {','.join(map(str, seeds))})"
    return f"{st}{where}: {bad[0].get('reason') or ''}"


def scenario_table(res: Results, scenario: str) -> tuple[pd.DataFrame, list[dict]]:
    """One row per preset x task x defense config; returns (numeric table, per-column metadata)."""
    recs = [r for r in res.records if r["scenario"] == scenario]
    rows_by: dict[tuple, list[dict]] = {}
    for r in recs:
        rows_by.setdefault(row_key(r), []).append(r)
    # A defense with no applicable cell here, or an attack x view no defense admits, is only in the
    # cross-matrix (with its reason): it would be an empty row / column in this table.
    rows_by = {k: g for k, g in rows_by.items() if any(r["status"] != "n/a" for r in g)}
    live = {(r["attack_label"], r["view"], r["attack_kind"]) for r in recs if r["status"] != "n/a"}
    cols_meta: dict[str, dict] = {}
    # the seed interval is the table's spread; a within-run one or a sample size is no utility column
    util_keys = sorted({k for r in recs for k in (r.get("utility") or {}) if is_utility(k)})
    table: list[dict] = []
    est: dict[tuple, Estimate] = {}
    cell_recs: dict[tuple, list[dict]] = {}
    privacy_keys = ["epsilon", "epsilon_composed", "delta"]
    if any("epsilon_composed_no_amplification" in (r.get("privacy") or {}) for r in recs):
        privacy_keys.insert(2, "epsilon_composed_no_amplification")
    for rk in sorted(rows_by, key=lambda k: (k[0], k[1], _defense_order(k[2]))):
        group = rows_by[rk]
        ok = [r for r in group if r["status"] == "ok"]
        g0 = group[0]
        row: dict[str, Any] = {
            "preset": rk[0],
            "task": rk[1],
            "defense": rk[2],
            "defense_name": g0["defense"],
            "defense_params": json.dumps(g0.get("defense_params") or {}, sort_keys=True, default=str),
        }
        src = ok or group
        # seeds with results: an n/a or failed record of another seed adds none
        row["seeds"] = ";".join(map(str, sorted({r["seed"] for r in src})))
        row["n_seeds"] = len({r["seed"] for r in src})
        # seeds whose training run diverged under the defense: no model, so their cells have no value (not a fault)
        row["diverged_seeds"] = ";".join(map(str, sorted({r["seed"] for r in group if diverged(r)})))
        for k in util_keys:
            e = res.utility(src, k)
            if e is not None:
                row[f"utility.{k}"] = e.value
                if e.has_ci():
                    row[f"utility.{k}.ci_low"], row[f"utility.{k}.ci_high"] = e.lo, e.hi
        for k in privacy_keys:
            vals = res.per_seed(src, lambda r, k=k: (r.get("privacy") or {}).get(k))
            vals = [float(v) for v in vals if v is not None]  # "inf" is stored as a string
            row[f"privacy.{k}"] = float(np.mean(vals)) if vals else math.nan
        notes = sorted({(r.get("privacy") or {}).get("note") or "" for r in src} - {""})
        row["privacy.note"] = "; ".join(notes)
        au = row_audit(group)
        if au is not None:  # the empirical epsilon audit: claimed vs measured lower bound (bench/report/audit.py)
            row["privacy.epsilon_claimed"] = math.nan if au["claimed"] is None else au["claimed"]
            row["privacy.epsilon_lower_bound"] = au["lower_bound"]
            row["privacy.epsilon_lower_bound.attack"] = au["attack"]
            row["privacy.epsilon_lower_bound.confidence"] = au["confidence"]
            row["privacy.epsilon_lower_bound.delta"] = au["delta"]
            row["dp_violation"] = au["violation"]
            if au["one_run_lower_bound"] is not None:  # Steinke et al. 2023 on member / non-member pairs
                row["privacy.epsilon_one_run_lower_bound"] = au["one_run_lower_bound"]
                row["privacy.epsilon_one_run_lower_bound.attack"] = au["one_run_attack"]
                row["privacy.epsilon_one_run_lower_bound.pairs"] = au["one_run_pairs"]
        for k in (
            "bytes_up_per_round",
            "bytes_down_per_round",
            "params_up_per_round",
            "rounds",
            "train_wall_s",
            "peak_mem_mb",
        ):
            vals = [v for v in res.per_seed(src, lambda r, k=k: (r.get("cost") or {}).get(k)) if v is not None]
            row[f"cost.{k}"] = float(np.mean(vals)) if vals else math.nan
        aw = [(r.get("cost") or {}).get("attack_wall_s") for r in group]
        row["cost.attack_wall_s"] = float(np.nansum([a for a in aw if a is not None]) / max(1, row["n_seeds"]))
        cells: dict[tuple, list[dict]] = {}
        for r in group:
            cells.setdefault((r["attack_label"], r["view"], r["attack_kind"]), []).append(r)
        for (alabel, view, kind), cell in sorted(cells.items()):
            if (alabel, view, kind) not in live:
                continue
            okc = [r for r in cell if r["status"] == "ok"]
            status = _status_text(cell)
            for metric in HEADLINE.get(kind, ()):
                col = f"{alabel}/{view}:{metric}"
                cols_meta.setdefault(
                    col,
                    {
                        "attack": alabel,
                        "view": view,
                        "kind": kind,
                        "metric": metric,
                        "primary": metric == HEADLINE[kind][0],
                    },
                )
                e = res.metric(okc, metric) if okc else None
                if e is not None and e.note:  # not reported (e.g. TPR at an FPR the non-members cannot resolve)
                    row[f"{col}.status"] = e.note + (f"; {status}" if status else "")
                    continue
                if e is not None:
                    row[col], row[f"{col}.ci_low"], row[f"{col}.ci_high"] = e.value, e.lo, e.hi
                    est[(rk, col)] = e
                    cell_recs[(rk, col)] = okc
                if status:
                    row[f"{col}.status"] = status
        table.append(row)
    df = pd.DataFrame(table)
    if df.empty:
        return df, []
    df = rank_columns(res, df, cols_meta, est, cell_recs)
    df["positive_control"] = [res.control_text(p, t) for p, t in zip(df.preset, df.task)]
    fixed = [
        c
        for c in df.columns
        if not c.startswith(("utility.", "privacy.", "cost."))
        and c not in cols_meta
        and not any(c.startswith(m + ".") for m in cols_meta)
    ]
    order = (
        fixed
        + sorted(c for c in df.columns if c.startswith("utility."))
        + [c for c in df.columns if c.startswith("privacy.")]
        + [c for c in df.columns if c.startswith("cost.")]
    )
    col_order = sorted(
        cols_meta, key=lambda c: (cols_meta[c]["attack"], cols_meta[c]["view"], not cols_meta[c]["primary"], c)
    )
    for col in col_order:
        order += [
            c
            for c in (
                col,
                f"{col}.ci_low",
                f"{col}.ci_high",
                f"{col}.vs_base",
                f"{col}.vs_base.ci_low",
                f"{col}.vs_base.ci_high",
                f"{col}.vs_base.method",
                f"{col}.best",
                f"{col}.vs_baseline",
                f"{col}.vs_baseline.method",
                f"{col}.status",
            )
            if c in df.columns
        ]
    meta = [{"column": c, **cols_meta[c]} for c in col_order]
    return df[order], meta


def matrix_table(res: Results, scenario: str) -> pd.DataFrame:
    """Defenses x attacks, one cell each: per-view headline, or ``n/a: reason`` / ``failed: reason``."""
    recs = [r for r in res.records if r["scenario"] == scenario]
    attacks = sorted({r["attack_label"] for r in recs})
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in recs:
        by.setdefault(row_key(r), {}).setdefault(r["attack_label"], []).append(r)
    rows = []
    for rk in sorted(by, key=lambda k: (k[0], k[1], _defense_order(k[2]))):
        row = {"preset": rk[0], "task": rk[1], "defense": rk[2]}
        for a in attacks:
            cell = by[rk].get(a, [])
            parts = []
            for view in sorted({r["view"] for r in cell}):
                vr = [r for r in cell if r["view"] == view]
                ok = [r for r in vr if r["status"] == "ok"]
                st = _status_text(vr)
                if ok:
                    kind = ok[0]["attack_kind"]
                    e = res.metric(ok, HEADLINE[kind][0])
                    short = VIEW_SHORT.get(view, view)
                    txt = f"{short} {HEADLINE[kind][0]} {e.value:.3f}" if e else short
                    parts.append(txt + (f" ({st})" if st else ""))
                elif st:
                    parts.append((f"{VIEW_SHORT.get(view, view)} " if len({r["view"] for r in cell}) > 1 else "") + st)
            row[a] = "; ".join(parts)
        rows.append(row)
    return pd.DataFrame(rows, columns=["preset", "task", "defense", *attacks])


def cells_table(res: Results, scenario: str) -> pd.DataFrame:
    """One flat row per record (numbers stay numbers)."""
    rows = []
    for r in res.records:
        if r["scenario"] != scenario:
            continue
        row = {
            k: r.get(k)
            for k in (
                "preset",
                "task",
                "defense_label",
                "attack_label",
                "attack_kind",
                "view",
                "seed",
                "status",
                "reason",
                "failure",
                "cell_id",
            )
        }
        for name, m in sorted((r.get("metrics") or {}).items()):
            row[name] = m.get("value")
            row[f"{name}.ci_low"], row[f"{name}.ci_high"] = m.get("ci_low"), m.get("ci_high")
        for group in ("utility", "privacy", "cost"):
            for k, v in sorted((r.get(group) or {}).items()):
                if isinstance(v, dict):  # e.g. privacy.epsilon_lower_bound {value, confidence, delta, attack, ...}
                    row.update({f"{group}.{k}.{kk}": vv for kk, vv in sorted(v.items())})
                else:
                    row[f"{group}.{k}"] = v
        row["artifacts"] = ";".join(f"{k}={v}" for k, v in sorted((r.get("artifacts") or {}).items()))
        row["attack_notes"] = "; ".join(r.get("attack_notes") or [])  # what the attack said about its own run
        rows.append(row)
    df = pd.DataFrame(rows)
    first = list(rows[0])[:10] if rows else []
    return df[first + sorted(c for c in df.columns if c not in first)] if rows else df


def to_csv_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False, float_format=FLOAT_FORMAT, lineterminator="\n").encode()
