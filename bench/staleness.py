"""Which stored records the current code would redo: those whose resolved fields differ from what their cell now
expects (``bench.matrix.Cell.expected``: an earlier protocol, inversion budget, reference count or parameter
default), the check ``bench run`` makes before skipping a cell, made here from the records alone (the scenarios'
declarations, ``bench.specs``; no task is built, no training cache read). The leaderboard leaves them out, as it
does records of a superseded task configuration, and says how many: pooling them with current records would put
two protocols in one row. A record the check cannot rebuild (a scenario, method or parameter this code no longer
has, a scenario that declares no configuration) is kept and counted as unchecked."""

from __future__ import annotations

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


def check(records: Iterable[dict]) -> Staleness:
    """The finished records (``ok`` / ``n/a``) whose cell, rebuilt from the record, expects other field values."""
    from .matrix import Cell
    from .registry import ATTACKS, DEFENSES
    from .store import mismatch

    out = Staleness()
    memo: dict = {}
    for r in records:
        if r.get("status") not in ("ok", "n/a"):
            continue
        task = _tasks(r["scenario"], r["preset"], memo).get(r["task"])
        defense = (
            None
            if r["defense"] == "base"
            else _method(DEFENSES, r["defense"], r.get("defense_params") or {}, "defense", memo)
        )
        attack = _method(ATTACKS, r["attack"], r.get("attack_params") or {}, "attack", memo)
        if task is None or attack is None or (defense is None and r["defense"] != "base"):
            out.unchecked += 1
            continue
        try:
            cell = Cell(task, defense, attack, r["view"], r["seed"])
            if cell.id != r["cell_id"]:
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
