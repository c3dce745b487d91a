"""Start-up: ``bench list`` plans over the scenarios' static declarations (bench.specs), building no task, and so
does a fully cached ``bench run`` (every cell recorded already).

The declarations must equal what building gives (id, TaskSpec fields, FL settings, configuration hash: the
cell ids and training keys) and plan to the same cells, so the two cannot drift.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

from bench import cli
from bench.device import with_precision
from bench.registry import ATTACKS, DEFENSES, SCENARIOS, expand
from bench.runner import plan
from bench.specs import configured, declared
from bench.store import Store
from tests.conftest import smoke_tasks

# Imported only by the functions that need them, never to list names or plan (`python -X importtime -m bench list`)
HEAVY = (
    "transformers",
    "diffusers",
    "timm",
    "opacus",
    "sklearn",
    "pandas",
    "matplotlib",
    "scipy",
    "skimage",
    "peft",
    "sympy",
)


# Never imported by a fully cached re-run, leaderboards included (they build no model)
MODEL_LIBRARIES = ("timm", "torchvision", "transformers", "diffusers", "peft")


def _planned(tasks: list) -> list[tuple]:
    cells = plan(tasks, expand(DEFENSES, "all", full_grid=False), expand(ATTACKS, "all"), [0])
    return [(c.task.id, c.defense_label, c.attack.name, c.view, c.na, c.error) for c in cells]


@functools.cache
def _built(scenario: str, preset: str) -> tuple:
    return tuple(smoke_tasks(scenario) if preset == "smoke" else SCENARIOS.get(scenario)(preset))


@pytest.mark.parametrize(
    "preset",
    ["smoke", pytest.param("default", marks=pytest.mark.slow)],  # default builds load SmolLM2 / EfficientNet
)
@pytest.mark.parametrize("scenario", SCENARIOS.names())
def test_declarations_equal_the_built_tasks(scenario, preset):
    built = _built(scenario, preset)  # skipped when the scenario's Debian asset is missing (smoke)

    decl = declared(SCENARIOS.get(scenario), preset)

    assert decl is not None, f"{scenario} declares no {preset} tasks (bench.specs)"
    assert all(type(d.api).__name__ == "TaskSpec" for d in decl)  # plain data, no functions
    assert [(d.id, d.api, d.fl) for d in decl] == [(t.id, t.api.spec(), t.fl) for t in built]
    assert configured(decl), f"{scenario} declares no configuration at {preset}"
    assert [(d.scenario, d.preset, dict(d.config)) for d in decl] == [
        (t.scenario, t.preset, dict(t.config)) for t in built
    ]
    assert [d.config_hash() for d in decl] == [t.config_hash() for t in built]  # the cell ids' and training keys'
    assert [with_precision(d, "bf16").config_hash() for d in decl] == [
        with_precision(t, "bf16").config_hash() for t in built
    ]
    assert _planned(decl) == _planned(built)


def test_list_builds_no_task(monkeypatch, capsys):
    def no_build(*args, **kwargs):
        raise AssertionError("bench list built a task")

    monkeypatch.setattr(cli, "build_tasks", no_build)
    for name in SCENARIOS.names():
        if declared(SCENARIOS.get(name), "smoke") is None:
            pytest.skip(f"{name} declares no smoke tasks here (its asset is missing)")

    rc = cli.main(["list", "--preset", "smoke"])

    out = capsys.readouterr().out
    assert rc == 0
    assert "cells at preset smoke (one seed):" in out and "image-cls/vit" in out


def test_a_scenario_without_declarations_is_built(monkeypatch):
    built = []

    def builder(preset):  # this test module defines no ``specs``
        built.append(preset)
        return []

    assert declared(builder, "smoke") is None
    monkeypatch.setattr(cli, "build_tasks", lambda names, preset: built.append((tuple(names), preset)) or [])

    cli.listed_tasks(["llm-text"], "paper")  # llm-text declares nothing on paper: built instead

    assert built == [(("llm-text",), "paper")]


def test_listing_and_planning_import_no_heavy_library():
    code = (
        "import sys, json\n"
        "import bench.cli, bench.runner, bench.specs\n"
        "from bench.registry import ATTACKS, DEFENSES, SCENARIOS\n"
        "DEFENSES.load(); ATTACKS.load(); SCENARIOS.load()\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout

    assert json.loads(out.strip().splitlines()[-1]) == []


def _record_every_cell(out, tasks: list, defense: str, attack: str) -> int:
    """Write a finished (n/a) record for every cell the *built* tasks plan, as a finished run leaves them."""
    store = Store(out)
    cells = plan(tasks, expand(DEFENSES, defense, full_grid=False), expand(ATTACKS, attack), [0])
    for c in cells:
        store.write(
            {
                **c.skeleton(),
                "status": "n/a",
                "reason": "recorded by the test",
                "cost": {},
                "utility": {},
                "privacy": {},
            }
        )
    return len(cells)


def _cached_run(out, scenario: str, *extra: str) -> tuple[dict, list[str]]:
    """A fully cached ``bench run`` in a fresh interpreter where building a task exits: its return code, the
    top-level modules it imported, and its stdout lines."""
    code = (
        "import json, sys\n"
        "import bench.cli\n"
        "def no_build(*args, **kwargs):\n"
        "    raise SystemExit('the cached re-run built a task')\n"
        "bench.cli.build_tasks = no_build\n"
        f"rc = bench.cli.main(['run', '--preset', 'smoke', '--scenario', {scenario!r}, '--defense', 'fedavg', "
        f"'--attack', 'loss_mia', '--out', {str(out)!r}, *{list(extra)!r}])\n"
        "print(json.dumps({'rc': rc, 'modules': sorted({m.split('.')[0] for m in sys.modules})}))"
    )
    env = {**os.environ, "BENCH_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    lines = res.stdout.strip().splitlines()
    return json.loads(lines[-1]), lines[:-1]


@pytest.mark.parametrize("scenario", SCENARIOS.names())
def test_a_cached_rerun_builds_no_task_and_imports_no_model_library(tmp_path, scenario):
    n = _record_every_cell(tmp_path, list(_built(scenario, "smoke")), "fedavg", "loss_mia")

    got, stdout = _cached_run(tmp_path, scenario)

    assert got["rc"] == 0
    assert f"{n} already done" in "\n".join(stdout) and "cells: 0 ok, 0 n/a, 0 failed" in "\n".join(stdout)
    assert sorted(set(got["modules"]) & set(MODEL_LIBRARIES)) == []


def test_a_missing_cell_builds_the_tasks(tmp_path):
    tasks = list(_built("image-cls", "smoke"))
    _record_every_cell(tmp_path, tasks, "fedavg", "loss_mia")
    defenses, attacks = expand(DEFENSES, "fedavg", full_grid=False), expand(ATTACKS, "loss_mia")
    args = (["image-cls"], "smoke", "fp32", defenses, attacks, [0], tmp_path)
    assert [d.id for d in cli.recorded_tasks(*args) or []] == [t.id for t in tasks]

    (next((tmp_path / "records").rglob("*.json"))).unlink()  # one cell not recorded

    assert cli.recorded_tasks(*args) is None
    assert cli.recorded_tasks(["image-cls"], "smoke", "fp32", defenses, attacks, [0, 1], tmp_path) is None


def test_a_task_filter_needs_only_its_tasks_recorded(tmp_path):
    tasks = [t for t in _built("image-cls", "smoke") if t.id == "image-cls/vit"]
    n = _record_every_cell(tmp_path, tasks, "fedavg", "loss_mia")  # the resnet34 task has none

    got, stdout = _cached_run(tmp_path, "image-cls", "--task", "image-cls/vit")

    assert got["rc"] == 0
    assert f"{n} already done" in "\n".join(stdout) and "cells: 0 ok, 0 n/a, 0 failed" in "\n".join(stdout)


def test_a_cached_rerun_starts_no_executor(tmp_path):
    _record_every_cell(tmp_path, list(_built("image-cls", "smoke")), "fedavg", "loss_mia")

    got, stdout = _cached_run(tmp_path, "image-cls", "--executor", "ray", "--jobs", "2")

    assert got["rc"] == 0 and "cells: 0 ok, 0 n/a, 0 failed" in "\n".join(stdout)
    assert "ray" not in got["modules"]  # no local Ray started for nothing (seconds), no cluster contacted
    assert "estimated time: 0 s with 2 job(s)" in "\n".join(stdout)  # --jobs, as --dry-run shows it


def test_a_real_runs_cached_rerun_imports_no_heavy_library_and_leaves_every_file_alone(tmp_path):
    """A real tiny run (records, training cache, leaderboards), then its re-run: nothing to do, so nothing is
    imported beyond planning and nothing under --out is rewritten."""
    env = {**os.environ, "BENCH_THREADS": "1"}
    args = ["--preset", "smoke", "--scenario", "image-cls", "--defense", "fedavg", "--attack", "loss_mia"]
    first = subprocess.run(
        [sys.executable, "-m", "bench", "run", *args, "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert " 0 already done" in first.stdout and (tmp_path / "cache").is_dir()
    before = _tree(tmp_path)

    got, stdout = _cached_run(tmp_path, "image-cls")

    n = len(list((tmp_path / "records").rglob("*.json")))
    assert got["rc"] == 0 and f"cells: 0 ok, 0 n/a, 0 failed, {n} already done" in "\n".join(stdout)
    assert f"leaderboards up to date: {tmp_path / 'leaderboards'}" in stdout
    assert sorted(set(got["modules"]) & {*HEAVY, *MODEL_LIBRARIES}) == []
    assert _tree(tmp_path) == before  # records, training cache and leaderboards: not one file written


# ----------------------------------------------------------------------------------------------
# leaderboards regenerated only when something they read changed (bench/report/lbcache.py)


def _tree(root) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: (mtime_ns, inode, content), by relative path."""
    return {
        p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_cached_rerun_with_unchanged_records_leaves_the_leaderboards_alone(tmp_path):
    _record_every_cell(tmp_path, list(_built("image-cls", "smoke")), "fedavg", "loss_mia")
    _cached_run(tmp_path, "image-cls")  # the first run after the cells were recorded writes the leaderboards
    before = _tree(tmp_path / "leaderboards")

    got, stdout = _cached_run(tmp_path, "image-cls")

    assert got["rc"] == 0 and before
    assert _tree(tmp_path / "leaderboards") == before  # nothing rewritten
    assert f"leaderboards up to date: {tmp_path / 'leaderboards'}" in stdout
    assert not any(line.startswith("wrote ") for line in stdout)
    assert sorted(set(got["modules"]) & {"pandas", "matplotlib"}) == []


@pytest.fixture
def boards(tmp_path):
    from bench.report import lbcache

    _record_every_cell(tmp_path, list(_built("image-cls", "smoke")), "fedavg", "loss_mia")
    written = lbcache.regenerate(tmp_path)
    assert written and lbcache.up_to_date(tmp_path) == []
    return tmp_path, written


def test_a_changed_record_makes_the_leaderboards_stale(boards):
    from bench.report import lbcache

    out, _ = boards
    path = next((out / "records").rglob("*.json"))
    rec = json.loads(path.read_bytes())

    Store(out).write({**rec, "reason": "recorded again by the test"})

    assert lbcache.up_to_date(out) is None


def test_a_deleted_or_edited_output_makes_the_leaderboards_stale(boards):
    from bench.report import lbcache

    out, written = boards
    written[0].unlink()
    assert lbcache.up_to_date(out) is None

    lbcache.regenerate(out)
    assert lbcache.up_to_date(out) == []
    written[-1].write_bytes(written[-1].read_bytes() + b"\n")
    assert lbcache.up_to_date(out) is None


def test_changed_report_code_makes_the_leaderboards_stale(boards, tmp_path_factory, monkeypatch):
    from bench.report import lbcache

    out, _ = boards
    code = tmp_path_factory.mktemp("code")
    (code / "extra.py").write_text("X = 1\n")
    monkeypatch.setattr(lbcache, "CODE_GLOBS", (*lbcache.CODE_GLOBS, (code, "*.py")))
    lbcache.regenerate(out)
    assert lbcache.up_to_date(out) == []

    (code / "extra.py").write_text("X = 2\n")

    assert lbcache.up_to_date(out) is None


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1, "inputs": 3}', b"[]"])
def test_a_damaged_or_missing_manifest_regenerates(boards, damage):
    from bench.report import lbcache

    out, _ = boards
    lbcache.manifest_path(out).write_bytes(damage)
    assert lbcache.up_to_date(out) is None
    lbcache.manifest_path(out).unlink()
    assert lbcache.up_to_date(out) is None


