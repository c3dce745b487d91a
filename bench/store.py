"""Result records: one JSON file per cell, versioned schema, written atomically.

Schema (``schema_version`` 1), documented in README.md "Result records":
  cell_id, scenario, task, preset, defense, defense_params, defense_label, attack, attack_params,
  attack_label, attack_kind, view, seed, status ("ok" | "n/a" | "failed"), reason,
  metrics {name: {value, ci_low, ci_high}}, variants {score name: {metric: value}} (membership),
  per_sample {metric: [values per image]} (reconstruction), roc {fpr, tpr},
  per_candidate {score, member, variants {score name: [scores]} for the attack's kept variants} (membership),
  utility {name: value},
  privacy {epsilon, epsilon_composed, delta, sample_rate, note},
  cost {bytes_up_per_round, bytes_down_per_round, params_up_per_round, train_wall_s, attack_wall_s,
  peak_mem_mb}, artifacts {name: path relative to the output dir}, provenance {code_version, packages,
  config_hash, started_at, ...}.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

SCHEMA_VERSION = 1
FINISHED = ("ok", "n/a")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def jsonable(obj: Any) -> Any:
    """Tuples to lists, and non-finite floats (e.g. alpha = inf in a parameter) to their string."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def stable_hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


class Store:
    """``<out>/records/<scenario>/<cell_id>.json`` plus ``<out>/artifacts/<cell_id>/``."""

    def __init__(self, out: str | Path):
        self.out = Path(out)

    def record_path(self, scenario: str, cell_id: str) -> Path:
        return self.out / "records" / scenario / f"{cell_id}.json"

    def artifact_dir(self, cell_id: str) -> Path:
        d = self.out / "artifacts" / cell_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def finished(self, scenario: str, cell_id: str) -> bool:
        p = self.record_path(scenario, cell_id)
        if not p.exists():
            return False
        try:
            return json.loads(p.read_text()).get("status") in FINISHED
        except json.JSONDecodeError:
            return False

    def write(self, record: dict) -> Path:
        record = jsonable({"schema_version": SCHEMA_VERSION, **record})
        p = self.record_path(record["scenario"], record["cell_id"])
        atomic_write_bytes(p, json.dumps(record, indent=1, sort_keys=True, allow_nan=False).encode())
        return p

    def records(self) -> Iterator[dict]:
        root = self.out / "records"
        for p in sorted(root.glob("*/*.json")):
            rec = json.loads(p.read_text())
            if rec.get("schema_version") != SCHEMA_VERSION:
                raise ValueError(f"{p}: schema_version {rec.get('schema_version')} != {SCHEMA_VERSION}")
            prov = rec.setdefault("provenance", {})
            if not prov.get("started_at"):  # records written before started_at existed: the file's time
                prov["started_at"] = utc_stamp(p.stat().st_mtime)
            yield rec


def utc_stamp(t: float | None = None) -> str:
    """``t`` (default: now) as an ISO-8601 UTC second, e.g. 2026-11-23T12:00:00Z (sorts as text)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@lru_cache(maxsize=1)
def provenance() -> dict:
    """Code version and package versions, recorded in every record."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", False
    pkgs = {}
    for name in ("torch", "torchvision", "timm", "transformers", "peft", "diffusers", "scikit-learn",
                 "scikit-image", "opacus", "numpy"):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    return {"code_version": sha or "unknown", "dirty": dirty, "python": platform.python_version(), "packages": pkgs}
