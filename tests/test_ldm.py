"""The ldm-t2i scenario: grounded captions, the diffusers LDM and its LoRA, deterministic per-sample
losses, the [SMP-LoRA] Table 4 splits, FID / KID, the paper preset's loaders on a tiny saved checkpoint, and the
membership controls (an over-fitted LoRA is detectable by a loss threshold; the un-adapted base model is not)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from bench import captions as cap
from models import ldm
from tests.assets import hub_snapshot

TINY = ldm.LDMConfig(
    vae_channels=(8, 8, 16), unet_channels=(16, 32), text="hash", text_dim=32, text_len=12, lora_r=4, lora_alpha=4.0
)


@pytest.fixture(scope="module")
def smoke_task():
    from bench.scenarios.ldm_t2i import build_task

    return build_task("smoke")


def _item(seed: int, canvas: int = 32) -> dict:
    rng = np.random.default_rng(seed)
    img28 = (rng.random((28, 28)) * 255).astype(np.uint8)
    x, a = cap.augment(img28, rng, canvas=canvas)
    c = cap.caption(cap.CLASS_NAMES[seed % 10], a)
    return {"image": x, "text": ldm.encode_captions(TINY, [c])[c], "caption": c, "label": seed % 10}


# ----------------------------------------------------------------------------------------------
# captions


def test_augment_is_deterministic_and_caption_is_grounded():
    img = np.full((28, 28), 255, dtype=np.uint8)
    x1, a1 = cap.augment(img, np.random.default_rng(3))
    x2, a2 = cap.augment(img, np.random.default_rng(3))
    assert torch.equal(x1, x2) and a1 == a2
    text = cap.caption("sneaker", a1)
    assert text.startswith(f"a {a1.size} {a1.tint} sneaker {a1.position}") and text.endswith(a1.rotation)
    assert x1.shape == (3, 32, 32) and float(x1.min()) >= 0.0 and float(x1.max()) <= 1.0


@pytest.mark.parametrize("position", ["in the upper left", "in the lower right", "at the top", "on the left"])
def test_render_puts_the_item_where_the_caption_says_with_its_tint(position):
    img = np.full((28, 28), 255, dtype=np.uint8)
    attrs = dataclasses.replace(
        cap.sample_attributes(np.random.default_rng(0)), position=position, size="small", rotation="upright", tint="red"
    )
    fy, fx = cap.POSITIONS[position]
    free = 32 - attrs.pixels
    attrs = dataclasses.replace(attrs, top=int(fy * free), left=int(fx * free))
    x = cap.render(img, attrs)
    mass = x.sum(0)
    ys, xs = torch.nonzero(mass > 0.5, as_tuple=True)
    cy, cx = ys.float().mean() / 31, xs.float().mean() / 31
    assert abs(float(cy) - (0.2 + 0.6 * fy)) < 0.2 and abs(float(cx) - (0.2 + 0.6 * fx)) < 0.2
    assert float(x[0].sum()) > 3 * float(x[1].sum())  # red tint


def test_every_attribute_combination_gives_a_distinct_caption():
    seen = set()
    for s in cap.SIZES:
        for p in cap.POSITIONS:
            for r in cap.ROTATIONS:
                for t in cap.TINTS:
                    seen.add(cap.caption("bag", cap.Attributes(s, p, r, t, 10, 0, 0)))
    assert len(seen) == cap.num_captions(1)


# ----------------------------------------------------------------------------------------------
# model, LoRA, losses


def test_fresh_lora_computes_the_base_model_and_only_lora_trains():
    base = ldm.random_base(TINY)
    adapted = ldm.add_lora(ldm.random_base(TINY), r=4, alpha=4.0)
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} >= {"to_q", "to_k", "to_v"}
    assert any(".to_out.0.lora_" in n for n in trainable)
    z, txt, t = torch.randn(2, 4, 8, 8), torch.randn(2, 12, 32), torch.tensor([10, 900])
    with torch.no_grad():
        assert torch.allclose(base(z, t, txt), adapted(z, t, txt), atol=1e-6)


def test_per_sample_loss_is_deterministic_per_item_and_averages_ten_timesteps():
    model = ldm.add_lora(ldm.random_base(TINY), r=4, alpha=4.0)
    items = [_item(i) for i in range(3)]
    with torch.no_grad():
        together = ldm.per_sample_loss(model, ldm.collate(items))
        alone = torch.cat([ldm.per_sample_loss(model, ldm.collate([it])) for it in reversed(items)]).flip(0)
        steps = ldm.eval_timesteps(1000)
        per_t = torch.stack([ldm.loss_at_timestep(model, ldm.collate(items), t) for t in steps], 1)
    assert steps == [50, 150, 250, 350, 450, 550, 650, 750, 850, 950]
    assert torch.allclose(together, alone, atol=1e-5)
    assert torch.allclose(together, per_t.mean(1), atol=1e-5)
    assert (together > 0).all()


def test_prepared_batches_give_the_same_losses_and_per_sample_gradients_run_under_vmap(smoke_task):
    import warnings

    from bench.loss_signals import per_sample_grad_norms

    api, model = smoke_task.api, smoke_task.api.build_model()
    items = [smoke_task.nonmembers[i] for i in range(5)]
    batch, steps = ldm.collate(items), [100, 500, 900]
    with torch.no_grad():
        plain = ldm.loss_at_timesteps(model, batch, steps)
        ready = ldm.loss_at_timesteps(model, ldm.prepare_batch(model, batch, steps), steps)
        assert torch.equal(
            ldm.per_sample_loss(model, ldm.prepare_batch(model, batch, [])), ldm.per_sample_loss(model, batch)
        )
    assert torch.equal(plain, ready)
    with pytest.raises(ValueError, match="covers 3 timesteps"):
        ldm.loss_at_timesteps(model, ldm.prepare_batch(model, batch, steps), [100])
    procs = {k: type(v) for k, v in model.unet.attn_processors.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the vmap path must run, not fall back to the loop
        fast, _ = per_sample_grad_norms(api, model, items, batch_size=5, timesteps=steps)
    slow, _ = per_sample_grad_norms(api, model, items, batch_size=5, timesteps=steps, use_vmap=False)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-7)
    assert {k: type(v) for k, v in model.unet.attn_processors.items()} == procs  # restored after


def test_training_loss_is_random_and_differentiable_in_the_lora():
    model = ldm.add_lora(ldm.random_base(TINY), r=4, alpha=4.0)
    batch = ldm.collate([_item(i) for i in range(4)])
    torch.manual_seed(0)
    a = ldm.train_loss(model, batch)
    b = ldm.train_loss(model, batch)
    assert not torch.isclose(a, b)
    a.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)


def test_generate_returns_images_in_unit_range():
    model = ldm.random_base(TINY)
    txt = torch.randn(3, 12, 32)
    out = ldm.generate(model, txt, steps=2, seed=1)
    assert out.shape == (3, 3, 32, 32) and float(out.min()) >= 0 and float(out.max()) <= 1
    assert torch.equal(out, ldm.generate(model, txt, steps=2, seed=1))


# ----------------------------------------------------------------------------------------------
# utility metrics


def test_fid_kid_match_an_independent_computation():
    import scipy.linalg

    from bench.utility_gen import fid_kid

    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(60, 6, generator=g), torch.randn(60, 6, generator=g) * 1.5 + 0.7
    out = fid_kid(real.double(), fake.double(), kid_subset=30)
    r, f = real.double().numpy(), fake.double().numpy()
    s1, s2 = np.cov(r, rowvar=False), np.cov(f, rowvar=False)
    ref = ((r.mean(0) - f.mean(0)) ** 2).sum() + np.trace(s1 + s2 - 2 * scipy.linalg.sqrtm(s1 @ s2).real)
    assert out["fid_effnetlite0"] == pytest.approx(ref, rel=1e-4)
    same = fid_kid(real.double(), torch.randn(60, 6, generator=g).double(), kid_subset=30)  # same distribution
    assert abs(fid_kid(real.double(), real.double())["fid_effnetlite0"]) < 1e-6
    assert out["kid_effnetlite0"] > 5 * abs(same["kid_effnetlite0"])
    assert out["fid_effnetlite0"] > 3 * same["fid_effnetlite0"]


def test_kid_reports_a_spread_only_when_its_subsets_differ():
    from bench.utility_gen import fid_kid

    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(40, 6, generator=g).double(), torch.randn(40, 6, generator=g).double() + 0.5
    whole = fid_kid(real, fake, kid_subset=100)  # every subset would be all 40: one estimate
    halves = fid_kid(real, fake, kid_subset=20)
    assert "kid_effnetlite0_std" not in whole
    assert halves["kid_effnetlite0_std"] > 0


def test_efficientnet_lite0_features_are_pooled_1280d():
    from bench.utility_gen import feature_encoder

    f = feature_encoder()(torch.rand(2, 3, 32, 32))
    assert f.shape == (2, 1280) and torch.isfinite(f).all()


# ----------------------------------------------------------------------------------------------
# the scenario


def test_smoke_builds_with_table4_splits_disjoint(smoke_task):
    t = smoke_task
    ex = t.extras
    sizes = {k: len(v) for k, v in ex.items()}
    assert sizes == {"aux_members": 16, "te_members": 16, "aux_nonmembers": 16, "te_nonmembers": 16}
    src = {k: {it["source_index"] for it in v} for k, v in ex.items()}
    src["heldout"] = {it["source_index"] for it in t.test_data.items}
    names = list(src)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert not src[names[i]] & src[names[j]], (names[i], names[j])
    members = {it["source_index"] for it in t.central_data.items}
    assert members == src["aux_members"] | src["te_members"]
    assert {it["source_index"] for it in t.nonmembers.items} == src["aux_nonmembers"] | src["te_nonmembers"]
    assert sorted(i for c in t.client_data for i in c.indices) == list(range(len(t.central_data)))
    assert t.api.family == "ldm-t2i" and t.api.logits is None and t.api.lora is not None and t.api.arch == "unet"
    assert t.api.num_layers == 7 and t.api.aux_sets and t.api.diffusion_ops is not None
    item = t.central_data[0]
    assert set(item) >= {"image", "text", "caption", "label"} and cap.CLASS_NAMES[item["label"]] in item["caption"]


@pytest.mark.parametrize("view", ["released_model", "global_model", "client_model"])
def test_membership_is_evaluated_on_d_te_only(smoke_task, view):
    """[SMP-LoRA] Table 4: candidates from D_te^m / D_te^nm; the attacker's aux split is D_aux (what the
    MP-/SMP-LoRA proxy trained on), never scored."""
    from bench.cells import member_pool, view_split

    t = smoke_task
    src = lambda items: {it["source_index"] for it in items}  # noqa: E731
    pool = member_pool(t, view)
    for seed in (0, 1):
        s = view_split(t, view, len(pool), seed)
        assert src(pool[i] for i in s.members) == src(t.extras["te_members"])
        assert src(t.nonmembers[i] for i in s.nonmembers) == src(t.extras["te_nonmembers"])
        assert src(pool[i] for i in s.aux_members) == src(t.extras["aux_members"])
        assert src(t.nonmembers[i] for i in s.aux_nonmembers) == src(t.extras["aux_nonmembers"])
    assert view_split(t, view, len(pool), 0) == view_split(t, view, len(pool), 0)


def test_smoke_population_is_disjoint_from_every_private_item(smoke_task):
    t = smoke_task
    private = {it["source_index"] for v in t.extras.values() for it in v}
    private |= {it["source_index"] for ds in (t.central_data, t.nonmembers, t.test_data) for it in ds.items}

    pop = [it["source_index"] for it in t.population.items]

    assert len(pop) == len(set(pop)) == t.api.population_size == 128
    assert not set(pop) & private
    assert set(t.population[0]) >= {"image", "text", "caption", "label"} and t.population.labels


@pytest.mark.parametrize("preset", ["smoke", "default"])
def test_population_indices_are_seeded_outside_the_private_pool(preset):
    """Default checked on indices alone (rendering it would encode every population caption with MiniLM)."""
    from bench.scenarios import ldm_t2i

    p = ldm_t2i.SPECS[preset]
    src, sizes, perm = ldm_t2i.private_pool(p)

    idx = ldm_t2i.population_indices(len(src.test_x), perm, ldm_t2i.N_POPULATION[preset], p.data_seed)

    assert len(perm) == sum(sizes.values()) and len(idx) == len(set(idx.tolist())) == ldm_t2i.N_POPULATION[preset]
    assert not set(idx.tolist()) & set(perm.tolist())
    assert idx.tolist() == ldm_t2i.population_indices(len(src.test_x), perm, len(idx), p.data_seed).tolist()
    assert idx.tolist() != ldm_t2i.population_indices(len(src.test_x), perm, len(idx), p.data_seed + 1).tolist()
    assert ldm_t2i.N_POPULATION["paper"] == 0  # Table 4 uses all 833 Pokemon images: rmia stays n/a there


@pytest.mark.parametrize("preset", ["smoke", "default"])
def test_population_holds_reference_training_sets_that_differ(preset):
    """The reference models' training pool (half the population) holds twice the central training set, so each
    reference model trains on its own draw (a pool of exactly one training set would repeat it)."""
    from bench.reference import population_split
    from bench.scenarios import ldm_t2i

    p = ldm_t2i.SPECS[preset]
    n_train = p.n_aux_m + p.n_te_m  # the central (released-model) training set, the largest a reference imitates

    split = population_split(ldm_t2i.N_POPULATION[preset], n_train, seed=0)

    assert len(split.train_pool) >= 2 * n_train and len(split.z_pool) >= n_train


def test_rmia_applies_to_the_smoke_cells(smoke_task):
    from attacks.rmia import RMIA
    from bench.registry import DEFENSES
    from bench.runner import plan

    defenses = [DEFENSES.get(n)() for n in ("lora", "mp_lora", "fedavg")]

    cells = plan([smoke_task], defenses, [RMIA()], [0])

    na = {(c.defense_label, c.view): c.na for c in cells}
    assert RMIA().applies(smoke_task.api) is None
    assert na[("lora", "released_model")] is None and na[("mp_lora", "released_model")] is None
    assert na[("fedavg", "global_model")] is None and na[("fedavg", "client_model")] is None


def test_mp_lora_reference_runs_keep_the_recipe_and_hold_no_candidate(smoke_task):
    """A reference run's defender plays the target's game on its own data: D_aux^m from its training set, the
    target's D_aux^nm (no candidate: scored are D_te^m / D_te^nm only), and no D_te item anywhere."""
    from bench import reference as ref
    from bench.registry import DEFENSES

    t, defense = smoke_task, DEFENSES.get("mp_lora")()
    spec = ref.reference_spec(t, defense, 0, 0)
    src = lambda items: {it["source_index"] for it in items}  # noqa: E731

    rt = ref.reference_task(t, defense, spec.items)

    assert rt.central_data is not None and src(rt.central_data) == src(spec.items)
    assert src(rt.extras["aux_members"]) <= src(rt.central_data)
    assert len(rt.extras["aux_members"]) == len(t.extras["aux_members"])
    assert src(rt.extras["aux_nonmembers"]) == src(t.extras["aux_nonmembers"])
    assert "te_members" not in rt.extras and "te_nonmembers" not in rt.extras
    held = src(spec.items) | {i for v in rt.extras.values() for i in src(v)}
    assert not held & (src(t.extras["te_members"]) | src(t.extras["te_nonmembers"]))
    assert rt.eval_subsets is None and rt.nonmembers is None and rt.population is None
    with pytest.raises(ValueError, match="may be evaluation candidates"):
        ref.reference_task(dataclasses.replace(t, eval_subsets=None), defense, spec.items)


