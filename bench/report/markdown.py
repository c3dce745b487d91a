"""Markdown rendering of the leaderboards (tabulate): the readable tables (``display``: one shown cell per
value, with its interval, best-group flag and comparison mark), the per-scenario page and the index."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from ..controls import AUROC_MIN, GAP_MIN, SSIM_GAP_MIN
from .ranking import COLLAPSE
from .results import UTILITY_ORDER, VIEW_SHORT, Results, diverged
from .stats import Estimate

METRIC_NAMES = {
    "auroc": "AUROC",
    "tpr@0.05fpr": "TPR@5%FPR",
    "tpr@0.01fpr": "TPR@1%FPR",
    "tpr@0.001fpr": "TPR@0.1%FPR",
    "ssim": "SSIM",
    "psnr": "PSNR",
}
MARKS = {"less leakage": " \u25bc", "more leakage": " \u25b2"}


@dataclass
class Shown:
    """One displayed cell: text, the number it sorts by, and whether it is in the column's best group."""

    text: str
    sort: float | None = None
    best: bool = False


def md_escape(x: Any) -> str:
    """A record string made inert in markdown: no raw HTML (``<script>`` shows as text), no table breaks."""
    return html.escape("" if x is None else str(x), quote=False).replace("|", "\\|")


def _frame_md(df: pd.DataFrame) -> str:
    from tabulate import tabulate

    body = [[md_escape(v) for v in row] for row in df.itertuples(index=False)]
    return tabulate(body, headers=[md_escape(c) for c in df.columns], tablefmt="github", disable_numparse=True)


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _shown_estimate(r, col: str) -> Estimate:
    lo, hi = _num(r.get(f"{col}.ci_low")), _num(r.get(f"{col}.ci_high"))
    return Estimate(float(r[col]), math.nan if lo is None else lo, math.nan if hi is None else hi)


def human_bytes(n: float | None) -> str:
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def reportable(table: pd.DataFrame, m: dict) -> bool:
    """A column is shown when it has a value in some row, or is a headline (its n/a then says why)."""
    return m["primary"] or (m["column"] in table.columns and table[m["column"]].notna().any())


def hidden_columns(table: pd.DataFrame, meta: list[dict]) -> str:
    """The metrics no row reports: a metric's name where every attack and view lacks it, else the name with the
    attack/view columns that lack it (another attack may report it: a failed cell has no value at any FPR)."""
    by_metric: dict[str, list[dict]] = {}
    for m in meta:
        by_metric.setdefault(METRIC_NAMES.get(m["metric"], m["metric"]), []).append(m)
    out = []
    for name, ms in sorted(by_metric.items()):
        gone = [f"{m['attack']}/{VIEW_SHORT.get(m['view'], m['view'])}" for m in ms if not reportable(table, m)]
        if gone:
            out.append(name if len(gone) == len(ms) else f"{name} of {', '.join(gone)}")
    return "; ".join(out)


