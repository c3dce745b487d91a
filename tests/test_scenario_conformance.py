"""Scenario conformance: every registered scenario's smoke tasks keep the typed task contract
(bench.types.TaskSpec / TaskAPI), with no per-scenario test code: a new scenario is tested once registered.

Checked per task: the typed fields hold their declared types and agree with each other and with the built
model and data; collate / loss / per_sample_loss on two items; build_model; client data non-empty and
disjoint from the non-members; a config hash stable across two builds; every registered defense and attack
whose ``applies()`` accepts the task finds the fields it ``requires``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from bench import types as bt
from bench.conformance import smoke_tasks as cached_smoke_tasks
from bench.lora_params import is_lora, layer_index
from bench.loss_signals import per_sample_grad_norms, per_sample_losses
from bench.registry import ATTACKS, DEFENSES, SCENARIOS, build
from bench.signals import token_signals
from defenses.fedavg import FedAvg
from tests.assets import need
from tests.conftest import SMOKE_ASSETS
from tests.toy import toy_task

SPEC_TYPES = {
    "lora": bt.LoraSpec,
    "image": bt.ImageSpec,
    "vit": bt.ViTSpec,
    "diffusion": bt.DiffusionSpec,
    "tokens": bt.TokenSpec,
    "caption": bt.CaptionSpec,
    "diffusion_ops": bt.DiffusionOps,
}


@pytest.fixture(scope="module", params=SCENARIOS.names())
def tasks(request):
    """Every smoke task of one registered scenario (built once per process: bench.conformance caches it)."""
    if request.param in SMOKE_ASSETS:  # skipped when its Debian asset is missing (tests/assets.py)
        path, install = SMOKE_ASSETS[request.param]
        need(Path(path).is_file(), install)
    built = list(cached_smoke_tasks(request.param))
    assert built, f"scenario {request.param} built no smoke task"
    return request.param, built


def _unset(value) -> bool:
    return value is None or value is False or value == () or value == 0


def _fingerprint(item) -> str:
    """A content hash of one data item (tensors, arrays, strings, numbers, nested containers)."""
    h = hashlib.sha256()

    def feed(v):
        if isinstance(v, torch.Tensor):
            h.update(str(tuple(v.shape)).encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(v, dict):
            for k in sorted(v):
                h.update(str(k).encode())
                feed(v[k])
        elif isinstance(v, (list, tuple)):
            for x in v:
                feed(x)
        elif hasattr(v, "tobytes"):
            h.update(v.tobytes())
        else:
            h.update(repr(v).encode())

    feed(item)
    return h.hexdigest()


def check_typed_fields_hold_their_declared_types(task) -> None:
    families = typing.get_args(bt.Family)
    api = task.api
    assert isinstance(api, bt.TaskAPI), f"{task.id}: api is {type(api).__name__}, expected TaskAPI"
    assert api.family in families, f"{task.id}: family {api.family!r} is not one of {families}"
    assert api.name == task.id, f"{task.id}: api.name is {api.name!r}"
    assert isinstance(api.spec(), bt.TaskSpec) and type(api.spec()) is bt.TaskSpec
    for fname, cls in SPEC_TYPES.items():
        v = getattr(api, fname)
        assert v is None or isinstance(v, cls), f"{task.id}: {fname} is {type(v).__name__}, expected {cls.__name__}"
    assert isinstance(api.parts, tuple) and all(isinstance(p, str) and p for p in api.parts)
    assert api.num_layers is None or (isinstance(api.num_layers, int) and api.num_layers >= 1)
    assert isinstance(api.population_size, int) and api.population_size >= 0
    assert api.dp_delta is None or 0 < api.dp_delta < 1
    for fn in ("loss", "per_sample_loss", "collate", "build_model"):
        assert callable(getattr(api, fn)), f"{task.id}: api.{fn} is not callable"


def test_typed_fields_hold_their_declared_types(tasks):
    for task in tasks[1]:
        check_typed_fields_hold_their_declared_types(task)


def check_typed_fields_agree_with_each_other(task) -> None:
    api = task.api
    assert bool(api.parts) == (api.logits is not None), f"{task.id}: parts {api.parts} vs logits {api.logits}"
    assert (api.diffusion is None) == (api.diffusion_ops is None), f"{task.id}: diffusion without its ops"
    assert api.vit is None or api.image is not None, f"{task.id}: a ViT spec needs the image spec"
    assert api.caption is None or api.tokens is not None, f"{task.id}: a caption spec needs the token spec"
    if api.aux_sets:
        assert task.extras.get("aux_members") and task.extras.get("aux_nonmembers"), (
            f"{task.id}: aux_sets without extras['aux_members'] / ['aux_nonmembers']"
        )
    population = len(task.population) if getattr(task, "population", None) is not None else 0
    assert api.population_size == population, f"{task.id}: population_size {api.population_size} vs {population}"
    if api.image is not None:
        assert len(api.image.mean) == len(api.image.std) == api.image.input_shape[0]
        assert api.image.num_classes >= 2 and api.image.inversion_iterations >= 1
    if api.diffusion is not None:
        assert all(0 <= t < api.diffusion.num_timesteps for t in api.diffusion.eval_timesteps)
    if task.recon_ids is not None:  # reconstruction rows pair on these ids: one per target, unique
        n = len(task.recon_targets or [])
        assert len(task.recon_ids) == len(set(task.recon_ids)) == n, f"{task.id}: recon_ids do not name {n} targets"


def test_typed_fields_agree_with_each_other(tasks):
    for task in tasks[1]:
        check_typed_fields_agree_with_each_other(task)


def check_model_builds_and_matches_the_declared_fields(task) -> None:
    api = task.api
    model = api.build_model()
    assert isinstance(model, nn.Module), f"{task.id}: build_model returned {type(model).__name__}"
    params = dict(model.named_parameters())
    trainable = task.shared_names(model)
    assert trainable, f"{task.id}: the model has no trainable parameter"
    if api.lora is not None:
        lora = [n for n in trainable if is_lora(n)]
        assert lora, f"{task.id}: lora is declared but no trainable parameter is a LoRA A/B"
        if api.num_layers is not None:
            idx = [layer_index(n) for n in lora if layer_index(n) is not None]
            assert all(0 <= i < api.num_layers for i in idx), f"{task.id}: LoRA layer index >= num_layers"
    if api.vit is not None:
        assert api.vit.pos_embed_param in params and api.vit.patch_embed_param in params


def test_model_builds_and_matches_the_declared_fields(tasks):
    for task in tasks[1]:
        check_model_builds_and_matches_the_declared_fields(task)


def check_collate_loss_and_per_sample_loss_on_two_items(task) -> None:
    api = task.api
    items = [task.client_data[0][i] for i in range(2)]
    batch = api.collate(items)
    model = api.build_model()
    torch.manual_seed(0)
    loss = api.loss(model, batch)
    assert loss.ndim == 0 and torch.isfinite(loss), f"{task.id}: loss {loss}"
    torch.manual_seed(0)
    per = api.per_sample_loss(model, batch)
    assert tuple(per.shape) == (2,) and torch.isfinite(per).all(), f"{task.id}: per_sample_loss {per}"
    if api.image is not None:
        assert tuple(items[0][0].shape) == api.image.input_shape
    if api.logits is not None:
        for part in api.parts:
            lg, tg, mask = api.logits(model, batch, part)
            assert lg.shape[0] == 2 and mask.shape == lg.shape[:2] and mask.dtype == torch.bool
            assert tg is None or tg.shape == lg.shape[:2]
            if api.tokens is not None:
                assert lg.shape[-1] == api.tokens.vocab_size


def test_collate_loss_and_per_sample_loss_on_two_items(tasks):
    for task in tasks[1]:
        check_collate_loss_and_per_sample_loss_on_two_items(task)


def check_length_order_keeps_each_items_signals(task) -> None:
    """A task that declares ``api.length`` is scored in length order (bench.signals.length_sorted): every
    per-sample signal must come back in the caller's order and equal the one computed in the given order."""
    api = task.api
    if api.length is None:
        return
    pool = [task.nonmembers[i] for i in range(min(len(task.nonmembers), 32))]
    assert all(isinstance(api.length(x), int) and api.length(x) >= 1 for x in pool), f"{task.id}: api.length"
    items = sorted(pool, key=api.length, reverse=True)[:: max(1, len(pool) // 6)][:6]  # longest first
    assert len({api.length(x) for x in items}) >= 2, f"{task.id}: smoke items of one length; nothing to reorder"
    plain = dataclasses.replace(api, length=None)
    model = api.build_model()
    torch.testing.assert_close(
        per_sample_losses(api, model, items, batch_size=3), per_sample_losses(plain, model, items, batch_size=3)
    )
    g, _ = per_sample_grad_norms(api, model, items, batch_size=3)
    torch.testing.assert_close(g, per_sample_grad_norms(plain, model, items, batch_size=3)[0], rtol=1e-4, atol=1e-6)
    if api.logits is not None:
        a, b = (token_signals(x, model, items, alphas=(1.0,), batch_size=3) for x in (api, plain))
        for part in a:
            assert torch.equal(a[part].mask, b[part].mask), f"{task.id}: part {part}: token masks differ"
            torch.testing.assert_close(a[part].entropy[1.0], b[part].entropy[1.0])


def test_length_order_keeps_each_items_signals(tasks):
    for task in tasks[1]:
        check_length_order_keeps_each_items_signals(task)


def check_client_data_non_empty_and_disjoint_from_nonmembers(task) -> None:
    assert task.client_data and all(len(c) > 0 for c in task.client_data), f"{task.id}: an empty client"
    assert task.nonmembers is not None and len(task.nonmembers) > 0, f"{task.id}: no non-members"
    members = {_fingerprint(c[i]) for c in task.client_data for i in range(len(c))}
    non = {_fingerprint(task.nonmembers[i]) for i in range(len(task.nonmembers))}
    assert not members & non, f"{task.id}: {len(members & non)} non-members are also client items"


def test_client_data_non_empty_and_disjoint_from_nonmembers(tasks):
    for task in tasks[1]:
        check_client_data_non_empty_and_disjoint_from_nonmembers(task)


def test_config_hash_is_stable_across_builds(tasks):
    name, built = tasks
    again = SCENARIOS.get(name)("smoke")
    assert [t.id for t in again] == [t.id for t in built]
    for a, b in zip(built, again):
        assert a.config_hash() == b.config_hash(), f"{a.id}: the config hash differs between two builds"
        blob = json.dumps(dict(a.config), sort_keys=True, default=str)
        assert " at 0x" not in blob, f"{a.id}: the hashed config holds an object repr (memory address)"


def _methods():
    out = []
    for registry, kind in ((DEFENSES, "defense"), (ATTACKS, "attack")):
        for _key, cls in registry.items():
            for cfg in cls.grid:
                out.append(build(cls, dict(cfg), kind))
    return out


def check_methods_that_apply_find_the_fields_they_require(task, methods) -> None:
    for method in methods:
        if method.applies(task.api) is not None:
            continue
        missing = [f for f in method.requires if _unset(getattr(task.api, f, None))]
        assert not missing, f"{method.name} applies to {task.id} but its required fields {missing} are unset"
        # applicability is decided by the TaskSpec fields alone (static declarations rely on it)
        assert method.applies(task.api.spec()) is None, f"{method.name}.applies reads beyond TaskSpec"


def test_methods_that_apply_find_the_fields_they_require(tasks):
    for task in tasks[1]:
        check_methods_that_apply_find_the_fields_they_require(task, _methods())


def test_requires_names_real_task_fields():
    names = {f.name for f in dataclasses.fields(bt.TaskAPI)}
    for method in _methods():
        unknown = set(method.requires) - names
        assert not unknown, f"{method.name}.requires names {sorted(unknown)}, not TaskAPI fields"


# ----------------------------------------------------------------------------------------------
# the checks catch broken tasks (the toy task, renamed to pass the name check, and broken one way each)


@dataclass
class NeedsViT(FedAvg):
    """Claims to apply everywhere but reads the ViT spec."""

    name = "needs_vit"
    requires = ("vit",)


def _toy(**api_changes):
    task = toy_task()
    task = dataclasses.replace(task, variant="")
    return dataclasses.replace(task, api=dataclasses.replace(task.api, name=task.id, **api_changes))


def test_the_toy_task_passes_the_checks():
    task = _toy()
    for check in (
        check_typed_fields_hold_their_declared_types,
        check_typed_fields_agree_with_each_other,
        check_model_builds_and_matches_the_declared_fields,
        check_collate_loss_and_per_sample_loss_on_two_items,
        check_client_data_non_empty_and_disjoint_from_nonmembers,
    ):
        check(task)


@pytest.mark.parametrize(
    "check, broken, needle",
    [
        (check_typed_fields_agree_with_each_other, {"parts": ("text",)}, "vs logits"),
        (check_typed_fields_agree_with_each_other, {"population_size": 5}, "population_size 5"),
        (check_typed_fields_hold_their_declared_types, {"lora": {"r": 4}}, "expected LoraSpec"),
        (
            check_model_builds_and_matches_the_declared_fields,
            {"lora": bt.LoraSpec(r=4, alpha=8.0, targets=("q",))},
            "no trainable parameter is a LoRA",
        ),
    ],
)
def test_a_broken_task_fails_its_check(check, broken, needle):
    with pytest.raises(AssertionError, match=needle):
        check(_toy(**broken))


def test_reconstruction_target_ids_that_do_not_name_each_target_once_fail():
    task = _toy()
    item = task.client_data[0][0]
    for ids in (["t:0"], ["t:0", "t:0"]):
        broken = dataclasses.replace(task, recon_targets=[item, item], recon_ids=ids)
        with pytest.raises(AssertionError, match="recon_ids do not name 2 targets"):
            check_typed_fields_agree_with_each_other(broken)


def test_client_items_among_the_nonmembers_fail():
    task = _toy()
    task = dataclasses.replace(task, nonmembers=[*task.nonmembers, task.client_data[0][0]])

    with pytest.raises(AssertionError, match="non-members are also client items"):
        check_client_data_non_empty_and_disjoint_from_nonmembers(task)


def test_a_method_applying_without_its_required_fields_fails():
    with pytest.raises(AssertionError, match=r"needs_vit applies to toy but its required fields \['vit'\]"):
        check_methods_that_apply_find_the_fields_they_require(_toy(), [NeedsViT()])
