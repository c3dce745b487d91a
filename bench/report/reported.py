"""Numbers the papers report, kept apart from the suite's measurements and shown beside them.

``leaderboards/reported/*.csv`` (one file per paper) hold one reported number per row: ``paper, table,
setting, metric, value, spread, unit`` as printed (percent stays percent), then the suite's closest
setting: ``scenario`` (names or task ids, ``;``-separated), ``defense`` / ``attack`` (CLI specs: a bare
name means its default configuration), ``view``, ``part`` and ``suite_metric``:

- ``auroc``, ``asr``, ``advantage``, ``tpr@0.05fpr``, ``ssim``, ...: a metric of the cell;
- ``variants:<score>:<metric>``: a named score of a membership attack (``{part}`` is filled from the
  ``part`` column; a ``caption`` part falls back to ``text`` in text-only scenarios);
- ``utility.<name>``: the global model's utility (names compared without case and punctuation);
- ``derived:comm_ratio``: (bytes up + down per round) / FedAvg's in the same task ([FedRand] Fig. 3);
- ``derived:frac_ssim_above_0.5``: share of reconstructions with SSIM > 0.5 ([FLRSP]'s threshold).

The first scenario listed is the paper's own setting's counterpart; a further one is a different setting (e.g.
[FedRand]'s MSCOCO-vs-NoCaps AUROCs beside the text-only fortunes of ``llm-text``): such rows are kept in the CSV
with ``same_setting`` False and left out of the markdown, never put beside the paper's number as its
measurement. ``asr`` is measured by a record's calibrated ``asr_aux`` only (the oracle-threshold ASR, chosen on
the evaluation set itself, is optimistic and never shown beside a paper's ASR).

An empty ``suite_metric`` means the suite does not measure it. Reported values are converted to the
suite's scale (percent -> fraction) only in the ``reported (suite scale)`` column; nothing reported
ever enters an estimate, a claim verdict or a plot.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from .results import Results
from .stats import Estimate, sample_estimate, seed_estimate

ROOT = Path(__file__).resolve().parents[2] / "leaderboards" / "reported"
COLUMNS = [
    "paper",
    "table",
    "setting",
    "metric",
    "value",
    "spread",
    "unit",
    "scenario",
    "defense",
    "attack",
    "view",
    "part",
    "suite_metric",
    "note",
]
UNITS = {"percent", "fraction", "score", "value", "loss", "ssim", "direction", "count", "probability"}
OUT_COLUMNS = [
    "paper",
    "table",
    "setting",
    "metric",
    "reported",
    "reported (suite scale)",
    "scenario",
    "preset",
    "task",
    "defense",
    "attack",
    "view",
    "suite_metric",
    "measured",
    "measured_value",
    "measured_ci_low",
    "measured_ci_high",
    "n_seeds",
    "same_setting",
    "note",
]


def load(root: Path | None = None) -> pd.DataFrame:
    """All reported numbers, validated (every file has the columns; values are numbers or empty)."""
    frames = []
    for p in sorted(Path(root or ROOT).glob("*.csv")):
        df = pd.read_csv(p, dtype=str, keep_default_na=False)
        missing = [c for c in COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(f"{p}: missing columns {missing}")
        bad = [u for u in df.unit if u not in UNITS]
        if bad:
            raise ValueError(f"{p}: unknown unit(s) {sorted(set(bad))}; valid: {sorted(UNITS)}")
        for col in ("value", "spread"):
            for v in df[col]:
                if v != "":
                    float(v)  # raises on a malformed number
        df["source"] = p.name
        frames.append(df[COLUMNS + ["source"]])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS + ["source"])


def to_suite_scale(value: str, unit: str, suite_metric: str) -> float | None:
    if value == "":
        return None
    v = float(value)
    base = suite_metric.rsplit(":", 1)[-1]
    if unit == "percent" and base in ("auroc", "asr", "tpr@0.05fpr", "tpr@0.01fpr", "tpr@0.001fpr", "advantage"):
        return v / 100.0
    return v


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def _utility_key(res: Results, recs: list[dict], want: str) -> str | None:
    keys = sorted({k for r in recs for k in (r.get("utility") or {})})
    for k in keys:
        if _norm(k) == _norm(want):
            return k
    for k in keys:
        if _norm(k).startswith(_norm(want)):
            return k
    return None


def _variant(recs: list[dict], metric: str, part: str, scenario: str) -> str | None:
    if "{part}" not in metric:
        return metric
    names = {n for r in recs for n in (r.get("variants") or {})}
    for p in [part] + (["text"] if part == "caption" else []):
        m = metric.replace("{part}", p)
        if m.split(":")[1] in names:
            return m
    return None


def measure(res: Results, row: dict, scenario: str) -> list[dict]:
    """The suite's measurement(s) of one reported row in one scenario (one per preset x task)."""
    sm = row["suite_metric"]
    if not sm or not row["defense"]:
        return []
    recs_all = res.select(
        scenario=scenario, defense=row["defense"], attack=row["attack"] or None, view=row["view"] or None
    )
    if not row["attack"]:  # utility / cost: any ok record of the training run
        recs_all = [r for r in recs_all if r["defense"] != "base"]
    out = []
    for preset, task in sorted({(r["preset"], r["task"]) for r in recs_all}):
        recs = [r for r in recs_all if (r["preset"], r["task"]) == (preset, task)]
        est: Estimate | None = None
        what = sm
        if sm.startswith("utility."):
            key = _utility_key(res, recs, sm[8:])
            est = res.utility(recs, key) if key else None
            what = f"utility.{key}" if key else sm
        elif sm == "derived:comm_ratio":
            est = _comm_ratio(res, recs, preset, task)
        elif sm == "derived:frac_ssim_above_0.5":
            est = sample_estimate(
                recs, "ssim", key=(preset, task, row["defense"], "frac"), transform=lambda g: (g > 0.5).astype(float)
            )
        else:
            if sm.startswith("variants:"):
                what = _variant(recs, sm, row["part"], scenario) or ""
                if not what:
                    continue
            if what == "asr":
                what = "asr_aux"
            cells: dict[tuple, list[dict]] = {}
            for r in recs:
                cells.setdefault((r["attack_label"], r["view"]), []).append(r)
            for _key, cell in sorted(cells.items()):
                est = res.metric(cell, what)
                if est is not None:
                    out.append(_row(est, preset, task, cell[0], what))
            continue
        if est is not None:
            out.append(_row(est, preset, task, recs[0], what))
    return out