def test_an_rmia_smoke_cell_runs_end_to_end(smoke_task, tmp_path):
    from attacks.rmia import RMIA
    from bench.cells import run_membership
    from bench.fl import run_federated
    from bench.registry import DEFENSES

    task, defense = dataclasses.replace(smoke_task, central_epochs=1), DEFENSES.get("lora")()  # 4 steps a run
    _, train = run_federated(task, defense, 0)

    got = run_membership(
        task,
        defense,
        RMIA(n_reference=1, timesteps=1, n_population=16),
        "released_model",
        train,
        0,
        cache_root=tmp_path,
    )

    assert np.isfinite(got["metrics"]["auroc"]["value"])
    assert got["reference"]["setting"] == "offline" and got["reference"]["n_reference"] == 1
    assert any((tmp_path / "reference").iterdir())


@pytest.mark.slow
def test_default_splits_scale_table4(monkeypatch):
    from bench.scenarios import ldm_t2i

    p = ldm_t2i.SPECS["default"]
    splits = ldm_t2i.private_splits(p)
    sizes = [len(splits[k]) for k in ("aux_members", "te_members", "aux_nonmembers", "te_nonmembers")]
    assert sizes == [64, 256, 64, 256]  # >= 250 D_te candidates per side (the evaluation set)
    idx = [it["source_index"] for v in splits.values() for it in v]
    assert len(idx) == len(set(idx))
    assert splits["aux_members"][0]["text"].shape == (16, 384)  # MiniLM token states


