"""Contributed defenses: the CONTRIBUTING.md template, the worked example, the entry-point group, a
path on the command line, type-checked hyper-parameters, and the acceptance run (a defense from a
temporary folder outside the repository reaches the leaderboard; broken ones are reported)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch

from bench.conformance import defense_report
from bench.registry import DEFENSES, Registry, UsageError, build, expand

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "image-cls"  # a real smoke scenario


def template() -> str:
    """The minimal defense of CONTRIBUTING.md section 1, verbatim."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return next(b for b in blocks if b.startswith("# my_defense.py"))


BROKEN = {
    "broken_nan": """
        def client_step(self, state, ctx):
            msg = standard_message(state, ctx)
            return Message(msg.client, msg.round, {n: t * float("nan") for n, t in msg.tensors.items()},
                           msg.num_samples, kind=msg.kind)
    """,
    "broken_shape": """
        def client_step(self, state, ctx):
            msg = standard_message(state, ctx)
            n = sorted(msg.tensors)[0]
            return Message(msg.client, msg.round, {**msg.tensors, n: msg.tensors[n].flatten()[:-1]},
                           msg.num_samples, kind=msg.kind)
    """,
    "broken_raise": """
        def client_step(self, state, ctx):
            raise RuntimeError("the contributed client exploded")
    """,
}


def broken_source(body: str) -> str:
    return (
        "from dataclasses import dataclass\n"
        "from bench.fl import fedavg_aggregate, standard_message\n"
        "from bench.registry import register_defense\n"
        "from bench.types import Defense, Message\n\n\n"
        "@register_defense\n@dataclass\nclass Broken(Defense):\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "\n    def aggregate(self, global_state, msgs, ctx):\n"
        "        return fedavg_aggregate(global_state, msgs, ctx)\n"
    )


@pytest.fixture
def restore_registry():
    """Path-loaded defenses register globally: undo it so other tests see the repository's set."""
    DEFENSES.load()
    before = dict(DEFENSES._items)
    yield
    DEFENSES._items.clear()
    DEFENSES._items.update(before)


