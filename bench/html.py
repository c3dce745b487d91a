"""Rendering of the leaderboards: markdown tables (tabulate) for the README, and one static,
self-contained HTML page of every scenario (sortable tables in vanilla JS, no network; the
cross-matrix, claims, reported-vs-measured and the plots, linked relatively)."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from .leaderboard import UTILITY_ORDER, VIEW_SHORT, Estimate, Results

METRIC_NAMES = {"auroc": "AUROC", "tpr@0.01fpr": "TPR@1%FPR", "tpr@0.001fpr": "TPR@0.1%FPR", "ssim": "SSIM",
                "psnr": "PSNR"}
MARKS = {"less leakage": " \u25bc", "more leakage": " \u25b2"}


@dataclass
class Shown:
    """One displayed cell: text, the number it sorts by, and whether it is in the column's best group."""

    text: str
    sort: float | None = None
    best: bool = False


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


def display(table: pd.DataFrame, meta: list[dict], *, which: str = "all") -> tuple[list[str], list[list[Shown]]]:
    """Header and cells of the readable table: ``which`` = all | primary | secondary attack metrics."""
    if table.empty:
        return [], []
    presets = table.preset.nunique() > 1
    util = [c for c in table.columns if c.startswith("utility.") and not c.endswith((".ci_low", ".ci_high"))]
    util.sort(key=lambda c: (UTILITY_ORDER.index(c[8:]) if c[8:] in UTILITY_ORDER else len(UTILITY_ORDER), c))
    cols = [m for m in meta if which == "all" or m["primary"] == (which == "primary")]
    header = (["preset"] if presets else []) + ["task", "defense"] + [c[8:] for c in util] + \
        (["epsilon", "epsilon composed", "up / round", "train s"] if which != "secondary" else []) + \
        [f"{m['attack']}/{VIEW_SHORT.get(m['view'], m['view'])} {METRIC_NAMES.get(m['metric'], m['metric'])}" for m in cols]
    rows = []
    for _, r in table.iterrows():
        cells = ([Shown(r.preset)] if presets else []) + [Shown(r.task), Shown(r.defense)]
        for c in util:
            v = _num(r.get(c))
            lo, hi = _num(r.get(f"{c}.ci_low")), _num(r.get(f"{c}.ci_high"))
            txt = "" if v is None else (Estimate(v, lo, hi).fmt() if lo is not None else f"{v:.4g}")
            cells.append(Shown(txt, v))
        if which != "secondary":
            for c in ("privacy.epsilon", "privacy.epsilon_composed"):
                v = _num(r.get(c))
                cells.append(Shown("" if v is None else f"{v:.3g}", v))
            up = _num(r.get("cost.bytes_up_per_round"))
            cells.append(Shown(human_bytes(up), up))
            t = _num(r.get("cost.train_wall_s"))
            cells.append(Shown("" if t is None else f"{t:.1f}", t))
        for m in cols:
            c = m["column"]
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

    body = [[(f"**{c.text}**" if c.best and c.text else c.text).replace("|", "\\|") for c in row] for row in rows]
    return tabulate(body, headers=header, tablefmt="github", disable_numparse=True)


LEGEND = ("Membership: AUROC, TPR at 1% and 0.1% FPR; reconstruction: mean SSIM and PSNR over images. "
          "[95% interval: bootstrap over seeds and samples]. **Bold**: the column's best group (lowest leakage, "
          "AUROC ranked by its distance from 0.5, and every row the intervals cannot tell apart from it). "
          "\u25bc / \u25b2: significantly less / more leakage than the undefended baseline of the same protocol "
          "(fedavg, fedsgd for FedSGD forms, lora for released models). `n/a`: the pair does not apply; "
          "`failed`: the cell raised (reasons in the cross-matrix and the CSV).")


def shift_check(table: pd.DataFrame, meta: list[dict]) -> list[str]:
    """Attacks on the un-fine-tuned base model: AUROC away from 0.5 means a distribution-shift confound."""
    lines = []
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
            lines.append(f"- {r.task} {m['attack']}/{VIEW_SHORT.get(m['view'], m['view'])}: AUROC {e.fmt()}{flag}")
    return lines


