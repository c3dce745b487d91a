"""[FedRand] Table 4 beside Table 1, from the suite's records: MaxRényi-0% / -10% AUROC on the image
and caption slices per method and threat view ("server" = global model, "client" = the curious server's
reconstruction of a client), next to the caption utility of the same training run, with the paper's
reported numbers (``leaderboards/reported/papers000_fedrand.csv``) in the adjacent columns.

Measured AUROCs are in percent, as the paper prints them, with 95% intervals: the bootstrap over candidates
(and seeds), from the per-candidate scores the records keep for these four variants (``Scores.keep`` in
``attacks/max_renyi.py``); records without them (older runs) get a Student-t interval over seeds. Utility columns
are Table 1's (BLEU-1..4, ROUGE-L, CIDEr); client rows use the target client's model (``utility.client_*``),
where the paper averages over clients. Rows the paper does not have (the un-fine-tuned base model - the
distribution-shift check -, DP-FedLoRA, FLRSP) have empty reported columns; DP-FedLoRA and FLRSP get one row
per configuration found in the records.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import pandas as pd

from .reported import load as load_reported
from .results import Results, spec_matches

SCENARIO = "vlm-caption"
ATTACK = "max_renyi"
SCORES = (
    ("MaxRenyi-0% image", 0, "image"),
    ("MaxRenyi-0% caption", 0, "caption"),
    ("MaxRenyi-10% image", 10, "image"),
    ("MaxRenyi-10% caption", 10, "caption"),
)
UTILITY = (
    ("BLEU-1", "bleu1"),
    ("BLEU-2", "bleu2"),
    ("BLEU-3", "bleu3"),
    ("BLEU-4", "bleu4"),
    ("ROUGE", "rouge"),
    ("CIDEr", "cider"),
)
# (row label, defense spec: a bare name is its default configuration, None = every configuration, view)
ROWS: tuple[tuple[str, str, bool, str], ...] = (
    ("Base model (not fine-tuned)", "base", True, "global_model"),
    ("FedAvg (server)", "fedavg", True, "global_model"),
    ("FedAvg (client)", "fedavg", True, "client_model"),
    ("FedPer (2 layers)", "fedper:shared_layers=2", True, "global_model"),
    ("FedPer (4 layers)", "fedper:shared_layers=4", True, "global_model"),
    ("FedPara", "fedpara", True, "global_model"),
    ("FedRand (server)", "fedrand", True, "global_model"),
    ("FedRand (client)", "fedrand", True, "client_model"),
    ("DP-FedLoRA (server)", "dp_fedlora", False, "global_model"),
    ("DP-FedLoRA (client)", "dp_fedlora", False, "client_model"),
    ("FLRSP (server)", "flrsp", False, "global_model"),
    ("FLRSP (client)", "flrsp", False, "client_model"),
)


def _results(records: Any) -> Results:
    if isinstance(records, Results):
        return records
    if isinstance(records, pd.DataFrame):
        records = records.to_dict("records")
    return Results(list(records))


def _reported(rep: pd.DataFrame, spec: str, view: str) -> dict[str, tuple[float, float]]:
    """{column: (value, spread)} of [FedRand]'s Table 4 and Table 1 for one row (percent, as printed)."""
    out: dict[str, tuple[float, float]] = {}
    if rep.empty:
        return out
    p = rep[(rep.paper == "papers/000") & (rep.defense == spec)]
    f = lambda v: float(v) if v != "" else math.nan  # noqa: E731
    for name, k, part in SCORES:
        hit = p[
            (p.table == "Table 4")
            & (p.view == view)
            & (p.part == part)
            & (p.suite_metric == f"variants:maxrenyi_K{k}_a0.5_{{part}}:auroc")
        ]
        if len(hit):
            out[name] = (f(hit.value.iloc[0]), f(hit.spread.iloc[0]))
    table1 = "Table 1 (client)" if view == "client_model" else "Table 1 (server)"
    for name, _ in UTILITY:
        hit = p[(p.table == table1) & (p.metric == f"MSCOCO {name}")]
        if len(hit):
            out[name] = (f(hit.value.iloc[0]), f(hit.spread.iloc[0]))
    return out


def _status(res: Results, preset: str, task: str, spec: str, view: str) -> str:
    bad = [
        r
        for r in res.select(scenario=task, preset=preset, defense=spec, attack=ATTACK, view=view, status=None)
        if r["status"] != "ok"
    ]
    return f"{bad[0]['status']}: {bad[0].get('reason') or ''}" if bad else ""


