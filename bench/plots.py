"""Plots (matplotlib, Agg): reconstruction grids, ROC curves, per-scenario summaries."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)


def save_roc(curves: dict[str, tuple[Sequence[float], Sequence[float]]], path: Path, *, title: str = "") -> str:
    """Log-scale ROC curves (Carlini et al. 2022 style), one line per label."""
    fig, ax = plt.subplots(figsize=(4.2, 4))
    for name, (fpr, tpr) in curves.items():
        ax.plot(np.maximum(fpr, 1e-4), np.maximum(tpr, 1e-4), label=name, lw=1.2)
    ax.plot([1e-4, 1], [1e-4, 1], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)