def _row(est: Estimate, preset: str, task: str, rec: dict, what: str) -> dict:
    privacy = "utility" not in what and "comm" not in what
    return {
        "preset": preset,
        "task": task,
        "defense": rec["defense_label"],
        "attack": rec["attack_label"] if rec.get("attack_kind") and privacy else "",
        "view": rec["view"] if privacy else "",
        "suite_metric": what,
        "measured": est.note or est.fmt(),
        "measured_value": est.value,
        "measured_ci_low": est.lo,
        "measured_ci_high": est.hi,
        "n_seeds": est.n_seeds,
    }


def _comm_ratio(res: Results, recs: list[dict], preset: str, task: str) -> Estimate | None:
    def total(rs):
        v = Results.per_seed(
            rs,
            lambda r: (
                ((r.get("cost") or {}).get("bytes_up_per_round") or 0)
                + ((r.get("cost") or {}).get("bytes_down_per_round") or 0)
            ),
        )
        return float(np.mean(v)) if v else math.nan

    base = res.select(preset=preset, task=task, defense="fedavg")
    mine, ref = total(recs), total(base) if base else math.nan
    if not ref or math.isnan(ref) or math.isnan(mine):
        return None
    return seed_estimate([mine / ref])


def compare(res: Results, reported: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every reported number beside the suite's closest measurement ("not measured" where none)."""
    rep = load() if reported is None else reported
    rows = []
    for _, r in rep.iterrows():
        r = dict(r)
        reported_txt = (
            r["value"]
            + (f" +- {r['spread']}" if r["spread"] else "")
            + (f" {r['unit']}" if r["value"] else f"({r['unit']})")
        )
        scaled = to_suite_scale(r["value"], r["unit"], r["suite_metric"])
        base = {
            "paper": r["paper"],
            "table": r["table"],
            "setting": r["setting"],
            "metric": r["metric"],
            "reported": reported_txt.strip(),
            "reported (suite scale)": "" if scaled is None else f"{scaled:.6g}",
            "note": r["note"],
        }
        scenarios = [s for s in r["scenario"].split(";") if s] or [""]
        for i, s in enumerate(scenarios):
            ms = measure(res, r, s) if s else []
            same = {"same_setting": i == 0}
            for m in ms:
                rows.append({**base, "scenario": s.split("/")[0], **m, **same})
            if not ms:
                rows.append(
                    {
                        **base,
                        "scenario": s.split("/")[0],
                        **same,
                        "preset": "",
                        "task": s if "/" in s else "",
                        "defense": r["defense"],
                        "attack": r["attack"],
                        "view": r["view"],
                        "suite_metric": r["suite_metric"],
                        "measured": "not measured" if r["suite_metric"] else "not measured by the suite",
                        "measured_value": math.nan,
                        "measured_ci_low": math.nan,
                        "measured_ci_high": math.nan,
                        "n_seeds": 0,
                    }
                )
    return pd.DataFrame(rows, columns=OUT_COLUMNS)
