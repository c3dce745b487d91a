"""Result records against their schema, quarantine of invalid files, and the safetensors + JSON cache."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from bench import cachefile
from bench.schema import SCHEMA_REVISION, validate
from bench.store import RecordInvalid, Store


def record(**over) -> dict:
    """A valid ok membership record (schema 1) with ``over`` applied."""
    rec = {
        "schema_version": 1,
        "cell_id": "0123456789abcdef",
        "scenario": "toy",
        "task": "toy/mlp",
        "preset": "smoke",
        "seed": 0,
        "defense": "fedavg",
        "defense_params": {},
        "defense_label": "fedavg",
        "attack": "toy_loss",
        "attack_params": {"alpha": "inf"},
        "attack_label": "toy_loss",
        "attack_kind": "membership",
        "view": "global_model",
        "status": "ok",
        "reason": None,
        "metrics": {"auroc": {"value": 0.75, "ci_low": 0.6, "ci_high": 0.9}},
        "per_candidate": {"score": [0.1, 0.9], "member": [0, 1], "id": ["n:0", "m:3"]},
        "utility": {"accuracy": 0.5, "perplexity": "inf"},
        "privacy": {"epsilon": 8.0, "epsilon_composed": "inf", "delta": 1e-5, "sample_rate": 1.0, "note": ""},
        "cost": {"bytes_up_per_round": 10.0, "rounds": 2},
        "artifacts": {},
        "provenance": {"code_version": "abc", "config_hash": "h", "started_at": "2026-11-23T12:00:00Z"},
    }
    rec.update(over)
    return rec


def test_a_valid_record_passes_and_round_trips(tmp_path):
    store = Store(tmp_path)

    path = store.write(record())

    assert validate(record()) is None
    assert path == tmp_path / "records" / "toy" / "0123456789abcdef.json"
    assert store.finished("toy", "0123456789abcdef")
    assert [r["metrics"]["auroc"]["value"] for r in store.records()] == [0.75]


@pytest.mark.parametrize(
    "change, fragment",
    [
        ({"metrics": {"auroc": {"value": "garbage"}}}, "metrics.auroc.value"),
        ({"metrics": {"auroc": {"value": float("nan")}}}, "metrics.auroc.value"),
        ({"metrics": {"auroc": {"value": True}}}, "metrics.auroc.value"),
        ({"metrics": {"auroc": {"value": 0.5, "ci_low": 0.9, "ci_high": 0.1}}}, "ci_low"),
        ({"status": "done"}, "status"),
        ({"status": "failed", "reason": ""}, "needs a reason"),
        ({"failure": "diverged"}, "only a failed one"),
        ({"status": "failed", "reason": "x", "failure": "nan"}, "failure"),
        ({"metrics": {}}, "needs metrics"),
        ({"per_candidate": None}, "per_candidate"),
        ({"per_candidate": {"score": [0.1, 0.2], "member": [1]}}, "lengths"),
        ({"per_candidate": {"score": [0.1], "member": [2]}}, "per_candidate.member"),
        ({"privacy": {"epsilon": -1.0}}, "privacy.epsilon"),
        ({"privacy": {"epsilon": "nan"}}, "privacy.epsilon"),
        ({"seed": "0"}, "seed"),
        ({"cell_id": "../../etc/x"}, "cell_id"),
        ({"view": "the_server"}, "view"),
        ({"artifacts": {"grid": "/abs/grid.png"}}, "relative"),
        ({"artifacts": {"grid": "../grid.png"}}, "relative"),
        ({"schema_version": 2}, "schema_version 2"),
    ],
)
def test_invalid_records_are_named_and_never_written(tmp_path, change, fragment):
    bad = record(**change)

    with pytest.raises(RecordInvalid, match="fails the schema") as err:
        Store(tmp_path).write(bad)

    assert fragment in str(err.value)
    assert not list(tmp_path.rglob("*.json"))


def test_artifact_paths_are_stored_relative_to_the_output_dir(tmp_path):
    store = Store(tmp_path)
    grid = store.artifact_dir("0123456789abcdef") / "grid.png"

    store.write(record(artifacts={"grid": str(grid.resolve())}))

    rec = next(store.records())
    assert rec["artifacts"]["grid"] == "artifacts/0123456789abcdef/grid.png"
    assert store.resolve(rec["artifacts"]["grid"]) == tmp_path / "artifacts" / "0123456789abcdef" / "grid.png"


def test_absolute_artifact_paths_of_earlier_records_are_read_relative_not_quarantined(tmp_path):
    store = Store(tmp_path)
    path = store.write(record())
    old = json.loads(path.read_text())
    old["artifacts"] = {"grid": "/elsewhere/results/artifacts/0123456789abcdef/grid.png"}  # a folder since moved
    path.write_text(json.dumps(old))

    rec = next(store.records())

    assert rec["artifacts"]["grid"] == "artifacts/0123456789abcdef/grid.png"
    assert not (tmp_path / "quarantine").exists()


DAMAGE = {
    "random bytes": os.urandom(256) + b"\xff\xfe",
    "empty list": b"[]",
    "status only": b'{"status": "ok"}',
    "garbage metric": json.dumps(record(metrics={"auroc": {"value": "garbage"}})).encode(),
    "wrong schema": json.dumps(record(schema_version=0)).encode(),
    "NaN literal": json.dumps(record(metrics={"auroc": {"value": float("nan")}})).encode(),
    "another cell's record": json.dumps(record(cell_id="fedcba9876543210")).encode(),
    "truncated": json.dumps(record()).encode()[:100],
    "deep nesting": b"[" * 100_000,
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_invalid_record_files_are_quarantined_with_the_reason(tmp_path, capsys, name):
    store = Store(tmp_path)
    store.write(record(cell_id="1111111111111111"))  # a good neighbour stays
    path = store.record_path("toy", "0123456789abcdef")
    path.write_bytes(DAMAGE[name])

    finished = store.finished("toy", "0123456789abcdef")

    assert not finished and not path.exists()
    moved = tmp_path / "quarantine" / "toy" / path.name
    assert moved.read_bytes() == DAMAGE[name]  # set aside as it was, never deleted
    assert "invalid record" in (tmp_path / "quarantine" / "toy" / f"{path.name}.reason.txt").read_text()
    assert f"quarantined {path}" in capsys.readouterr().err
    assert [r["cell_id"] for r in store.records()] == ["1111111111111111"]


@pytest.mark.parametrize(
    "over",
    [{"schema_version": 2}, {"schema_revision": 99, "per_candidate": {"future_field_only": [1.0]}, "metrics": {}}],
    ids=["newer schema version", "newer revision, unreadable here"],
)
def test_a_record_from_a_newer_version_of_the_suite_is_skipped_and_left_in_place(tmp_path, capsys, over):
    store = Store(tmp_path)
    path = store.record_path("toy", "0123456789abcdef")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record(**over)))

    finished = store.finished("toy", "0123456789abcdef")

    assert not finished and path.exists()  # not quarantined: an older checkout must not move a newer one's records
    assert not (tmp_path / "quarantine").exists()
    assert "newer version of the suite" in capsys.readouterr().err


def test_written_records_carry_the_schema_revision(tmp_path):
    path = Store(tmp_path).write(record())

    assert json.loads(path.read_text())["schema_revision"] == SCHEMA_REVISION


def test_a_folder_or_link_where_a_record_belongs_is_quarantined_and_the_cell_redone(tmp_path, capsys):
    store = Store(tmp_path)
    target = tmp_path / "elsewhere.txt"
    target.write_text("not a record")
    folder, link, dangling = (store.record_path("toy", c * 16) for c in "abc")
    folder.mkdir(parents=True)
    (folder / "inside").write_text("kept")
    link.symlink_to(target)
    dangling.symlink_to(tmp_path / "gone.json")

    done = [store.finished("toy", c * 16) for c in "abc"]
    store.write(record(cell_id="a" * 16))  # the redone cells' records land where the folder and link were
    store.write(record(cell_id="b" * 16))
    store.write(record(cell_id="c" * 16))

    q = tmp_path / "quarantine" / "toy"
    assert done == [False, False, False]
    assert (q / folder.name / "inside").read_text() == "kept" and (q / link.name).is_symlink()
    assert target.read_text() == "not a record"  # the link moved, its target untouched
    assert sorted(r["cell_id"] for r in store.records()) == ["a" * 16, "b" * 16, "c" * 16]
    assert f"quarantined {folder}" in capsys.readouterr().err


def test_records_skips_and_reports_invalid_files_instead_of_raising(tmp_path, capsys):
    store = Store(tmp_path)
    store.write(record())
    for i, raw in enumerate([b"[]", b'{"status": "ok"}']):
        (tmp_path / "records" / "toy" / f"bad{i}.json").write_bytes(raw)

    recs = list(store.records())

    assert [r["cell_id"] for r in recs] == ["0123456789abcdef"]
    err = capsys.readouterr().err
    assert "bad0.json" in err and "bad1.json" in err
    assert sorted(p.name for p in (tmp_path / "quarantine" / "toy").glob("*.json")) == ["bad0.json", "bad1.json"]


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_readonly_store_skips_and_reports_invalid_records_and_moves_nothing(tmp_path, capsys, name):
    Store(tmp_path).write(record(cell_id="1111111111111111"))
    store = Store(tmp_path, readonly=True)
    path = store.record_path("toy", "0123456789abcdef")
    path.write_bytes(DAMAGE[name])

    finished = store.finished("toy", "0123456789abcdef")
    recs = list(store.records())

    assert not finished and path.read_bytes() == DAMAGE[name]  # left where it was, as it was
    assert [r["cell_id"] for r in recs] == ["1111111111111111"]
    assert not (tmp_path / "quarantine").exists()
    assert f"skipped invalid record {path}" in capsys.readouterr().err
    with pytest.raises(PermissionError, match="read-only"):
        store.write(record())


def test_a_second_quarantine_of_the_same_file_name_keeps_both(tmp_path):
    store = Store(tmp_path)
    path = store.record_path("toy", "0123456789abcdef")
    for raw in (b"first", b"second"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        store.finished("toy", "0123456789abcdef")

    q = tmp_path / "quarantine" / "toy"
    assert (q / path.name).read_bytes() == b"first"
    assert (q / f"{path.name}.1").read_bytes() == b"second"


# ----------------------------------------------------------------------------------------------
# cache entries: safetensors + JSON


def _entry(tmp_path):
    stem = tmp_path / "cache" / "k"
    stem.parent.mkdir(parents=True)
    tensors = {"global/b": torch.arange(3.0), "global/a": torch.ones(2, 2, dtype=torch.bfloat16)}
    cachefile.save(stem, tensors, {"order": {"global": ["b", "a"]}, "utility": {"acc": 0.25}})
    return stem, tensors


def _decode(t, meta):
    return cachefile.unflatten(t, meta["order"]), meta


def test_cache_entry_round_trips_tensors_order_and_metadata(tmp_path):
    stem, tensors = _entry(tmp_path)

    groups, meta = cachefile.load(stem, _decode, quarantine_dir=tmp_path / "q")

    assert list(groups["global"]) == ["b", "a"]
    assert groups["global"]["a"].dtype == torch.bfloat16
    assert torch.equal(groups["global"]["b"], tensors["global/b"])
    assert meta["utility"] == {"acc": 0.25}


def test_rewriting_a_cache_entry_removes_the_tensor_file_it_replaces(tmp_path):
    # arrange: a checkpoint entry saved twice with other tensors
    stem, _ = _entry(tmp_path)
    first = _tensor_file(stem)

    # act
    cachefile.save(stem, {"global/b": torch.zeros(3), "global/a": torch.ones(2, 2)}, {"order": {"global": ["b", "a"]}})

    # assert: one tensor file, the new one, and it loads
    files = sorted(p.name for p in stem.parent.glob("k-*.safetensors"))
    assert files == [_tensor_file(stem).name] and not first.exists()
    groups, _ = cachefile.load(stem, _decode, quarantine_dir=tmp_path / "q")
    assert torch.equal(groups["global"]["b"], torch.zeros(3))


def _tensor_file(stem):
    return stem.parent / json.loads((stem.parent / f"{stem.name}.json").read_text())["tensors"]


@pytest.mark.parametrize(
    "damage",
    ["truncate", "flip", "random", "json garbage", "json list", "no tensors", "path escape", "missing listed tensor"],
)
def test_damaged_cache_entries_are_quarantined_and_missed(tmp_path, capsys, damage):
    stem, _ = _entry(tmp_path)
    tfile, jfile = _tensor_file(stem), stem.parent / "k.json"
    data = tfile.read_bytes()
    if damage == "truncate":
        tfile.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        tfile.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "random":
        tfile.write_bytes(os.urandom(len(data)))
    elif damage == "json garbage":
        jfile.write_bytes(b"\x00\x01 not json")
    elif damage == "json list":
        jfile.write_text("[]")
    elif damage == "no tensors":
        tfile.unlink()
    elif damage == "path escape":
        head = json.loads(jfile.read_text())
        jfile.write_text(json.dumps({**head, "tensors": "../../etc/passwd"}))
    else:
        head = json.loads(jfile.read_text())
        jfile.write_text(json.dumps({**head, "meta": {"order": {"global": ["b", "a", "c"]}}}))

    got = cachefile.load(stem, _decode, quarantine_dir=tmp_path / "q")

    assert got is None
    assert not jfile.exists()
    assert (tmp_path / "q" / "k.json.reason.txt").exists()
    assert "quarantined" in capsys.readouterr().err


class _Payload:
    """Unpickling this writes a marker file (what a planted cache file would do with real code)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_planted_legacy_pickle_is_refused_not_run(tmp_path):
    marker, control = tmp_path / "PWNED", tmp_path / "control"
    pickle.loads(pickle.dumps(_Payload(control)))  # the payload is live: plain unpickling runs it
    assert control.exists()
    old = tmp_path / "k.pt"
    old.write_bytes(pickle.dumps({"global_state": _Payload(marker)}))

    got = cachefile.load(
        tmp_path / "k", _decode, quarantine_dir=tmp_path / "q", legacy=(old, lambda blob: ({}, {"order": {}}))
    )

    assert got is None and not marker.exists()
    assert (tmp_path / "q" / "k.pt").exists() and not old.exists()


