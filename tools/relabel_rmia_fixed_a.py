"""One-off record migration (2026-11-28): RMIA records made while ``a`` was fixed at 0.3 become ``rmia(a=0.3)``.

Until commit bba03ed ``rmia`` used a fixed offline a = 0.3; it now tunes a per cell (attacks/rmia.py), so those
records are stale as ``rmia``. They are exactly what ``rmia:a=0.3`` computes today (the code path for a set ``a``
is unchanged), so rather than dropping them until the tuned cells are recomputed, this gives them that label and
that cell id (``bench.matrix.Cell.id``: labels omit defaults), keeping every other field. A record is moved only
when it names ``attack_params.a == 0.3`` under the label ``rmia`` and does not say where its a came from
(``attack_details.rmia.a_from``, written since); an existing ``rmia(a=0.3)`` record is never overwritten.

    PYTHONPATH=. python tools/relabel_rmia_fixed_a.py RECORDS_DIR [RECORDS_DIR ...]   # from the repository root
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.store import atomic_write_bytes, stable_hash

NEW_LABEL = "rmia(a=0.3)"


def cell_id(rec: dict, attack_label: str) -> str:
    """``bench.matrix.Cell.id`` of the record's cell under ``attack_label``."""
    return stable_hash(
        {
            "task": rec["task"],
            "preset": rec["preset"],
            "cfg": rec["provenance"]["config_hash"],
            "defense": rec["defense_label"],
            "attack": attack_label,
            "view": rec["view"],
            "seed": rec["seed"],
        }
    )


def relabel(records: Path) -> int:
    moved = 0
    for path in sorted(records.glob("*/*.json")):
        rec = json.loads(path.read_text())
        details = (rec.get("attack_details") or {}).get("rmia") or {}
        if rec.get("attack") != "rmia" or rec.get("attack_label") != "rmia" or "a_from" in details:
            continue
        if (rec.get("attack_params") or {}).get("a") != 0.3 or cell_id(rec, "rmia") != rec["cell_id"]:
            continue
        rec["attack_label"], rec["cell_id"] = NEW_LABEL, cell_id(rec, NEW_LABEL)
        dest = path.with_name(rec["cell_id"] + ".json")
        if dest.exists():
            continue
        atomic_write_bytes(dest, json.dumps(rec, indent=1, sort_keys=True, allow_nan=False).encode())  # as Store.write
        path.unlink()
        moved += 1
    return moved


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for d in sys.argv[1:]:
        print(f"{d}: {relabel(Path(d))} records relabelled {NEW_LABEL}")  # noqa: T201
