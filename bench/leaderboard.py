"""Leaderboards regenerated from the stored result records alone, deterministically (DESIGN.md s.4).

Per scenario, under ``<out>/leaderboards``: ``<scenario>.csv`` (one row per preset x task x defense
configuration: utility, epsilon, cost, and per attack x view the headline metrics with 95% intervals,
whether the row is in the column's best group, and how it compares with the undefended baseline),
``<scenario>_matrix.csv`` (defenses x attacks, one cell each: the value, ``n/a`` + reason, or
``failed`` + reason), ``<scenario>_cells.csv`` (one row per record), ``<scenario>.md`` and plots;
across scenarios ``reported_vs_measured.csv``, ``claims.csv`` / ``claims.md``, ``README.md`` and
``index.html``. The same records give byte-identical CSVs: rows and columns are sorted, bootstrap
generators are seeded from the cell's identity, floats are written with ``%.6g``.

Intervals (95%): membership metrics with per-candidate scores in the record are bootstrapped over
seeds and, within each drawn seed, over members and non-members (stratified, hierarchical
bootstrap; Efron & Tibshirani 1993, ch. 6); reconstruction metrics likewise over seeds and images.
Without per-candidate scores a single seed keeps the record's own interval and several seeds use a
normal approximation combining the per-seed intervals with the between-seed spread. Utility has one
value per seed: a Student-t interval over seeds. Two rows differ only when the bootstrap interval of
their difference excludes 0 (or, without replicates, when their intervals do not overlap).
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from .store import Store, atomic_write_bytes, stable_hash

N_BOOT = 1000
LEVEL = 0.95
# the first of each kind is the primary column; the others are the secondary table (TPR at 1% and 0.1% FPR:
# the low-FPR regime Carlini et al. 2022 argue for, papers/000 and papers/004 report)
HEADLINE = {"membership": ("auroc", "tpr@0.01fpr", "tpr@0.001fpr"), "reconstruction": ("ssim", "psnr")}
FLOAT_FORMAT = "%.6g"
BASELINES = ("fedavg", "fedsgd", "lora")  # undefended references, by protocol
VIEW_SHORT = {"global_model": "global", "client_model": "client", "client_update": "update",
              "released_model": "released"}
# utility metrics where lower is better (everything else: higher is better)
LOWER_BETTER = ("loss", "perplexity", "fid", "kid", "error")
UTILITY_ORDER = ("accuracy", "cider", "bleu4", "rouge", "test_loss", "perplexity", "fid", "kid")


def lower_is_better(utility_key: str) -> bool:
    k = utility_key.lower()
    return any(t in k for t in LOWER_BETTER)


# ----------------------------------------------------------------------------------------------
# estimates with intervals


@dataclass
class Estimate:
    """A point value with a 95% interval; ``reps`` are bootstrap replicates when there are any."""

    value: float
    lo: float = math.nan
    hi: float = math.nan
    n_seeds: int = 1
    method: str = "point"
    reps: np.ndarray | None = None

    def has_ci(self) -> bool:
        return not (math.isnan(self.lo) or math.isnan(self.hi))

    def fmt(self, digits: int = 3) -> str:
        s = num(self.value, digits)
        return s + (f" [{num(self.lo, digits - 1)}, {num(self.hi, digits - 1)}]" if self.has_ci() else "")


def num(x: float, digits: int = 3) -> str:
    """Fixed decimals in the usual range, 3 significant digits for very large or small magnitudes."""
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:.{digits}f}"
    return f"{x:.3g}"


def bounds(metric: str) -> tuple[float, float]:
    """The natural range of a metric (intervals from normal / t approximations are clipped to it)."""
    m = metric.rsplit(":", 1)[-1].removeprefix("utility.")
    if m in ("auroc", "advantage", "asr", "accuracy", "label_acc") or m.startswith("tpr@"):
        return 0.0, 1.0
    if m == "ssim":
        return -1.0, 1.0
    if m in ("psnr", "mse", "test_loss", "perplexity", "fid", "kid"):
        return 0.0, math.inf
    return -math.inf, math.inf


def clipped(e: Estimate | None, metric: str) -> Estimate | None:
    if e is None or not e.has_ci():
        return e
    lo, hi = bounds(metric)
    e.lo, e.hi = min(max(e.lo, lo), hi), max(min(e.hi, hi), lo)
    return e


def _rng(*key: Any) -> np.random.Generator:
    return np.random.default_rng(int(stable_hash(list(map(str, key)), 15), 16))


def _pct(reps: np.ndarray) -> tuple[float, float]:
    a = (1 - LEVEL) / 2 * 100
    return float(np.percentile(reps, a)), float(np.percentile(reps, 100 - a))


def auroc_rows(pos: np.ndarray, neg: np.ndarray) -> np.ndarray:
    """AUROC per row of [B, n1] member and [B, n0] non-member scores (Mann-Whitney U, ties averaged)."""
    n1, n0 = pos.shape[1], neg.shape[1]
    ranks = stats.rankdata(np.concatenate([pos, neg], axis=1), axis=1)
    return (ranks[:, :n1].sum(1) - n1 * (n1 + 1) / 2) / (n1 * n0)


def tpr_at_fpr_rows(pos: np.ndarray, neg: np.ndarray, fpr: float) -> np.ndarray:
    """Highest TPR with FPR <= ``fpr`` per row (the conservative ROC reading of bench.metrics)."""
    m = int(math.floor(fpr * neg.shape[1] + 1e-9))  # non-members allowed above the threshold
    if m >= neg.shape[1]:
        return np.ones(len(pos))
    thr = -np.sort(-neg, axis=1)[:, m]  # the (m+1)-th highest non-member score
    return (pos > thr[:, None]).mean(1)


def _member_stat(metric: str):
    if metric == "auroc":
        return auroc_rows
    if metric == "advantage":
        return lambda p, n: np.abs(auroc_rows(p, n) - 0.5) / 0.5
    m = re.fullmatch(r"tpr@([0-9.]+)fpr", metric)
    if m:
        f = float(m.group(1))
        return lambda p, n: tpr_at_fpr_rows(p, n, f)
    return None


def _hierarchical(groups: list[Any], draw, rng: np.random.Generator, n_boot: int) -> np.ndarray:
    """Bootstrap replicates: resample seeds, then ``draw(group, idx_rows)`` within each drawn seed."""
    k = len(groups)
    seed_idx = rng.integers(0, k, size=(n_boot, k)) if k > 1 else np.zeros((n_boot, 1), dtype=int)
    total = np.zeros(n_boot)
    for j in range(seed_idx.shape[1]):
        col = np.zeros(n_boot)
        for g in range(k):
            rows = np.flatnonzero(seed_idx[:, j] == g)
            if len(rows):
                col[rows] = draw(groups[g], len(rows), rng)
        total += col
    return total / seed_idx.shape[1]


def membership_estimate(recs: Sequence[dict], metric: str, *, key: Any = "", n_boot: int = N_BOOT,
                        variant: str | None = None) -> Estimate | None:
    """A membership metric over the seeds in ``recs`` (one record per seed, status ok): of the primary score,
    or of a ``variant`` whose per-candidate scores the records kept (``per_candidate.variants``)."""
    def metrics_of(r: dict) -> dict:
        if variant is None:
            return r.get("metrics") or {}
        return {k: {"value": v} for k, v in ((r.get("variants") or {}).get(variant) or {}).items()}

    def scores_of(r: dict) -> list | None:
        pc = r.get("per_candidate") or {}
        return pc.get("score") if variant is None else (pc.get("variants") or {}).get(variant)

    recs = [r for r in recs if metric in metrics_of(r)]
    if not recs:
        return None
    stat = _member_stat(metric)
    samples = [(scores_of(r), (r.get("per_candidate") or {}).get("member")) for r in recs]
    if stat is not None and all(sc and y and len(sc) == len(y) for sc, y in samples):
        groups = []
        for sc, y in samples:
            sc, y = np.asarray(sc, float), np.asarray(y, int)
            groups.append((sc[y == 1], sc[y == 0]))
        if all(len(p) and len(n) for p, n in groups):
            value = float(np.mean([stat(p[None], n[None])[0] for p, n in groups]))

            def draw(g, b, rng):
                p, n = g
                return stat(p[rng.integers(0, len(p), (b, len(p)))], n[rng.integers(0, len(n), (b, len(n)))])

            reps = _hierarchical(groups, draw, _rng("member", key, metric), n_boot)
            lo, hi = _pct(reps)
            return Estimate(value, lo, hi, len(recs), f"bootstrap over {'seeds x ' if len(recs) > 1 else ''}candidates",
                            reps)
    return _from_record_cis([metrics_of(r)[metric] for r in recs])


def _from_record_cis(ms: Sequence[dict]) -> Estimate:
    vals = np.array([m["value"] for m in ms], float)
    if len(ms) == 1:
        m = ms[0]
        return Estimate(float(m["value"]), float(m.get("ci_low", math.nan)), float(m.get("ci_high", math.nan)), 1,
                        "record interval")
    z = stats.norm.ppf(0.5 + LEVEL / 2)
    se_within = [(m.get("ci_high", math.nan) - m.get("ci_low", math.nan)) / (2 * z) for m in ms]
    within = float(np.nanmean(np.square(se_within))) if not np.all(np.isnan(se_within)) else 0.0
    se = math.sqrt((within + float(vals.var(ddof=1))) / len(vals))
    v = float(vals.mean())
    return Estimate(v, v - z * se, v + z * se, len(ms), "normal approx. over seeds")


def sample_estimate(recs: Sequence[dict], metric: str, *, key: Any = "", transform=None,
                    n_boot: int = N_BOOT) -> Estimate | None:
    """Mean of a per-sample metric (reconstruction: per image) over seeds x samples."""
    groups = [np.asarray((r.get("per_sample") or {}).get(metric, []), float) for r in recs]
    groups = [g if transform is None else transform(g) for g in groups if len(g)]
    if not groups:
        ms = [r["metrics"][metric] for r in recs if metric in (r.get("metrics") or {})]
        return _from_record_cis(ms) if ms else None
    value = float(np.mean([g.mean() for g in groups]))

    def draw(g, b, rng):
        return g[rng.integers(0, len(g), (b, len(g)))].mean(1)

    reps = _hierarchical(groups, draw, _rng("sample", key, metric, transform is not None), n_boot)
    lo, hi = _pct(reps)
    return Estimate(value, lo, hi, len(groups), f"bootstrap over {'seeds x ' if len(groups) > 1 else ''}samples", reps)


def seed_estimate(values: Iterable[float]) -> Estimate | None:
    """Mean over seeds with a Student-t interval (one value per seed, e.g. utility)."""
    v = np.array([x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))], float)
    if not len(v):
        return None
    if len(v) == 1:
        return Estimate(float(v[0]), n_seeds=1, method="single seed")
    half = stats.t.ppf(0.5 + LEVEL / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return Estimate(float(v.mean()), float(v.mean() - half), float(v.mean() + half), len(v), "t over seeds")


def distance_from(e: Estimate | None, ref: float) -> Estimate | None:
    """|value - ref| with its interval (AUROC is ranked by its distance from chance: a score that separates
    members in the "wrong" direction still leaks, as in papers/004's |AUC - 0.5| / 0.5)."""
    if e is None:
        return None
    reps = np.abs(e.reps - ref) if e.reps is not None else None
    if reps is not None:
        lo, hi = _pct(reps)
    elif e.has_ci():
        a, b = abs(e.lo - ref), abs(e.hi - ref)
        lo, hi = (0.0 if e.lo <= ref <= e.hi else min(a, b)), max(a, b)
    else:
        lo = hi = math.nan
    return Estimate(abs(e.value - ref), lo, hi, e.n_seeds, e.method, reps)


def leakage(e: Estimate | None, metric: str) -> Estimate | None:
    """The quantity ranked for privacy (lower = less leakage): AUROC's distance from 0.5, else the metric."""
    return distance_from(e, 0.5) if metric == "auroc" else e


def differs(a: Estimate | None, b: Estimate | None) -> int:
    """-1 if ``a`` is lower than ``b`` by the intervals, +1 if higher, 0 if the intervals cannot tell."""
    if a is None or b is None:
        return 0
    if a.reps is not None and b.reps is not None and len(a.reps) == len(b.reps):
        lo, hi = _pct(a.reps - b.reps)
    elif a.has_ci() and b.has_ci():
        lo, hi = a.lo - b.hi, a.hi - b.lo
    else:
        return 0
    return -1 if hi < 0 else (1 if lo > 0 else 0)


# ----------------------------------------------------------------------------------------------
# records


def _label_keys(label: str) -> set[str]:
    inner = label[label.find("(") + 1:-1] if label.endswith(")") and "(" in label else ""
    return set(re.findall(r"(?:^|,)(\w+)=", inner))


def _value_eq(raw: str, val: Any) -> bool:
    if isinstance(val, bool):
        return raw.lower() in (("true", "1", "yes") if val else ("false", "0", "no"))
    if isinstance(val, (int, float)):
        try:
            return math.isclose(float(raw), float(val), rel_tol=1e-9, abs_tol=1e-12)
        except ValueError:
            return False
    return str(val) == raw


def spec_matches(spec: str, name: str, params: dict, label: str) -> bool:
    """``fedper:shared_layers=4`` matches that configuration; a bare name matches the defaults only."""
    from .registry import parse_spec

    want, kv = parse_spec(spec)
    if want != name or not _label_keys(label) <= set(kv):
        return False
    return all(k in params and _value_eq(v, params[k]) for k, v in kv.items())


def row_key(rec: dict) -> tuple:
    return rec.get("preset", ""), rec.get("task", ""), rec.get("defense_label", "")


def _defense_order(label: str) -> tuple:
    name = label.split("(", 1)[0]
    return (0 if name == "base" else 1 if name in BASELINES else 2, label)


def current_config(records: list[dict]) -> tuple[list[dict], dict[tuple[str, str], int]]:
    """Keep, per (task, preset), only the records of its latest task configuration (``provenance.config_hash``
    of the most recently started record): after a preset or data change the old records stay on disk, and
    pooling them with the new ones as if they were seeds would mix two experiments. Returns (kept records,
    {(task, preset): number of superseded records dropped})."""
    latest: dict[tuple[str, str], tuple[str, str]] = {}
    for r in records:
        prov = r.get("provenance") or {}
        k = (r.get("task", ""), r.get("preset", ""))
        cand = (str(prov.get("started_at") or ""), str(prov.get("config_hash") or ""))
        if k not in latest or cand > latest[k]:
            latest[k] = cand
    kept, dropped = [], {}
    for r in records:
        k = (r.get("task", ""), r.get("preset", ""))
        if str((r.get("provenance") or {}).get("config_hash") or "") == latest[k][1]:
            kept.append(r)
        else:
            dropped[k] = dropped.get(k, 0) + 1
    return kept, dropped


class Results:
    """The records of one output directory (the latest configuration of each task), with selections and
    per-row estimates."""

    def __init__(self, records: Iterable[dict]):
        records, self.superseded = current_config(list(records))
        self.records = sorted(records, key=lambda r: (r.get("scenario", ""), *row_key(r), r.get("attack_label", ""),
                                                       r.get("view", ""), r.get("seed", 0), r.get("cell_id", "")))
        self._memo: dict[tuple, Estimate | None] = {}

    @classmethod
    def load(cls, out: str | Path) -> "Results":
        return cls(Store(out).records())

    def scenarios(self) -> list[str]:
        return sorted({r["scenario"] for r in self.records})

    def select(self, *, scenario: str | None = None, task: str | None = None, preset: str | None = None,
               defense: str | None = None, attack: str | None = None, view: str | None = None,
               kind: str | None = None, status: str | None = "ok") -> list[dict]:
        """Records matching every given field; ``scenario`` may also be a task id; specs as in the CLI."""
        out = []
        for r in self.records:
            if scenario and scenario not in (r["scenario"], r["task"]):
                continue
            if (task and r["task"] != task) or (preset and r["preset"] != preset) or (view and r["view"] != view):
                continue
            if (kind and r.get("attack_kind") != kind) or (status and r["status"] != status):
                continue
            if defense and not spec_matches(defense, r["defense"], r.get("defense_params") or {}, r["defense_label"]):
                continue
            if attack and not spec_matches(attack, r["attack"], r.get("attack_params") or {}, r["attack_label"]):
                continue
            out.append(r)
        return out

    @staticmethod
    def per_seed(recs: Sequence[dict], getter) -> list[Any]:
        """One value per seed (the first record of each seed: utility and cost are per training run)."""
        seen: dict[int, Any] = {}
        for r in recs:
            if r["seed"] not in seen:
                seen[r["seed"]] = getter(r)
        return [seen[s] for s in sorted(seen)]

    def utility(self, recs: Sequence[dict], key: str) -> Estimate | None:
        return clipped(self._utility(recs, key), key)

    def _utility(self, recs: Sequence[dict], key: str) -> Estimate | None:
        return seed_estimate(self.per_seed(recs, lambda r: (r.get("utility") or {}).get(key)))

    def metric(self, recs: Sequence[dict], metric: str) -> Estimate | None:
        """A headline or secondary metric of one cell (one record per seed), by kind (memoised)."""
        key = (tuple(r.get("cell_id") for r in recs), metric)
        if key not in self._memo:
            self._memo[key] = clipped(self._metric(recs, metric), metric)
        return self._memo[key]

    def _metric(self, recs: Sequence[dict], metric: str) -> Estimate | None:
        if not recs:
            return None
        r0 = recs[0]
        key = (r0["preset"], r0["task"], r0["defense_label"], r0["attack_label"], r0["view"])
        if metric.startswith("variants:"):
            _, name, m = metric.split(":", 2)
            if all(r.get("primary") == name for r in recs):
                return self.metric(recs, m)
            if all(((r.get("per_candidate") or {}).get("variants") or {}).get(name) for r in recs):
                # the records kept this variant's per-candidate scores: bootstrap it like the primary score
                return membership_estimate(recs, m, key=key + (name,), variant=name)
            return seed_estimate([(r.get("variants") or {}).get(name, {}).get(m) for r in recs])
        if r0.get("attack_kind") == "reconstruction":
            return sample_estimate(recs, metric, key=key)
        return membership_estimate(recs, metric, key=key)


# ----------------------------------------------------------------------------------------------
# tables


def baseline_for(label: str, view: str, labels: Iterable[str]) -> str | None:
    """The undefended reference of a row: fedsgd for FedSGD forms, lora for released models, else fedavg."""
    name = label.split("(", 1)[0]
    if name == "base" or name in BASELINES and "(" not in label:
        return None
    want = "lora" if view == "released_model" else ("fedsgd" if "form=fedsgd" in label or name == "fedsgd"
                                                     else "fedavg")
    return want if want in set(labels) else None


def _status_text(recs: Sequence[dict]) -> str:
    bad = [r for r in recs if r["status"] != "ok"]
    if not bad:
        return ""
    st = bad[0]["status"]
    seeds = sorted({r["seed"] for r in bad})
    where = "" if len(bad) == len(recs) else f" (seed {','.join(map(str, seeds))})"
    return f"{st}{where}: {bad[0].get('reason') or ''}"


def scenario_table(res: Results, scenario: str) -> tuple[pd.DataFrame, list[dict]]:
    """One row per preset x task x defense config; returns (numeric table, per-column metadata)."""
    recs = [r for r in res.records if r["scenario"] == scenario]
    rows_by: dict[tuple, list[dict]] = {}
    for r in recs:
        rows_by.setdefault(row_key(r), []).append(r)
    # A defense with no applicable cell here, or an attack x view no defense admits, is only in the
    # cross-matrix (with its reason): it would be an empty row / column in this table.
    rows_by = {k: g for k, g in rows_by.items() if any(r["status"] != "n/a" for r in g)}
    live = {(r["attack_label"], r["view"], r["attack_kind"]) for r in recs if r["status"] != "n/a"}
    cols_meta: dict[str, dict] = {}
    util_keys = sorted({k for r in recs for k in (r.get("utility") or {})})
    table: list[dict] = []
    est: dict[tuple, Estimate] = {}
    for rk in sorted(rows_by, key=lambda k: (k[0], k[1], _defense_order(k[2]))):
        group = rows_by[rk]
        ok = [r for r in group if r["status"] == "ok"]
        g0 = group[0]
        row: dict[str, Any] = {"preset": rk[0], "task": rk[1], "defense": rk[2], "defense_name": g0["defense"],
                               "defense_params": json.dumps(g0.get("defense_params") or {}, sort_keys=True, default=str),
                               "seeds": ";".join(map(str, sorted({r["seed"] for r in group}))),
                               "n_seeds": len({r["seed"] for r in group})}
        src = ok or group
        for k in util_keys:
            e = res.utility(src, k)
            if e is not None:
                row[f"utility.{k}"] = e.value
                if e.has_ci():
                    row[f"utility.{k}.ci_low"], row[f"utility.{k}.ci_high"] = e.lo, e.hi
        for k in ("epsilon", "epsilon_composed", "delta"):
            vals = res.per_seed(src, lambda r: (r.get("privacy") or {}).get(k))
            vals = [v for v in vals if v is not None]
            row[f"privacy.{k}"] = float(np.mean(vals)) if vals else math.nan
        notes = sorted({(r.get("privacy") or {}).get("note") or "" for r in src} - {""})
        row["privacy.note"] = "; ".join(notes)
        for k in ("bytes_up_per_round", "bytes_down_per_round", "params_up_per_round", "rounds", "train_wall_s",
                  "peak_mem_mb"):
            vals = [v for v in res.per_seed(src, lambda r: (r.get("cost") or {}).get(k)) if v is not None]
            row[f"cost.{k}"] = float(np.mean(vals)) if vals else math.nan
        aw = [(r.get("cost") or {}).get("attack_wall_s") for r in group]
        row["cost.attack_wall_s"] = float(np.nansum([a for a in aw if a is not None]) / max(1, row["n_seeds"]))
        cells: dict[tuple, list[dict]] = {}
        for r in group:
            cells.setdefault((r["attack_label"], r["view"], r["attack_kind"]), []).append(r)
        for (alabel, view, kind), cell in sorted(cells.items()):
            if (alabel, view, kind) not in live:
                continue
            okc = [r for r in cell if r["status"] == "ok"]
            status = _status_text(cell)
            for metric in HEADLINE.get(kind, ()):
                col = f"{alabel}/{view}:{metric}"
                cols_meta.setdefault(col, {"attack": alabel, "view": view, "kind": kind, "metric": metric,
                                           "primary": metric == HEADLINE[kind][0]})
                e = res.metric(okc, metric) if okc else None
                if e is not None:
                    row[col], row[f"{col}.ci_low"], row[f"{col}.ci_high"] = e.value, e.lo, e.hi
                    est[(rk, col)] = e
                if status:
                    row[f"{col}.status"] = status
        table.append(row)
    df = pd.DataFrame(table)
    if df.empty:
        return df, []
    labels = set(df.defense)
    # best group and comparison with the baseline, per column (lower leakage is better)
    for col in sorted(cols_meta):
        best_flags, vs = [], []
        for _, row in df.iterrows():
            rk = (row.preset, row.task, row.defense)
            metric = cols_meta[col]["metric"]
            e = leakage(est.get((rk, col)), metric)
            peers = [(k, leakage(v, metric)) for k, v in est.items()
                     if k[1] == col and k[0][:2] == rk[:2] and k[0][2] != "base"]
            if e is None or row.defense == "base" or not peers:
                best_flags.append(math.nan)
            else:
                top = min(peers, key=lambda kv: (kv[1].value, kv[0][0][2]))[1]
                best_flags.append(float(differs(e, top) <= 0))
            base = baseline_for(row.defense, cols_meta[col]["view"], labels)
            b = leakage(est.get(((row.preset, row.task, base), col)), metric) if base else None
            vs.append("" if (e is None or b is None) else {-1: "less leakage", 0: "n.s.", 1: "more leakage"}[differs(e, b)])
        df[f"{col}.best"] = best_flags
        df[f"{col}.vs_baseline"] = vs
    fixed = [c for c in df.columns if not c.startswith(("utility.", "privacy.", "cost.")) and c not in cols_meta
             and not any(c.startswith(m + ".") for m in cols_meta)]
    order = fixed + sorted(c for c in df.columns if c.startswith("utility.")) + \
        [c for c in df.columns if c.startswith("privacy.")] + [c for c in df.columns if c.startswith("cost.")]
    col_order = sorted(cols_meta, key=lambda c: (cols_meta[c]["attack"], cols_meta[c]["view"],
                                                  not cols_meta[c]["primary"], c))
    for col in col_order:
        order += [c for c in (col, f"{col}.ci_low", f"{col}.ci_high", f"{col}.best", f"{col}.vs_baseline",
                              f"{col}.status") if c in df.columns]
    meta = [{"column": c, **cols_meta[c]} for c in col_order]
    return df[order], meta


def matrix_table(res: Results, scenario: str) -> pd.DataFrame:
    """Defenses x attacks, one cell each: per-view headline, or ``n/a: reason`` / ``failed: reason``."""
    recs = [r for r in res.records if r["scenario"] == scenario]
    attacks = sorted({r["attack_label"] for r in recs})
    by: dict[tuple, dict[str, list[dict]]] = {}
    for r in recs:
        by.setdefault(row_key(r), {}).setdefault(r["attack_label"], []).append(r)
    rows = []
    for rk in sorted(by, key=lambda k: (k[0], k[1], _defense_order(k[2]))):
        row = {"preset": rk[0], "task": rk[1], "defense": rk[2]}
        for a in attacks:
            cell = by[rk].get(a, [])
            parts = []
            for view in sorted({r["view"] for r in cell}):
                vr = [r for r in cell if r["view"] == view]
                ok = [r for r in vr if r["status"] == "ok"]
                st = _status_text(vr)
                if ok:
                    kind = ok[0]["attack_kind"]
                    e = res.metric(ok, HEADLINE[kind][0])
                    txt = f"{VIEW_SHORT.get(view, view)} {HEADLINE[kind][0]} {e.value:.3f}" if e else VIEW_SHORT.get(view, view)
                    parts.append(txt + (f" ({st})" if st else ""))
                elif st:
                    parts.append((f"{VIEW_SHORT.get(view, view)} " if len({r['view'] for r in cell}) > 1 else "") + st)
            row[a] = "; ".join(parts)
        rows.append(row)
    return pd.DataFrame(rows, columns=["preset", "task", "defense", *attacks])


def cells_table(res: Results, scenario: str) -> pd.DataFrame:
    """One flat row per record (numbers stay numbers)."""
    rows = []
    for r in res.records:
        if r["scenario"] != scenario:
            continue
        row = {k: r.get(k) for k in ("preset", "task", "defense_label", "attack_label", "attack_kind", "view", "seed",
                                     "status", "reason", "cell_id")}
        for name, m in sorted((r.get("metrics") or {}).items()):
            row[name] = m.get("value")
            row[f"{name}.ci_low"], row[f"{name}.ci_high"] = m.get("ci_low"), m.get("ci_high")
        for group in ("utility", "privacy", "cost"):
            for k, v in sorted((r.get(group) or {}).items()):
                row[f"{group}.{k}"] = v
        row["artifacts"] = ";".join(f"{k}={v}" for k, v in sorted((r.get("artifacts") or {}).items()))
        rows.append(row)
    df = pd.DataFrame(rows)
    first = list(rows[0])[:10] if rows else []
    return df[first + sorted(c for c in df.columns if c not in first)] if rows else df


def to_csv_bytes(df: pd.DataFrame) -> bytes:
    return df.to_csv(index=False, float_format=FLOAT_FORMAT, lineterminator="\n").encode()


def write_leaderboards(out: Path, dest: Path | None = None) -> list[Path]:
    """Write every scenario's leaderboard files under ``dest`` (default ``<out>/leaderboards``)."""
    from . import claims as C, html as H, plots as P, reported as R, table4 as T4
    from .html import index_markdown, scenario_markdown

    out = Path(out)
    dest = Path(dest) if dest else out / "leaderboards"
    res = Results.load(out)
    for (task, preset), n in sorted(res.superseded.items()):
        print(f"leaderboard: ignored {n} records of {task} ({preset}) from a superseded task configuration "
              f"(an earlier preset or data); they stay in {out / 'records'}", file=sys.stderr)
    written: list[Path] = []
    if not res.records:
        return written
    sections = []
    rvm = R.compare(res)
    claim_rows = C.evaluate(res)
    # papers/000 Table 4 beside Table 1, measured next to reported
    t4 = T4.table4(res) if T4.SCENARIO in res.scenarios() else None
    for scenario in res.scenarios():
        table, meta = scenario_table(res, scenario)
        matrix = matrix_table(res, scenario)
        files = {f"{scenario}.csv": table, f"{scenario}_matrix.csv": matrix,
                 f"{scenario}_cells.csv": cells_table(res, scenario)}
        for name, df in files.items():
            atomic_write_bytes(dest / name, to_csv_bytes(df))
            written.append(dest / name)
        plots = P.scenario_plots(res, scenario, table, dest, out)
        written += [dest / p for p in plots]
        s_claims = [c for c in claim_rows if c["scenario"] == scenario]
        s_rvm = rvm[rvm.scenario == scenario] if len(rvm) else rvm
        md = scenario_markdown(res, scenario, table, meta, matrix, s_claims, s_rvm, plots)
        if scenario == T4.SCENARIO and t4 is not None:
            md += "\n## papers/000 Table 4 and Table 1, measured beside reported\n\n" + T4.markdown(t4)
        atomic_write_bytes(dest / f"{scenario}.md", md.encode())
        written.append(dest / f"{scenario}.md")
        sections.append({"scenario": scenario, "table": table, "meta": meta, "matrix": matrix, "claims": s_claims,
                         "reported": s_rvm, "plots": plots, "res": res})
    if t4 is not None:
        atomic_write_bytes(dest / f"{T4.SCENARIO}_table4.csv", to_csv_bytes(t4))
        atomic_write_bytes(dest / f"{T4.SCENARIO}_table4.md", T4.markdown(t4).encode())
        written += [dest / f"{T4.SCENARIO}_table4.csv", dest / f"{T4.SCENARIO}_table4.md"]
    atomic_write_bytes(dest / "reported_vs_measured.csv", to_csv_bytes(rvm))
    atomic_write_bytes(dest / "claims.csv", to_csv_bytes(pd.DataFrame(claim_rows, columns=C.COLUMNS)))
    atomic_write_bytes(dest / "claims.md", C.markdown(claim_rows).encode())
    atomic_write_bytes(dest / "README.md", index_markdown(res, sections).encode())
    atomic_write_bytes(dest / "index.html", H.page(sections, claim_rows).encode())
    written += [dest / n for n in ("reported_vs_measured.csv", "claims.csv", "claims.md", "README.md", "index.html")]
    return written