def display(table: pd.DataFrame, meta: list[dict], *, which: str = "all") -> tuple[list[str], list[list[Shown]]]:
    """Header and cells of the readable table: ``which`` = all | primary | secondary attack metrics."""
    if table.empty:
        return [], []
    presets = table.preset.nunique() > 1  # noqa: PD101 -- counts distinct presets (NaN-free column), a small table
    util = [c for c in table.columns if c.startswith("utility.") and not c.endswith((".ci_low", ".ci_high"))]
    util.sort(key=lambda c: (UTILITY_ORDER.index(c[8:]) if c[8:] in UTILITY_ORDER else len(UTILITY_ORDER), c))
    cols = [m for m in meta if (which == "all" or m["primary"] == (which == "primary")) and reportable(table, m)]
    eps = [
        c
        for c in ("privacy.epsilon", "privacy.epsilon_composed", "privacy.epsilon_composed_no_amplification")
        if c in table.columns
    ]
    eps_names = {
        "privacy.epsilon": "epsilon",
        "privacy.epsilon_composed": "epsilon composed",
        "privacy.epsilon_composed_no_amplification": "epsilon composed (no amplification)",
    }
    audit = "privacy.epsilon_lower_bound" in table.columns
    header = (
        (["preset"] if presets else [])
        + ["task", "defense"]
        + [c[8:] for c in util]
        + (
            [eps_names[c] for c in eps]
            + (["epsilon claimed / measured lower bound"] if audit else [])
            + ["up / round", "train s"]
            if which != "secondary"
            else []
        )
    )
    for m in cols:
        name = f"{m['attack']}/{VIEW_SHORT.get(m['view'], m['view'])}"
        if f"{m['column']}.vs_base" in table.columns:
            header.append(f"{name} \u0394AUROC vs base")
        header.append(f"{name} {METRIC_NAMES.get(m['metric'], m['metric'])}")
    rows = []
    for _, r in table.iterrows():
        collapse = r.get("utility_collapse")
        defense = r.defense + (" (utility collapse)" if isinstance(collapse, str) and collapse else "")
        div = r.get("diverged_seeds")
        div = div if isinstance(div, str) else ""
        if div and div != r.get("seeds"):  # other seeds have results: the interval leaves these out (shown, not hid)
            defense += f" (diverged: seed {div.replace(';', ',')})"
        cells = ([Shown(r.preset)] if presets else []) + [Shown(r.task), Shown(defense)]
        for c in util:
            v = _num(r.get(c))
            lo, hi = _num(r.get(f"{c}.ci_low")), _num(r.get(f"{c}.ci_high"))
            # one seed: the point value in the same format as an interval's centre (was 4 significant digits)
            txt = (
                ("diverged" if div else "")
                if v is None
                else Estimate(v, math.nan if lo is None else lo, math.nan if hi is None else hi).fmt()
            )
            cells.append(Shown(txt, v))
        if which != "secondary":
            for c in eps:
                v = _num(r.get(c))
                cells.append(Shown("" if v is None else f"{v:.3g}", v))
            if audit:
                cells.append(audit_cell(r))
            up = _num(r.get("cost.bytes_up_per_round"))
            cells.append(Shown(human_bytes(up), up))
            t = _num(r.get("cost.train_wall_s"))
            cells.append(Shown("" if t is None else f"{t:.1f}", t))
        for m in cols:
            c = m["column"]
            if f"{c}.vs_base" in table.columns:
                d = _num(r.get(f"{c}.vs_base"))
                lo, hi = _num(r.get(f"{c}.vs_base.ci_low")), _num(r.get(f"{c}.vs_base.ci_high"))
                how = r.get(f"{c}.vs_base.method")
                txt = (
                    ""
                    if d is None
                    else f"{d:+.3f}"
                    + ("" if lo is None or hi is None else f" [{lo:+.2f}, {hi:+.2f}]")
                    + (" (unpaired)" if isinstance(how, str) and how.startswith("unpaired") else "")
                )
                cells.append(Shown(txt, d))
            v = _num(r.get(c))
            st = r.get(f"{c}.status")
            st = st if isinstance(st, str) else ""
            if v is None:
                cells.append(Shown(st.split(":", 1)[0].split(" (")[0] if st else ""))
                continue
            e = _shown_estimate(r, c)
            vs = r.get(f"{c}.vs_baseline")
            txt = e.fmt() + MARKS.get(vs if isinstance(vs, str) else "", "") + (" (partly failed)" if st else "")
            cells.append(Shown(txt, v, bool(r.get(f"{c}.best") == 1.0)))
        rows.append(cells)
    return header, rows


def md_table(header: list[str], rows: list[list[Shown]]) -> str:
    from tabulate import tabulate

    body = [[f"**{md_escape(c.text)}**" if c.best and c.text else md_escape(c.text) for c in row] for row in rows]
    return tabulate(body, headers=[md_escape(h) for h in header], tablefmt="github", disable_numparse=True)