def scenario_markdown(res: Results, scenario: str, table: pd.DataFrame, meta: list[dict], matrix: pd.DataFrame,
                      claims: list[dict], rvm: pd.DataFrame, plots: list[str]) -> str:
    from tabulate import tabulate

    presets = ", ".join(sorted(set(table.preset))) if len(table) else ""
    n = sum(r["scenario"] == scenario for r in res.records)
    parts = [f"# Leaderboard: {scenario} (preset: {presets})", "",
             f"Regenerated from {n} result records by `python -m bench leaderboard`. {LEGEND}", ""]
    for title, which in (("Privacy (headline) and cost", "primary"), ("Privacy (secondary metrics)", "secondary")):
        header, rows = display(table, meta, which=which)
        if rows and len(header) > 3:
            parts += [f"## {title}", "", md_table(header, rows), ""]
    if len(matrix):
        short = matrix.copy()
        for c in short.columns[3:]:
            short[c] = [v if len(v) <= 90 else v[:87] + "..." for v in short[c].fillna("")]
        parts += ["## Cross-matrix: defenses x attacks", "",
                  tabulate(short.drop(columns=["preset"] if short.preset.nunique() == 1 else []),
                           headers="keys", tablefmt="github", showindex=False, disable_numparse=True), ""]
    shift = shift_check(table, meta)
    if shift:
        parts += ["## Distribution-shift check (attacks on the un-fine-tuned base model)", ""] + shift + [""]
    notes = sorted({n for n in table.get("privacy.note", pd.Series(dtype=str)).fillna("") if n})
    if notes:
        parts += ["## Privacy notes", ""] + [f"- {x}" for x in notes] + [""]
    if claims:
        parts += ["## Claims from the papers, measured here", ""]
        for c in claims:
            parts.append(f"- **{c['paper']}** ({c['preset']}): {c['claim']} -> **{c['verdict']}**, direction "
                         f"{c['direction']}. {c['evidence']}")
        parts.append("")
    if len(rvm):
        shown = rvm[rvm.measured != "not measured"]
        parts += ["## Reported by the papers vs measured here", "",
                  "Reported numbers are the papers' own (their models, data and scale), converted to the suite's "
                  "scale where the unit differs; the measured column is this suite's closest setting. They are "
                  "never pooled. Full list: `reported_vs_measured.csv`.", ""]
        if len(shown):
            cols = ["paper", "table", "setting", "metric", "reported", "task", "defense", "attack", "view", "measured"]
            parts += [tabulate(shown[cols], headers="keys", tablefmt="github", showindex=False, disable_numparse=True), ""]
        else:
            parts += [f"No reported number has a measured counterpart in these records "
                      f"({len(rvm)} reported numbers map to this scenario).", ""]
    failed = [r for r in res.records if r["scenario"] == scenario and r["status"] == "failed"]
    if failed:
        parts += ["## Failed cells", ""]
        parts += [f"- {r['task']} {r['defense_label']} x {r['attack_label']}/{r['view']} seed {r['seed']}: "
                  f"{r.get('reason')}" for r in failed] + [""]
    if plots:
        parts += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots if p.endswith(".png")] + [""]
    return "\n".join(parts)