def bench(*args: str, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "BENCH_QUIET": "1", "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, str(ROOT)) if p)}
    return subprocess.run(
        [sys.executable, "-m", "bench", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=1800
    )


# ----------------------------------------------------------------------------------------------
# in-process


def test_contributing_template_passes_conformance_from_a_folder_outside_the_repo(tmp_path, restore_registry):
    path = tmp_path / "my_defense.py"
    path.write_text(template())

    cls = DEFENSES.get(str(path))
    rep = defense_report(build(cls, {}, "defense"), SCENARIO)

    assert cls.name == "my_defense"
    assert not rep.failed, rep.render()


def test_worked_example_keeps_the_largest_entries_and_conforms(restore_registry):
    cls = DEFENSES.get(str(ROOT / "examples" / "topk_sparsification.py"))
    mod = sys.modules[cls.__module__]
    t = torch.tensor([[0.1, -3.0, 0.2], [2.0, -0.05, 0.0]])

    kept = mod.topk_keep(t, 2 / 6)

    assert torch.equal(kept, torch.tensor([[0.0, -3.0, 0.0], [2.0, 0.0, 0.0]]))
    assert torch.equal(mod.topk_keep(t, 1.0), t)
    assert [c["keep"] for c in cls.grid] == [0.5, 0.2, 0.05]
    rep = defense_report(build(cls, {"keep": "0.05"}, "defense"), SCENARIO)
    assert not rep.failed, rep.render()


def test_command_line_hyper_parameters_are_type_checked(restore_registry):
    cls = DEFENSES.get(str(ROOT / "examples" / "topk_sparsification.py"))

    assert build(cls, {"keep": "0.1"}, "defense").keep == 0.1
    with pytest.raises(UsageError, match="not a valid float"):
        build(cls, {"keep": "lots"}, "defense")
    with pytest.raises(UsageError, match="Valid parameters: keep"):
        build(cls, {"k": "0.1"}, "defense")
    with pytest.raises(UsageError, match="keep must be in"):
        build(cls, {"keep": "2"}, "defense")
    with pytest.raises(UsageError, match=r"keep=nan is not a number \(NaN\); keep must be a finite number"):
        build(cls, {"keep": "nan"}, "defense")  # the generic rule: no declaration needed
    with pytest.raises(UsageError, match=r"keep=1e999 \(read as inf\) is not finite"):
        build(cls, {"keep": "1e999"}, "defense")
    with pytest.raises(UsageError, match="is not one of fedavg, fedsgd"):
        expand(DEFENSES, "flrsp:form=fedprox")
    with pytest.raises(UsageError, match="is not a boolean"):
        expand(DEFENSES, "fedrand:normalize=maybe")


def _dist_info(root: Path, module: str, source: str) -> None:
    """A minimal installed distribution exposing ``module:MyDefense`` in the bench.defenses group."""
    (root / f"{module}.py").write_text(source)
    info = root / f"{module.replace('_', '-')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[bench.defenses]\nclip_pkg = {module}:MyDefense\n")


def test_entry_point_group_registers_a_packaged_defense(tmp_path, monkeypatch):
    src = template().replace("@register_defense\n", "")  # a package need not import the decorator
    _dist_info(tmp_path, "contrib_clip_pkg", src)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("defense", None, "bench.defenses")

    cls = reg.get("clip_pkg")

    assert cls.__name__ == "MyDefense" and "clip_pkg" in reg.names()
    assert build(cls, {"clip": "0.5"}, "defense").clip == 0.5


# ----------------------------------------------------------------------------------------------
# acceptance, through the real CLI


@pytest.fixture(scope="module")
def contrib_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("outside_the_repo")
    (d / "my_defense.py").write_text(template())
    for name, body in BROKEN.items():
        (d / f"{name}.py").write_text(broken_source(body))
    return d


@pytest.mark.slow
def test_contributed_defense_reaches_the_leaderboard_and_broken_ones_fail_with_reasons(contrib_dir, tmp_path):
    out = tmp_path / "results"
    specs = ",".join(str(contrib_dir / f"{n}.py") for n in ["my_defense", *BROKEN])

    ran = bench(
        "run",
        "--scenario",
        SCENARIO,
        "--preset",
        "smoke",
        "--defense",
        specs,
        "--attack",
        "loss_mia:method=threshold",
        "--out",
        str(out),
        "--no-leaderboard",
        cwd=tmp_path,
    )
    lb = bench("leaderboard", "--out", str(out), cwd=tmp_path)

    assert ran.returncode == 0, ran.stderr
    assert lb.returncode == 0, lb.stderr
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    status = {(r["task"], r["defense"], r["view"]): (r["status"], r.get("reason") or "") for r in recs}
    tasks = sorted({r["task"] for r in recs})
    for task in tasks:
        assert status[(task, "my_defense", "global_model")][0] == "ok"
        assert status[(task, "base", "global_model")][0] == "ok"
        assert status[(task, "broken_raise", "global_model")] == (
            "failed",
            "RuntimeError: training failed: RuntimeError: the contributed client exploded",
        )
        assert "non-finite" in status[(task, "broken_nan", "client_model")][1]
        assert "shape" in status[(task, "broken_shape", "global_model")][1]
    table = pd.read_csv(out / "leaderboards" / f"{SCENARIO}.csv")
    mine = table[table.defense.str.startswith("my_defense")]
    assert len(mine) == 2 * len(tasks)  # the template's grid has two configurations
    assert mine["loss_mia/global_model:auroc"].notna().all()
    matrix = pd.read_csv(out / "leaderboards" / f"{SCENARIO}_matrix.csv")
    cell = matrix[matrix.defense == "broken_raise"]["loss_mia"].iloc[0]
    assert "failed" in cell and "exploded" in cell
    assert "my_defense" in (out / "leaderboards" / "index.html").read_text()
    first = (out / "leaderboards" / f"{SCENARIO}.csv").read_bytes()
    again = bench("leaderboard", "--out", str(out), cwd=tmp_path)
    assert again.returncode == 0 and (out / "leaderboards" / f"{SCENARIO}.csv").read_bytes() == first


@pytest.mark.slow
def test_bench_check_reports_broken_defenses_and_passes_a_packaged_one(contrib_dir, tmp_path):
    broken = ",".join(str(contrib_dir / f"{n}.py") for n in BROKEN)
    pkg = tmp_path / "site"
    pkg.mkdir()
    _dist_info(pkg, "contrib_clip_pkg", template().replace("@register_defense\n", ""))

    bad = bench("check", "--defense", broken, "--scenario", SCENARIO, cwd=tmp_path)
    good = bench("check", "--defense", "clip_pkg:clip=0.5", "--scenario", SCENARIO, cwd=tmp_path, pythonpath=str(pkg))

    assert bad.returncode == 1, bad.stdout + bad.stderr
    fails = [ln for ln in bad.stdout.splitlines() if ln.strip().startswith("FAIL")]
    assert any("finite" in ln and "NaN" in ln for ln in fails), bad.stdout
    assert any("shapes" in ln and "has shape" in ln for ln in fails), bad.stdout
    assert any("train" in ln and "exploded" in ln for ln in fails), bad.stdout
    assert good.returncode == 0, good.stdout + good.stderr
    assert "all checks passed" in good.stdout and "clip_pkg(clip=0.5)" in good.stdout


@pytest.mark.slow
def test_an_entry_point_defense_keeps_its_registered_name_in_worker_processes(tmp_path):
    # arrange: a defense installed as a package entry point (its class is named by the parent's registry)
    pkg = tmp_path / "site"
    pkg.mkdir()
    _dist_info(pkg, "contrib_clip_pkg", template().replace("@register_defense\n", ""))
    out = tmp_path / "results"

    # act: the cells run in worker processes, which import the bare class
    ran = bench(
        "run",
        "--scenario",
        SCENARIO,
        "--preset",
        "smoke",
        "--defense",
        "clip_pkg:clip=0.5",
        "--attack",
        "loss_mia:method=threshold",
        "--out",
        str(out),
        "--no-leaderboard",
        cwd=tmp_path,
        pythonpath=str(pkg),
    )

    # assert
    assert ran.returncode == 0, ran.stderr
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    mine = [r for r in recs if r["defense"] != "base"]
    assert mine and all(r["defense"] == "clip_pkg" and r["defense_label"].startswith("clip_pkg(") for r in mine)
