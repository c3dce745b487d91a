"""Which stored records the current code would redo: those whose resolved fields differ from what their cell now
expects (``bench.matrix.Cell.expected``: an earlier protocol, inversion budget, reference count or parameter
default), the check ``bench run`` makes before skipping a cell, made here from the records alone (the scenarios'
declarations, ``bench.specs``; no task is built, no training cache read). The leaderboard leaves them out, as it
does records of a superseded task configuration, and says how many: pooling them with current records would put
two protocols in one row. A record the check cannot rebuild (a scenario, method or parameter this code no longer
has, a scenario that declares no configuration) is kept and counted as unchecked. A record made before a default
changed keeps the old value in its parameters while its label (and id) omits it: it is rebuilt as its label
names it, as ``bench run`` builds the cell, and found stale by its parameters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class Staleness:
    stale: dict[str, str] = field(default_factory=dict)  # "<scenario>/<cell_id>" -> the first differing field
    unchecked: int = 0  # finished records that could not be rebuilt as a cell


def _unjson(v: Any) -> Any:
    """A parameter as the record stores it (``bench.store.jsonable``) back as the method takes it: tuples were
    written as lists, non-finite floats as strings."""
    if isinstance(v, list):
        return tuple(_unjson(x) for x in v)
    return float(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v


def _method(registry, name: str, params: dict[str, Any], kind: str, memo: dict) -> Any:
    from .registry import build

    key = (kind, name, repr(sorted(params.items())))
    if key not in memo:
        try:
            memo[key] = build(registry.get(name), {k: _unjson(v) for k, v in params.items()}, kind)
        except Exception:  # noqa: BLE001 - unknown now, or parameters this version rejects: not checkable
            memo[key] = None
    return memo[key]


def label_keys(label: str) -> set[str]:
    """The parameter names a label sets (``flrsp(R=0.8,form=fedsgd)``: R and form; ``bench.training.label``)."""
    inner = label[label.index("(") + 1 : -1] if label.endswith(")") and "(" in label else ""
    return set(re.findall(r"(?:^|,)\s*([A-Za-z_]\w*)=", inner))


def _labelled(params: dict[str, Any], label: str) -> dict[str, Any]:
    """The parameters a record's label names, with the record's values: the configuration as the grid builds it,
    whose other fields take today's defaults."""
    keys = label_keys(label)
    return {k: v for k, v in params.items() if k in keys}


def _tasks(scenario: str, preset: str, memo: dict) -> dict[str, Any]:
    from .registry import SCENARIOS
    from .specs import configured, declared

    if (scenario, preset) not in memo:
        try:
            decl = declared(SCENARIOS.get(scenario), preset)
        except Exception:  # noqa: BLE001 - a scenario this version no longer has
            decl = None
        memo[scenario, preset] = {d.id: d for d in decl} if configured(decl) and decl else {}
    return memo[scenario, preset]


def _cell(r: dict, task: Any, full: bool, memo: dict) -> Any:
    """The record's cell rebuilt from its parameters (``full``) or from those its labels name, or None."""
    from .matrix import Cell
    from .registry import ATTACKS, DEFENSES

    if task is None:
        return None

    def params(kind: str) -> dict[str, Any]:
        got = r.get(f"{kind}_params") or {}
        return got if full else _labelled(got, r.get(f"{kind}_label") or "")

    defense = None if r["defense"] == "base" else _method(DEFENSES, r["defense"], params("defense"), "defense", memo)
    attack = _method(ATTACKS, r["attack"], params("attack"), "attack", memo)
    if attack is None or (defense is None and r["defense"] != "base"):
        return None
    return Cell(task, defense, attack, r["view"], r["seed"])


def check(records: Iterable[dict]) -> Staleness:
    """The finished records (``ok`` / ``n/a``) whose cell, rebuilt from the record, expects other field values."""
    from .store import mismatch

    out = Staleness()
    memo: dict = {}
    for r in records:
        if r.get("status") not in ("ok", "n/a"):
            continue
        task = _tasks(r["scenario"], r["preset"], memo).get(r["task"])
        try:
            # the record's own configuration; where that no longer gives the record's id (a default changed since,
            # so the label now names it), the configuration its label names, as ``bench run`` builds the cell
            cell = next(
                (c for c in (_cell(r, task, full, memo) for full in (True, False)) if c and c.id == r["cell_id"]),
                None,
            )
            if cell is None:
                out.unchecked += 1
                continue
            expected = cell.expected()
        except Exception:  # noqa: BLE001 - a declaration that cannot answer (e.g. no configuration)
            out.unchecked += 1
            continue
        if r["status"] == "n/a":
            continue  # nothing measured: nothing to mix (``bench run`` keeps it too)
        why = mismatch(r, expected)
        if why is not None:
            out.stale[f"{r['scenario']}/{r['cell_id']}"] = why
    return out
