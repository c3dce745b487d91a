"""Chart primitives of the leaderboards (matplotlib, Agg): log-scale ROC curves (Carlini et al. 2022), the
privacy-utility trade-off ([FedRand] Fig. 2), distributions ([FLRSP] Fig. 12), communication bars
([FedRand] Fig. 3) and curves."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter  # noqa: E402

from ..figures import save_figure  # noqa: E402

FPR_GRID = np.logspace(-3, 0, 200)


def save_roc(
    curves: Mapping[str, tuple[Sequence[float] | np.ndarray, Sequence[float] | np.ndarray]],
    path: Path,
    *,
    title: str = "",
) -> str:
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
    return save_figure(fig, path)


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
    """Privacy vs utility, one point per defense configuration with 95% error bars ([FedRand] Fig. 2)."""
    n = len(panels)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    height = 3.8 * rows
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, height), squeeze=False)
    # margins in inches (a fraction of the height would shrink under the title as rows are added)
    fig.subplots_adjust(
        left=0.85 / (4.6 * cols), right=0.98, bottom=0.5 / height, top=1 - 0.75 / height, wspace=0.3, hspace=0.45
    )
    # one colour per defense in every panel (a panel's own order gave lora blue in one, orange in the next)
    labels = sorted({pt["label"] for p in panels for pt in p["points"]})
    palette = plt.get_cmap("tab10" if len(labels) <= 10 else "tab20")
    colour = {lab: palette(i % palette.N) for i, lab in enumerate(labels)}
    for ax, p in zip(axes.flat, panels):
        for pt in p["points"]:
            xerr = [[pt["x"] - pt["xlo"]], [pt["xhi"] - pt["x"]]] if not math.isnan(pt["xlo"]) else None
            yerr = [[pt["y"] - pt["ylo"]], [pt["yhi"] - pt["y"]]] if not math.isnan(pt["ylo"]) else None
            ax.errorbar(
                pt["x"],
                pt["y"],
                xerr=xerr,
                yerr=yerr,
                fmt="o",
                ms=4,
                capsize=2,
                label=pt["label"],
                color=colour[pt["label"]],
            )
            ax.annotate(pt["label"], (pt["x"], pt["y"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if p.get("ref") is not None:
            ax.axhline(p["ref"], color="k", ls=":", lw=0.8)
        ax.set_xlabel(p["xlabel"], fontsize=8)
        ax.set_ylabel(p["ylabel"], fontsize=8)
        ax.set_title(p["title"], fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.2 / height)
    return save_figure(fig, path)


def save_distributions(
    data: Mapping[str, Sequence[float]], path: Path, *, xlabel: str, title: str = "", ref: float | None = None
) -> str:
    """Per-defense distributions (box + points), e.g. per-image SSIM as [FLRSP] Fig. 12."""
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
    return save_figure(fig, path)


def save_bars(
    values: dict[str, tuple[float, float]], path: Path, *, xlabel: str, title: str = "", ref: float | None = None
) -> str:
    """Stacked horizontal bars (up, down) per label, e.g. communication per round ([FedRand] Fig. 3)."""
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
    return save_figure(fig, path)


def save_curves(
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logy: bool = False,
) -> str:
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    fig.subplots_adjust(left=0.14, right=0.97, bottom=0.13, top=0.91)
    for name, (x, y) in series.items():
        ax.plot(x, y, marker="o" if len(x) < 2 else None, ms=4, label=name, lw=1.2)
    if logy:
        ax.set_yscale("log")
        plain_log_ticks(ax, "y")
    if all(float(v).is_integer() for x, _ in series.values() for v in x):  # rounds: no tick at round 1.5
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    return save_figure(fig, path)
