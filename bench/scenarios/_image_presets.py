"""The image-cls scenario's presets (:data:`SPECS` and :func:`fl_config`: what smoke / default / paper pin, with
the measurements that chose them) and the inversion budget per preset. The scenario itself:
:mod:`bench.scenarios.image_cls`."""

from __future__ import annotations

from dataclasses import dataclass

from bench.types import FLConfig
from models import image as image_models

DATA_SEED = 0  # the data subset and the client split
MODEL_SEED = 0  # build_model: the same initial weights for every call of a task
VARIANTS = ("vit", "resnet34")


@dataclass(frozen=True)
class Spec:
    """What a preset pins besides the FL settings."""

    img_size: int
    n_train: int  # members, split over the clients
    n_test: int
    n_nonmembers: int
    n_photos: int  # reconstruction targets: scikit-image photos ...
    n_client_targets: int  # ... and client 0's training images
    max_membership: int
    dp_delta: float
    vit: image_models.ViTSize  # the models' shapes (models.image)
    resnet: image_models.ResNetSize
    pretrained: bool = False  # ImageNet weights (then vit / resnet are their shapes)
    n_pretrain: int = 0  # public images the base is pre-trained on (0: random initialisation)
    pretrain: dict[str, image_models.PretrainConfig] | None = None  # per architecture


SPECS = {
    "smoke": Spec(
        img_size=32,
        n_train=160,
        n_test=128,
        n_nonmembers=96,
        n_photos=2,
        n_client_targets=2,
        max_membership=32,
        dp_delta=1e-5,
        vit=image_models.ViTSize(patch=8, width=48, depth=2, heads=2, mlp_ratio=2.0),
        resnet=image_models.ResNetSize(layers=(1, 1, 1, 1), channels=(16, 32, 64, 128)),
    ),
    # 312 members (156 per client) and 600 non-members: 250 evaluation candidates per side plus an attacker
    # split; the base is pre-trained on 6,000 further training images (module doc)
    "default": Spec(
        img_size=28,
        n_train=312,
        n_test=1000,
        n_nonmembers=600,
        n_photos=4,
        n_client_targets=4,
        max_membership=250,
        dp_delta=1e-5,
        n_pretrain=6000,
        # narrow ViT (patch 7 on 28 px: 16 tokens) and ResNet34's depth at a quarter of its width: the
        # CPU budget of pre-training + federated over-fitting here (models.image)
        vit=image_models.ViTSize(patch=7, width=128, depth=6, heads=4, mlp_ratio=4.0),
        resnet=image_models.ResNetSize(layers=(3, 4, 6, 3), channels=(16, 32, 64, 128)),
        pretrain={
            "resnet34": image_models.PretrainConfig(steps=120, batch_size=64, lr=2e-3, weight_decay=0.05),
            "vit": image_models.PretrainConfig(steps=300, batch_size=64, lr=1e-3, weight_decay=0.05),
        },
    ),
    "paper": Spec(
        img_size=224,
        n_train=50_000,
        n_test=5_000,
        n_nonmembers=5_000,
        n_photos=4,
        n_client_targets=11,
        max_membership=500,
        dp_delta=0.5,
        vit=image_models.VIT_S16,
        resnet=image_models.RESNET34,
        pretrained=True,
    ),
}


# Inverting-gradients iterations per preset: [FLRSP] runs 24,000; smoke/default fit a CPU budget. Measured
# on the former default (ViT-S/4 at 32 px, 8 targets optimised jointly, 1 thread on a loaded 2-core machine):
# ~2.8 s per iteration, so 300 kept one cell near 10-15 min. The current default models cost ~5-13x less per
# image (models.image). Measured on them (fedavg, seed 0, 300 iterations, 8 targets): SSIM ViT 0.109 [0.06, 0.16]
# in 164 s, ResNet34 0.038 [0.01, 0.07] in 426 s, against 0.008 for uniform random images (not clearly above it
# for ResNet34: more iterations are affordable now); APRIL on the ViT: SSIM 1.000.
# Calibrated against the random-image control (session 2026-11-25, FedSGD seed 0, 8 targets, mean SSIM minus random
# images' on the same targets, +- its standard error over targets; wall time of the cell, 1 thread, loaded machine):
# ViT 300 its +0.07, 1,000 its +0.109 +- 0.045 (239 s), 3,000 its +0.140 +- 0.053 (751 s); ResNet34 300 its +0.02,
# 1,000 its +0.067 +- 0.025 (354 s, nothing recognisable: batch-1 train-mode BatchNorm is an instance norm). That was
# the probe's fault, not the budget's: since 2026-11-26 probes normalise with the global model's BatchNorm statistics
# (bench.recon_cells.PROBE_PROTOCOL, breaching's honest-but-curious case), and ResNet34 at 300 iterations reaches mean
# SSIM 0.37 on the 4 photos (0.06 in train mode, 0.01 random images; one run); the default cells, 3 seeds x 8 targets:
# SSIM minus random images' +0.19, lower end +0.14 (control passes). The ViT (no BatchNorm) stays short of it: FedSGD
# seed 0, 8 targets, gap over random images 0.106 at the defaults, 0.069 at tv 0.05, 0.112 at tv 0.5, 0.087 at lr 0.03,
# 0.101 with per-parameter cosines, 0.118 at 1,000 iterations (2026-11-26); APRIL is the ViT's attack (SSIM 1.0).
# At 2,000 iterations (session 2026-11-28, FedSGD, 3 seeds x 8 targets, the control's own bootstrap): gap 0.163,
# lower end 0.074 (tv 0.2); 0.164, lower end 0.082 (tv 1.0); ~5x a cell's time, and the control still fails: the
# reconstructions hold each patch's colours in the wrong place (ViT inversion's patch-order ambiguity; Hatamizadeh
# et al. 2022, GradViT, add a patch prior for it), and one target (0.6-0.7) carries most of the mean.
# GradViT's patch prior alone (the L2 norms of the pixel differences across every patch border, weighted and added
# to the TV term; FedSGD seed 0, 8 targets, gap over random images; session 2026-11-28, a scratch trial not kept):
# 300 its: 0.079 without, 0.096 / 0.069 / 0.046 / 0.040 at weight 0.05 / 0.5 / 2 / 8; 1,000 its: 0.105 without,
# 0.075 at 0.5. It does not lift the control. GradViT's other prior, a CNN's BatchNorm statistics (the cached
# pre-trained default ResNet34, eval mode, its BN layers' inputs of >= 4 positions matched to their running mean and
# variance, L2; prior gradient scaled to w x the matching gradient's L1 before the sign; same protocol; session
# 2026-11-28, scratch, not kept): 300 its: 0.079 without, 0.079 / 0.055 / 0.036 / 0.049 at w 0.1 / 0.3 / 1 / 3.
# 300 stays; the `paper` preset runs [FLRSP]'s 24,000. Session 2026-12-02: a uniform start, the best of 4 restarts
# and, for the FedAvg client's Adam (a one-step update of signs), matching by sign agreement (attacks/
# inverting_gradients.py; chosen on seed 0): 3 seeds x 8 targets, gap +0.172 FedAvg / +0.162 FedSGD, lower ends
# +0.100 / +0.089 (before +0.076 / +0.114): still short; ResNet34 +0.234 / +0.236 (before +0.191 / +0.171).
# 8 restarts instead of 4 (session 2026-12-02, scratch, the same targets): FedAvg seed 0 0.183 (4: 0.182), seed 1
# 0.184 (0.161), FedSGD seed 0 0.210 (0.216): no gain worth twice the time. The interval is wide because one photo
# (rocket, +0.43 to +0.77) carries the mean while client 0's Fashion-MNIST images sit near +0.1: more client targets
# would narrow the interval but lower the mean (about +0.135 at 16 targets, lower end ~+0.09 by the same spread).
INVERSION_ITERATIONS = {"smoke": 60, "default": 300, "paper": 24_000}


