"""Plots (matplotlib, Agg), all regenerated from the records: reconstruction grids (per cell, written by
the runner), log-scale ROC curves (Carlini et al. 2022), the privacy-utility trade-off ([FedRand]
Fig. 2), per-image SSIM distributions ([FLRSP] Fig. 12), communication per round ([FedRand]
Fig. 3) and composed epsilon over rounds for the DP defenses (opacus RDP via the defense's own
``epsilon_composed``)."""

from __future__ import annotations

import math
import re
import shutil
import warnings
from pathlib import Path

import numpy as np

from .charts import mean_roc, save_bars, save_curves, save_distributions, save_roc, save_tradeoff
from .results import HEADLINE, UTILITY_ORDER, VIEW_SHORT, lower_is_better


def slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "_".join(parts)).strip("_")


def scenario_plots(res, scenario: str, table, dest: Path, out: Path) -> list[str]:
    """Every plot of ``scenario``; returns paths relative to ``dest`` (sorted, deterministic)."""
    rel = Path("plots") / slug(scenario)
    recs = [r for r in res.records if r["scenario"] == scenario and r["status"] == "ok"]
    written: list[str] = []
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r["preset"], r["task"]), []).append(r)
    for (preset, task), tr in sorted(groups.items()):
        tag = slug(task, preset)
        by_cell: dict[tuple, dict[str, list[dict]]] = {}
        for r in tr:
            by_cell.setdefault((r["attack_kind"], r["attack_label"], r["view"]), {}).setdefault(
                r["defense_label"], []
            ).append(r)
        for (kind, alabel, view), per_def in sorted(by_cell.items()):
            if kind == "membership":
                curves = {}
                for dl, rs in sorted(per_def.items()):
                    rocs = [r["roc"] for r in rs if r.get("roc")]
                    if rocs:
                        e = res.metric(rs, "auroc")
                        curves[f"{dl} (AUROC {e.value:.2f})"] = mean_roc(rocs)
                if curves:
                    p = rel / f"roc_{slug(tag, alabel, VIEW_SHORT.get(view, view))}.png"
                    save_roc(curves, dest / p, title=f"{task} [{preset}]: {alabel} / {view}")
                    written.append(str(p))
            else:
                data = {
                    dl: [v for r in rs for v in (r.get("per_sample") or {}).get("ssim", [])]
                    for dl, rs in sorted(per_def.items())
                }
                data = {k: v for k, v in data.items() if v}
                if data:
                    p = rel / f"ssim_{slug(tag, alabel)}.png"
                    save_distributions(
                        data,
                        dest / p,
                        ref=0.5,
                        title=f"{task} [{preset}]: {alabel}",
                        xlabel="SSIM per reconstructed image, all seeds (dotted: 0.5, papers/003)",
                    )
                    written.append(str(p))
                written += _copy_grids(per_def, out, dest, rel / "grids", tag, alabel)
        sub = table[(table.preset == preset) & (table.task == task)]
        written += _tradeoff(res, sub, dest, rel, tag, task, preset, HEADLINE)
        written += _communication(sub, dest, rel, tag, task, preset)
        written += _epsilon(res, tr, dest, rel, tag, task, preset)
    return sorted(written)


def _copy_grids(per_def: dict[str, list[dict]], out: Path, dest: Path, rel: Path, tag: str, alabel: str) -> list[str]:
    done = []
    for dl, rs in sorted(per_def.items()):
        r = min(rs, key=lambda x: x["seed"])
        src = out / "artifacts" / r["cell_id"] / "grid.png"
        if src.is_file():
            p = rel / f"{slug(tag, dl, alabel, 'seed' + str(r['seed']))}.png"
            (dest / p).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / p)
            done.append(str(p))
    return done


def _tradeoff(res, sub, dest: Path, rel: Path, tag: str, task: str, preset: str, headline) -> list[str]:
    keys = [c[8:] for c in sub.columns if c.startswith("utility.") and not c.endswith((".ci_low", ".ci_high"))]
    keys = [k for k in UTILITY_ORDER if k in keys] + sorted(k for k in keys if k not in UTILITY_ORDER)
    if not keys or sub.empty:
        return []
    uk = keys[0]
    panels = []
    metric_cols = [c for c in sub.columns if ":" in c and c.rsplit(":", 1)[1] in ("auroc", "ssim")]
    for col in metric_cols:
        pts = []
        for _, r in sub.iterrows():
            x, y = r.get(f"utility.{uk}"), r.get(col)
            if r.defense == "base" or x is None or y is None or math.isnan(x) or math.isnan(y):
                continue
            pts.append(
                {
                    "label": r.defense,
                    "x": x,
                    "y": y,
                    "xlo": r.get(f"utility.{uk}.ci_low", math.nan),
                    "xhi": r.get(f"utility.{uk}.ci_high", math.nan),
                    "ylo": r.get(f"{col}.ci_low", math.nan),
                    "yhi": r.get(f"{col}.ci_high", math.nan),
                }
            )
        for pt in pts:
            for k in ("xlo", "xhi", "ylo", "yhi"):
                pt[k] = math.nan if pt[k] is None else float(pt[k])
        if pts:
            metric = col.rsplit(":", 1)[1]
            panels.append(
                {
                    "points": pts,
                    "title": col.rsplit(":", 1)[0],
                    "ref": 0.5 if metric == "auroc" else None,
                    "xlabel": f"{uk} ({'lower' if lower_is_better(uk) else 'higher'} is better)",
                    "ylabel": f"{metric.upper()} (closer to {'0.5' if metric == 'auroc' else '0'}: less leakage)",
                }
            )
    if not panels:
        return []
    p = rel / f"tradeoff_{tag}.png"
    save_tradeoff(panels, dest / p, title=f"{task} [{preset}]: privacy-utility trade-off")
    return [str(p)]