def index_markdown(res: Results, sections: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in res.records) for s in ("ok", "n/a", "failed")}
    parts = ["# Leaderboards", "",
             f"{len(res.records)} cells: {counts['ok']} ok, {counts['n/a']} n/a, {counts['failed']} failed. "
             "Open `index.html` for sortable tables and plots.", ""]
    for s in sections:
        parts.append(f"- [{s['scenario']}]({s['scenario']}.md): {len(s['table'])} defense rows, "
                     f"{len(s['meta'])} attack columns")
    parts += ["- [claims](claims.md)", "- [reported vs measured](reported_vs_measured.csv)", ""]
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
# HTML

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:110em}
h1{font-size:1.5em}h2{font-size:1.25em;border-bottom:1px solid #ccc;margin-top:2em}h3{font-size:1.05em}
table{border-collapse:collapse;font-size:12px;margin:.5em 0 1em}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#f0f0f0;position:sticky;top:0}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th[aria-sort=ascending]::after{content:" \\25B2"}
table.sortable th[aria-sort=descending]::after{content:" \\25BC"}
td.best{font-weight:bold;background:#eef8ee}
.wrap{overflow-x:auto}.legend{font-size:12px;color:#444;max-width:90em}
.plots img{max-width:32em;margin:4px;border:1px solid #ddd}
.v-holds{color:#060}.v-does-not-hold{color:#a00}.v-holds-in-part{color:#a60}
nav a{margin-right:1em}
"""

# Click a header: sort by data-v (numbers) when every non-empty cell has one, else by text; empties last.
JS = """
function cellKey(td){
  if(!td) return null;
  var v = td.getAttribute('data-v');
  if(v !== null && v !== '') return parseFloat(v);
  var t = td.textContent.trim();
  return t === '' ? null : t.toLowerCase();
}
function sortTable(table, col, th){
  var body = table.tBodies[0];
  var rows = Array.prototype.slice.call(body.rows);
  var dir = th.getAttribute('aria-sort') === 'ascending' ? -1 : 1;
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function(h){ h.removeAttribute('aria-sort'); });
  th.setAttribute('aria-sort', dir === 1 ? 'ascending' : 'descending');
  rows.sort(function(a, b){
    var x = cellKey(a.cells[col]), y = cellKey(b.cells[col]);
    if(x === null && y === null) return 0;
    if(x === null) return 1;
    if(y === null) return -1;
    var nx = typeof x === 'number', ny = typeof y === 'number';
    if(nx !== ny) return nx ? -1 : 1;
    return (x < y ? -1 : x > y ? 1 : 0) * dir;
  });
  rows.forEach(function(r){ body.appendChild(r); });
}
document.addEventListener('DOMContentLoaded', function(){
  document.querySelectorAll('table.sortable').forEach(function(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function(th, i){
      th.addEventListener('click', function(){ sortTable(table, i, th); });
    });
  });
});
"""


def esc(x: Any) -> str:
    return html.escape("" if x is None or (isinstance(x, float) and math.isnan(x)) else str(x))


def table_html(header: list[str], rows: list[list[Shown]], *, table_id: str, sortable: bool = True) -> str:
    cls = ' class="sortable"' if sortable else ""
    out = [f'<div class="wrap"><table id="{esc(table_id)}"{cls}><thead><tr>']
    out += [f"<th>{esc(h)}</th>" for h in header]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>")
        for c in row:
            v = f' data-v="{c.sort!r}"' if c.sort is not None else ""
            b = ' class="best"' if c.best else ""
            out.append(f"<td{v}{b}>{esc(c.text)}</td>")
        out.append("</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def frame_html(df: pd.DataFrame, *, table_id: str, sortable: bool = True) -> str:
    rows = [[Shown("" if isinstance(v, float) and math.isnan(v) else str(v),
                   float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) else None)
             for v in r] for r in df.itertuples(index=False)]
    return table_html([str(c) for c in df.columns], rows, table_id=table_id, sortable=sortable)


def _claims_html(claims: list[dict], table_id: str) -> str:
    if not claims:
        return ""
    out = [f'<div class="wrap"><table id="{esc(table_id)}" class="sortable"><thead><tr>'
           "<th>paper</th><th>preset</th><th>claim</th><th>verdict</th><th>direction</th><th>evidence</th>"
           "</tr></thead><tbody>"]
    for c in claims:
        v = c["verdict"].replace(" ", "-")
        out.append(f"<tr><td>{esc(c['paper'])}</td><td>{esc(c['preset'])}</td><td>{esc(c['claim'])}</td>"
                   f'<td class="v-{esc(v)}">{esc(c["verdict"])}</td><td>{esc(c["direction"])}</td>'
                   f"<td>{esc(c['evidence'])}</td></tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def page(sections: list[dict], claims: list[dict]) -> str:
    """The whole page; ``sections`` as built by ``bench.leaderboard.write_leaderboards``."""
    nav = " ".join(f'<a href="#{esc(s["scenario"])}">{esc(s["scenario"])}</a>' for s in sections)
    body = [f"<h1>Privacy attacks x defenses: leaderboards</h1><nav>{nav}<a href=\"#claims\">claims</a></nav>",
            f'<p class="legend">{esc(LEGEND.replace("**", "").replace("`", ""))} Click a column header to sort.</p>']
    for s in sections:
        sc, table, meta = s["scenario"], s["table"], s["meta"]
        presets = ", ".join(sorted(set(table.preset))) if len(table) else ""
        body.append(f'<section id="{esc(sc)}" class="scenario"><h2>{esc(sc)} <small>(preset: {esc(presets)})</small></h2>')
        header, rows = display(table, meta, which="all")
        body.append(table_html(header, rows, table_id=f"lb-{sc}"))
        if len(s["matrix"]):
            body.append("<h3>Cross-matrix: defenses x attacks</h3>")
            body.append(frame_html(s["matrix"].fillna(""), table_id=f"matrix-{sc}"))
        shift = shift_check(table, meta)
        if shift:
            body.append("<h3>Distribution-shift check (un-fine-tuned base model)</h3><ul>")
            body += [f"<li>{esc(x[2:].replace('**', ''))}</li>" for x in shift]
            body.append("</ul>")
        if s["claims"]:
            body.append("<h3>Claims, measured here</h3>" + _claims_html(s["claims"], f"claims-{sc}"))
        rvm = s["reported"]
        if len(rvm):
            shown = rvm[rvm.measured != "not measured"]
            body.append(f"<h3>Reported by the papers vs measured here</h3><p class=\"legend\">{len(rvm)} reported "
                        "numbers map to this scenario; shown: those with a measured counterpart. Never pooled.</p>")
            if len(shown):
                cols = ["paper", "table", "setting", "metric", "reported", "reported (suite scale)", "task", "defense",
                        "attack", "view", "measured"]
                body.append(frame_html(shown[cols], table_id=f"reported-{sc}"))
        imgs = [p for p in s["plots"] if p.endswith(".png")]
        if imgs:
            body.append('<h3>Plots</h3><div class="plots">')
            body += [f'<a href="{esc(p)}"><img src="{esc(p)}" alt="{esc(p)}"></a>' for p in imgs]
            body.append("</div>")
        body.append("</section>")
    body.append('<section id="claims"><h2>All claims</h2>' + _claims_html(claims, "claims-all") + "</section>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Leaderboards</title>"
            f"<style>{CSS}</style><script>{JS}</script></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