@pytest.mark.slow
def test_negative_control_base_model_is_at_chance(smoke_task):
    """The base never saw the private pool: loss-threshold AUROC on 128 vs 128 fresh items is 0.5 +- 0.1."""
    from bench.data import fashion_mnist
    from bench.scenarios import ldm_t2i

    p = ldm_t2i.SPECS["smoke"]
    src = fashion_mnist()
    used = {it["source_index"] for v in smoke_task.extras.values() for it in v}
    free = [i for i in np.random.default_rng(7).permutation(len(src.test_x)) if i not in used][:256]
    items = ldm_t2i.make_items(p.model, src.test_x[free], src.test_y[free], seed=7, split=9)
    model = smoke_task.api.build_model()
    with torch.no_grad():
        scores = torch.cat(
            [
                -smoke_task.api.per_sample_loss(model, smoke_task.api.collate(items[i : i + 64]))
                for i in range(0, 256, 64)
            ]
        )
    auc = roc_auc_score([1] * 128 + [0] * 128, scores.numpy())
    assert abs(auc - 0.5) <= 0.1, auc


@pytest.mark.slow
def test_positive_control_overfit_lora_is_detected_by_a_loss_threshold(smoke_task):
    """Plain LoRA over-fitted on 8 members (300 epochs, lr 5e-3): -loss separates them from 8 non-members."""
    from bench.fl import run_federated
    from bench.registry import DEFENSES, build
    from bench.scenarios.ldm_t2i import Items

    mem = smoke_task.extras["aux_members"][:8]
    non = smoke_task.extras["te_nonmembers"][:8]
    task = dataclasses.replace(
        smoke_task,
        central_data=Items(mem),
        central_epochs=300,
        fl=dataclasses.replace(smoke_task.fl, lr=5e-3, batch_size=8),
    )
    model, _ = run_federated(task, build(DEFENSES.get("lora"), {}, "defense"), seed=0)
    with torch.no_grad():
        s = torch.cat(
            [
                -task.api.per_sample_loss(model, task.api.collate(mem)),
                -task.api.per_sample_loss(model, task.api.collate(non)),
            ]
        )
    base = task.api.build_model()
    with torch.no_grad():
        s0 = torch.cat(
            [
                -task.api.per_sample_loss(base, task.api.collate(mem)),
                -task.api.per_sample_loss(base, task.api.collate(non)),
            ]
        )
    y = [1] * 8 + [0] * 8
    assert roc_auc_score(y, s.numpy()) >= 0.8
    assert roc_auc_score(y, s.numpy()) > roc_auc_score(y, s0.numpy())


