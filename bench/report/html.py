"""One static, self-contained HTML page of every scenario: sortable tables in vanilla JS, no network; the
cross-matrix, claims, reported-vs-measured and the plots, linked relatively."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from .markdown import LEGEND, Shown, audit_banner, control_banner, display, shift_check

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
.v-holds{color:#060}.v-contradicted{color:#a00}.v-inconclusive{color:#a60}.v-holds-only-nominally{color:#a60}
.banner{border-left:4px solid #a00;padding:.3em .8em;background:#fff4f4}
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
    rows = [
        [
            Shown(
                "" if isinstance(v, float) and math.isnan(v) else str(v),
                float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) else None,
            )
            for v in r
        ]
        for r in df.itertuples(index=False)
    ]
    return table_html([str(c) for c in df.columns], rows, table_id=table_id, sortable=sortable)


def _claims_html(claims: list[dict], table_id: str) -> str:
    if not claims:
        return ""
    out = [
        f'<div class="wrap"><table id="{esc(table_id)}" class="sortable"><thead><tr>'
        "<th>paper</th><th>preset</th><th>claim</th><th>verdict</th>"
        "<th>claimed effect</th><th>MDE</th><th>evidence</th>"
        "</tr></thead><tbody>"
    ]
    for c in claims:
        v = c["verdict"].replace(" ", "-")
        out.append(
            f"<tr><td>{esc(c['paper'])}</td><td>{esc(c['preset'])}</td><td>{esc(c['claim'])}</td>"
            f'<td class="v-{esc(v)}">{esc(c["verdict"])}</td><td>{esc(c["effect"])}</td><td>{esc(c["mde"])}</td>'
            f"<td>{esc(c['evidence'])}</td></tr>"
        )
    out.append("</tbody></table></div>")
    return "".join(out)


def page(sections: list[dict], claims: list[dict]) -> str:
    """The whole page; ``sections`` as built by ``bench.report.leaderboards.write_leaderboards``."""
    nav = " ".join(f'<a href="#{esc(s["scenario"])}">{esc(s["scenario"])}</a>' for s in sections)
    body = [
        f'<h1>Privacy attacks x defenses: leaderboards</h1><nav>{nav}<a href="#claims">claims</a></nav>',
        f'<p class="legend">{esc(LEGEND.replace("**", "").replace("`", ""))} Click a column header to sort.</p>',
    ]
    for s in sections:
        sc, table, meta = s["scenario"], s["table"], s["meta"]
        presets = ", ".join(sorted(set(table.preset))) if len(table) else ""
        body.append(
            f'<section id="{esc(sc)}" class="scenario"><h2>{esc(sc)} <small>(preset: {esc(presets)})</small></h2>'
        )
        banners = audit_banner(table) + (control_banner(s["res"], table) if "res" in s else [])
        for line in banners:
            if line:
                body.append(f'<p class="banner">{esc(line.lstrip("> ").replace("**", "").replace("`", ""))}</p>')
        header, rows = display(table, meta, which="all")
        body.append(table_html(header, rows, table_id=f"lb-{sc}"))
        if len(s["matrix"]):
            body.append("<h3>Cross-matrix: defenses x attacks</h3>")
            body.append(frame_html(s["matrix"].fillna(""), table_id=f"matrix-{sc}"))
        if s.get("coverage"):
            body.append(
                f'<p class="legend">Coverage of the default grid: {esc(s["coverage"])} ({esc(sc)}_coverage.csv).</p>'
            )
        shift = shift_check(table, meta)
        if shift:
            body.append("<h3>Distribution-shift check (un-fine-tuned base model)</h3><ul>")
            body += [f"<li>{esc(x[2:].replace('**', ''))}</li>" for x in shift]
            body.append("</ul>")
        if s["claims"]:
            body.append("<h3>Claims, measured here</h3>" + _claims_html(s["claims"], f"claims-{sc}"))
        rvm = s["reported"]
        if len(rvm):
            shown = rvm[(rvm.measured != "not measured") & (rvm.same_setting.astype(bool))]
            body.append(
                f'<h3>Reported by the papers vs measured here</h3><p class="legend">{len(rvm)} reported '
                "numbers map to this scenario; shown: those with a measured counterpart. Never pooled.</p>"
            )
            if len(shown):
                cols = [
                    "paper",
                    "table",
                    "setting",
                    "metric",
                    "reported",
                    "reported (suite scale)",
                    "task",
                    "defense",
                    "attack",
                    "view",
                    "measured",
                ]
                body.append(frame_html(shown[cols], table_id=f"reported-{sc}"))
        imgs = [p for p in s["plots"] if p.endswith(".png")]
        if imgs:
            body.append('<h3>Plots</h3><div class="plots">')
            body += [f'<a href="{esc(p)}"><img src="{esc(p)}" alt="{esc(p)}"></a>' for p in imgs]
            body.append("</div>")
        body.append("</section>")
    body.append('<section id="claims"><h2>All claims</h2>' + _claims_html(claims, "claims-all") + "</section>")
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>Leaderboards</title>'
        f"<style>{CSS}</style><script>{JS}</script></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
