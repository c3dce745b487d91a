"""Results loading: the records of one output directory (each task's latest configuration only), the
naming constants shared by every table, and per-cell estimates (memoised)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..controls import Control, positive_controls, reconstruction_controls
from ..staleness import label_keys
from ..store import Store, current_config
from .stats import Estimate, clipped, membership_estimate, sample_estimate, seed_estimate, unresolvable

# the first of each kind is the primary column; the others are the secondary table (TPR at 1% and 0.1% FPR:
# the low-FPR regime Carlini et al. 2022 argue for, [FedRand] and [SMP-LoRA] report)
# (TPR at 5% FPR needs >= 200 non-members, at 1% 1,000, at 0.1% 10,000: below that the cell reads n/a)
HEADLINE = {"membership": ("auroc", "tpr@0.05fpr", "tpr@0.01fpr", "tpr@0.001fpr"), "reconstruction": ("ssim", "psnr")}
BASELINES = ("fedavg", "fedsgd", "lora")  # undefended references, by protocol
VIEW_SHORT = {
    "global_model": "global",
    "client_model": "client",
    "client_update": "update",
    "released_model": "released",
}
# utility metrics where lower is better (everything else: higher is better)
LOWER_BETTER = ("loss", "perplexity", "fid", "kid", "error")
UTILITY_ORDER = ("accuracy", "cider", "bleu4", "rouge", "test_loss", "perplexity", "fid", "kid")


def lower_is_better(utility_key: str) -> bool:
    k = utility_key.lower()
    return any(t in k for t in LOWER_BETTER)


def is_utility(key: str) -> bool:
    """A utility key that measures the model: not a within-run spread (``kid_*_std``, KID over subsets) nor a
    sample size (``n_generated``): neither is a utility a defense trades privacy for."""
    return not key.endswith("_std") and not key.startswith("n_")


def diverged(rec: dict) -> bool:
    """A failed record whose training run diverged under its defense (schema revision 12 ``failure``; an older
    record by its reason, which bench.fl has always worded ``training diverged``)."""
    if rec.get("status") != "failed":
        return False
    if rec.get("failure") is not None:
        return rec["failure"] == "diverged"
    return "training diverged" in str(rec.get("reason") or "")


# ----------------------------------------------------------------------------------------------
# records


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
    from ..registry import parse_spec

    want, kv = parse_spec(spec)
    if want != name or not label_keys(label) <= set(kv):
        return False
    return all(k in params and _value_eq(v, params[k]) for k, v in kv.items())


def row_key(rec: dict) -> tuple:
    return rec.get("preset", ""), rec.get("task", ""), rec.get("defense_label", "")


def _defense_order(label: str) -> tuple:
    name = label.split("(", 1)[0]
    return (0 if name == "base" else 1 if name in BASELINES else 2, label)


def oracle_asr_named(rec: dict) -> dict:
    """Records written before ``asr_oracle`` existed call it ``asr``: the best threshold chosen on the evaluation
    set itself (optimistic). Renamed on load so it is never shown as a calibrated ASR (``asr_aux``)."""
    if "asr" not in (rec.get("metrics") or {}) and not any("asr" in v for v in (rec.get("variants") or {}).values()):
        return rec
    rec = dict(rec)
    rec["metrics"] = {("asr_oracle" if k == "asr" else k): v for k, v in (rec.get("metrics") or {}).items()}
    rec["variants"] = {
        n: {("asr_oracle" if k == "asr" else k): x for k, x in v.items()}
        for n, v in (rec.get("variants") or {}).items()
    }
    return rec


class Results:
    """The records of one output directory (the latest configuration of each task), with selections and
    per-row estimates."""

    def __init__(self, records: Iterable[dict]):
        records, self.superseded = current_config([oracle_asr_named(r) for r in records])
        self.records = sorted(
            records,
            key=lambda r: (
                r.get("scenario", ""),
                *row_key(r),
                r.get("attack_label", ""),
                r.get("view", ""),
                r.get("seed", 0),
                r.get("cell_id", ""),
            ),
        )
        self._memo: dict[tuple, Estimate | None] = {}
        self.stale: dict[tuple[str, str], int] = {}  # (task, preset) -> stale records left out (see ``load``)
        self._controls: dict[tuple[str, str], list[Control]] | None = None
        self._recon_controls: dict[tuple[str, ...], Control] | None = None

    def controls(self) -> dict[tuple[str, str], list[Control]]:
        """The positive controls (``bench.controls``) per (preset, task), computed once."""
        if self._controls is None:
            self._controls = {}
            for c in positive_controls(self.records):
                self._controls.setdefault((c.preset, c.task), []).append(c)
        return self._controls

    def view_control(self, preset: str, task: str, view: str) -> Control | None:
        """The membership positive control of the task's undefended baseline in ``view``, None when unchecked."""
        return next((c for c in self.controls().get((preset, task), []) if c.view == view), None)

    def recon_control(self, preset: str, task: str, attack_label: str, baseline: str, view: str) -> Control | None:
        """The reconstruction control (``bench.controls``) of that baseline's cell, None when it has no ok record."""
        return self._recon().get((preset, task, attack_label, baseline, view))

    def recon_control_list(self) -> list[Control]:
        return list(self._recon().values())

    def _recon(self) -> dict[tuple[str, ...], Control]:
        """The reconstruction controls by (preset, task, attack, baseline, view), computed once."""
        if self._recon_controls is None:
            self._recon_controls = {
                (c.preset, c.task, c.attack, c.baseline, c.view): c for c in reconstruction_controls(self.records)
            }
        return self._recon_controls

    def control_text(self, preset: str, task: str) -> str:
        """``passed``, ``failed: <reasons>``, or ``not checked`` (no membership cell of an undefended baseline)."""
        cs = self.controls().get((preset, task), [])
        if not cs:
            return "not checked"
        bad = [f"{c.view}: {c.reason}" for c in cs if not c.passed]
        return "failed: " + "; ".join(bad) if bad else "passed"

    def mixed_trainings(self, scenario: str | None = None) -> list[tuple[str, str, str, int, int]]:
        """(preset, task, defense label, seed, runs) where the membership records of one (task, defense, seed)
        were made from more than one training run (their ``training`` checksum, or their utility before it): the
        rows then compare different models. ``bench run`` redoes the records of a run no longer cached."""
        runs: dict[tuple[str, str, str, int], list[tuple[str | None, str]]] = {}
        for r in self.select(scenario=scenario, kind="membership"):
            if r["defense"] != "base":
                t = r.get("training")
                ident = (t["sha256"] if isinstance(t, dict) else None, json.dumps(r.get("utility"), sort_keys=True))
                runs.setdefault((r["preset"], r["task"], r["defense_label"], r["seed"]), []).append(ident)
        out = []
        for k, ids in sorted(runs.items()):
            sums = {sha for sha, _ in ids if sha is not None}
            known = {u for sha, u in ids if sha is not None}  # a record without the checksum is the run of its utility
            n = len(sums) + len({u for sha, u in ids if sha is None and u not in known})
            if n > 1:
                out.append((*k, n))
        return out

    def unreproduced_trainings(self, scenario: str | None = None) -> list[tuple[str, str, str, int, int, str]]:
        """(preset, task, defense label, seed, recorded membership cells, reason) where some membership cells of a
        (task, defense, seed) are recorded while others failed because its training run failed: the recorded ones
        (reconstruction cells attack round-0 probes, which no training changes) come from an earlier
        run (e.g. trained on another CPU, whose cache is gone) that retraining here did not reproduce (a run
        that diverges on this machine), so nothing here checks them. ``bench run`` keeps them (module
        bench.runner: a failed retraining leaves finished records as they are)."""
        groups: dict[tuple[str, str, str, int], list[dict]] = {}
        for r in self.select(scenario=scenario, status=None):
            if r["defense"] != "base":
                groups.setdefault((r["preset"], r["task"], r["defense_label"], r["seed"]), []).append(r)
        out = []
        for k, rs in sorted(groups.items()):
            ok = sum(r["status"] == "ok" and r.get("attack_kind") == "membership" for r in rs)  # scored the run
            reasons = (str(r.get("reason") or "") for r in rs)
            why = min((w for w in reasons if w.startswith("training failed")), default="")
            if ok and why:
                out.append((*k, ok, why))
        return out

    @classmethod
    def load(cls, out: str | Path) -> Results:
        """The records of ``out`` but the stale ones (``bench.staleness``: those ``bench run`` would redo),
        which ``stale`` keeps count of per (task, preset)."""
        from ..staleness import check

        records = list(Store(out).records())
        found = check(records)
        res = cls(r for r in records if f"{r['scenario']}/{r['cell_id']}" not in found.stale)
        for r in records:
            if f"{r['scenario']}/{r['cell_id']}" in found.stale:
                res.stale[r["task"], r["preset"]] = res.stale.get((r["task"], r["preset"]), 0) + 1
        return res

    def scenarios(self) -> list[str]:
        return sorted({r["scenario"] for r in self.records})

    def select(
        self,
        *,
        scenario: str | None = None,
        task: str | None = None,
        preset: str | None = None,
        defense: str | None = None,
        attack: str | None = None,
        view: str | None = None,
        kind: str | None = None,
        status: str | None = "ok",
    ) -> list[dict]:
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
            why = unresolvable(recs, m)
            if why:
                return Estimate(math.nan, n_seeds=len(recs), method="not reported", note=why)
            return seed_estimate([(r.get("variants") or {}).get(name, {}).get(m) for r in recs])
        if r0.get("attack_kind") == "reconstruction":
            return sample_estimate(recs, metric, key=key)
        return membership_estimate(recs, metric, key=key)