LEGEND = (
    "Membership: \u0394AUROC vs base (the headline: the row's AUROC minus the un-fine-tuned base model's on "
    "the same candidates, paired bootstrap; `(unpaired)` where the records carry no candidate ids), AUROC, "
    "TPR at 5%, 1% and 0.1% FPR (`n/a` below 10/FPR non-members: 200, 1,000, 10,000); reconstruction: mean "
    "SSIM and PSNR over images (rows compared paired on the same target images where records name them). "
    "[95% interval: bootstrap over seeds and, independently, candidate or image ids]. **Bold**: the "
    "column's best group (lowest leakage, AUROC ranked by its distance from 0.5, and every row a paired "
    "comparison cannot tell apart from it; a row whose utility collapsed never is). "
    "\u25bc / \u25b2: significantly less / more leakage than the undefended baseline of the same protocol "
    "(fedavg, fedsgd for FedSGD forms, lora for released models). `(utility collapse)`: " + COLLAPSE + ". "
    "`n/a`: the pair does not apply; `failed`: the cell raised (reasons in the cross-matrix and the CSV); "
    "`diverged`: the row's training run diverged under its defense, leaving no model (the defense's outcome). "
    "Epsilon claimed / measured lower bound: the composed epsilon (without amplification where recorded) "
    "beside the empirical lower bound of Jagielski et al. 2020 from the strongest membership cell of the row "
    "(Clopper-Pearson, Bonferroni over thresholds and cells, 95%; delta the defense's, else 1e-5); a claim "
    "below the bound is a VIOLATION (CSV column `dp_violation`). `one-run`: the bound of Steinke et al. 2023 "
    "on member / non-member pairs of one class (one pair = one independent coin), which does not treat one "
    "run's candidates as independent trials; it counts toward a VIOLATION too."
)


def shift_check(table: pd.DataFrame, meta: list[dict]) -> list[str]:
    """Attacks on the un-fine-tuned base model: AUROC away from 0.5 means a distribution-shift confound."""
    lines: list[str] = []
    if table.empty:  # every cell n/a: nothing was scored
        return lines
    for _, r in table[table.defense == "base"].iterrows():
        for m in meta:
            if m["metric"] != "auroc" or _num(r.get(m["column"])) is None:
                continue
            e = _shown_estimate(r, m["column"])
            flag = ""
            if e.has_ci() and not e.lo <= 0.5 <= e.hi:
                flag = " **confound: the interval excludes 0.5**"
            elif not e.has_ci() and abs(e.value - 0.5) > 0.1:
                flag = " **confound: far from 0.5**"
            lines.append(
                f"- {md_escape(r.task)} {md_escape(m['attack'])}/{VIEW_SHORT.get(m['view'], m['view'])}: "
                f"AUROC {e.fmt()}{flag}"
            )
    return lines


def audit_cell(r) -> Shown:
    """``claimed / measured`` epsilon (``-`` when nothing is claimed), loudly marked when the claim is violated."""
    lb = _num(r.get("privacy.epsilon_lower_bound"))
    if lb is None:
        return Shown("")
    c = _num(r.get("privacy.epsilon_claimed"))
    one = _num(r.get("privacy.epsilon_one_run_lower_bound"))
    txt = f"{'-' if c is None else f'{c:.3g}'} / {lb:.3g}" + ("" if one is None else f" (one-run {one:.3g})")
    return Shown(txt + (" \u26a0 VIOLATION" if r.get("dp_violation") is True else ""), lb)


