"""Published leaderboard snapshots that carry their records, so the tables can be regenerated and a run resumed
from them on another machine (``python -m bench leaderboard --publish DIR`` / ``--restore DIR``).

A snapshot folder holds the generated tables, plots and page of ``<out>/leaderboards``, plus
``records/<scenario>/<cell_id>.json.gz`` (each record gzipped deterministically, so an unchanged record is an
unchanged file and a version-controlled snapshot grows only by new records) and the reconstruction grids the
plots are drawn from (``artifacts/<cell_id>/grid.png``). Restoring copies the records back into an output
directory, where ``bench leaderboard`` regenerates the same tables and ``bench run`` skips the recorded cells.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tempfile
from pathlib import Path

from ..errors import UsageError
from ..store import Store, atomic_write_bytes

GZ = ".json.gz"


def _gzip(data: bytes) -> bytes:
    """``data`` gzipped with no name or time in the header: the same record always gives the same bytes."""
    return gzip.compress(data, compresslevel=9, mtime=0)


def _published_records(snapshot: Path) -> list[Path]:
    return sorted((snapshot / "records").glob(f"*/*{GZ}"))


def publish(out: Path, snapshot: Path) -> list[Path]:
    """Replace ``snapshot`` with ``out``'s current leaderboards, every valid record of ``out`` and the grids they
    name. Built beside it and swapped in, so a failure leaves the previous snapshot whole."""
    from .lbcache import regenerate

    out, snapshot = Path(out), Path(snapshot)
    regenerate(out)
    store = Store(out, readonly=True)
    records = list(store.records())
    if not records:
        raise UsageError(f"no valid records under {out / 'records'}: nothing to publish")
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{snapshot.name}.", dir=snapshot.parent))
    try:
        shutil.copytree(out / "leaderboards", tmp, dirs_exist_ok=True)
        for rec in records:
            src = store.record_path(rec["scenario"], rec["cell_id"])
            dst = tmp / "records" / rec["scenario"] / f"{rec['cell_id']}{GZ}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(_gzip(src.read_bytes()))
            grid = out / "artifacts" / rec["cell_id"] / "grid.png"
            if grid.is_file():
                (tmp / "artifacts" / rec["cell_id"]).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(grid, tmp / "artifacts" / rec["cell_id"] / "grid.png")
        old = snapshot.with_name(f".{snapshot.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if snapshot.exists():
            snapshot.rename(old)
        tmp.rename(snapshot)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(p for p in snapshot.rglob("*") if p.is_file())


def restore(snapshot: Path, out: Path) -> int:
    """Copy ``snapshot``'s records (and grids) into ``out``; the number of records written. A record already in
    ``out`` with other content is a conflict: UsageError naming it, and nothing is written."""
    snapshot, out = Path(snapshot), Path(out)
    files = _published_records(snapshot)
    if not files:
        raise UsageError(
            f"{snapshot} holds no published records ({snapshot / 'records'}/<scenario>/<cell_id>{GZ}); "
            "snapshots that carry their records are listed in leaderboards/README.md"
        )
    store = Store(out)
    todo: list[tuple[Path, bytes]] = []
    for f in files:
        try:
            data = gzip.decompress(f.read_bytes())
            json.loads(data)
        except (OSError, ValueError, EOFError) as e:
            raise UsageError(f"{f} is not a gzipped JSON record: {type(e).__name__}: {e}") from None
        dst = store.record_path(f.parent.name, f.name[: -len(GZ)])
        if dst.exists():
            if dst.read_bytes() != data:
                raise UsageError(
                    f"{dst} already holds another record of that cell; restore into an empty --out "
                    "(or remove the conflicting record) - nothing was written"
                )
            continue
        todo.append((dst, data))
    for dst, data in todo:
        atomic_write_bytes(dst, data)
    for grid in sorted((snapshot / "artifacts").glob("*/grid.png")):
        dst = out / "artifacts" / grid.parent.name / "grid.png"
        if not dst.exists():
            atomic_write_bytes(dst, grid.read_bytes())
    return len(todo)
