"""The empirical epsilon audit of a leaderboard row (``bench.audit``, Jagielski et al., NeurIPS 2020): the
claimed epsilon beside the strongest measured lower bound, and a violation when the claim is below it.

The row's bound is the maximum over its membership cells (attack x view x seed) with per-candidate scores,
each recomputed from those scores with the Bonferroni correction widened to all k cells, so the maximum
still holds at 95%. The claim is the composed epsilon without amplification when recorded (the
honest-but-curious server's), else the composed one; a claim below the bound means a bug or a wrong
accounting. Beside it, the one-run bound (``bench.one_run_audit``, Steinke et al., NeurIPS 2023, on member /
non-member pairs), which holds without treating one run's candidates as independent trials.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from ..audit import EpsilonBound, audit_delta, epsilon_lower_bound
from ..one_run_audit import OneRunBound, auditable
from ..one_run_audit import record_bound as one_run_record

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
    one, one_where = _one_run(cells)
    c = claimed if claimed is not None and math.isfinite(claimed) else math.inf  # nothing finite claimed: no violation
    violation = c < best.value
    one_violation = one is not None and c < one.value
    return {
        "claimed": claimed,
        "lower_bound": best.value,
        "attack": where,
        "confidence": best.confidence,
        "delta": best.delta,
        "n_cells": k,
        "one_run_lower_bound": None if one is None else one.value,
        "one_run_attack": one_where,
        "one_run_pairs": None if one is None else one.pairs,
        "violation": bool(violation or one_violation),
    }


def _one_run(cells: Sequence[dict]) -> tuple[OneRunBound | None, str | None]:
    """The strongest one-run bound (bench.one_run_audit) over the cells that can be paired, Bonferroni over them;
    None when no cell can (records before schema revision 3)."""
    ok = sorted((r for r in cells if auditable(r)), key=lambda r: (r["attack_label"], r["view"], r["seed"]))
    best: OneRunBound | None = None
    where: str | None = None
    for r in ok:
        b = one_run_record(r, delta=audit_delta((r.get("privacy") or {}).get("delta")), tests=len(ok))
        if best is None or b.value > best.value:
            best, where = b, f"{r['attack_label']}/{r['view']} seed {r['seed']}"
    return best, (where if best is not None and best.value > 0 else "-" if best is not None else None)


def tightness(audit: dict[str, Any]) -> str:
    """Claimed / audited ratio in words (a DP row's tightness)."""
    c, lb = audit["claimed"], audit["lower_bound"]
    if c is None:
        return "no epsilon claimed"
    one = audit.get("one_run_lower_bound")
    lb = max(lb, one or 0.0)  # the larger of the ROC bound and the one-run bound (both hold at 95%)
    if audit["violation"]:
        return f"VIOLATION: claimed {c:.3g} < audited lower bound {lb:.3g}"
    if lb <= 0:
        return f"claimed {c:.3g}; audited lower bound 0 (no attack shows any leakage: ratio unbounded)"
    return f"claimed {c:.3g} / audited {lb:.3g} = {c / lb:.3g}x"


def one_run_text(value: float | None, pairs: Any) -> str:
    """The one-run bound as shown: ``n/a`` for rows whose records predate it (schema revision < 3)."""
    if value is None:
        return "n/a (records before schema revision 3)"
    n = _float(pairs)
    return f"{value:.3g}" + (f" ({int(n)} pairs)" if n is not None else "")


def dp_rows(table, scenario: str) -> list[dict[str, Any]]:
    """The audited rows of a scenario table (``bench.report.tables.scenario_table``) that claim an epsilon."""
    if "privacy.epsilon_lower_bound" not in getattr(table, "columns", ()):
        return []
    out = []
    for _, r in table.iterrows():
        c, lb = _float(r.get("privacy.epsilon_claimed")), _float(r.get("privacy.epsilon_lower_bound"))
        if c is None or lb is None:
            continue
        one = _float(r.get("privacy.epsilon_one_run_lower_bound"))
        au = {
            "claimed": c,
            "lower_bound": lb,
            "one_run_lower_bound": one,
            "violation": bool(r.get("dp_violation") is True),
        }
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
                "one_run": one_run_text(one, r.get("privacy.epsilon_one_run_lower_bound.pairs")),
            }
        )
    return out
