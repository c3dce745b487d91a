"""Each paper's headline claim, checked on the suite's measured records (never on reported numbers).

A check returns comparisons, each with ``direction`` (the point estimates point the claimed way) and
``ok`` (the claimed criterion is met: a claimed difference needs the 95% intervals to separate, see
``bench.leaderboard.differs``; "comparable utility" is a stated tolerance). Verdict per scenario and
preset: ``holds`` (every comparison ok), ``holds in part`` (some), ``does not hold`` (none),
``not measured`` (no records for the cells the claim needs). Membership leakage is AUROC's distance
from 0.5 (a score separating in the wrong direction still leaks).
"""
from __future__ import annotations

from typing import Callable

from .leaderboard import Estimate, Results, differs, leakage

COLUMNS = ["paper", "claim", "scenario", "preset", "verdict", "direction", "evidence"]
# "comparable utility": tolerated loss, absolute for accuracy-like metrics in [0, 1], else relative
TOLERANCE = {"accuracy": ("abs", 0.05), "test_loss": ("rel", 0.05), "perplexity": ("rel", 0.10),
             "cider": ("rel", 0.05), "fid": ("rel", 0.10), "kid": ("rel", 0.10)}
MODEST = 0.20  # papers/002: "modest" utility loss = at most 20% relative (its Table I: +18% training loss)
NEAR_CHANCE = 0.10  # papers/004: "near 0.5" = within 0.1 of 0.5, or the interval contains 0.5
UTILITY_PREFERENCE = ("accuracy", "cider", "test_loss", "perplexity", "fid", "kid")
LOWER = ("test_loss", "perplexity", "fid", "kid")

CLAIMS: list[dict] = []


def claim(paper: str, scenarios: tuple[str, ...], text: str) -> Callable:
    def deco(fn: Callable[[Results, str, str], list[dict]]) -> Callable:
        CLAIMS.append({"paper": paper, "scenarios": scenarios, "claim": text, "check": fn})
        return fn

    return deco


def verdict(comparisons: list[dict]) -> tuple[str, str]:
    if not comparisons:
        return "not measured", "n/a"
    ok = [c["ok"] for c in comparisons]
    d = [c["direction"] for c in comparisons]
    v = "holds" if all(ok) else ("holds in part" if any(ok) else "does not hold")
    return v, "agrees" if all(d) else ("opposite" if not any(d) else "mixed")


def evaluate(res: Results) -> list[dict]:
    """One row per claim x scenario x preset (``not measured`` rows where a scenario has no records)."""
    out = []
    for c in CLAIMS:
        for scenario in c["scenarios"]:
            presets = sorted({r["preset"] for r in res.records if r["scenario"] == scenario})
            for preset in presets or [""]:
                try:
                    comps = c["check"](res, scenario, preset) if preset else []
                except (KeyError, ValueError) as e:
                    comps = []
                    note = f"could not evaluate: {e}"
                else:
                    note = ""
                v, d = verdict(comps)
                evidence = "; ".join(x["text"] for x in comps) or note or "no records of the cells this claim needs"
                out.append({"paper": c["paper"], "claim": c["claim"], "scenario": scenario, "preset": preset or "-",
                            "verdict": v, "direction": d, "evidence": evidence})
    return out


def markdown(rows: list[dict]) -> str:
    from tabulate import tabulate

    parts = ["# Claims from the papers, measured by the suite", "",
             "Verdicts come from the suite's own records and 95% intervals, per scenario and preset; reported "
             "numbers never enter them (see `reported_vs_measured.csv`). " + __doc__.split("\n\n")[1].replace("\n", " "),
             ""]
    if rows:
        parts.append(tabulate([[r[c] for c in COLUMNS] for r in rows], headers=COLUMNS, tablefmt="github",
                              disable_numparse=True))
    return "\n".join(parts) + "\n"


# ----------------------------------------------------------------------------------------------
# helpers


def main_utility(res: Results, recs: list[dict]) -> str | None:
    keys = {k for r in recs for k in (r.get("utility") or {})}
    return next((k for k in UTILITY_PREFERENCE if k in keys), None)