def table4(records: Results | Iterable[dict] | pd.DataFrame, *, reported: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (preset, task, Table 4 row); measured and reported columns side by side (percent)."""
    res = _results(records)
    rep = load_reported() if reported is None else reported
    tasks = sorted({(r["preset"], r["task"]) for r in res.records if r["scenario"] == SCENARIO})
    rows = []
    for preset, task in tasks:
        for label, spec, default_only, view in ROWS:
            recs_all = res.select(scenario=task, preset=preset, attack=ATTACK, view=view, status=None)
            if default_only:
                labels = {
                    r["defense_label"]
                    for r in recs_all
                    if spec_matches(spec, r["defense"], r.get("defense_params") or {}, r["defense_label"])
                }
            else:
                labels = {r["defense_label"] for r in recs_all if r["defense"] == spec}
            for dlabel in sorted(labels) or [None]:
                method = label if default_only or dlabel in (None, spec) else f"{label} [{dlabel}]"
                rows.append(_row(res, rep, preset, task, method, spec, dlabel, view))
    cols = ["preset", "task", "method", "defense", "view", "n_seeds"]
    for name, _, _ in SCORES:
        cols += [name, f"{name} ci_low", f"{name} ci_high", f"{name} reported", f"{name} reported spread"]
    for name, _ in UTILITY:
        cols += [name, f"{name} reported"]
    cols += ["note"]
    return pd.DataFrame(rows, columns=cols)


def _row(
    res: Results, rep: pd.DataFrame, preset: str, task: str, label: str, spec: str, dlabel: str | None, view: str
) -> dict[str, Any]:
    row: dict[str, Any] = {"preset": preset, "task": task, "method": label, "defense": dlabel or spec, "view": view}
    recs = (
        [r for r in res.select(scenario=task, preset=preset, attack=ATTACK, view=view) if r["defense_label"] == dlabel]
        if dlabel
        else []
    )
    row["n_seeds"] = len({r["seed"] for r in recs})
    for name, k, part in SCORES:
        e = res.metric(recs, f"variants:maxrenyi_K{k}_a0.5_{part}:auroc") if recs else None
        row[name] = 100 * e.value if e is not None else math.nan
        row[f"{name} ci_low"] = 100 * e.lo if e is not None and e.has_ci() else math.nan
        row[f"{name} ci_high"] = 100 * e.hi if e is not None and e.has_ci() else math.nan
    # utility of the same training run (any attack's records of this defense configuration carry it)
    urecs = [r for r in res.select(scenario=task, preset=preset) if r["defense_label"] == dlabel] if dlabel else []
    prefix = "client_" if view == "client_model" else ""
    for name, key in UTILITY:
        e = res.utility(urecs, prefix + key) if urecs else None
        row[name] = e.value if e is not None else math.nan
    reported = _reported(rep, spec, view)
    for name, _, _ in SCORES:
        row[f"{name} reported"], row[f"{name} reported spread"] = reported.get(name, (math.nan, math.nan))
    for name, _ in UTILITY:
        row[f"{name} reported"] = reported.get(name, (math.nan, math.nan))[0]
    row["note"] = "" if recs else (_status(res, preset, task, dlabel or spec, view) or "not run")
    return row


def markdown(df: pd.DataFrame) -> str:
    """The table as markdown: 'measured [ci] (reported)' per score, utility 'measured (reported)'."""

    def cell(v: float, lo: float = math.nan, hi: float = math.nan, rv: float = math.nan, rs: float = math.nan) -> str:
        s = "-" if math.isnan(v) else f"{v:.1f}"
        if not (math.isnan(lo) or math.isnan(hi)):
            s += f" [{lo:.1f}, {hi:.1f}]"
        if not math.isnan(rv):
            s += f" ({rv:.2f}" + ("" if math.isnan(rs) else f" ± {rs:.2f}") + ")"
        return s

    from tabulate import tabulate

    head = ["preset", "method"] + [n for n, _, _ in SCORES] + [n for n, _ in UTILITY] + ["note"]
    rows = []
    for _, r in df.iterrows():
        cells = [r.preset, r.method]
        cells += [
            cell(r[n], r[f"{n} ci_low"], r[f"{n} ci_high"], r[f"{n} reported"], r[f"{n} reported spread"])
            for n, _, _ in SCORES
        ]
        cells += [cell(r[n], rv=r[f"{n} reported"]) for n, _ in UTILITY]
        cells.append(str(r.note or ""))
        rows.append(cells)
    return (
        tabulate(rows, headers=head, tablefmt="github", disable_numparse=True)
        + "\n\nMaxRényi AUROC in percent, measured [95% interval] (papers/000 reported ± spread); "
        "utility measured (reported, Table 1).\n"
    )