def audit_banner(table: pd.DataFrame) -> list[str]:
    """Banner lines for the rows whose claimed epsilon is below the audited lower bound (bench/report/audit.py)."""
    if "dp_violation" not in table.columns:
        return []
    out = []
    for _, r in table[table.dp_violation.eq(True)].iterrows():
        key = "privacy.epsilon_lower_bound"
        one = _num(r.get("privacy.epsilon_one_run_lower_bound"))
        if one is not None and one > r[key]:  # the one-run bound is the larger (bench.one_run_audit)
            key, how = "privacy.epsilon_one_run_lower_bound", "one-run audit, "
        else:
            how = ""
        out += [
            f"> **DP VIOLATION: {md_escape(r.task)} {md_escape(r.defense)} claims epsilon "
            f"{r['privacy.epsilon_claimed']:.3g} but {md_escape(r[key + '.attack'])} "
            f"shows epsilon >= {r[key]:.3g} ({how}{r['privacy.epsilon_lower_bound.confidence']:.0%} confidence, "
            f"delta {r['privacy.epsilon_lower_bound.delta']:.3g})**: a bug or a wrong accounting.",
            "",
        ]
    return out


def control_banner(res: Results, table: pd.DataFrame) -> list[str]:
    """Banner lines for the tasks whose undefended baseline fails its positive control (``bench.controls``)."""
    out = []
    for preset, task in sorted({(p, t) for p, t in zip(table.get("preset", []), table.get("task", []))}):
        txt = res.control_text(preset, task)
        if txt.startswith("failed"):
            views = sorted({c.view for c in res.controls().get((preset, task), []) if not c.passed})
            out.append(
                f"> **Positive control failed for {md_escape(task)} ({md_escape(preset)}), "
                f"{md_escape(', '.join(views))} view{'s' if len(views) > 1 else ''}**: the undefended baseline does "
                f"not leak clearly there, so no defense can be shown to stop an attack there; claim clauses measured "
                f"there are `inconclusive` (clauses of views whose control passes, and utility clauses, keep "
                f"their verdicts). {md_escape(txt[len('failed: ') :])}"
            )
            out.append("")
    tasks = set(table.get("task", []))
    for c in sorted(res.recon_control_list(), key=lambda c: (c.task, c.attack, c.baseline)):
        if c.task in tasks and not c.passed:
            out.append(
                f"> **Reconstruction control {'not checked' if c.reason.startswith('not checked') else 'failed'} for "
                f"{md_escape(c.task)} {md_escape(c.attack)} against {md_escape(c.baseline)} ({md_escape(c.preset)})**: "
                f"the undefended baseline's reconstructions are not clearly above random images, so a defense "
                f"cannot be shown to stop this attack; its claim clauses are `inconclusive`. {md_escape(c.reason)}"
            )
            out.append("")
    return out


def training_banner(res: Results, scenario: str) -> list[str]:
    """A banner for each (task, defense, seed) whose membership records come from more than one training run, or
    whose recorded cells come from a run that retraining here failed to reproduce."""
    return [
        f"> **Mixed training runs: {md_escape(task)} {md_escape(d)} seed {seed} ({md_escape(p)})**: its membership "
        f"records were made from {n} different training runs (a run retrained after its cache was lost), so its "
        f"rows compare different models; `python -m bench run` redoes the records of the runs no longer cached.\n"
        for p, task, d, seed, n in res.mixed_trainings(scenario)
    ] + [
        f"> **Training not reproduced: {md_escape(task)} {md_escape(d)} seed {seed} ({md_escape(p)})**: its {n} "
        f"recorded membership cells come from an earlier run of it (its cache is gone, e.g. trained on another CPU); "
        f"retraining it here failed ({md_escape(why)}), so its other cells are `failed` and nothing here "
        f"reproduces the recorded ones.\n"
        for p, task, d, seed, n, why in res.unreproduced_trainings(scenario)
    ]


