"""Figures the run-time harness writes (matplotlib, Agg): the reconstruction grid of a cell, and the
deterministic PNG writer every plot uses (no version string in the file: the same data, the same bytes)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

PNG_META = {"Software": None}  # no version string: the same records give the same bytes


def save_figure(fig, path: Path, dpi: int = 90, *, tight: bool = False) -> str:
    if tight:
        fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata=PNG_META)
    plt.close(fig)
    return str(path)


def save_grid(
    originals: np.ndarray, recon: np.ndarray, path: Path, *, title: str = "", scores: Sequence[float] | None = None
) -> str:
    """Originals (top row) over reconstructions (bottom row), [N,C,H,W] in [0,1]; returns the path."""
    n = len(originals)
    fig, axes = plt.subplots(2, n, figsize=(1.6 * n + 0.4, 3.6), squeeze=False)
    for i in range(n):
        for row, img in ((0, originals[i]), (1, recon[i])):
            ax = axes[row][i]
            im = np.moveaxis(img, 0, -1)
            ax.imshow(
                im.squeeze(-1) if im.shape[-1] == 1 else im, cmap="gray" if im.shape[-1] == 1 else None, vmin=0, vmax=1
            )
            ax.set_xticks([])
            ax.set_yticks([])
        if scores is not None:
            axes[1][i].set_xlabel(f"SSIM {scores[i]:.2f}", fontsize=8)
    axes[0][0].set_ylabel("original", fontsize=8)
    axes[1][0].set_ylabel("reconstruction", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return save_figure(fig, path, dpi=80, tight=True)