def test_the_leaderboard_command_always_rewrites(boards, capsys):
    from bench.report import lbcache

    out, written = boards
    before = _tree(out / "leaderboards")

    rc = cli.main(["leaderboard", "--out", str(out)])

    assert rc == 0 and f"wrote {written[0]}" in capsys.readouterr().out
    after = _tree(out / "leaderboards")
    assert after.keys() == before.keys()
    assert all(after[k][2] == before[k][2] for k in after)  # the same bytes ...
    assert any(after[k][:2] != before[k][:2] for k in after)  # ... written again
    assert lbcache.up_to_date(out) == []


def test_a_failed_regeneration_leaves_no_manifest(boards, monkeypatch):
    from bench.report import lbcache, leaderboards

    out, _ = boards

    def broken(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(leaderboards, "write_leaderboards", broken)
    with pytest.raises(RuntimeError):
        lbcache.regenerate(out)

    assert not lbcache.manifest_path(out).exists() and lbcache.up_to_date(out) is None


# ----------------------------------------------------------------------------------------------
# a dry run writes nothing


def _listing(root) -> dict[str, str]:
    """Every path under ``root`` (folders too) with the hash of its content."""
    import hashlib

    return {
        p.relative_to(root).as_posix(): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
        for p in sorted(root.rglob("*"))
    }


def test_a_dry_run_over_a_damaged_record_leaves_the_folder_byte_identical(tmp_path, monkeypatch, capsys):
    from bench.training import cache_stem

    tasks = list(_built("image-cls", "smoke"))
    _record_every_cell(tmp_path, tasks, "fedavg", "loss_mia")
    cells = plan(tasks, expand(DEFENSES, "fedavg"), expand(ATTACKS, "loss_mia"), [0])
    cell = next(c for c in cells if c.na is None and c.defense is not None)  # a cell with a training run
    damaged = Store(tmp_path).record_path(cell.task.scenario, cell.id)
    damaged.write_bytes(b'{"schema_version": 1, "cell_id": ')  # a torn write
    stem = cache_stem(cell.task, cell.defense, cell.seed, tmp_path / "cache")
    head = stem.parent / f"{stem.name}.json"  # the cache entry of its training run, damaged too
    head.parent.mkdir(parents=True)
    head.write_text('{"tensors": "nothing"}')
    before = _listing(tmp_path)
    monkeypatch.setattr(cli, "build_tasks", lambda names, preset, precision="fp32": tasks)

    rc = cli.main(
        ["run", "--preset", "smoke", "--scenario", "image-cls", "--defense", "fedavg", "--attack", "loss_mia"]
        + ["--dry-run", "--out", str(tmp_path)]
    )

    captured = capsys.readouterr()
    assert rc == 0 and "1 to run" in captured.out
    assert f"skipped invalid record {damaged}" in captured.err
    assert f"damaged cache entry {head} (left in place)" in captured.err
    assert _listing(tmp_path) == before
    assert not (tmp_path / "quarantine").exists()