def _communication(sub, dest: Path, rel: Path, tag: str, task: str, preset: str) -> list[str]:
    rows = sub[(sub.defense != "base")]
    if rows.empty or "cost.bytes_up_per_round" not in rows:
        return []
    ref_row = rows[rows.defense == "fedavg"]
    ref = (
        float(ref_row["cost.bytes_up_per_round"].iloc[0] + ref_row["cost.bytes_down_per_round"].iloc[0])
        if len(ref_row)
        else None
    )
    vals = {}
    for _, r in rows.iterrows():
        up, down = r.get("cost.bytes_up_per_round"), r.get("cost.bytes_down_per_round")
        if up is None or math.isnan(up):
            continue
        down = 0.0 if down is None or math.isnan(down) else down
        vals[r.defense] = (up / ref, down / ref) if ref else (up / 1024, down / 1024)
    if not vals:
        return []
    p = rel / f"communication_{tag}.png"
    save_bars(
        vals,
        dest / p,
        ref=1.0 if ref else None,
        xlabel="bytes per round relative to fedavg (up + down)" if ref else "KB per round (up + down)",
        title=f"{task} [{preset}]: communication per round",
    )
    return [str(p)]


def epsilon_series(rec: dict, *, points: int = 6) -> tuple[list[int], list[float], str]:
    """Composed epsilon after a few rounds 1..R of a DP record, recomputed by the defense itself.

    Needs the record's ``privacy.sample_rate`` (else only the recorded final value is returned); the
    recomputation must reproduce the recorded final ``epsilon_composed``, else only that point is used.
    Each point is one RDP accounting (about 0.5 s CPU), so only ``points`` geometric rounds are drawn.
    """
    pv, cost = rec.get("privacy") or {}, rec.get("cost") or {}
    final, delta, rounds = pv.get("epsilon_composed"), pv.get("delta"), int(cost.get("rounds") or 0)
    if final is None or delta is None or rounds < 1:
        return [], [], "no composed epsilon recorded"
    q = pv.get("sample_rate")
    if q is None:
        return [rounds], [float(final)], "recorded value only (the record has no sample rate)"
    try:
        from ..registry import DEFENSES, build

        d = build(DEFENSES.get(rec["defense"]), dict(rec.get("defense_params") or {}), "defense")
        xs = sorted({int(round(x)) for x in np.geomspace(1, rounds, min(points, rounds))} | {rounds})
        with warnings.catch_warnings():  # a defense that needs its message structure says so: the fallback below
            warnings.simplefilter("ignore")
            ys = [float(d.epsilon_composed(delta=delta, rounds=r, sample_rate=q)) for r in xs]
        if not math.isclose(ys[-1], final, rel_tol=1e-3):
            raise ValueError(f"recomputed {ys[-1]:.4g} != recorded {final:.4g}")
        return xs, ys, f"sample rate {q:.3g}"
    except Exception as e:  # e.g. a defense loaded from a path is not importable here: the recorded point
        return [rounds], [float(final)], f"recorded value only ({type(e).__name__}: {e})"


def _epsilon(res, tr: list[dict], dest: Path, rel: Path, tag: str, task: str, preset: str) -> list[str]:
    first: dict[str, dict] = {}
    for r in tr:
        if (r.get("privacy") or {}).get("epsilon_composed") is not None and r["defense"] != "base":
            first.setdefault(r["defense_label"], r)
    series = {}
    for dl, r in sorted(first.items()):
        xs, ys, note = epsilon_series(r)
        if xs:
            series[f"{dl} (eps/release {r['privacy'].get('epsilon', math.nan):.3g})"] = (xs, ys)
    if not series:
        return []
    p = rel / f"epsilon_{tag}.png"
    save_curves(
        series,
        dest / p,
        xlabel="round",
        ylabel="composed epsilon (RDP, client sampling)",
        logy=True,
        title=f"{task} [{preset}]: privacy budget over rounds",
    )
    return [str(p)]
