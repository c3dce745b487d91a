"""The ldm-t2i scenario's presets (:data:`SPECS`: what smoke / default / paper pin, with the measurements that
chose them), the paper preset's data source and the attacker's population size per preset. The scenario itself:
:mod:`bench.scenarios.ldm_t2i`."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.types import FLConfig
from models import ldm

PAPER_DATA_ENV = "BENCH_LDM_PAPER_DATA"
PAPER_DATA_REPO = "WilliamLUO0/StablePrivateLoRA"  # [SMP-LoRA]'s code; dataset/Pokemon/1_pokemon: 833 png + BLIP txt
PAPER_DATA_COMMIT = "c3182917b91862aa7883bddcd0570faaadb11833"


@dataclass(frozen=True)
class Spec:
    """What a preset pins (one entry of :data:`SPECS`, keyed by ``bench.task.PRESETS``)."""

    model: ldm.LDMConfig
    n_aux_m: int
    n_te_m: int
    n_aux_nm: int
    n_te_nm: int
    n_heldout: int
    fl: FLConfig
    central_epochs: int
    n_public: int = 0  # pre-training images (default preset)
    gen_steps: int = 20
    guidance: float = 2.0
    max_membership: int = 64
    data_seed: int = 0
    model_seed: int = 0
    notes: dict = field(default_factory=dict)
    model_label: str = ""  # task.config["model"]["model"] (a cache-key label; paper: the hub id instead)
    gpu_mem_mb: int | None = None  # Task.gpu_mem_mb: what one unit needs on a GPU (None: undeclared)


SPECS: dict[str, Spec] = {
    # Tiny model; its UNet is pre-trained for 160 steps on 512 public images (random VAE) so that it
    # denoises at all (a random UNet's LoRA barely memorises); cached. 6 epochs of 32 members = 24 steps.
    "smoke": Spec(
        model=ldm.LDMConfig(
            vae_channels=(8, 8, 16),
            unet_channels=(16, 32),
            text="hash",
            text_dim=32,
            text_len=12,
            lora_r=8,
            lora_alpha=8.0,
            unet_steps=160,
            unet_batch=16,
        ),
        n_aux_m=16,
        n_te_m=16,
        n_aux_nm=16,
        n_te_nm=16,
        n_heldout=16,
        n_public=512,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=2,
            local_epochs=3,
            batch_size=8,
            lr=5e-3,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=6,
        gen_steps=4,
        max_membership=16,
        model_label="tiny random LDM (diffusers AutoencoderKL + UNet2DConditionModel)",
    ),
    # Pre-trained base (see load_or_pretrain). Measured (seed 0, released LoRA, loss-threshold attack): 40 epochs
    # at alpha 4 left AUROC 0.53 (nothing for a defense to stop); 200 epochs at alpha 8 (scale 1) give 0.65 with
    # held-out denoising loss 0.032 vs 0.030 and the same FID (~135). Calibration for the positive control at
    # 256 + 256 D_te candidates (seed 0; loss threshold / proxy AUROC; base model 0.51 / 0.50), central LoRA:
    # rank 8, 200 epochs, lr 1e-3, batch 8: 0.624 / 0.646; lr 3e-3 0.605 / 0.603; batch 4 0.640 / 0.665; rank 32
    # (alpha 32) 0.661 / 0.672; 400 epochs 0.713 / 0.741; rank 32 at 500 epochs 0.778 / 0.811 [0.77, 0.85]
    # (chosen; held-out loss 0.035, FID 134; 1,116 s here beside a second process). FedAvg (the task's control
    # baseline; 4 clients x 64 members, all clients every round), rank 32: 125 rounds x 4 local epochs (the central
    # run's exposure) only 0.68-0.70 (averaging dilutes each client's fit); 250 x 4 0.79-0.83; 125 x 8 0.80-0.82
    # in both views (chosen: half the rounds; held-out loss 0.035, FID 131; 2,156 s here).
    "default": Spec(
        model=ldm.LDMConfig(
            vae_channels=(8, 16, 32),
            unet_channels=(32, 64),
            text="minilm",
            text_dim=384,
            text_len=16,
            lora_r=32,
            lora_alpha=32.0,
            vae_steps=300,
            vae_batch=32,
            unet_steps=1000,
            unet_batch=64,
        ),
        n_aux_m=64,
        n_te_m=256,
        n_aux_nm=64,
        n_te_nm=256,
        n_heldout=96,
        n_public=10000,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=125,
            local_epochs=8,
            batch_size=8,
            lr=1e-3,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=500,
        gen_steps=20,
        max_membership=256,
        model_label="small LDM pre-trained from scratch on public Fashion-MNIST",
    ),
    # [SMP-LoRA] Table 4 (Pokemon) and Table 5.
    # [SMP-LoRA] Appendix E (A100): on Pokemon, LoRA takes ~8,000 MiB of GPU memory and SMP-LoRA ~10,000 MiB.
    "paper": Spec(
        gpu_mem_mb=10_000,
        model=ldm.LDMConfig(image_size=512, text="clip", text_dim=768, text_len=77, lora_r=64, lora_alpha=32.0),
        n_aux_m=200,
        n_te_m=200,
        n_aux_nm=200,
        n_te_nm=233,
        n_heldout=0,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=100,
            local_epochs=4,
            batch_size=1,
            lr=1e-4,
            optimizer="adamw",
            weight_decay=0.0,
        ),
        central_epochs=400,
        gen_steps=50,
        guidance=7.5,
        max_membership=200,
        notes={
            "lr_schedule": "constant (Table 5)",
            "proxy_lr_eta1": 1e-5,
            "utility": "FID/KID against D_te^nm images (no separate held-out split in Table 4)",
        },
    ),
}


# Attacker-side population images per preset (reference models, [RMIA] / [LiRA]): Fashion-MNIST test images outside
# the private splits, rendered like them; half train the reference models (2x the members' count), half are RMIA's
# z samples (bench.reference). None on paper: Table 4's splits use all 833 Pokemon images. The training pool holds
# twice the central training set (D_aux^m + D_te^m), so reference training sets differ (tests/test_ldm.py).
N_POPULATION = {"smoke": 128, "default": 1280, "paper": 0}
