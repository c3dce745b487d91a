"""Metrics (docs/design.md s.5): membership AUROC / advantage / ASR / TPR at low FPR with bootstrap
intervals (ROC from scikit-learn), and reconstruction SSIM / PSNR / MSE per image (scikit-image).

TPR at FPR f is reported only with at least 10 / f non-members (else ``value`` None and a ``reason``): with
fewer, every low-FPR column reads TPR at zero false positives. The ASR here picks the best threshold on the
evaluation set itself, so it is optimistic: it is recorded as ``asr_oracle`` (an attack's own calibrated
ASR, e.g. a threshold set on auxiliary data, is ``asr_aux``)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from .bootstrap import tpr_unreported

FPRS = (0.001, 0.01, 0.05)


def tpr_at_fpr(fpr: np.ndarray, tpr: np.ndarray, target: float) -> float:
    """Highest TPR whose FPR does not exceed ``target`` (the conservative reading of the ROC)."""
    ok = fpr <= target
    return float(tpr[ok].max()) if ok.any() else 0.0


def unreported_tprs(labels: np.ndarray) -> dict[str, str]:
    """{``tpr@<f>fpr``: reason} for the FPRs too low for the number of non-members in ``labels``."""
    n0 = int((np.asarray(labels) == 0).sum())
    return {f"tpr@{f:g}fpr": why for f in FPRS if (why := tpr_unreported(f, n0))}


def membership_point(scores: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Point metrics of one score; TPRs at FPRs the non-members cannot resolve are left out."""
    from sklearn.metrics import auc, roc_curve  # lazy: sklearn is not needed to plan (start-up)

    fpr, tpr, _ = roc_curve(labels, scores, drop_intermediate=False)
    area = float(auc(fpr, tpr))  # = roc_auc_score (trapezoids over the full ROC), one pass
    out = {"auroc": area, "advantage": abs(area - 0.5) / 0.5, "asr_oracle": float(np.max(1 - (fpr + (1 - tpr)) / 2))}
    skip = unreported_tprs(labels)
    for f in FPRS:
        if f"tpr@{f:g}fpr" not in skip:
            out[f"tpr@{f:g}fpr"] = tpr_at_fpr(fpr, tpr, f)
    return out


def membership_metrics(
    scores: ArrayLike, labels: ArrayLike, *, n_boot: int = 200, seed: int = 0
) -> tuple[dict[str, dict[str, Any]], dict[str, list[float]]]:
    """Point estimates with 95% bootstrap intervals (resampling candidates), and the ROC curve."""
    import sklearn
    from sklearn.metrics import roc_curve

    s = np.asarray(scores, dtype=float)
    y = np.asarray(labels, dtype=int)
    if not np.isfinite(s).all():
        raise ValueError("membership scores contain NaN or inf")
    point = membership_point(s, y)
    rng = np.random.default_rng(seed)
    boots: dict[str, list[float]] = {k: [] for k in point}
    # Inputs were validated above; scikit-learn's per-call validation would dominate 200 replicates.
    with sklearn.config_context(skip_parameter_validation=True, assume_finite=True):
        for _ in range(n_boot):
            idx = rng.integers(0, len(s), len(s))
            if len(np.unique(y[idx])) < 2:
                continue
            for k, v in membership_point(s[idx], y[idx]).items():
                if k in boots:  # a TPR gated out of the point estimate stays out of the replicates
                    boots[k].append(v)
    metrics: dict[str, dict[str, Any]] = {
        k: {"value": v, "ci_low": float(np.percentile(boots[k], 2.5)), "ci_high": float(np.percentile(boots[k], 97.5))}
        for k, v in point.items()
    }
    for k, why in unreported_tprs(y).items():
        metrics[k] = {"value": None, "ci_low": None, "ci_high": None, "reason": why}
    fpr, tpr, _ = roc_curve(y, s)
    return metrics, {"fpr": fpr.tolist(), "tpr": tpr.tolist()}


def to_unit(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """De-normalise [N,C,H,W] model inputs to [0,1] images."""
    m = np.asarray(mean, dtype=float).reshape(1, -1, 1, 1)
    sd = np.asarray(std, dtype=float).reshape(1, -1, 1, 1)
    return np.clip(images * sd + m, 0.0, 1.0)


def reconstruction_metrics(recon: np.ndarray, target: np.ndarray) -> dict[str, list[float]]:
    """Per-image SSIM, PSNR, MSE on [0,1] images of shape [N,C,H,W]."""
    from skimage.metrics import mean_squared_error, peak_signal_noise_ratio, structural_similarity  # lazy

    out: dict[str, list[float]] = {"ssim": [], "psnr": [], "mse": []}
    for r, t in zip(recon, target):
        r2, t2 = np.moveaxis(r, 0, -1), np.moveaxis(t, 0, -1)
        win = min(7, *t2.shape[:2]) // 2 * 2 + 1 if min(t2.shape[:2]) < 7 else 7
        out["ssim"].append(float(structural_similarity(t2, r2, data_range=1.0, channel_axis=-1, win_size=win)))
        mse = float(mean_squared_error(t2, r2))
        out["mse"].append(mse)
        out["psnr"].append(float(peak_signal_noise_ratio(t2, r2, data_range=1.0)) if mse > 0 else 100.0)
    return out


def mean_ci(values: Sequence[float], *, n_boot: int = 1000, seed: int = 0) -> dict[str, float]:
    """Mean with a 95% bootstrap interval over the values (images, or seeds)."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = rng.choice(v, size=(n_boot, len(v)), replace=True).mean(1) if len(v) > 1 else np.array([v.mean()])
    return {
        "value": float(v.mean()),
        "ci_low": float(np.percentile(means, 2.5)),
        "ci_high": float(np.percentile(means, 97.5)),
    }


def held_out_scores(
    fit: Callable[[Any, Any], Callable[[Any], Any]], x_members: Any, x_nonmembers: Any, *, folds: int = 5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray] | None:
    """Out-of-fold scores of an attack that learns from the attacker's aux data: ``fit(members, nonmembers)``
    returns a scorer; each aux item is scored by one fitted on the other folds (scikit-learn's stratified
    k-fold), so the ``asr_aux`` threshold is chosen on scores the classifier did not train on. None with fewer
    than 2 aux items per side."""
    from sklearn.model_selection import StratifiedKFold  # lazy (start-up)

    n_m, n_n = len(x_members), len(x_nonmembers)
    k = min(folds, n_m, n_n)
    if k < 2:
        return None
    y = np.r_[np.ones(n_m, dtype=int), np.zeros(n_n, dtype=int)]
    out = np.full(n_m + n_n, np.nan)
    for train, test in StratifiedKFold(k, shuffle=True, random_state=seed).split(y, y):
        tm, tn = train[train < n_m], train[train >= n_m] - n_m
        score = fit(x_members[tm], x_nonmembers[tn])
        em, en = test[test < n_m], test[test >= n_m] - n_m
        out[em], out[n_m + en] = _flat(score(x_members[em])), _flat(score(x_nonmembers[en]))
    return out[:n_m], out[n_m:]


def _flat(v: Any) -> np.ndarray:
    return np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=float).reshape(-1)