@pytest.mark.slow
def test_utility_reports_loss_fid_kid(smoke_task):
    out = smoke_task.utility(smoke_task.api.build_model())
    assert set(out) >= {"heldout_denoise_loss", "fid_effnetlite0", "kid_effnetlite0"}
    assert all(np.isfinite(v) for v in out.values())


# ----------------------------------------------------------------------------------------------
# paper preset: SD v1.5 and the Pokemon images from local files, on a tiny checkpoint saved here

REV = "0123456789abcdef0123456789abcdef01234567"


def _tiny_clip_tokenizer():
    """The real CLIP BPE tokenizer class over single byte-level characters (no merges): small enough to save."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    chars = sorted(ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"])}
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _tiny_sd15(cache, hub_id: str = "bench-test/tiny-sd"):
    """A Stable-Diffusion-v1.5-shaped checkpoint (vae / unet / scheduler / tokenizer / text_encoder subfolders),
    tiny, laid out as the Hugging Face cache stores a snapshot."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    snap = hub_snapshot(cache, hub_id, REV)
    torch.manual_seed(0)
    AutoencoderKL(
        block_out_channels=(8, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
    ).save_pretrained(snap / "vae")
    UNet2DConditionModel(
        sample_size=16,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    ).save_pretrained(snap / "unet")
    DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear").save_pretrained(snap / "scheduler")
    tok = _tiny_clip_tokenizer()
    tok.save_pretrained(snap / "tokenizer")
    cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    CLIPTextModel(cfg).save_pretrained(snap / "text_encoder")
    return hub_id


def _fake_pokemon(folder, n: int) -> None:
    """``n`` captioned images (png + BLIP .txt) of assorted sizes, one image without a caption and a stray file."""
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n + 1):
        Image.fromarray(rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8)).save(folder / f"{i:04d}.png")
        if i < n:
            (folder / f"{i:04d}.txt").write_text(f"a drawing of pokemon number {i}\n")
    (folder / "README").write_text("not an image")


