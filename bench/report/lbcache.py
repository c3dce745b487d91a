"""Leaderboard freshness: a cached re-run skips regenerating ``<out>/leaderboards`` when nothing it reads changed.

The manifest ``<out>/cache/leaderboards.json`` (outside the leaderboards folder) holds one digest of what
``write_leaderboards`` reads: every record file's stat (name, size, mtime_ns, ctime_ns, inode; no JSON parsed),
the reconstruction grids it copies, the report code and reported-numbers tables (content hashes), the versions
of the libraries that draw and format them, and the options; beside it, each file written with its size and
mtime_ns. Equal digest and every output intact: up to date, and neither pandas nor matplotlib is imported.
The manifest is written atomically only after a regeneration whose inputs did not change while it ran; a
missing or damaged manifest means regenerate.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from ..store import atomic_write_bytes

FORMAT = 1
ROOT = Path(__file__).resolve().parent.parent  # bench/
# what the report package runs: its own modules, the harness modules it imports, the reported numbers it compares
CODE_GLOBS = (
    (ROOT / "report", "*.py"),
    (ROOT.parent / "leaderboards" / "reported", "*.csv"),
    # which records are stale (bench.staleness) depends on every cell's expected fields: the harness, the
    # scenarios' declarations and the methods' defaults
    (ROOT, "*.py"),
    (ROOT / "scenarios", "*.py"),
    (ROOT.parent / "attacks", "*.py"),
    (ROOT.parent / "defenses", "*.py"),
)
LIBRARIES = ("pandas", "numpy", "matplotlib", "scipy")


def manifest_path(out: Path) -> Path:
    return Path(out) / "cache" / "leaderboards.json"


def _stat_rows(root: Path, pattern: str) -> list[list]:
    """(path relative to ``root``, size, mtime_ns, ctime_ns, inode) of the files matching ``pattern``, sorted."""
    rows = []
    for p in sorted(root.glob(pattern)):
        try:
            st = p.stat()
        except OSError:  # vanished meanwhile: it is simply not an input
            continue
        if p.is_file():
            rows.append([p.relative_to(root).as_posix(), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return rows


def code_digest() -> str:
    h = hashlib.sha256()
    for i, (folder, pattern) in enumerate(CODE_GLOBS):
        for p in sorted(folder.glob(pattern)):
            h.update(f"{i}:{p.relative_to(folder).as_posix()}\0".encode() + p.read_bytes() + b"\0")
    for name in LIBRARIES:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = None
        h.update(f"{name}={version}\0".encode())
    return h.hexdigest()


def inputs_digest(out: Path, dest: Path) -> str:
    """One digest of everything a regeneration of ``dest`` from ``out`` reads, and of its options."""
    out = Path(out)
    blob = {
        "format": FORMAT,
        "records": _stat_rows(out / "records", "*/*.json"),
        "grids": _stat_rows(out / "artifacts", "*/grid.png"),
        "code": code_digest(),
        "options": {"dest": os.path.relpath(dest, out)},
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _output_rows(dest: Path, paths: list[Path]) -> list[list]:
    rows = []
    for p in sorted(paths):
        st = p.stat()
        rows.append([p.relative_to(dest).as_posix(), st.st_size, st.st_mtime_ns])
    return rows


def up_to_date(out: Path, dest: Path | None = None) -> list[str] | None:
    """The notices of the last regeneration when ``dest`` is current for the inputs in ``out``, else None."""
    out = Path(out)
    dest = Path(dest) if dest else out / "leaderboards"
    try:
        m = json.loads(manifest_path(out).read_bytes())
        if m["format"] != FORMAT or m["inputs"] != inputs_digest(out, dest):
            return None
        if _output_rows(dest, [dest / r[0] for r in m["outputs"]]) != m["outputs"]:
            return None
        notices = m["notices"]
        if not (isinstance(notices, list) and all(isinstance(n, str) for n in notices)):
            return None
        return notices
    except (OSError, ValueError, KeyError, TypeError, IndexError):  # missing, damaged or foreign: regenerate
        return None


def regenerate(out: Path, dest: Path | None = None) -> list[Path]:
    """Rewrite the leaderboards (``write_leaderboards``) and record the manifest of what they were built from."""
    from .leaderboards import write_leaderboards

    out = Path(out)
    dest = Path(dest) if dest else out / "leaderboards"
    manifest_path(out).unlink(missing_ok=True)  # a failure below leaves no manifest claiming the old files
    before = inputs_digest(out, dest)
    notices: list[str] = []
    written = write_leaderboards(out, dest, notices=notices)
    if inputs_digest(out, dest) == before:  # e.g. a record quarantined while loading: next time regenerates
        doc = {"format": FORMAT, "inputs": before, "outputs": _output_rows(dest, written), "notices": notices}
        atomic_write_bytes(manifest_path(out), json.dumps(doc, indent=1, sort_keys=True).encode())
    return written


def print_notices(notices: list[str]) -> None:
    for n in notices:
        print(n, file=sys.stderr)  # noqa: T201 -- the same notices a regeneration prints
