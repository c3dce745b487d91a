"""Plots (matplotlib, Agg), all regenerated from the records: reconstruction grids (per cell, written by
the runner), log-scale ROC curves (Carlini et al. 2022), the privacy-utility trade-off (papers/000
Fig. 2), per-image SSIM distributions (papers/003 Fig. 12), communication per round (papers/000
Fig. 3) and composed epsilon over rounds for the DP defenses (opacus RDP via the defense's own
``epsilon_composed``)."""
from __future__ import annotations

import math
import re
import shutil
import warnings
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

PNG_META = {"Software": None}  # no version string: the same records give the same bytes
FPR_GRID = np.logspace(-3, 0, 200)


def _save(fig, path: Path, dpi: int = 90, *, tight: bool = False) -> str:
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata=PNG_META)
    plt.close(fig)
    return str(path)


def save_grid(originals: np.ndarray, recon: np.ndarray, path: Path, *, title: str = "",
              scores: Sequence[float] | None = None) -> str:
    """Originals (top row) over reconstructions (bottom row), [N,C,H,W] in [0,1]; returns the path."""
    n = len(originals)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n + 0.4, 3.6), squeeze=False)
    for i in range(n):
        for row, img in ((0, originals[i]), (1, recon[i])):
            ax = axes[row][i]
            im = np.moveaxis(img, 0, -1)
            ax.imshow(im.squeeze(-1) if im.shape[-1] == 1 else im, cmap="gray" if im.shape[-1] == 1 else None,
                      vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        if scores is not None:
            axes[1][i].set_xlabel(f"SSIM {scores[i]:.2f}", fontsize=8)
    axes[0][0].set_ylabel("original", fontsize=8)
    axes[1][0].set_ylabel("reconstruction", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path, dpi=80, tight=True)


def save_roc(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, *, title: str = "") -> str:
    """Log-scale ROC curves (Carlini et al. 2022 style), one line per label."""
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    fig.subplots_adjust(left=0.15, right=0.97, bottom=0.12, top=0.91)
    for name, (fpr, tpr) in curves.items():
        ax.plot(np.maximum(fpr, 1e-3), np.maximum(tpr, 1e-3), label=name, lw=1.2)
    ax.plot([1e-3, 1], [1e-3, 1], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_ticks(ax, "xy")
    ax.set_xlim(1e-3, 1)
    ax.set_ylim(1e-3, 1.05)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="lower right")
    return _save(fig, path)


def plain_log_ticks(ax, which: str) -> None:
    """Log axes with plain decimal labels (mathtext tick labels are slow to lay out)."""
    fmt = FuncFormatter(lambda v, _: f"{v:g}")
    for w in which:
        axis = ax.xaxis if w == "x" else ax.yaxis
        axis.set_major_formatter(fmt)
        axis.set_minor_formatter(NullFormatter())


def mean_roc(rocs: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Vertical average over seeds of ROC curves on a log-spaced FPR grid."""
    tprs = [np.interp(FPR_GRID, np.asarray(r["fpr"], float), np.asarray(r["tpr"], float)) for r in rocs]
    return FPR_GRID, np.mean(tprs, axis=0)


def save_tradeoff(panels: list[dict], path: Path, *, title: str = "") -> str:
    """Privacy vs utility, one point per defense configuration with 95% error bars (papers/000 Fig. 2)."""
    n = len(panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.8 * rows), squeeze=False)
    fig.subplots_adjust(left=0.08 / cols ** 0.5, right=0.98, bottom=0.12 / rows, top=1 - 0.12 / rows, wspace=0.3,
                        hspace=0.45)
    for ax, p in zip(axes.flat, panels):
        for pt in p["points"]:
            xerr = [[pt["x"] - pt["xlo"]], [pt["xhi"] - pt["x"]]] if not math.isnan(pt["xlo"]) else None
            yerr = [[pt["y"] - pt["ylo"]], [pt["yhi"] - pt["y"]]] if not math.isnan(pt["ylo"]) else None
            ax.errorbar(pt["x"], pt["y"], xerr=xerr, yerr=yerr, fmt="o", ms=4, capsize=2, label=pt["label"])
            ax.annotate(pt["label"], (pt["x"], pt["y"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if p.get("ref") is not None:
            ax.axhline(p["ref"], color="k", ls=":", lw=0.8)
        ax.set_xlabel(p["xlabel"], fontsize=8)
        ax.set_ylabel(p["ylabel"], fontsize=8)
        ax.set_title(p["title"], fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def save_distributions(data: dict[str, Sequence[float]], path: Path, *, xlabel: str, title: str = "",
                       ref: float | None = None) -> str:
    """Per-defense distributions (box + points), e.g. per-image SSIM as papers/003 Fig. 12."""
    labels = list(data)
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(labels) + 1.4))
    fig.subplots_adjust(left=0.3, right=0.97, bottom=0.8 / fig.get_figheight(), top=1 - 0.45 / fig.get_figheight())
    ax.boxplot([np.asarray(data[k], float) for k in labels], orientation="horizontal", widths=0.6, showfliers=False)
    rng = np.random.default_rng(0)
    for i, k in enumerate(labels, start=1):
        v = np.asarray(data[k], float)
        ax.scatter(v, i + rng.uniform(-0.15, 0.15, len(v)), s=8, alpha=0.6)
    ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=7)
    if ref is not None:
        ax.axvline(ref, color="k", ls=":", lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def save_bars(values: dict[str, tuple[float, float]], path: Path, *, xlabel: str, title: str = "",
              ref: float | None = None) -> str:
    """Stacked horizontal bars (up, down) per label, e.g. communication per round (papers/000 Fig. 3)."""
    labels = list(values)
    up = np.array([values[k][0] for k in labels])
    down = np.array([values[k][1] for k in labels])
    fig, ax = plt.subplots(figsize=(6, 0.4 * len(labels) + 1.8))
    fig.subplots_adjust(left=0.3, right=0.9, bottom=1.2 / fig.get_figheight(), top=1 - 0.45 / fig.get_figheight())
    y = np.arange(len(labels))
    ax.barh(y, up, label="client -> server")
    ax.barh(y, down, left=up, label="server -> client")
    for i in range(len(labels)):
        ax.text(up[i] + down[i], i, f" {up[i] + down[i]:.3g}", va="center", fontsize=7)
    if ref is not None:
        ax.axvline(ref, color="k", ls=":", lw=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
    return _save(fig, path)


def save_curves(series: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, *, xlabel: str,
                ylabel: str, title: str = "", logy: bool = False) -> str:
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.13, top=0.91)
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o" if len(x) < 2 else None, ms=4, label=name, lw=1.2)
    if logy:
        ax.set_yscale("log")
        plain_log_ticks(ax, "y")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    return _save(fig, path)


# ----------------------------------------------------------------------------------------------
# the plots of one scenario, from the records


def slug(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", "_".join(parts)).strip("_")


def scenario_plots(res, scenario: str, table, dest: Path, out: Path) -> list[str]:
    """Every plot of ``scenario``; returns paths relative to ``dest`` (sorted, deterministic)."""
    from .leaderboard import HEADLINE, VIEW_SHORT

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
                r["defense_label"], []).append(r)
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
                data = {dl: [v for r in rs for v in (r.get("per_sample") or {}).get("ssim", [])]
                        for dl, rs in sorted(per_def.items())}
                data = {k: v for k, v in data.items() if v}
                if data:
                    p = rel / f"ssim_{slug(tag, alabel)}.png"
                    save_distributions(data, dest / p, ref=0.5, title=f"{task} [{preset}]: {alabel}",
                                       xlabel="SSIM per reconstructed image, all seeds (dotted: 0.5, papers/003)")
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
    from .leaderboard import UTILITY_ORDER, lower_is_better

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
            pts.append({"label": r.defense, "x": x, "y": y, "xlo": r.get(f"utility.{uk}.ci_low", math.nan),
                        "xhi": r.get(f"utility.{uk}.ci_high", math.nan), "ylo": r.get(f"{col}.ci_low", math.nan),
                        "yhi": r.get(f"{col}.ci_high", math.nan)})
        for pt in pts:
            for k in ("xlo", "xhi", "ylo", "yhi"):
                pt[k] = math.nan if pt[k] is None else float(pt[k])
        if pts:
            metric = col.rsplit(":", 1)[1]
            panels.append({"points": pts, "title": col.rsplit(":", 1)[0], "ref": 0.5 if metric == "auroc" else None,
                           "xlabel": f"{uk} ({'lower' if lower_is_better(uk) else 'higher'} is better)",
                           "ylabel": f"{metric.upper()} (closer to {'0.5' if metric == 'auroc' else '0'}: less leakage)"})
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
    ref = float(ref_row["cost.bytes_up_per_round"].iloc[0] + ref_row["cost.bytes_down_per_round"].iloc[0]) \
        if len(ref_row) else None
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
    save_bars(vals, dest / p, ref=1.0 if ref else None,
              xlabel="bytes per round relative to fedavg (up + down)" if ref else "KB per round (up + down)",
              title=f"{task} [{preset}]: communication per round")
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
        from .registry import DEFENSES, build

        d = build(DEFENSES.get(rec["defense"]), dict(rec.get("defense_params") or {}), "defense")
        if getattr(d, "_delta", "absent") is None:
            d._delta = delta  # as the runner's training run had it after setup()
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
    save_curves(series, dest / p, xlabel="round", ylabel="composed epsilon (RDP, client sampling)", logy=True,
                title=f"{task} [{preset}]: privacy budget over rounds")
    return [str(p)]
