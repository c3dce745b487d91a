"""The clauses of a claim and their verdicts (``holds`` / ``contradicted`` / ``inconclusive`` / ``not
measured``): a leakage clause from a paired difference and the claimed effect (with the minimum detectable effect),
a utility clause from a stated tolerance and a seed-paired interval of the utility loss, with utility collapse
(perplexity above 10x the reference's, accuracy at chance) never holding. See ``bench.report.claims`` for how
clauses make a claim's verdict."""

from __future__ import annotations

import math
from typing import Callable

from .paired import difference, mde
from .ranking import CHANCE_MARGIN
from .ranking import PERPLEXITY_FACTOR as PERPLEXITY_COLLAPSE
from .results import Results, is_utility
from .stats import Estimate, seed_estimate

# "comparable utility": tolerated loss, absolute for accuracy-like metrics in [0, 1], else relative
TOLERANCE = {
    "accuracy": ("abs", 0.05),
    "test_loss": ("rel", 0.05),
    "perplexity": ("rel", 0.10),
    "cider": ("rel", 0.05),
    "fid": ("rel", 0.10),
    "kid": ("rel", 0.10),
}
MODEST = 0.20  # [DP-FedLoRA]: "modest" utility loss = at most 20% relative (its Table I: +18% training loss)
NEAR_CHANCE = 0.10  # [SMP-LoRA]: "near 0.5" = within 0.1 of 0.5
UTILITY_PREFERENCE = ("accuracy", "cider", "test_loss", "perplexity", "fid", "kid")
LOWER = ("test_loss", "perplexity", "fid", "kid")
# A composed epsilon above this guarantees nothing a reader would call private (e^10 ~ 2.2e4 likelihood ratio).
MEANINGFUL_EPSILON = 10.0
# Claimed effects, in the leakage units of the clause (AUROC distance from 0.5, or SSIM):
FEDRAND_EFFECT = 0.0217  # [FedRand] Table 4, client view, MaxRenyi-0% caption: FedAvg 70.68 vs FedRand 68.51
SMP_LORA_EFFECT = 0.295  # [SMP-LoRA] Table 1 (Pokemon): |AUC-0.5|/0.5 0.73 (LoRA) vs 0.14 (SMP-LoRA), halved
DEFAULT_AUROC_EFFECT = 0.05  # smallest effect of interest where the paper states no size ([DP-FedLoRA])
DEFAULT_SSIM_EFFECT = 0.10  # [FLRSP] gives directions only (Fig. 12)
HOLDS, CONTRA, INCONC, NOT_MEASURED = "holds", "contradicted", "inconclusive", "not measured"


def utility_name(key: str) -> str | None:
    """The canonical utility a record key measures (``fid_effnetlite0`` -> ``fid``), None if none."""
    k = key.lower()
    return next((u for u in UTILITY_PREFERENCE if k == u or k.startswith(u + "_")), None)


def main_utility(res: Results, recs: list[dict]) -> str:
    """The record key of the preferred utility; raises KeyError when the records carry none of them."""
    keys = sorted({k for r in recs for k in (r.get("utility") or {})})
    for u in UTILITY_PREFERENCE:
        hit = next((k for k in keys if utility_name(k) == u and is_utility(k)), None)
        if hit:
            return hit
    raise KeyError(
        f"no utility among {list(UTILITY_PREFERENCE)} (or their _<variant> forms) in the records' keys {keys}"
    )


def _value(r: dict, key: str) -> float | None:
    raw = (r.get("utility") or {}).get(key)
    if raw is None:
        return None
    try:
        v = float(raw)  # a non-finite utility is stored as its string ("inf")
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _first_per_seed(recs: list[dict], key: str) -> dict[int, float]:
    """Each seed's utility from its first record carrying it (as ``Results.per_seed``: a seed whose records come
    from two training runs is read from the run its first record scored)."""
    out: dict[int, float] = {}
    for r in recs:
        if (v := _value(r, key)) is not None:
            out.setdefault(r["seed"], v)
    return out


