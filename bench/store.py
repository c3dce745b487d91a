"""Result records: one JSON file per cell, versioned schema, written atomically.

Schema (``schema_version`` 1), documented in README.md "Result records":
  cell_id, scenario, task, preset, defense, defense_params, defense_label, attack, attack_params,
  attack_label, attack_kind, view, seed, status ("ok" | "n/a" | "failed"), reason,
  metrics {name: {value, ci_low, ci_high}}, variants {score name: {metric: value}} (membership),
  per_sample {metric: [values per image]} (reconstruction), roc {fpr, tpr},
  per_candidate {score, member, variants {score name: [scores]} for every score but the primary, id, label} (membership;
  reconstruction: {id, score (the ``primary`` metric, ssim), variants {metric: [values per target], ssim_random (the
  negative control)}}, no member), negative_control and probe (reconstruction),
  fedsgd_batches ("seeded": FedSGD batches follow the run seed), attack_resolved (revision >= 5: the values the
  attack's configuration leaves to the task, where they differ from those of earlier records: bench.runner),
  utility {name: value},
  privacy {epsilon, epsilon_composed, delta, sample_rate, note, epsilon_lower_bound {value, confidence, delta,
  attack, ...} (membership: the empirical audit, bench/audit.py), epsilon_one_run_lower_bound {value, pairs, ...}
  (membership, revision >= 3: bench/one_run_audit.py)},
  cost {bytes_up_per_round, bytes_down_per_round, params_up_per_round, train_wall_s, attack_wall_s,
  peak_mem_mb, signals_computed / signals_reused (membership, revision >= 8), preparation_s (cells, revision >= 10:
  seconds spent building or waiting for a shared cache entry such as the VLM's aligned projector, not counted in
  attack_wall_s), signals_loaded (membership, revision >= 11: signal calls read back from cache/signals)},
  artifacts {name: path relative
  to the output dir}, provenance {code_version, packages, config_hash, started_at, ...}.

Every record is checked against the typed schema (bench/schema.py) when written and when read: an invalid
file is moved to ``<out>/quarantine/<scenario>/<file>`` with ``<file>.reason.txt`` (never deleted), reported
on stderr, and its cell counts as not done, so the next ``run`` redoes it. A record written by a newer version
of the suite (higher ``schema_version``, or higher ``schema_revision`` within it) that this code cannot read is
skipped and reported but left in place: an older checkout running on the same output directory must not
quarantine what a newer one wrote.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable, Iterator

from .schema import SCHEMA_REVISION, SCHEMA_VERSION, newer_writer, validate

FINISHED = ("ok", "n/a")


class RecordInvalid(ValueError):
    """A record the harness built fails the schema; the runner keeps the cell as ``failed`` with this reason."""


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
    try:  # make the rename itself durable (a power cut, not just a killed process)
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(dfd)


def jsonable(obj: Any) -> Any:
    """Tuples to lists, and non-finite floats (e.g. alpha = inf in a parameter) to their string."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def quarantine(files: Iterable[Path], qdir: Path, reason: str) -> list[Path]:
    """Move ``files`` (those that exist) into ``qdir`` with a ``<name>.reason.txt`` beside each; never
    overwrites an earlier quarantined file (a numeric suffix is added). Reports each move on stderr. A folder
    or a link where a file belongs is moved the same way (it would block the file's rewrite)."""
    moved = []
    for f in files:
        if not os.path.lexists(f):
            continue
        dest, k = qdir / f.name, 1
        try:
            qdir.mkdir(parents=True, exist_ok=True)
            while os.path.lexists(dest):
                dest, k = qdir / f"{f.name}.{k}", k + 1
            f.replace(dest)
            dest.with_name(dest.name + ".reason.txt").write_text(reason + "\n")
        except FileNotFoundError:  # another process moved it first
            continue
        except OSError as e:
            print(  # noqa: T201
                f"warning: could not quarantine {f} ({reason}): {type(e).__name__}: {e}",
                file=sys.stderr,
            )
            continue
        print(f"quarantined {f} -> {dest}: {reason}", file=sys.stderr)  # noqa: T201 - reported by design
        moved.append(dest)
    return moved


def stable_hash(obj: Any, n: int = 16) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


