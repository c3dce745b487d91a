"""Published leaderboard snapshots that carry their records (``leaderboards/<name>/records/``): every record is
valid under the schema, and the snapshot's tables regenerate from those records alone (nothing hand-edited)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.store import Store

ROOT = Path(__file__).resolve().parent.parent / "leaderboards"
SNAPSHOTS = sorted(p.parent for p in ROOT.glob("*/records") if p.is_dir())


def test_the_default_snapshot_carries_its_records():
    assert ROOT / "default" in SNAPSHOTS


@pytest.mark.parametrize("snap", SNAPSHOTS, ids=lambda p: p.name)
def test_published_records_are_valid_and_regenerate_the_published_tables(snap, tmp_path, capsys):
    from bench.report.lbcache import regenerate
    from bench.report.snapshot import restore

    n = restore(snap, tmp_path)
    recs = list(Store(tmp_path, readonly=True).records())
    regenerate(tmp_path)

    assert n == len(recs) > 0, capsys.readouterr().err  # every published record valid under the schema

    published = sorted(p.name for p in snap.glob("*.csv"))
    assert published
    for name in published:
        assert (tmp_path / "leaderboards" / name).read_text() == (snap / name).read_text(), name


# ----------------------------------------------------------------------------------------------
# publish / restore on tiny records


def _run_dir(tmp_path):
    from tests.test_leaderboard import rec, write

    recs = [rec(defense=d, label=d, seed=s, strength=st) for d, st in (("fedavg", 1.5), ("flrsp", 0.3)) for s in (0, 1)]
    write(tmp_path / "run", recs + [rec(defense="base", strength=0.0)])
    return tmp_path / "run"


def test_a_published_snapshot_restores_to_the_same_records_and_tables(tmp_path):
    from bench.report.snapshot import publish, restore

    run = _run_dir(tmp_path)
    publish(run, tmp_path / "snap")

    n = restore(tmp_path / "snap", tmp_path / "again")
    publish(tmp_path / "again", tmp_path / "snap2")

    src = sorted(p.relative_to(run / "records") for p in (run / "records").rglob("*.json"))
    assert n == len(src) == 5
    for rel in src:
        assert (tmp_path / "again" / "records" / rel).read_bytes() == (run / "records" / rel).read_bytes()
    for p in sorted((tmp_path / "snap").rglob("*")):  # records, tables and plots byte-identical
        if p.is_file() and p.suffix in (".gz", ".csv", ".md"):
            assert (tmp_path / "snap2" / p.relative_to(tmp_path / "snap")).read_bytes() == p.read_bytes(), p


def test_restoring_over_a_different_record_of_a_cell_raises_and_writes_nothing(tmp_path):
    import gzip

    from bench.errors import UsageError
    from bench.report.snapshot import publish, restore

    publish(_run_dir(tmp_path), tmp_path / "snap")
    first, *rest = sorted((tmp_path / "snap" / "records").rglob("*.json.gz"))
    clash = tmp_path / "out" / "records" / first.parent.name / first.name.replace(".gz", "")
    clash.parent.mkdir(parents=True)
    clash.write_bytes(gzip.decompress(first.read_bytes()).replace(b'"seed": 0', b'"seed": 7'))

    with pytest.raises(UsageError, match="already holds another record"):
        restore(tmp_path / "snap", tmp_path / "out")

    assert sorted((tmp_path / "out" / "records").rglob("*.json")) == [clash]


def test_publishing_replaces_the_snapshot_whole(tmp_path):
    from bench.report.snapshot import publish

    (tmp_path / "snap" / "records" / "gone").mkdir(parents=True)
    (tmp_path / "snap" / "records" / "gone" / "stale.json.gz").write_bytes(b"x")

    publish(_run_dir(tmp_path), tmp_path / "snap")

    assert not (tmp_path / "snap" / "records" / "gone").exists()
    assert len(list((tmp_path / "snap" / "records").rglob("*.json.gz"))) == 5
    assert not list(tmp_path.glob(".snap*"))  # no temporary folder left beside it
