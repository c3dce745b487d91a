"""The preset names have one source (``bench.task.PRESETS``): every scenario's per-preset table covers
exactly those names, a bad name fails once with the valid choices, and ``models/`` never takes a preset."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from bench.errors import UsageError
from bench.registry import SCENARIOS
from bench.task import PRESETS, check_preset, preset_entry

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", SCENARIOS.names())
def test_every_scenario_table_has_one_entry_per_preset(name):
    module = importlib.import_module(SCENARIOS.get(name).__module__)
    assert tuple(module.SPECS) == PRESETS


def test_a_bad_preset_names_the_valid_choices():
    assert check_preset("smoke") == "smoke"
    with pytest.raises(UsageError, match="Did you mean 'smoke'.*Valid choices: smoke, default, paper"):
        check_preset("smok")


def test_preset_entry_reads_the_table_and_rejects_unknown_names():
    table = {"smoke": 1, "default": 2}
    assert preset_entry(table, "default") == 2
    with pytest.raises(UsageError, match="unknown preset 'tiny'"):
        preset_entry(table, "tiny")
    with pytest.raises(KeyError, match="no entry for 'paper'"):
        preset_entry(table, "paper")


@pytest.mark.parametrize("name", SCENARIOS.names())
def test_a_scenario_rejects_an_unknown_preset_before_building(name):
    with pytest.raises(UsageError, match="unknown preset 'huge'"):
        SCENARIOS.get(name)("huge")


def test_models_take_explicit_sizes_not_presets():
    """No function in models/ has a ``preset`` parameter, and no code there compares against a preset name."""
    offenders = []
    for path in sorted((ROOT / "models").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                offenders += [f"{path.name}:{node.lineno} {node.name}({a.arg})" for a in args if "preset" in a.arg]
            if isinstance(node, ast.Compare):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                offenders += [f"{path.name}:{node.lineno} compares with {c!r}" for c in consts if c in PRESETS]
    assert offenders == []