def utility_loss(recs: list[dict], ref_recs: list[dict], key: str, *, relative: bool) -> Estimate | None:
    """How much worse ``recs`` is than ``ref_recs`` (positive = worse), paired by seed: the mean over the seeds
    both ran of each seed's loss (absolute, or relative to the reference's value), with a Student-t interval
    over those seeds (utility has one value per training run, so seeds are its only replication)."""
    lower = utility_name(key) in LOWER
    mine, ref = _first_per_seed(recs, key), _first_per_seed(ref_recs, key)
    losses = []
    for s in sorted(set(mine) & set(ref)):
        w = (mine[s] - ref[s]) if lower else (ref[s] - mine[s])
        losses.append(w / max(abs(ref[s]), 1e-12) if relative else w)
    return seed_estimate(x for x in losses if math.isfinite(x))


def _chance(recs: list[dict]) -> float:
    n = next(
        ((r.get("utility") or {}).get("num_classes") for r in recs if (r.get("utility") or {}).get("num_classes")), None
    )
    return 1 / float(n) if n else math.nan


def collapsed(res: Results, recs: list[dict], ref_recs: list[dict], key: str) -> str:
    """Why ``recs``'s utility collapsed (perplexity > 10x the reference's, accuracy at chance), or ""."""
    if utility_name(key) == "perplexity":
        a, b = res.utility(recs, key), res.utility(ref_recs, key)
        if a is not None and b is not None and (math.isinf(a.value) or a.value > PERPLEXITY_COLLAPSE * b.value):
            return f"perplexity {a.value:.3g} > {PERPLEXITY_COLLAPSE:g}x {b.value:.3g}: utility collapsed"
    if utility_name(key) == "accuracy":
        chance = _chance(recs)
        for who, rs in (("the reference's ", ref_recs), ("", recs)):  # a reference at chance: nothing to compare
            e = res.utility(rs, key)
            if e is not None and not math.isnan(chance) and abs(e.value - chance) <= CHANCE_MARGIN:
                return f"{who}accuracy {e.value:.3f} is at chance ({chance:.3f})"
    return ""


def utility_clause(res: Results, recs: list[dict], ref_recs: list[dict], rule: str, ref: str) -> dict | None:
    """``rule`` = comparable | modest: the utility of ``recs`` against ``ref_recs``' (None for rule none)."""
    if rule == "none":
        return None
    key = main_utility(res, recs)
    ua, ub = res.utility(recs, key), res.utility(ref_recs, key)
    tasks = tuple(sorted({r["task"] for r in recs}))
    if ua is None or ub is None:
        return {"verdict": NOT_MEASURED, "tasks": tasks, "text": f"{key} not measured"}
    why = collapsed(res, recs, ref_recs, key)
    if why:
        return {
            "verdict": CONTRA if not why.startswith("the reference") else INCONC,
            "tasks": tasks,
            "text": f"{key} {ua.value:.3g} vs {ref} {ub.value:.3g}: {why}",
        }
    if rule == "modest":
        relative, tol, unit = True, MODEST, " (relative, modest)"
    else:
        kind, tol = TOLERANCE.get(utility_name(key) or key, ("rel", 0.05))
        relative, unit = kind != "abs", "" if kind == "abs" else " (relative)"
    loss = utility_loss(recs, ref_recs, key, relative=relative)
    head = f"{key} {ua.value:.3g} vs {ref} {ub.value:.3g}: "
    if loss is None or not loss.has_ci():
        n = 0 if loss is None else loss.n_seeds
        return {
            "verdict": INCONC,
            "tasks": tasks,
            "text": head + f"undecided ({n} seed(s) shared: a utility loss needs an interval over >= 2 seeds, "
            f"tolerance {tol})",
        }
    v = HOLDS if loss.hi <= tol else (CONTRA if loss.lo > tol else INCONC)
    word = {HOLDS: "comparable", CONTRA: "worse", INCONC: "undecided"}[v]
    return {
        "verdict": v,
        "tasks": tasks,
        "text": head + f"{word} (loss {loss.value:+.3f} [{loss.lo:+.3f}, {loss.hi:+.3f}]{unit} over "
        f"{loss.n_seeds} paired seeds, tolerance {tol})",
    }