def utility_loss(mine: Estimate, ref: Estimate, key: str) -> float:
    """How much worse ``mine`` is than ``ref`` (positive = worse), in the tolerance's units."""
    worse = (mine.value - ref.value) if key in LOWER else (ref.value - mine.value)
    kind, _ = TOLERANCE.get(key, ("rel", 0.05))
    return worse if kind == "abs" else worse / max(abs(ref.value), 1e-12)


def relative_loss(mine: Estimate, ref: Estimate, key: str) -> float:
    worse = (mine.value - ref.value) if key in LOWER else (ref.value - mine.value)
    return worse / max(abs(ref.value), 1e-12)


def comparable(mine: Estimate | None, ref: Estimate | None, key: str) -> tuple[bool, str]:
    if mine is None or ref is None:
        return False, "utility not measured"
    loss = utility_loss(mine, ref, key)
    kind, tol = TOLERANCE.get(key, ("rel", 0.05))
    ok = loss <= tol
    unit = "" if kind == "abs" else " (relative)"
    return ok, f"{key} {mine.value:.3g} vs {ref.value:.3g}: {'comparable' if ok else 'worse'} (loss {loss:+.3f}{unit}, tolerance {tol})"


def _cells(res: Results, scenario: str, preset: str, defense: str, **kw) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in res.select(scenario=scenario, preset=preset, defense=defense, **kw):
        out.setdefault((r["task"], r["attack_label"], r["view"]), []).append(r)
    return out


def leakage_comparisons(res: Results, scenario: str, preset: str, mine: str, ref: str, *, views: tuple[str, ...],
                        attack_prefix: str = "", kind: str = "membership", util_rule: str = "comparable") -> list[dict]:
    """``mine`` leaks less than ``ref`` (intervals) in each shared cell, with the utility condition."""
    a, b = _cells(res, scenario, preset, mine, kind=kind), _cells(res, scenario, preset, ref, kind=kind)
    out = []
    for key in sorted(set(a) & set(b)):
        task, alabel, view = key
        if view not in views or not alabel.startswith(attack_prefix):
            continue
        metric = "auroc" if kind == "membership" else "ssim"
        ea, eb = res.metric(a[key], metric), res.metric(b[key], metric)
        la, lb = leakage(ea, metric), leakage(eb, metric)
        if la is None or lb is None:
            continue
        d = differs(la, lb)
        uk = main_utility(res, a[key])
        ua, ub = (res.utility(a[key], uk), res.utility(b[key], uk)) if uk else (None, None)
        if util_rule == "none":
            u_ok, u_txt = True, ""
        elif util_rule == "modest":
            rel = relative_loss(ua, ub, uk) if ua and ub else None
            u_ok = rel is not None and rel <= MODEST
            u_txt = (f"{uk} {ua.value:.3g} vs {ub.value:.3g} (relative loss {rel:+.3f}, modest <= {MODEST})"
                     if rel is not None else "utility not measured")
        else:
            u_ok, u_txt = comparable(ua, ub, uk) if uk else (False, "utility not measured")
        sig = {-1: "lower by the intervals", 0: "intervals overlap", 1: "higher by the intervals"}[d]
        out.append({"direction": la.value < lb.value, "ok": d == -1 and u_ok,
                    "text": f"{task} {alabel}/{view}: {metric} {ea.fmt()} vs {ref} {eb.fmt()} ({sig})"
                            + (f"; {u_txt}" if u_txt else "")})
    return out


# ----------------------------------------------------------------------------------------------
# the claims


@claim("papers/003 FLRSP", ("image-cls",),
       "FLRSP gives lower reconstruction SSIM than standard FL (FedSGD / FedAvg) at comparable accuracy")
