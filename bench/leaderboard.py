"""Leaderboards regenerated from the stored records alone, deterministically.

Per scenario: ``<scenario>_cells.csv`` (one row per record), ``<scenario>.csv`` (one row per task x
defense configuration; utility, privacy, cost, and per attack x view the headline metric with its 95%
interval), ``<scenario>.md`` (the same as markdown, with the controls and claims), ``<scenario>.png``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from tabulate import tabulate

from .claims import evaluate_claims
from .store import Store, atomic_write_bytes

HEADLINE = {"membership": ("auroc", "tpr@0.01fpr"), "reconstruction": ("ssim", "psnr")}


def flatten(rec: dict) -> dict:
    """One record -> one flat row (numbers stay numbers; missing metrics are NaN)."""
    row = {k: rec.get(k) for k in ("scenario", "task", "preset", "defense", "defense_label", "attack",
                                   "attack_label", "attack_kind", "view", "seed", "status", "reason", "cell_id")}
    for name, m in sorted((rec.get("metrics") or {}).items()):
        for part in ("value", "ci_low", "ci_high"):
            row[f"{name}.{part}" if part != "value" else name] = m.get(part)
    for group in ("utility", "privacy", "cost"):
        for k, v in sorted((rec.get(group) or {}).items()):
            row[f"{group}.{k}"] = v
    row["grid"] = (rec.get("artifacts") or {}).get("grid")
    return row


def load(out: Path) -> pd.DataFrame:
    rows = [flatten(r) for r in Store(out).records()]
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    return df.sort_values(["scenario", "task", "defense_label", "attack_label", "view", "seed"]).reset_index(drop=True)


def _fmt(v, lo=None, hi=None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    s = f"{v:.3f}"
    if lo is not None and hi is not None and not (math.isnan(lo) or math.isnan(hi)):
        s += f" [{lo:.2f}, {hi:.2f}]"
    return s


def wide(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(numeric table, display table): one row per task x defense configuration."""
    rows, disp = [], []
    for (task, dlabel), g in df.groupby(["task", "defense_label"], sort=True):
        row: dict = {"task": task, "defense": dlabel}
        ok = g[g.status == "ok"]
        for col in sorted(c for c in g.columns if c.startswith(("utility.", "privacy.", "cost."))):
            vals = pd.to_numeric(ok[col], errors="coerce").dropna() if col in ok else []
            if len(vals):
                row[col] = float(np.mean(vals))
            elif col == "privacy.note" and ok[col].notna().any():
                row[col] = "; ".join(sorted(set(ok[col].dropna()) - {""}))
        d = {"task": task, "defense": dlabel}
        for key in ("utility.accuracy", "utility.perplexity", "utility.test_loss", "privacy.epsilon",
                    "privacy.epsilon_composed", "cost.bytes_up_per_round"):
            if key in row:
                d[key.split(".", 1)[1]] = _fmt(row[key]) if "bytes" not in key else f"{row[key]:.3g}"
        for (alabel, view, kind), cell in g.groupby(["attack_label", "view", "attack_kind"], sort=True):
            for metric in HEADLINE[kind]:
                col = f"{alabel}/{view}:{metric}"
                c_ok = cell[cell.status == "ok"]
                if len(c_ok) and metric in c_ok and c_ok[metric].notna().any():
                    v = float(c_ok[metric].mean())
                    lo = float(c_ok[f"{metric}.ci_low"].min())
                    hi = float(c_ok[f"{metric}.ci_high"].max())
                    row[col], row[col + ".ci_low"], row[col + ".ci_high"] = v, lo, hi
                    if metric == HEADLINE[kind][0]:
                        d[f"{alabel}/{view}"] = _fmt(v, lo, hi)
                elif metric == HEADLINE[kind][0]:
                    st = cell.status.iloc[0]
                    reason = str(cell.reason.iloc[0] or "")
                    row[col + ".status"] = f"{st}: {reason}"
                    d[f"{alabel}/{view}"] = "n/a" if st == "n/a" else "failed"
        rows.append(row)
        disp.append(d)
    return pd.DataFrame(rows), pd.DataFrame(disp).fillna("")