def leakage_clause(d: Estimate | None, effect: float) -> tuple[str, float]:
    """(verdict, MDE) of "leaks less by ``effect``" from the difference ``d`` = leak(mine) - leak(ref)."""
    if d is None or not d.has_ci():
        return NOT_MEASURED, math.nan
    m = mde(d)
    if d.hi < 0:
        return HOLDS, m
    if d.lo > 0:
        return CONTRA, m
    if not m <= effect:
        return INCONC, m
    return (CONTRA if d.lo > -effect else INCONC), m


def control_failure(res: Results, preset: str, task: str, view: str) -> str | None:
    """Why a leakage clause in ``view`` cannot be decided: the undefended baseline's positive control
    (``bench.controls``) fails in that view, so a difference there says nothing about the defense; None if it
    passes or was not checked. A control that fails in another view of the task does not gate this one."""
    c = res.view_control(preset, task, view)
    return None if c is None or c.passed else f"the baseline's positive control in {view} FAILED: {c.reason}"


def _cells(res: Results, scenario: str, preset: str, defense: str, **kw) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in res.select(scenario=scenario, preset=preset, defense=defense, **kw):
        out.setdefault((r["task"], r["attack_label"], r["view"]), []).append(r)
    return out


def _runs(cells: dict[tuple, list[dict]], key: tuple) -> list[dict]:
    """The records of cell ``key``, then every other record of its task among ``cells`` (any attack, any view):
    utility belongs to the training run, not to the cell, so a claim checked with an attack run at fewer seeds
    still has every seed's utility; ``Results.per_seed`` takes a seed's first record, so a seed the cell itself
    ran keeps the run it scored (an earlier run of that seed may sit in another cell's older records)."""
    return cells[key] + [r for k, recs in cells.items() if k[0] == key[0] and k != key for r in recs]


def leakage_comparisons(
    res: Results,
    scenario: str,
    preset: str,
    mine: str,
    ref: str,
    *,
    views: tuple[str, ...],
    effect: float,
    attacks: tuple[str, ...] = (),
    kind: str = "membership",
    util_rule: str = "comparable",
    pairs: Callable[[str, str], bool] | None = None,
) -> list[dict]:
    """``mine`` leaks less than ``ref`` by ``effect`` in each shared cell (paired), with the utility clause;
    ``attacks``: only the cells of these attack names (all where empty); ``pairs(task, attack)``: only the
    (task, attack) pairs the claim covers."""
    a, b = _cells(res, scenario, preset, mine, kind=kind), _cells(res, scenario, preset, ref, kind=kind)
    out = []
    for key in sorted(set(a) & set(b)):
        task, alabel, view = key
        name = a[key][0]["attack"]
        if view not in views or (attacks and name not in attacks) or (pairs is not None and not pairs(task, name)):
            continue
        metric = "auroc" if kind == "membership" else "ssim"
        ea, eb = res.metric(a[key], metric), res.metric(b[key], metric)
        if ea is None or eb is None:
            continue
        d = difference(res, a[key], b[key], metric, key=("claim", mine, ref) + key)
        v, m = leakage_clause(d, effect)
        how = "paired" if d is not None and d.method.startswith("paired") else "unpaired"
        dtxt = d.fmt() if d is not None else "n/a"
        gate = ""
        if kind == "reconstruction":  # an attack that does not reconstruct on the baseline shows nothing
            c = res.recon_control(preset, task, alabel, ref.split(":")[0], view)
            if c is None or not c.passed:
                v = INCONC if v in (HOLDS, CONTRA) else v
                why = (
                    "not checked"
                    if c is None
                    else c.reason
                    if c.reason.startswith("not checked")
                    else f"FAILED: {c.reason}"
                )
                gate = f"; {ref}'s reconstruction control {why} -> {v}"
        elif (failed := control_failure(res, preset, task, view)) is not None:
            v = INCONC if v in (HOLDS, CONTRA) else v
            gate = f"; {failed} -> {v}"
        out.append(
            {
                "verdict": v,
                "tasks": (task,),
                "effect": effect,
                "mde": m,
                "text": f"{task} {alabel}/{view}: {metric} {ea.fmt()} vs {ref} {eb.fmt()}; leakage difference "
                f"{dtxt} ({how}), MDE {m:.3g} vs claimed effect {effect:.3g}" + (gate or f" -> {v}"),
            }
        )
        u = utility_clause(res, _runs(a, key), _runs(b, key), util_rule, ref)
        if u is not None:
            out.append(u)
    return out