def scenario_markdown(
    res: Results,
    scenario: str,
    table: pd.DataFrame,
    meta: list[dict],
    matrix: pd.DataFrame,
    claims: list[dict],
    rvm: pd.DataFrame,
    plots: list[str],
    *,
    strength_md: str = "",
    coverage_md: list[str] | None = None,
) -> str:
    """The scenario page; ``strength_md``: the attack-strength section (``bench.report.strength``), after the
    distribution-shift check; ``coverage_md``: the coverage section (``bench.report.coverage``), after the matrix."""

    presets = ", ".join(sorted(set(table.preset))) if len(table) else ""
    n = sum(r["scenario"] == scenario for r in res.records)
    parts = [f"# Leaderboard: {md_escape(scenario)} (preset: {md_escape(presets)})", ""]
    parts += audit_banner(table) + control_banner(res, table) + training_banner(res, scenario)
    left = sum(k for (task, _), k in res.stale.items() if task.split("/", 1)[0] == scenario)
    gone = (
        f" {left} stale records (made under an earlier protocol or budget; `python -m bench run` redoes them) "
        f"are left out."
        if left
        else ""
    )
    parts += [f"Regenerated from {n} result records by `python -m bench leaderboard`.{gone} {LEGEND}", ""]
    for title, which in (("Privacy (headline) and cost", "primary"), ("Privacy (secondary metrics)", "secondary")):
        header, rows = display(table, meta, which=which)
        if rows and len(header) > 3:
            parts += [f"## {title}", "", md_table(header, rows), ""]
    if hidden := hidden_columns(table, meta):
        parts += [
            f"Not reported in any row (too few non-members for the FPR, or no value; reasons in the CSV's "
            f"`.status` columns): {hidden}.",
            "",
        ]
    if len(matrix):
        short = matrix.copy()
        for c in short.columns[3:]:
            short[c] = [v if len(v) <= 90 else v[:87] + "..." for v in short[c].fillna("")]
        one_preset = short.preset.nunique() == 1  # noqa: PD101 -- a count of distinct presets, as above
        parts += [
            "## Cross-matrix: defenses x attacks",
            "",
            _frame_md(short.drop(columns=["preset"] if one_preset else [])),
            "",
        ]
    parts += coverage_md or []
    shift = shift_check(table, meta)
    if shift:
        parts += ["## Distribution-shift check (attacks on the un-fine-tuned base model)", ""] + shift + [""]
    if strength_md:
        parts += [strength_md]
    notes = sorted({n for n in table.get("privacy.note", pd.Series(dtype=str)).fillna("") if n})
    if notes:
        parts += ["## Privacy notes", ""] + [f"- {md_escape(x)}" for x in notes] + [""]
    if claims:
        parts += ["## Claims from the papers, measured here", ""]
        for c in claims:
            parts.append(
                f"- **{md_escape(c['paper'])}** ({md_escape(c['preset'])}): {md_escape(c['claim'])} -> "
                f"**{md_escape(c['verdict'])}**. {md_escape(c['evidence'])}"
            )
        parts.append("")
    if len(rvm):
        shown = rvm[(rvm.measured != "not measured") & (rvm.same_setting.astype(bool))]
        parts += [
            "## Reported by the papers vs measured here",
            "",
            "Reported numbers are the papers' own (their models, data and scale), converted to the suite's "
            "scale where the unit differs; the measured column is this suite's counterpart of the paper's "
            "setting (rows measured in a different setting are only in the CSV, `same_setting` False). They "
            "are never pooled. Full list: `reported_vs_measured.csv`.",
            "",
        ]
        if len(shown):
            cols = ["paper", "table", "setting", "metric", "reported", "task", "defense", "attack", "view", "measured"]
            parts += [_frame_md(shown[cols]), ""]
        else:
            parts += [
                f"No reported number has a measured counterpart in these records "
                f"({len(rvm)} reported numbers map to this scenario).",
                "",
            ]
    parts += diverged_section(res, scenario)
    failed = [r for r in res.records if r["scenario"] == scenario and r["status"] == "failed" and not diverged(r)]
    if failed:
        parts += ["## Failed cells", ""]
        parts += [
            f"- {md_escape(r['task'])} {md_escape(r['defense_label'])} x {md_escape(r['attack_label'])}/"
            f"{r['view']} seed {r['seed']}: {md_escape(r.get('reason'))}"
            for r in failed
        ] + [""]
    if plots:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots if p.endswith(".png")] + [""]
    return "\n".join(parts)