class Store:
    """``<out>/records/<scenario>/<cell_id>.json`` plus ``<out>/artifacts/<cell_id>/``. ``readonly`` (e.g. a dry
    run): an invalid record is skipped and reported, never moved, and writing raises."""

    def __init__(self, out: str | Path, *, readonly: bool = False):
        self.out = Path(out)
        self.readonly = readonly

    def record_path(self, scenario: str, cell_id: str) -> Path:
        return self.out / "records" / scenario / f"{cell_id}.json"

    def artifact_dir(self, cell_id: str) -> Path:
        d = self.out / "artifacts" / cell_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def quarantine_dir(self, scenario: str) -> Path:
        return self.out / "quarantine" / scenario

    def load(self, path: Path) -> dict | None:
        """The record at ``path`` when it is a valid schema-1 record of that file name, else None (the file
        is then quarantined and reported; skipped and reported in a read-only store)."""
        why: str | None
        newer = None
        try:
            rec = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as e:  # ValueError: not JSON / not UTF-8
            why = f"unreadable: {type(e).__name__}: {e}"
        else:
            if isinstance(rec, dict) and isinstance(rec.get("artifacts"), dict):  # records of earlier versions
                rec["artifacts"] = {k: self.relative(v, legacy=True) for k, v in rec["artifacts"].items()}
            why = validate(rec)
            newer = newer_writer(rec) if why is not None else None
            if why is None and (rec["scenario"], rec["cell_id"]) != (path.parent.name, path.stem):
                why = f"record of {rec['scenario']}/{rec['cell_id']} stored as {path.parent.name}/{path.name}"
            if why is None:
                return rec
        if newer is not None:
            print(  # noqa: T201
                f"skipped record {path} written by a newer version of the suite, {newer} (left in place): {why}",
                file=sys.stderr,
            )
        elif self.readonly:
            print(f"skipped invalid record {path} (left in place): {why}", file=sys.stderr)  # noqa: T201
        else:
            quarantine([path], self.quarantine_dir(path.parent.name), f"invalid record: {why}")
        return None

    def finished(
        self,
        scenario: str,
        cell_id: str,
        *,
        expect: dict[str, Any] | None = None,
        accept: Callable[[dict], bool] | None = None,
    ) -> bool:
        """A finished record of the cell; with ``expect``, one whose fields equal those values as stored (e.g. the
        attack's resolved parameters: a changed default leaves the cell id alone but makes the record stale); an
        expected None matches an absent field. ``accept(record)``: a further test (e.g. made from the cached run)."""
        rec = self.load(self.record_path(scenario, cell_id))
        if rec is None or rec["status"] not in FINISHED:
            return False
        if mismatch(rec, expect or {}) is not None:
            return False
        return accept is None or rec["status"] != "ok" or accept(rec)

    def write(self, record: dict) -> Path:
        """Write ``record`` atomically after checking it against the schema (raises RecordInvalid, writing
        nothing); artifact paths are stored relative to the output directory."""
        if self.readonly:
            raise PermissionError(f"read-only store {self.out}: not writing a record")
        record = {"schema_version": SCHEMA_VERSION, **record, "schema_revision": SCHEMA_REVISION}
        if record.get("artifacts"):
            record["artifacts"] = {k: self.relative(v) for k, v in record["artifacts"].items()}
        record = jsonable(record)
        why = validate(record)
        if why is not None:
            raise RecordInvalid(f"record fails the schema: {why}")
        p = self.record_path(record["scenario"], record["cell_id"])
        atomic_write_bytes(p, json.dumps(record, indent=1, sort_keys=True, allow_nan=False).encode())
        return p

    def relative(self, path: Any, *, legacy: bool = False) -> Any:
        """``path`` (absolute, or relative to the working directory as the harness builds it) relative to the
        output directory in POSIX form when it lies inside it; otherwise unchanged (the schema then rejects
        an absolute path, and takes a relative one as relative to the output directory already).
        ``legacy``: an absolute path a record of an earlier version holds, maybe from a folder since moved,
        is read from its ``artifacts/`` component on."""
        if not isinstance(path, (str, Path)):
            return path  # the schema names the problem
        p = Path(path)
        try:
            return p.resolve().relative_to(self.out.resolve()).as_posix()
        except (ValueError, OSError):
            pass
        if not p.is_absolute():
            return p.as_posix()
        parts = p.parts
        if legacy and "artifacts" in parts:
            return PurePosixPath(*parts[len(parts) - 1 - parts[::-1].index("artifacts") :]).as_posix()
        return str(path)

    def resolve(self, rel: str) -> Path:
        """An artifact path from a record (relative to the output directory) as a path to open."""
        return self.out / rel

    def records(self) -> Iterator[dict]:
        """Every valid record; invalid files are quarantined (read-only: skipped) and reported, not raised."""
        root = self.out / "records"
        for p in sorted(root.glob("*/*.json")):
            rec = self.load(p)
            if rec is None:
                continue
            prov = rec["provenance"]
            if not prov.get("started_at"):  # records written before started_at existed: the file's time
                prov["started_at"] = utc_stamp(p.stat().st_mtime)
            yield rec


def utc_stamp(t: float | None = None) -> str:
    """``t`` (default: now) as an ISO-8601 UTC second, e.g. 2026-11-23T12:00:00Z (sorts as text)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


@lru_cache(maxsize=1)
def provenance() -> dict:
    """Code version, package versions and the machine's CPU speed probe, recorded in every record."""
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                cwd=root,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", False
    pkgs: dict[str, str | None] = {}
    for name in (
        "torch",
        "torchvision",
        "timm",
        "transformers",
        "peft",
        "diffusers",
        "scikit-learn",
        "scikit-image",
        "opacus",
        "numpy",
    ):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    from .machine import machine_info

    return {
        "code_version": sha or "unknown",
        "dirty": dirty,
        "python": platform.python_version(),
        "packages": pkgs,
        "machine": machine_info(),  # the CPU and its speed probe: estimates scale records made elsewhere
    }


def mismatch(record: dict, expect: dict[str, Any]) -> str | None:
    """The first field of ``expect`` whose stored value ``record`` does not hold (an expected None matches an
    absent field), as ``field: recorded ..., expected ...``; None when every one matches."""
    for k, v in expect.items():
        if record.get(k) != jsonable(v):
            return f"{k}: recorded {record.get(k)!r}, expected {jsonable(v)!r}"
    return None


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
    kept: list[dict] = []
    dropped: dict[tuple[str, str], int] = {}
    for r in records:
        k = (r.get("task", ""), r.get("preset", ""))
        if str((r.get("provenance") or {}).get("config_hash") or "") == latest[k][1]:
            kept.append(r)
        else:
            dropped[k] = dropped.get(k, 0) + 1
    return kept, dropped
