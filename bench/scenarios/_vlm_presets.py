"""The vlm-caption scenario's presets (:data:`SPECS`: what smoke / default / paper pin, with the measurements that
chose them) and the attacker's population size per preset. The scenario itself: :mod:`bench.scenarios.vlm_caption`."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.types import FLConfig
from models import vlm

PAPER_DATA_ENV = "BENCH_VLM_PAPER_DATA"


@dataclass(frozen=True)
class Spec:
    """What a preset pins (one entry of :data:`SPECS`, keyed by ``bench.task.PRESETS``)."""

    model: str  # "tiny" | "effnet-smollm2" | "tinyllava"
    n_members: int
    n_nonmembers: int
    n_test: int
    fl: FLConfig
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    canvas: int = 32  # rendered image side (px)
    side: int = 2  # visual tokens = side x side pooled grid of the encoder's feature map
    encoder_size: int = 128  # EfficientNet-Lite0 input side (px)
    n_public: int = 0  # projector-alignment images (Fashion-MNIST train split)
    projector_steps: int = 0
    projector_batch: int = 16
    projector_lr: float = 1e-3
    train_projector: bool = False  # True: the projector is trained and federated too (not [FedRand]'s setting)
    max_caption_tokens: int = 32
    gen_items: int = 16  # held-out images captioned for the utility
    gen_tokens: int = 24
    tiny: dict = field(default_factory=dict)
    max_membership: int = 64
    central_epochs: int | None = None  # the released view's central LoRA epochs (None: fl.local_epochs)
    # private (and population) captions end with an annotator detail (bench.captions.detail) the image does not
    # show; projector-alignment captions never do
    caption_detail: bool = False
    data_seed: int = 0
    model_seed: int = 0
    notes: dict = field(default_factory=dict)


SPECS: dict[str, Spec] = {
    # Over-fits on purpose (many local epochs, high lr, small clients) so the membership attacks' positive
    # controls have something to find; a FedAvg run is ~170 steps of ~40 ms (single thread). Measured (4 seeds,
    # all of the target client's images vs as many non-members): FedAvg client-view MaxRényi-10% caption
    # AUROC 0.87-0.93 at 6 local epochs (0.76-0.86 at 4); the image slice stays at 0.41-0.61.
    # The projector stays random and frozen: aligning it to a random LM teaches it nothing.
    "smoke": Spec(
        model="tiny",
        n_members=96,
        n_nonmembers=96,
        n_test=48,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=2,
            local_epochs=6,
            batch_size=8,
            lr=5e-3,
            optimizer="adamw",
            weight_decay=0.0,
            dirichlet_alpha=0.5,
        ),
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        canvas=32,
        side=2,
        gen_items=8,
        gen_tokens=16,
        max_membership=32,
        # init_std 0.2 (llm-text smoke: 0.1): the tied output layer after RMSNorm bounds the logits, and at
        # 0.1 even a memorised token keeps a Rényi-0.5 entropy near 3 nats over the small vocabulary, so
        # MaxRényi could not separate members (measured at 4 local epochs, client view: AUROC 0.55-0.6 at 0.1,
        # 0.85-0.89 at 0.2 over 3 seeds; one seed: 0.62 at 0.4, 0.41 at 0.6 - confidently wrong on non-members).
        tiny=dict(hidden=64, layers=5, heads=4, intermediate=128, init_std=0.2),
    ),
    # Candidates and participation as llm-text default (issue 11): 312 members over 4 clients, all 4 in every
    # round, 250 candidates per side in the global view (the aux split holds back 62 per side), 312 non-members.
    # Visual tokens: EfficientNet-Lite0 at 224 px gives a 7x7 feature map, kept whole as 49 visual tokens
    # (LLaVA: 576), so MaxRenyi-K% of the image slice averages floor(K% x 49) positions (K=0: 1, K=10: 4);
    # the caption slice has 10-18 positions (mean 13.8 with eos), where K=0 and K=10 both pick one (the
    # record's attack_details states the counts).
    # Budget: llm-text default's recipe (4 rounds x 1 local epoch, no step cap; LoRA r=16 on every linear layer,
    # AdamW 5e-3), where FedAvg's loss attack cleared AUROC 0.75 in both views. Client sizes 102 / 54 / 99 / 57:
    # 41 steps of batch 8 per round, 164 per training run, every member seen 4 times.
    # Measured at this budget (session 2026-11-25, FedAvg seed 0, 250 + 250 candidates): the positive control FAILS
    # with grounded captions alone: loss AUROC 0.527 global / 0.533 client, MaxRenyi 0.52 / 0.50 (the only
    # member-specific content is which of 5 phrasings an image got, ~1.6 nats). More local epochs do not fix it:
    # 3 local epochs per round (scratch run, loss attack on the global model): AUROC 0.505 after round 1, 0.532
    # after round 2, while the mean caption loss fell 1.68 -> 0.85 (the model generalises the grounded words).
    # Hence ``caption_detail``: every private caption ends with an annotator detail the image does not show
    # (~9.5 nats, e.g. "beside a wooden lamp in the hallway"), as natural captions carry; fortunes (llm-text) leak
    # at this recipe for the same reason. Measured with details (harness, FedAvg seed 0, 250 + 250): loss AUROC 0.608
    # [0.56, 0.66] global / 0.642 [0.60, 0.69] client (proxy 0.652), base model 0.51; MaxRenyi 0.52 / 0.50 - better,
    # still short of the control (0.75); CIDEr 13.1 (the generated detail is not in the grounded references),
    # perplexity 2.70. Hence 3 local epochs per round (every member seen 12 times; training ~3x as long, ~70 min
    # on this loaded machine). Measured (harness, FedAvg seed 0, 250 + 250, session 2026-11-25): loss AUROC 0.847
    # [0.81, 0.88] client view (the view of [FedRand]'s claim): PASSES; 0.666 [0.62, 0.71] global view (the average
    # of 4 clients' updates dilutes each member): still FAILS; base model 0.51; CIDEr 15.9, perplexity 2.55.
    # Exposures matter, not detail length: two details per caption (~17 nats) at 1 local epoch (scratch run, the
    # same harness) gave 0.595 global / 0.646 client, as one detail did (0.608 / 0.642). Next for the global view:
    # more rounds or epochs (each epoch ~19 min of training here). Stronger attacks on the same FedAvg seed-0 run
    # (250 + 250) do not lift it to 0.75: gradient_mia 0.543 (session 2026-12-01); RMIA with 4 reference runs of the
    # target's recipe (each ~53 min here, --jobs 2) 0.688, its offline LiRA 0.695, against loss 0.645 on that run
    # (session 2026-12-02; the cell 1,104 s at 2 threads).
    # Hence 6 rounds (session 2026-12-03, AMD EPYC, 1 thread, the other core busy; a scratch run of the harness's
    # FedAvg seed 0 with round checkpoints, the loss attack on the global model after each round, the harness's
    # 250 + 250 candidates): AUROC 0.631 [0.58, 0.68] after round 3, 0.666 [0.62, 0.71] after round 4 (the published
    # 4-round cell's 0.666, from another machine), 0.689 [0.65, 0.73] after 5, 0.768 [0.73, 0.81] after 6: the
    # loss attack alone clears 0.75, with its lower end > 0.1 above the base model's 0.51. A higher lr does not:
    # AdamW 1e-2 gave 0.541 [0.49, 0.59] after round 3 (5e-3: 0.631). Each round ~13 min of training here (plus
    # ~3.5 min per scoring), so training and reference runs cost 1.5x the 4-round budget's.
    # The harness at this budget (session 2026-12-03, `bench run`, FedAvg seed 0, --jobs 2, training 4,982 s): loss
    # AUROC 0.768 [0.72, 0.81] global / 0.911 [0.88, 0.94] client, base model 0.509 [0.45, 0.55] on the same
    # candidates: the control passes in both views; gradient_mia 0.637 / 0.772, ref_loss 0.571 / 0.736, MaxRenyi
    # 0.466 / 0.507; CIDEr 22.0 (4 rounds: 15.9), perplexity 2.57.
    # Measured costs (session 2026-11-27, 1 thread per process, the other core busy): projector alignment 8.1-8.4 s
    # per step (200 steps ~27 min, once per machine); a training run at this budget 2,371 s (FedAvg) / 2,393 s
    # (FedRand) with two runs side by side (--jobs 2).
    # Earlier note (before the measurement): the positive control has not been run at this budget (the session's
    # machine could not align the projector in time). Measured step cost (batch 8, 1 thread, machine at load
    # ~17 on 2 cores, so CPU time is inflated too): side 7 (87 tokens), r=16 on every linear: 16-18 s CPU,
    # 175-195 s wall; side 2 (~42 tokens), r=8 on q,v (the earlier default): 7.3-7.5 s CPU, 54-56 s wall, where a
    # quiet machine gave ~2 s. Scaling by the CPU ratio (2.3x): ~4.5 s per step quiet, ~12 min per training run.
    # The earlier budget (side 2, r=8 on q,v, lr 1e-3, 96 members, 3 rounds x 2 of 4 clients x 15 steps) measured
    # on FedAvg seed 0: client-view loss-attack AUROC 0.93 (0.67 at lr 3e-4), MaxRenyi-10% caption 0.56,
    # held-out class accuracy 0.40 (the aligned base model: 0.19).
    "default": Spec(
        model="effnet-smollm2",
        n_members=312,
        n_nonmembers=312,
        n_test=128,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=6,
            local_epochs=3,
            batch_size=8,
            lr=5e-3,
            optimizer="adamw",
            weight_decay=1e-6,
            dirichlet_alpha=0.5,
            max_local_steps=None,
        ),
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        canvas=64,
        side=7,
        encoder_size=224,
        max_membership=250,
        central_epochs=4,
        caption_detail=True,
        # stage-1 alignment (batch 16, backward through the frozen LM; cached once per projector_key): ~13 min at
        # side 2 on a quiet machine; side 7 (87-token sequences) re-aligns: measured one step at 34.6 s CPU / 211 s
        # wall under load ~17 (~115 min CPU for 200 steps there); scaled as the training steps, ~30 min quiet
        n_public=3200,
        projector_steps=200,
        projector_batch=16,
        projector_lr=2e-3,
        gen_items=48,
        gen_tokens=24,
    ),
    # [FedRand] s.4.1 and App. A.1: 50k MSCOCO training images, 5k held out; 12 clients, 4 per round, 30 rounds
    # of one local epoch, AdamW 3e-4, wd 1e-6, batch 8, LoRA rank 8; 300 members vs 300 non-members.
    "paper": Spec(
        model="tinyllava",
        n_members=50000,
        n_nonmembers=5000,
        n_test=5000,
        fl=FLConfig(
            num_clients=12,
            clients_per_round=4,
            rounds=30,
            local_epochs=1,
            batch_size=8,
            lr=3e-4,
            optimizer="adamw",
            weight_decay=1e-6,
            dirichlet_alpha=None,
        ),
        lora_r=8,
        lora_alpha=16,
        lora_dropout=0.05,
        lora_targets=vlm.OPENELM_LORA_TARGETS,
        max_caption_tokens=64,
        gen_items=5000,
        gen_tokens=32,
        max_membership=300,
        notes={
            "split": "IID: the Karpathy split has no object classes (papers/000 splits MSCOCO by object class "
            "with Dirichlet(0.5))",
            "nonmembers": "held-out MSCOCO (same distribution); papers/000 used NoCaps (a distribution shift)",
            "lora_alpha": "not stated in papers/000; 2 x rank",
        },
    ),
}


# Attacker-side population images per preset (reference models, [RMIA] / [LiRA]): Fashion-MNIST test images outside
# the private splits, rendered like them; half train the reference models (>= the members' count, bench.reference.
# population_split), half are z samples: default 1,200 = a 600-image pool for 312-member reference runs and 600 z
# (llm-text's sizes; 512 could not hold one reference training set of the default's 312 members).
N_POPULATION = {"smoke": 256, "default": 1200, "paper": 0}
