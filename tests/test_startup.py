"""Start-up: ``bench list`` plans over the scenarios' static declarations (bench.specs), building no task.

The declarations must equal what building gives (id, TaskSpec fields, FL settings) and plan to the same
cells, so the two cannot drift.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import cli
from bench.registry import ATTACKS, DEFENSES, SCENARIOS, expand
from bench.runner import plan
from bench.specs import declared
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


def _planned(tasks: list) -> list[tuple]:
    cells = plan(tasks, expand(DEFENSES, "all", full_grid=False), expand(ATTACKS, "all"), [0])
    return [(c.task.id, c.defense_label, c.attack.name, c.view, c.na, c.error) for c in cells]


@pytest.mark.parametrize("scenario", SCENARIOS.names())
def test_smoke_declarations_equal_the_built_tasks(scenario):
    built = smoke_tasks(scenario)  # skipped when the scenario's Debian asset is missing

    decl = declared(SCENARIOS.get(scenario), "smoke")

    assert decl is not None, f"{scenario} declares no smoke tasks (bench.specs)"
    assert all(type(d.api).__name__ == "TaskSpec" for d in decl)  # plain data, no functions
    assert [(d.id, d.api, d.fl) for d in decl] == [(t.id, t.api.spec(), t.fl) for t in built]
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