def test_a_legacy_torch_cache_is_converted_with_weights_only(tmp_path):
    old = tmp_path / "k.pt"
    torch.save({"state": {"w": torch.ones(2)}, "log": {"steps": 3}}, old)

    def convert(blob):
        t, order = cachefile.flatten({"state": blob["state"]})
        return t, {"order": order, "log": blob["log"]}

    groups, meta = cachefile.load(tmp_path / "k", _decode, quarantine_dir=tmp_path / "q", legacy=(old, convert))

    assert torch.equal(groups["state"]["w"], torch.ones(2)) and meta["log"] == {"steps": 3}
    assert (tmp_path / "k.json").exists()  # rewritten in the new format; the next load reads that


# ----------------------------------------------------------------------------------------------
# record strings reach the leaderboards escaped


def _hold_lock(path: str, started, release) -> None:
    with cachefile.file_lock(Path(path)):
        started.set()
        release.wait(30)


def test_the_cache_lock_makes_a_second_process_wait_until_the_first_releases_it(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    lock = tmp_path / "entry" / "lock"  # its folder does not exist yet: the lock creates it
    holder = ctx.Process(target=_hold_lock, args=(str(lock), started, release))
    holder.start()
    assert started.wait(60)

    import fcntl

    with open(lock, "a+") as f:
        with pytest.raises(BlockingIOError):  # held by the other process
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        release.set()
        holder.join(60)
        with cachefile.file_lock(lock):  # released: taken at once
            pass

    assert holder.exitcode == 0


def test_every_markdown_and_html_leaderboard_escapes_record_strings(tmp_path):
    from bench.report.leaderboards import write_leaderboards
    from tests.test_leaderboard import rec, write

    evil = "<script>alert(1)</script>|x"
    write(
        tmp_path / "run",
        [
            rec(defense="fedavg"),
            rec(defense="mine", label=evil, params={"note": evil}),
            rec(
                defense="mine",
                label=evil,
                attack="mia2",
                attack_label=evil,
                status="failed",
                reason=f"<img src=x> {evil}",
            ),
            rec(defense="dp", label="dp(eps=1)", privacy={"epsilon": 1.0, "delta": 1e-5, "note": evil}),
        ],
    )

    written = write_leaderboards(tmp_path / "run", tmp_path / "lb")

    pages = [p for p in map(Path, written) if p.suffix in (".md", ".html")]
    assert any(p.suffix == ".md" for p in pages) and any(p.suffix == ".html" for p in pages), written
    for p in pages:
        text = p.read_text()
        assert "<script>alert" not in text and "<img src=x>" not in text, p
    md = (tmp_path / "lb" / "sc.md").read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;\\|x" in md  # the pipe cannot split a table cell either


def test_a_finished_record_with_other_resolved_parameters_is_stale():
    """Cell ids hold labels (defaults omitted): a changed default must make the earlier record stale."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d))
        store.write(record(attack_params={"n_population": 1000, "alphas": (0.5, 2.0)}))

        same = store.finished(
            "toy", "0123456789abcdef", expect={"attack_params": {"n_population": 1000, "alphas": (0.5, 2.0)}}
        )
        changed = store.finished(
            "toy", "0123456789abcdef", expect={"attack_params": {"n_population": None, "alphas": (0.5, 2.0)}}
        )

        assert same and not changed
        assert store.finished("toy", "0123456789abcdef")  # without expectations: any finished record
