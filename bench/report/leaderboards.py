"""Leaderboards regenerated from the stored result records alone, deterministically (docs/design.md s.4).

Per scenario, under ``<out>/leaderboards``: ``<scenario>.csv`` (one row per preset x task x defense
configuration: utility, epsilon, cost, and per attack x view the headline metrics with 95% intervals,
whether the row is in the column's best group, and how it compares with the undefended baseline),
``<scenario>_matrix.csv`` (defenses x attacks, one cell each: the value, ``n/a`` + reason, or
``failed`` + reason), ``<scenario>_cells.csv`` (one row per record), ``<scenario>_attack_strength.csv``
(RMIA against the best single-signal attack on the undefended baseline, ``bench.report.strength``; also a
section of the page), ``<scenario>.md`` and plots;
across scenarios ``reported_vs_measured.csv``, ``claims.csv`` / ``claims.md``, ``README.md`` and
``index.html``. The same records give byte-identical CSVs: rows and columns are sorted, bootstrap
generators are seeded from the cell's identity, floats are written with ``%.6g``.

Intervals (95%): membership metrics with per-candidate scores in the record are bootstrapped over
seeds and, independently, over member and non-member ids drawn once for all seeds (stratified; seeds share most
candidates: the pigeonhole bootstrap, ``bench.pigeonhole``); reconstruction metrics over seeds and target ids.
Without per-candidate scores a single seed keeps the record's own interval and several seeds use a
normal approximation combining the per-seed intervals with the between-seed spread. Utility has one
value per seed: a Student-t interval over seeds. Two rows differ only when the bootstrap interval of
their difference excludes 0 (or, without replicates, when their intervals do not overlap).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from ..store import atomic_write_bytes
from . import audit, claims, coverage, html, plots, reported, strength, table4
from .markdown import index_markdown, scenario_markdown
from .results import Results
from .tables import cells_table, matrix_table, scenario_table, to_csv_bytes


def write_leaderboards(out: Path, dest: Path | None = None, *, notices: list[str] | None = None) -> list[Path]:
    """Write every scenario's leaderboard files under ``dest`` (default ``<out>/leaderboards``); the notices
    printed on stderr are also appended to ``notices`` when given (bench/report/lbcache.py repeats them)."""
    out = Path(out)
    dest = Path(dest) if dest else out / "leaderboards"
    res = Results.load(out)
    left_out = [
        f"leaderboard: ignored {n} records of {task} ({preset}) from a superseded task configuration "
        f"(an earlier preset or data); they stay in {out / 'records'}"
        for (task, preset), n in sorted(res.superseded.items())
    ] + [
        f"leaderboard: left out {n} stale records of {task} ({preset}), made under an earlier protocol or "
        f"budget (bench.staleness); `python -m bench run` redoes them"
        for (task, preset), n in sorted(res.stale.items())
    ]
    for notice in left_out:
        print(notice, file=sys.stderr)  # noqa: T201 -- a notice to the user, on stderr
    if notices is not None:
        notices.extend(left_out)
    written: list[Path] = []
    if not res.records:
        return written
    sections = []
    audits: list[dict] = []
    rvm = reported.compare(res)
    claim_rows = claims.evaluate(res)
    # [FedRand] Table 4 beside Table 1, measured next to reported
    t4 = table4.table4(res) if table4.SCENARIO in res.scenarios() else None
    for scenario in res.scenarios():
        table, meta = scenario_table(res, scenario)
        audits += audit.dp_rows(table, scenario)
        matrix = matrix_table(res, scenario)
        files = {
            f"{scenario}.csv": table,
            f"{scenario}_matrix.csv": matrix,
            f"{scenario}_cells.csv": cells_table(res, scenario),
        }
        for name, df in files.items():
            atomic_write_bytes(dest / name, to_csv_bytes(df))
            written.append(dest / name)
        plot_files = plots.scenario_plots(res, scenario, table, dest, out)
        written += [dest / p for p in plot_files]
        # [RMIA] positive control: RMIA vs the best single-signal attack on the undefended baseline
        strong = strength.strength_table(res, scenario)
        if len(strong):
            atomic_write_bytes(dest / f"{scenario}_attack_strength.csv", to_csv_bytes(strong))
            written.append(dest / f"{scenario}_attack_strength.csv")
        s_claims = [c for c in claim_rows if c["scenario"] == scenario]
        s_rvm = rvm[rvm.scenario == scenario] if len(rvm) else rvm
        smd = strength.markdown(strong, scenario)
        # what the page covers: the default grid's applicable cells and their recorded seeds, "not run" included
        presets = sorted({r["preset"] for r in res.records if r["scenario"] == scenario})
        planned = {p: coverage.planned_cells(scenario, p) for p in presets}
        cov = coverage.coverage_table(res, scenario, planned)
        atomic_write_bytes(dest / f"{scenario}_coverage.csv", to_csv_bytes(cov))
        written.append(dest / f"{scenario}_coverage.csv")
        cmd = coverage.markdown(cov, scenario, [p for p, c in planned.items() if c is None])
        md = scenario_markdown(
            res, scenario, table, meta, matrix, s_claims, s_rvm, plot_files, strength_md=smd, coverage_md=cmd
        )
        if scenario == table4.SCENARIO and t4 is not None:
            md += "\n## papers/000 Table 4 and Table 1, measured beside reported\n\n" + table4.markdown(t4)
        atomic_write_bytes(dest / f"{scenario}.md", md.encode())
        written.append(dest / f"{scenario}.md")
        sections.append(
            {
                "scenario": scenario,
                "table": table,
                "meta": meta,
                "matrix": matrix,
                "claims": s_claims,
                "reported": s_rvm,
                "plots": plot_files,
                "strength": strong,
                "coverage": coverage.summary(cov),
                "res": res,
            }
        )
    if t4 is not None:
        atomic_write_bytes(dest / f"{table4.SCENARIO}_table4.csv", to_csv_bytes(t4))
        atomic_write_bytes(dest / f"{table4.SCENARIO}_table4.md", table4.markdown(t4).encode())
        written += [dest / f"{table4.SCENARIO}_table4.csv", dest / f"{table4.SCENARIO}_table4.md"]
    atomic_write_bytes(dest / "reported_vs_measured.csv", to_csv_bytes(rvm))
    atomic_write_bytes(dest / "claims.csv", to_csv_bytes(pd.DataFrame(claim_rows, columns=claims.COLUMNS)))
    atomic_write_bytes(dest / "claims.md", claims.markdown(claim_rows, audits).encode())
    atomic_write_bytes(dest / "README.md", index_markdown(res, sections).encode())
    atomic_write_bytes(dest / "index.html", html.page(sections, claim_rows).encode())
    written += [dest / n for n in ("reported_vs_measured.csv", "claims.csv", "claims.md", "README.md", "index.html")]
    return written
