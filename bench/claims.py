"""Each paper's headline claim, checked on the measured records (never on reported numbers).

A claim "holds" only where the 95% intervals separate; otherwise it is "not shown" or "does not hold".
"""
from __future__ import annotations

from typing import Callable

import pandas as pd

CLAIMS: list[dict] = []


def claim(paper: str, scenario: str, text: str) -> Callable:
    def deco(fn: Callable[[pd.DataFrame], tuple[str, str]]) -> Callable:
        CLAIMS.append({"paper": paper, "scenario": scenario, "claim": text, "check": fn})
        return fn

    return deco


def evaluate_claims(scenario: str, df: pd.DataFrame) -> list[dict]:
    out = []
    for c in CLAIMS:
        if c["scenario"] != scenario:
            continue
        try:
            verdict, evidence = c["check"](df)
        except (KeyError, ValueError) as e:
            verdict, evidence = "not measured", f"missing cells: {e}"
        out.append({"paper": c["paper"], "claim": c["claim"], "verdict": verdict, "evidence": evidence})
    return out


def _recon(df: pd.DataFrame, defense: str) -> pd.DataFrame:
    return df[(df.defense == defense) & (df.status == "ok") & (df.attack_kind == "reconstruction")]


@claim("papers/003 FLRSP", "image-cls",
       "FLRSP gives lower reconstruction SSIM than standard FL at comparable accuracy")
def flrsp_claim(df: pd.DataFrame) -> tuple[str, str]:
    lines, verdicts = [], []
    for (task, form), base_name in (((t, f), "fedsgd" if f == "fedsgd" else "fedavg")
                                    for t in sorted(set(df.task)) for f in ("fedavg", "fedsgd")):
        base = _recon(df[df.task == task], base_name)
        fl = _recon(df[df.task == task], "flrsp")
        fl = fl[fl.defense_label.str.contains(f"form={form}") | ((form == "fedavg") & ~fl.defense_label.str.contains("form="))]
        if base.empty or fl.empty:
            continue
        for attack in sorted(set(base.attack) & set(fl.attack)):
            b = base[base.attack == attack]
            b_ssim, b_hi, b_lo = b.ssim.mean(), b["ssim.ci_high"].max(), b["ssim.ci_low"].min()
            b_acc = b["utility.accuracy"].mean()
            for dl, g in fl[fl.attack == attack].groupby("defense_label"):
                s, s_hi = g.ssim.mean(), g["ssim.ci_high"].max()
                acc = g["utility.accuracy"].mean()
                lower = s_hi < b_lo
                comparable = abs(acc - b_acc) <= 0.05
                verdicts.append(lower and comparable)
                lines.append(f"{task} {attack} {dl}: SSIM {s:.2f} vs {base_name} {b_ssim:.2f} "
                             f"({'lower' if lower else 'not lower'} by the intervals), accuracy {acc:.2f} vs "
                             f"{b_acc:.2f} ({'comparable' if comparable else 'not comparable'})")
    if not verdicts:
        raise ValueError("no FLRSP and baseline reconstruction cells")
    verdict = "holds" if all(verdicts) else ("holds in part" if any(verdicts) else "does not hold")
    return verdict, "; ".join(lines)