def diverged_section(res: Results, scenario: str) -> list[str]:
    """The training runs that diverged under their defense, one line per (task, defense, seed) with the cells
    it leaves without a model: the defense's outcome at its budget, listed apart from failed cells."""
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for r in res.records:
        if r["scenario"] == scenario and diverged(r):
            runs.setdefault((r["task"], r["defense_label"], r["seed"]), []).append(r)
    if not runs:
        return []
    lines = [
        f"- {md_escape(task)} {md_escape(defense)} seed {seed}: {len(rs)} cell{'s' if len(rs) > 1 else ''} "
        f"without a model; {md_escape(min(str(r.get('reason') or '') for r in rs))}"
        for (task, defense, seed), rs in sorted(runs.items())
    ]
    return [
        "## Diverged training runs",
        "",
        "Training under these defenses produced a non-finite loss or model (`diverged` in the tables): the "
        "defense's own utility collapse at this budget, not a fault of the harness. There is no model to attack; "
        "such a defense stops no attack at a utility worth having. `bench run` retrains them (they fail again "
        "unless the recipe or the code changed).",
        "",
        *lines,
        "",
    ]


def _counts(values) -> list[tuple[str, int]]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return sorted(out.items())


def index_markdown(res: Results, sections: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in res.records) for s in ("ok", "n/a", "failed")}
    n_div = sum(diverged(r) for r in res.records)
    why = f" ({n_div} of them cells of a training run that diverged under its defense)" if n_div else ""
    parts = [
        "# Leaderboards",
        "",
        f"{len(res.records)} cells: {counts['ok']} ok, {counts['n/a']} n/a, {counts['failed']} failed{why}. "
        "Open `index.html` for sortable tables and plots.",
        "",
    ]
    for s in sections:
        strong = s.get("strength")
        parts.append(
            f"- [{md_escape(s['scenario'])}]({s['scenario']}.md): {len(s['table'])} defense rows, "
            f"{len(s['meta'])} attack columns"
            + (f"; coverage: {s['coverage']}" if s.get("coverage") else "")
            + (
                f"; [attack strength]({s['scenario']}_attack_strength.csv) (RMIA vs the best single-signal attack "
                f"on the undefended baseline: {', '.join(f'{n} {v}' for v, n in _counts(strong.verdict))})"
                if strong is not None and len(strong)
                else ""
            )
        )
    parts += ["- [claims](claims.md)", "- [reported vs measured](reported_vs_measured.csv)", ""]
    return "\n".join(parts + controls_markdown(res))


def controls_markdown(res: Results) -> list[str]:
    """Where these leaderboards can answer "does this defense stop the attack": each undefended baseline's
    positive control (bench.controls), membership per task and view, reconstruction per attack."""
    controls = [c for cs in res.controls().values() for c in cs] + res.recon_control_list()
    if not controls:
        return []
    rows = [
        {
            "task": c.task,
            "preset": c.preset,
            "kind": c.kind,
            "baseline": c.baseline,
            "view": VIEW_SHORT.get(c.view, c.view),
            "attack": c.attack,
            "control": "passed" if c.passed else "**FAILED**",
            "why": c.reason,
        }
        for c in sorted(controls, key=lambda c: (c.preset, c.task, c.kind, c.attack, c.baseline, c.view))
    ]
    n_bad = sum(not c.passed for c in controls)
    return [
        "## Positive controls",
        "",
        f"{len(controls) - n_bad} of {len(controls)} passed. A control checks that the undefended baseline leaks "
        f"clearly (membership: its strongest attack at AUROC >= {AUROC_MIN}, the 95% interval of its gain over the "
        f"un-fine-tuned base model on the same candidates above {GAP_MIN}; reconstruction: the interval of its SSIM "
        f"minus random images' on the same targets above {SSIM_GAP_MIN}). Where one fails, no defense can be shown "
        "to stop that attack there, and the claims measured there are `inconclusive`.",
        "",
        _frame_md(pd.DataFrame(rows)),
        "",
    ]