@pytest.fixture()
def paper_ldm(monkeypatch, tmp_path):
    """The paper preset on a tiny SD-v1.5-shaped checkpoint and 12 fake Pokemon images, Table 4's splits shrunk
    to 2 / 4 / 2 / 3 (D_aux^m / D_te^m / D_aux^nm / D_te^nm)."""
    import functools

    from huggingface_hub import constants

    from bench.scenarios import ldm_t2i

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    hub_id = _tiny_sd15(tmp_path / "hub")
    monkeypatch.setattr(ldm, "load_sd15", functools.partial(ldm.load_sd15, hub_id, REV))
    paper = ldm_t2i.SPECS["paper"]
    small = dataclasses.replace(
        paper,
        model=dataclasses.replace(paper.model, image_size=32, text_dim=16, lora_r=4, lora_alpha=4.0),
        n_aux_m=2,
        n_te_m=4,
        n_aux_nm=2,
        n_te_nm=3,
        fl=dataclasses.replace(paper.fl, num_clients=2, clients_per_round=2, rounds=1, local_epochs=1),
        central_epochs=1,
        gen_steps=2,
    )
    monkeypatch.setitem(ldm_t2i.SPECS, "paper", small)
    _fake_pokemon(tmp_path / "pokemon", 12)
    monkeypatch.setenv("BENCH_LDM_PAPER_DATA", str(tmp_path / "pokemon"))
    return ldm_t2i, hub_id, tmp_path


