"""One-off preparations (bench/preparations.py): the plan counts the uncached ones, and each declared entry is the
very cache entry its loader writes."""

from __future__ import annotations

import pytest
import torch

from bench import cachefile, preparations
from bench.costs import CostModel
from bench.preparations import Preparation
from bench.registry import ATTACKS, DEFENSES, SCENARIOS, expand
from bench.runner import plan
from bench.runplan import make_plan
from bench.specs import declared
from bench.store import Store


def _smoke_vit_cells():
    tasks = [t for t in declared(SCENARIOS.get("image-cls"), "smoke") if t.id == "image-cls/vit"]
    return plan(tasks, expand(DEFENSES, "fedavg", full_grid=False), expand(ATTACKS, "loss_mia"), [0])


def _declare(monkeypatch, *preps: Preparation) -> None:
    monkeypatch.setattr(preparations, "declared", lambda scenario, preset: [p for p in preps if scenario in p.what])


def test_an_uncached_preparation_is_named_and_added_whole_to_the_wall_estimate(tmp_path, monkeypatch):
    prep = Preparation("image-cls base", ("image-cls/vit",), tmp_path / "prep" / "base", 600.0)
    _declare(monkeypatch, prep)
    cells = _smoke_vit_cells()

    pl = make_plan(cells, Store(tmp_path / "out"), CostModel(), jobs=2)

    assert pl.preparations == [prep]
    assert pl.est_wall_s == pytest.approx(pl.est_total_s / 2 + 600.0)
    assert "one-off preparations" in pl.render() and "image-cls base ~10 min 00 s" in pl.render()
    assert "of one-off preparations" in pl.render()


def test_a_cached_or_unneeded_preparation_is_left_out(tmp_path, monkeypatch):
    cached = Preparation("image-cls base", ("image-cls/vit",), tmp_path / "a" / "base", 600.0)
    other = Preparation("image-cls other base", ("image-cls/resnet34",), tmp_path / "b" / "base", 60.0)
    cached.stem.parent.mkdir()
    cachefile.save(cached.stem, {"w": torch.zeros(2)}, {"log": {}})
    _declare(monkeypatch, cached, other)

    pl = make_plan(_smoke_vit_cells(), Store(tmp_path / "out"), CostModel())

    assert pl.preparations == [] and pl.prep_s == 0.0
    assert "one-off" not in pl.render()


class _Found(Exception):
    pass


def _lock_finder(monkeypatch):
    """bench.cachefile.file_lock, which both loaders take in their entry's folder before anything else: raises with
    the folder, so nothing is built (the loader has created the empty folder by then)."""
    from bench import cachefile

    def found(path):
        raise _Found(path.parent)

    monkeypatch.setattr(cachefile, "file_lock", found)


def test_the_ldm_base_declared_is_the_entry_its_loader_uses(monkeypatch):
    from bench.scenarios import ldm_t2i

    (prep,) = ldm_t2i.preparations("default")
    _lock_finder(monkeypatch)

    with pytest.raises(_Found) as got:
        ldm_t2i._base_factory(ldm_t2i.SPECS["default"])()

    assert got.value.args[0] == prep.stem.parent and prep.tasks == ("ldm-t2i",) and prep.seconds > 60


@pytest.mark.slow  # builds the default VLM task (SmolLM2, EfficientNet-Lite0, rendered data)
def test_the_vlm_projector_declared_is_the_entry_its_loader_uses(monkeypatch):
    from bench.scenarios import vlm_caption

    (prep,) = vlm_caption.preparations("default")
    task = vlm_caption.build_task("default")
    _lock_finder(monkeypatch)

    with pytest.raises(_Found) as got:
        task.api.build_model()

    assert got.value.args[0] == prep.stem.parent and prep.seconds > 60


def test_smoke_declares_no_preparation():
    assert [p for s in SCENARIOS.names() for p in preparations.declared(s, "smoke")] == []