def fl_config(preset: str, arch: str) -> FLConfig:
    """smoke / default: the optimiser means the same in the FedAvg form (local steps) and the FedSGD form (the
    server's step on the mean gradient, :func:`bench.fl.server_step` for Adam). ``paper``: [FLRSP] Table 1."""
    if preset == "smoke":
        return FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=2,
            local_epochs=1,
            batch_size=16,
            lr=0.05,
            optimizer="sgd",
            mode="fedavg",
        )
    if preset == "default":
        # Calibrated for the positive control (issue 11: the undefended baseline's strongest attack at AUROC
        # >= 0.75) with test accuracy >= 0.7, seed 0, 1 thread (trials: run_federated with fedavg, loss-attack
        # AUROC of all members vs all non-members every few rounds; then the harness with rmia, 250 per side).
        # - 5 clients x 100 members: FedAvg's averaging dilutes each client's memorisation (global loss AUROC
        #   <= 0.56 after 6-45 epochs, SGD or Adam); 2 clients, each in every round, leak far more.
        # - 2 clients x 156 (the 250 evaluation members plus the attacker's 62), 3 local epochs per round,
        #   constant rate: ResNet34 SGD 0.1 reaches loss AUROC 0.73 / 0.77 (global, 20 / 25 rounds) at accuracy
        #   0.79; the ViT with Adam 3e-4 loses accuracy as it memorises (0.73 -> 0.68 by round 20, AUROC 0.73),
        #   at Adam 1e-4 it keeps 0.71-0.72 but stalls at AUROC 0.71. The harness at 20 rounds: rmia 0.736
        #   (ViT) / 0.750 (ResNet), short of the control.
        # - A cosine-decayed rate over the rounds (bench.fl.round_lr) fixes both: ViT Adam 3e-4, 30 rounds:
        #   accuracy 0.714, loss AUROC 0.766 global / 0.767 client (constant rate: 0.680, 0.735 / 0.722).
        # - ResNet34 at 30 rounds, 3 seeds in the harness: loss AUROC 0.748 (0.763 / 0.738 / 0.746), short of the
        #   control by 0.001-0.002 in the client view. 40 rounds (cosine over 40): loss 0.784 / 0.757 / 0.763,
        #   gradient_mia 0.770 client / 0.774 global (means of seeds 0-2), accuracy 0.779-0.793; 4 local epochs
        #   at 30 rounds gave less (loss 0.767 / 0.749 / 0.758). ViT unchanged (passes at 30).
        # ResNet34 SGD 0.1, ViT Adam 3e-4 (SGD stalls the ViT; FedSGD applies Adam on the server,
        # bench.fl.server_step). The positive control is read on the strongest attack.
        return FLConfig(
            num_clients=2,
            clients_per_round=2,
            rounds=30 if arch == "vit" else 40,
            local_epochs=3,
            batch_size=16,
            lr=3e-4 if arch == "vit" else 0.1,
            optimizer="adam" if arch == "vit" else "sgd",
            mode="fedavg",
            lr_schedule="cosine",
        )
    # [FLRSP] Table 1: 5 clients, batch 32, lr 1e-5 (ViT) / 1e-4 (ResNet), 10 epochs. The optimiser is not
    # named; Adam is assumed (those rates fine-tune pretrained models with Adam, not with plain SGD).
    return FLConfig(
        num_clients=5,
        clients_per_round=5,
        rounds=10,
        local_epochs=1,
        batch_size=32,
        lr=1e-5 if arch == "vit" else 1e-4,
        optimizer="adam",
        mode="fedavg",
    )