def flrsp_claim(res: Results, scenario: str, preset: str) -> list[dict]:
    labels = sorted({r["defense_label"] for r in res.select(scenario=scenario, preset=preset, status=None)
                     if r["defense"] == "flrsp"})
    out = []
    for lab in labels:
        params = lab[lab.find("(") + 1:-1].replace(",", ":") if "(" in lab else ""
        spec = "flrsp" + (":" + params if params else "")
        ref = "fedsgd" if "form=fedsgd" in lab else "fedavg"
        for c in leakage_comparisons(res, scenario, preset, spec, ref, views=("client_update",), kind="reconstruction"):
            out.append({**c, "text": f"{lab}: {c['text']}"})
    return out


@claim("papers/000 FedRand", ("llm-text", "vlm-caption"),
       "FedRand's reconstructed client models leak less to MaxRényi-K% membership inference than FedAvg's "
       "(client view) at comparable utility")
def fedrand_claim(res: Results, scenario: str, preset: str) -> list[dict]:
    return leakage_comparisons(res, scenario, preset, "fedrand", "fedavg", views=("client_model",),
                               attack_prefix="max_renyi")


@claim("papers/004 SMP-LoRA", ("ldm-t2i",),
       "SMP-LoRA brings membership ASR and AUC near 0.5 (less leakage than LoRA) with a smaller utility loss "
       "than MP-LoRA")
def smp_lora_claim(res: Results, scenario: str, preset: str) -> list[dict]:
    out = []
    near = _cells(res, scenario, preset, "smp_lora", kind="membership")
    for c in leakage_comparisons(res, scenario, preset, "smp_lora", "lora", views=("released_model",),
                                 util_rule="none"):
        out.append(c)
    for (task, alabel, view), recs in sorted(near.items()):
        for metric in ("auroc", "asr"):
            e = res.metric(recs, metric)
            if e is None:
                continue
            ok = abs(e.value - 0.5) <= NEAR_CHANCE or (e.has_ci() and e.lo <= 0.5 <= e.hi)
            out.append({"direction": ok, "ok": ok,
                        "text": f"{task} {alabel}/{view}: smp_lora {metric} {e.fmt()} "
                                f"({'near' if ok else 'not near'} 0.5)"})
    smp = res.select(scenario=scenario, preset=preset, defense="smp_lora")
    mp = res.select(scenario=scenario, preset=preset, defense="mp_lora")
    uk = main_utility(res, smp) if smp and mp else None
    if uk:
        for task in sorted({r["task"] for r in smp} & {r["task"] for r in mp}):
            us = res.utility([r for r in smp if r["task"] == task], uk)
            um = res.utility([r for r in mp if r["task"] == task], uk)
            better = (us.value < um.value) if uk in LOWER else (us.value > um.value)
            d = differs(us, um) * (1 if uk in LOWER else -1)
            out.append({"direction": better, "ok": better and d == -1,
                        "text": f"{task} utility {uk}: smp_lora {us.fmt()} vs mp_lora {um.fmt()} "
                                f"({'better' if better else 'not better'}; "
                                f"{'separated by the intervals' if d == -1 else 'not separated by intervals over seeds'})"})
    return out


@claim("papers/002 DP-FedLoRA", ("llm-text",),
       "DP-FedLoRA gives a formal (epsilon, delta) guarantee and less membership leakage than FedAvg "
       "with a modest utility loss")
def dp_fedlora_claim(res: Results, scenario: str, preset: str) -> list[dict]:
    recs = res.select(scenario=scenario, preset=preset, defense="dp_fedlora")
    if not recs:
        return []
    eps = sorted({(r.get("privacy") or {}).get("epsilon") for r in recs} - {None})
    comp = sorted({(r.get("privacy") or {}).get("epsilon_composed") for r in recs} - {None})
    out = [{"direction": bool(eps), "ok": bool(eps),
            "text": f"dp_fedlora epsilon per release {eps[0]:.3g}, composed over all rounds "
                    f"{comp[0]:.3g}" if eps and comp else "dp_fedlora records no epsilon"}]
    out += leakage_comparisons(res, scenario, preset, "dp_fedlora", "fedavg", views=("global_model", "client_model"),
                               util_rule="modest")
    return out