def test_sd15_loader_real_path_on_a_tiny_checkpoint(paper_ldm):
    from bench.assets import AssetMissing

    _, hub_id, _ = paper_ldm
    model, tok, te = ldm.load_sd15()
    assert isinstance(model, ldm.LatentDiffusion) and model.num_timesteps == 1000
    assert model.scaling == pytest.approx(model.vae.config.scaling_factor) and not model.training
    ids = tok(["a red pokemon"], padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
    assert ids.shape == (1, 77) and te(ids)[0].shape == (1, 77, 16)
    with pytest.raises(AssetMissing, match=hub_id):
        ldm.load_sd15.func(hub_id, "f" * 40)  # a revision that is not cached: fails at once, names the model


def test_paper_preset_builds_table4_splits_from_local_files(paper_ldm):
    ldm_t2i, _, _ = paper_ldm
    (task,) = ldm_t2i.build("paper")
    ex = task.extras
    sizes = {k: len(ex[k]) for k in ("aux_members", "te_members", "aux_nonmembers", "te_nonmembers")}
    assert sizes == {"aux_members": 2, "te_members": 4, "aux_nonmembers": 2, "te_nonmembers": 3}
    caps = [it["caption"] for k in sizes for it in ex[k]]
    assert len(set(caps)) == 11 and all(c.startswith("a drawing of pokemon number") for c in caps)  # disjoint
    it = ex["te_members"][0]
    assert it["image"].shape == (3, 32, 32) and it["image"].dtype == torch.float16
    assert 0.0 <= float(it["image"].min()) <= float(it["image"].max()) <= 1.0
    assert it["text"].shape == (77, 16) and it["text"].dtype == torch.float16  # the CLIP text encoder's states
    assert task.api.num_layers == 4  # the tiny UNet's BasicTransformerBlocks: 1 down, 1 mid, 2 up (lpb + 1)
    assert "StablePrivateLoRA" in task.config["data"] and task.config["splits"]["heldout"] == 0


def test_paper_preset_trains_a_round_with_lora_on_the_unet(paper_ldm):
    from bench.fl import run_federated
    from defenses.fedavg import FedAvg

    ldm_t2i, _, _ = paper_ldm
    (task,) = ldm_t2i.build("paper")
    model, _ = run_federated(task, FedAvg(), seed=0)
    trainable = [n for n, q in model.named_parameters() if q.requires_grad]
    assert trainable and all(n.startswith("unet.") and "lora_" in n for n in trainable)
    batch = task.api.collate(task.extras["te_members"][:2])
    assert torch.isfinite(task.api.per_sample_loss(model, batch)).all()


def test_paper_preset_names_missing_data_and_too_few_images(paper_ldm, monkeypatch):
    from bench.assets import AssetMissing

    ldm_t2i, _, tmp_path = paper_ldm
    monkeypatch.delenv("BENCH_LDM_PAPER_DATA")
    with pytest.raises(AssetMissing, match="BENCH_LDM_PAPER_DATA"):
        ldm_t2i.build("paper")
    _fake_pokemon(tmp_path / "few", 3)
    monkeypatch.setenv("BENCH_LDM_PAPER_DATA", str(tmp_path / "few"))
    with pytest.raises(ValueError, match="holds 3 captioned images, Table 4 needs 11"):
        ldm_t2i.build("paper")