def write_leaderboards(out: Path, dest: Path | None = None) -> list[Path]:
    """Write every scenario's leaderboard files under ``dest`` (default ``<out>/leaderboards``)."""
    df = load(out)
    dest = dest or out / "leaderboards"
    written: list[Path] = []
    if df.empty:
        return written
    for scenario, sdf in df.groupby("scenario", sort=True):
        cells_csv = dest / f"{scenario}_cells.csv"
        atomic_write_bytes(cells_csv, sdf.to_csv(index=False, float_format="%.6g").encode())
        table, display = wide(sdf)
        table_csv = dest / f"{scenario}.csv"
        atomic_write_bytes(table_csv, table.to_csv(index=False, float_format="%.6g").encode())
        md = dest / f"{scenario}.md"
        atomic_write_bytes(md, markdown(scenario, sdf, display).encode())
        png = dest / f"{scenario}.png"
        summary_plot(sdf, png, scenario)
        written += [cells_csv, table_csv, md, png]
    return written


def markdown(scenario: str, sdf: pd.DataFrame, display: pd.DataFrame) -> str:
    presets = ", ".join(sorted(set(sdf.preset)))
    parts = [f"# Leaderboard: {scenario} (preset: {presets})", "",
             "Headline per attack / view: AUROC for membership, mean SSIM for reconstruction; "
             "[95% bootstrap interval]. `n/a`: the pair does not apply (reason in the CSV); "
             "`failed`: the cell raised (reason in the CSV).", "",
             tabulate(display, headers="keys", tablefmt="github", showindex=False), ""]
    notes = sorted(set(n for n in sdf.get("privacy.note", pd.Series(dtype=str)).dropna() if n))
    if notes:
        parts += ["## Privacy notes", ""] + [f"- {n}" for n in notes] + [""]
    base = sdf[(sdf.defense == "base") & (sdf.status == "ok")]
    if len(base):
        parts += ["## Distribution-shift check (attacks on the un-fine-tuned base model)", ""]
        for _, r in base.iterrows():
            flag = " **confound: far from 0.5**" if abs(r["auroc"] - 0.5) > 0.1 else ""
            parts.append(f"- {r['task']} {r['attack_label']}: AUROC {r['auroc']:.3f}{flag}")
        parts.append("")
    claims = evaluate_claims(scenario, sdf)
    if claims:
        parts += ["## Claims from the papers, measured here", ""]
        for c in claims:
            parts.append(f"- **{c['paper']}**: {c['claim']} -> **{c['verdict']}** ({c['evidence']})")
        parts.append("")
    failed = sdf[sdf.status == "failed"]
    if len(failed):
        parts += ["## Failed cells", ""]
        for _, r in failed.iterrows():
            parts.append(f"- {r['task']} {r['defense_label']} x {r['attack_label']}/{r['view']}: {r['reason']}")
        parts.append("")
    return "\n".join(parts)


def summary_plot(sdf: pd.DataFrame, path: Path, scenario: str) -> None:
    from .plots import plt

    ok = sdf[(sdf.status == "ok") & (sdf.defense != "base")]
    panels = [(k, m) for k, (m, _) in HEADLINE.items() if m in ok and (ok.attack_kind == k).any()]
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(6 * max(1, len(panels)), 4.5), squeeze=False)
    for ax, (kind, metric) in zip(axes[0], panels):
        sub = ok[ok.attack_kind == kind]
        piv = sub.groupby(["defense_label", "task"])[metric].mean().unstack("task")
        piv.plot.barh(ax=ax)
        ax.set_xlabel(f"mean {metric} over attacks and views")
        ax.set_title(f"{scenario}: {kind}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
