"""The empirical epsilon audit of a leaderboard row (``bench.audit``, Jagielski et al., NeurIPS 2020): the
claimed epsilon beside the strongest measured lower bound, and a violation when the claim is below it.

The row's bound is the maximum over its membership cells (attack x view x seed) with per-candidate scores,
each recomputed from those scores with the Bonferroni correction widened to all k cells, so the maximum
still holds at 95%. The claim is the composed epsilon without amplification when recorded (the
honest-but-curious server's), else the composed one; a claim below the bound means a bug or a wrong
accounting.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..audit import EpsilonBound, audit_delta, epsilon_lower_bound

CONFIDENCE = 0.95


def _float(v: Any) -> float | None:
    try:
        f = float(v)  # "inf" is stored as a string
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def claimed_epsilon(recs: Sequence[dict]) -> float | None:
    """The row's claimed epsilon: composed without amplification if recorded, else composed (max over seeds)."""
    vals: list[float] = []
    for r in recs:
        p = r.get("privacy") or {}
        v = _float(p.get("epsilon_composed_no_amplification"))
        v = v if v is not None else _float(p.get("epsilon_composed"))
        if v is not None:
            vals.append(v)
    return max(vals) if vals else None


def row_audit(recs: Sequence[dict]) -> dict[str, Any] | None:
    """Claimed epsilon, audited lower bound (strongest cell), its attack/view/seed, and the violation flag;
    None when the row has no membership cell with per-candidate scores."""
    cells = [
        r
        for r in recs
        if r.get("status") == "ok"
        and r.get("attack_kind") == "membership"
        and (r.get("per_candidate") or {}).get("score")
    ]
    if not cells:
        return None
    k = len(cells)
    best: EpsilonBound | None = None
    where: str | None = None
    for r in sorted(cells, key=lambda r: (r["attack_label"], r["view"], r["seed"])):
        pc = r["per_candidate"]
        b = epsilon_lower_bound(
            pc["score"],
            pc["member"],
            delta=audit_delta((r.get("privacy") or {}).get("delta")),
            confidence=CONFIDENCE,
            tests=k,
        )
        if best is None or b.value > best.value:
            best, where = b, f"{r['attack_label']}/{r['view']} seed {r['seed']}"
    assert best is not None  # cells is not empty
    if best.value <= 0:
        where = "-"  # no cell shows any leakage at this confidence
    claimed = claimed_epsilon(recs)
    violation = claimed is not None and math.isfinite(claimed) and claimed < best.value
    return {
        "claimed": claimed,
        "lower_bound": best.value,
        "attack": where,
        "confidence": best.confidence,
        "delta": best.delta,
        "n_cells": k,
        "violation": bool(violation),
    }


def tightness(audit: dict[str, Any]) -> str:
    """Claimed / audited ratio in words (a DP row's tightness)."""
    c, lb = audit["claimed"], audit["lower_bound"]
    if c is None:
        return "no epsilon claimed"
    if audit["violation"]:
        return f"VIOLATION: claimed {c:.3g} < audited lower bound {lb:.3g}"
    if lb <= 0:
        return f"claimed {c:.3g}; audited lower bound 0 (no attack shows any leakage: ratio unbounded)"
    return f"claimed {c:.3g} / audited {lb:.3g} = {c / lb:.3g}x"


def dp_rows(table, scenario: str) -> list[dict[str, Any]]:
    """The audited rows of a scenario table (``bench.report.tables.scenario_table``) that claim an epsilon."""
    if "privacy.epsilon_lower_bound" not in getattr(table, "columns", ()):
        return []
    out = []
    for _, r in table.iterrows():
        c, lb = _float(r.get("privacy.epsilon_claimed")), _float(r.get("privacy.epsilon_lower_bound"))
        if c is None or lb is None:
            continue
        au = {"claimed": c, "lower_bound": lb, "violation": bool(r.get("dp_violation") is True)}
        out.append(
            {
                "scenario": scenario,
                "preset": r.preset,
                "task": r.task,
                "defense": r.defense,
                "claimed": c,
                "lower_bound": lb,
                "attack": r.get("privacy.epsilon_lower_bound.attack"),
                "delta": r.get("privacy.epsilon_lower_bound.delta"),
                "violation": au["violation"],
                "tightness": tightness(au),
            }
        )
    return out
