"""The ldm-t2i ``default`` base model: a small VAE + UNet (:mod:`models.ldm`) pre-trained once from scratch on public
data, then cached per (architecture, data, diffusers version) in ``$BENCH_CACHE/ldm/<key>`` (checksummed safetensors,
no pickle; a file lock serialises concurrent runs), so every training run adapts the same base."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from bench import cachefile
from bench.assets import cache_dir
from bench.progress import progress
from models import ldm
from models.ldm import LatentDiffusion, LDMConfig


@dataclass
class PretrainResult:
    vae: dict[str, Tensor]
    unet: dict[str, Tensor]
    scaling: float
    log: dict[str, Any] = field(default_factory=dict)


def _cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def pretrain(
    cfg: LDMConfig, images: Tensor, texts: Tensor, text_index: Tensor, *, desc: str = "pre-train"
) -> PretrainResult:
    """From scratch: (1) the VAE on reconstruction + KL (Kingma & Welling 2014; LDM's KL-reg. autoencoder
    without its perceptual / GAN terms), (2) the latent scale 1/std, (3) the UNet on the eps-prediction
    loss with ``cond_dropout`` null captions. ``images`` [N,3,H,W] in [0,1]; ``texts`` [U,L,D] unique
    caption states, ``text_index`` [N] row per image. AdamW, warm-up + cosine schedule."""
    torch.manual_seed(cfg.init_seed)
    base = ldm.random_base(cfg)
    vae, unet = base.vae.train(), base.unet.train()
    n = images.shape[0]
    g = torch.Generator().manual_seed(cfg.init_seed + 1)
    log: dict[str, Any] = {"n_images": n, "n_captions": int(texts.shape[0])}
    t0 = time.time()
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, cfg.vae_steps, max(1, cfg.vae_steps // 20)))
    bar = progress(range(cfg.vae_steps), desc=f"{desc}: VAE", total=cfg.vae_steps)
    for step in bar:
        x = images[torch.randint(0, n, (cfg.vae_batch,), generator=g)].float() * 2 - 1
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        rec_loss = F.mse_loss(rec, x)
        loss = rec_loss + cfg.kl_weight * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sch.step()
        if hasattr(bar, "set_postfix") and step % 20 == 0:
            bar.set_postfix(rec=f"{rec_loss.item():.4f}")
    log["vae_rec_mse"] = float(rec_loss) if cfg.vae_steps else None
    log["vae_s"] = time.time() - t0
    vae.eval().requires_grad_(False)
    with torch.no_grad():
        lat = torch.cat([vae.encode(images[i : i + 256].float() * 2 - 1).latent_dist.mean for i in range(0, n, 256)])
    scaling = float(1.0 / lat.std().clamp(min=1e-6))
    lat = lat * scaling
    log["latent_scaling"] = scaling
    t1 = time.time()
    opt = torch.optim.AdamW(unet.parameters(), lr=cfg.unet_lr, weight_decay=1e-2)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, cfg.unet_steps, max(1, cfg.unet_steps // 20)))
    abar = base.alphas_cumprod
    bar = progress(range(cfg.unet_steps), desc=f"{desc}: UNet", total=cfg.unet_steps)
    ema = None
    for step in bar:
        idx = torch.randint(0, n, (cfg.unet_batch,), generator=g)
        z0 = lat[idx]
        txt = texts[text_index[idx]].float()
        drop = torch.rand(len(idx), generator=g) < cfg.cond_dropout
        txt[drop] = 0.0
        t = torch.randint(0, base.num_timesteps, (len(idx),), generator=g)
        noise = torch.randn(z0.shape, generator=g)
        ab = abar[t].view(-1, 1, 1, 1)
        pred = unet(ab.sqrt() * z0 + (1 - ab).sqrt() * noise, t, encoder_hidden_states=txt).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        opt.step()
        sch.step()
        ema = float(loss.detach()) if ema is None else 0.98 * ema + 0.02 * float(loss)
        if hasattr(bar, "set_postfix") and step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.4f}")
    log["unet_loss_ema"] = ema
    log["unet_s"] = time.time() - t1
    log["total_s"] = time.time() - t0
    return PretrainResult(
        {k: v.detach().clone() for k, v in vae.state_dict().items()},
        {k: v.detach().clone() for k, v in unet.state_dict().items()},
        scaling,
        log,
    )


def base_from(cfg: LDMConfig, res: PretrainResult) -> LatentDiffusion:
    model = ldm.random_base(cfg)
    model.vae.load_state_dict(res.vae)
    model.unet.load_state_dict(res.unet)
    model.scaling = res.scaling
    return model.eval()


def base_stem(cfg: LDMConfig, data_spec: dict[str, Any], *, create: bool = True) -> Path:
    """The pre-trained base's cache entry: ``base.json`` + ``base-<sha12>.safetensors`` (bench/cachefile.py: no
    pickle, checksummed) in ``$BENCH_CACHE/ldm/<key>`` of (architecture, data, diffusers version)."""
    import diffusers

    from bench.store import stable_hash

    key = stable_hash({"arch": cfg.arch(), "data": data_spec, "diffusers": diffusers.__version__})
    return cache_dir("ldm", key, create=create) / "base"


def load_or_pretrain(
    cfg: LDMConfig, data_spec: dict[str, Any], make_data: Callable[[], tuple[Tensor, Tensor, Tensor]]
) -> tuple[PretrainResult, Path]:
    """The cached pre-trained base for (config, data) or pre-train it now (once per machine: a file lock
    serialises concurrent runs; the result is written atomically). Returns (result, cache file)."""
    stem = base_stem(cfg, data_spec)
    d, key = stem.parent, stem.parent.name
    with cachefile.file_lock(d / "lock"):  # looked up at call time (tests/test_preparations.py finds it)
        res = cachefile.load(
            stem,
            _decode_base,
            quarantine_dir=d / "quarantine",
            legacy=(d / "base.pt", lambda blob: _encode_base(PretrainResult(**blob))),
        )
        if res is None:  # none yet, or a damaged one was quarantined: pre-train
            images, texts, text_index = make_data()
            res = pretrain(cfg, images, texts, text_index, desc=f"ldm base {key[:8]}")
            res.log.update({"config": cfg.arch(), "data": data_spec})
            cachefile.save(stem, *_encode_base(res))
    return res, d / "base.json"


def _encode_base(res: PretrainResult) -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors, order = cachefile.flatten({"vae": res.vae, "unet": res.unet})
    return tensors, {"scaling": float(res.scaling), "log": res.log, "order": order}


def _decode_base(tensors: dict[str, Tensor], meta: dict[str, Any]) -> PretrainResult:
    groups = cachefile.unflatten(tensors, meta["order"])
    return PretrainResult(groups["vae"], groups["unet"], float(meta["scaling"]), meta["log"])
