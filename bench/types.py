"""Core data types shared by the harness, the defenses and the attacks.

The harness owns ground truth; a defense sees a client's data and the global state; an attack sees
only an :class:`Observation` built by the harness for the threat view it declares (docs/design.md s.2).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence, Sized, cast

import torch
from torch import Tensor, nn

from .params import ADDED_KEY

View = Literal["global_model", "client_model", "client_update", "released_model"]
VIEWS: tuple[str, ...] = ("global_model", "client_model", "client_update", "released_model")
AttackKind = Literal["membership", "reconstruction"]
Setting = Literal["federated", "central"]  # a defense's threat setting: federated views or a released model
MessageKind = Literal["gradient", "weights"]  # FedSGD sends a gradient, FedAvg the weights after local training
Family = Literal["image-cls", "llm-text", "vlm-caption", "ldm-t2i"]
# The model argument of a scenario's hooks (loss, logits, generate, ...) is that scenario's own nn.Module subclass
# (SmallVLM, LatentDiffusion, ...); callable parameters are contravariant, so hooks typed on nn.Module would reject
# them. The harness only ever passes the model the scenario built.
ScenarioModel = Any
FLMode = Literal["fedavg", "fedsgd"]  # FedAvg sends weights after local epochs, FedSGD one gradient per round


class NotApplicable(Exception):
    """Raised (or returned as a reason) when a cell does not apply; recorded as ``n/a``."""


@dataclass(frozen=True)
class Message:
    """What one client sent in one round, as the server's transcript keeps it.

    ``kind`` is ``"gradient"`` (FedSGD) or ``"weights"`` (FedAvg: parameters after local training).
    ``meta`` carries public side information the protocol itself sends (e.g. which LoRA half).
    """

    client: int
    round: int
    tensors: dict[str, Tensor]
    num_samples: int
    kind: MessageKind = "weights"
    meta: Mapping[str, Any] = field(default_factory=dict)

    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.tensors.values()))

    def numel(self) -> int:
        return int(sum(t.numel() for t in self.tensors.values()))


@dataclass(frozen=True)
class FLConfig:
    """Federated settings pinned by a scenario preset."""

    num_clients: int = 4
    clients_per_round: int = 4
    rounds: int = 2
    local_epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-3
    optimizer: str = "sgd"  # "sgd" | "adam" | "adamw"
    weight_decay: float = 0.0
    mode: str = "fedavg"  # "fedavg" (weights after local epochs) | "fedsgd" (one gradient per round)
    dirichlet_alpha: float | None = None  # None = IID
    max_local_steps: int | None = None  # cap on local steps per round (CPU budget)
    # "constant", or "cosine": round r of R trains at lr * (1 + cos(pi * r / R)) / 2 (bench.fl.round_lr)
    lr_schedule: str = "constant"
    # BatchNorm statistics of local training: "batch" (train mode: each batch's own statistics) or "public" (eval
    # mode: the global model's running statistics, as breaching's honest-but-curious server ships its BatchNorm
    # buffers to the users, ``provide_public_buffers``). Reconstruction probes send batch-1 updates with "public":
    # batch-1 train-mode BatchNorm is an instance norm, a different function from the model (bench.cells).
    batchnorm_stats: str = "batch"


@dataclass
class DefenseRun:
    """Per-training-run state of one (task, defense config, seed), created by the harness.

    Defense dataclasses hold hyper-parameters only and are never mutated by a run; what a run needs or
    accumulates (the resolved DP ``delta``, a server optimiser's momentum, ...) lives here
    (:mod:`bench.run_state` creates it; ``Defense.start_run`` fills ``state``).
    """

    delta: float  # the DP delta of this run: the defense's configured one, else the scenario's dp_delta
    seed: int = 0
    state: dict[str, Any] = field(default_factory=dict)  # the defense's mutable per-run objects


@dataclass
class RoundCtx:
    """Everything a defense may know about the current round besides its own client's data."""

    round: int
    rounds: int
    fl: FLConfig
    task: TaskAPI
    generator: torch.Generator
    num_selected: int
    global_state: dict[str, Tensor] = field(default_factory=dict)
    shared_names: tuple[str, ...] = ()
    log: dict[str, list] = field(default_factory=dict)  # per-step diagnostics a defense wants logged
    extras: Mapping[str, Any] = field(default_factory=dict)  # defender-side data a scenario provides
    run: DefenseRun | None = None  # this training run's state (the same object every round); None: a lone round
    # the run's checkpoint (bench.checkpoint.Checkpoint) for a loop that saves within a round (a central run's
    # epochs: defenses/_lora_common.lora_loop); None: no checkpoints
    checkpoint: Any = None

    def log_value(self, key: str, value: float) -> None:
        self.log.setdefault(key, []).append(float(value))


@dataclass
class ClientState:
    """One client at the start of its local round.

    ``model`` already holds the global state; ``private`` persists across this client's rounds
    (FedRand's kept half, FedPara's private pair, an optimiser state, ...).
    """

    client: int
    model: nn.Module
    data: torch.utils.data.Dataset
    private: dict[str, Any]


def n_items(ds: torch.utils.data.Dataset) -> int:
    """``len(ds)`` of a map-style dataset: torch's ``Dataset`` type leaves ``__len__`` optional, and every
    dataset the suite builds has one."""
    return len(cast(Sized, ds))


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the model's ``targets`` (rank ``r``, scale ``alpha / r``): what LoRA defenses need."""

    r: int
    alpha: float
    targets: tuple[str, ...]


@dataclass(frozen=True)
class ImageSpec:
    """An image classifier's inputs ``[C, H, W]`` normalised by ``mean`` / ``std`` and its classes: what
    gradient inversion needs ([InvGrad], [APRIL]) and how reconstructions are scored in pixel space."""

    input_shape: tuple[int, int, int]
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...] = ()
    inversion_iterations: int = 300  # the scenario's default for attacks whose ``iterations`` is None


@dataclass(frozen=True)
class ViTSpec:
    """A vision transformer's learnable positional and patch embeddings (parameter names): [APRIL] and
    the fixed-position defense use them."""

    pos_embed_param: str
    patch_embed_param: str
    patch_size: int
    num_prefix_tokens: int = 1
    class_token: bool = True


@dataclass(frozen=True)
class TokenSpec:
    """A language model's token layout (llm-text, vlm-caption)."""

    vocab_size: int
    max_len: int
    pad_id: int
    num_categories: int | None = None  # llm-text: topic categories of the corpus


@dataclass(frozen=True)
class CaptionSpec:
    """A captioning VLM's prompt layout and greedy captioner ``generate(model, batch) -> list[str]``."""

    num_image_tokens: int
    image_start: int
    prompt_len: int
    image_size: int
    num_classes: int | None = None  # grounded captions name one of these classes (None: free captions)
    generate: Callable[[ScenarioModel, Any], list[str]] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class DiffusionSpec:
    """A latent-diffusion model's noise schedule and the timesteps its losses are evaluated at."""

    num_timesteps: int
    eval_timesteps: tuple[int, ...]
    image_size: int


@dataclass(frozen=True)
class DiffusionOps:
    """Per-timestep hooks of a diffusion scenario (:mod:`bench.signals`, MP-/SMP-LoRA):
    ``loss_at_timestep(model, batch, t) -> [B]``, ``denoise_error(model, batch, ...) -> [B]`` (the proxy
    attack's signal), optionally ``loss_at_timesteps(model, batch, ts) -> [B, len(ts)]`` (one encoder
    pass for all timesteps) and ``prepare(model, batch, ts) -> batch`` (the batch with its data-dependent
    inputs computed ahead, so per-sample gradients run under ``torch.func.vmap``; ``ts`` empty: the
    ``per_sample_loss`` steps)."""

    loss_at_timestep: Callable[[ScenarioModel, Any, int], Tensor]
    denoise_error: Callable[..., Tensor]
    loss_at_timesteps: Callable[[ScenarioModel, Any, Sequence[int]], Tensor] | None = None
    prepare: Callable[[ScenarioModel, Any, Sequence[int]], Any] | None = None


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    """What a task offers (plain data, no functions): the only fields ``applies()`` of a defense or attack
    may read, so applicability is decided by this declaration alone (tests/test_scenario_conformance.py).

    Which fields make what apply: ``lora`` -> the LoRA defenses (``fedper`` also reads ``num_layers``);
    ``vit`` -> ``fixed_position``, ``april``; ``image`` -> ``inverting_gradients``, ``april``; ``parts`` (an
    LM head: ``TaskAPI.logits``) -> ``max_renyi``; ``diffusion`` + ``aux_sets`` + ``lora`` (``ldm-t2i``) ->
    ``lora``, ``mp_lora``, ``smp_lora``; ``population_size`` > 0 -> reference-model attacks (``rmia``);
    ``dp_delta`` -> the DP delta of defenses that do not fix one.
    """

    name: str
    family: Family
    arch: str = ""  # model architecture ("vit", "resnet34", "llama", "openelm", "unet", ...)
    num_layers: int | None = None  # transformer blocks (LoRA layer indices run 0 .. num_layers - 1)
    lora: LoraSpec | None = None
    parts: tuple[str, ...] = ()  # slices of the LM logits (e.g. "image", "caption"); non-empty iff TaskAPI.logits
    image: ImageSpec | None = None
    vit: ViTSpec | None = None
    diffusion: DiffusionSpec | None = None  # with TaskAPI.diffusion_ops
    aux_sets: bool = False  # the defender holds aux member / non-member sets in Task.extras (MP-/SMP-LoRA)
    dp_delta: float | None = None  # the DP delta of defenses that fix none (bench.run_state.resolve_delta)
    population_size: int = 0  # attacker-side population items (Task.population) for reference models ([RMIA])

    def spec(self) -> TaskSpec:
        """These declared fields alone, as a plain :class:`TaskSpec` (what a static declaration must equal)."""
        return TaskSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TaskSpec)})


@dataclass(frozen=True, kw_only=True)
class TaskAPI(TaskSpec):
    """The public functions of a scenario: what the model computes, never which data it saw.

    Attacks and defenses call these instead of knowing the model family; the :class:`TaskSpec` fields
    say which of them apply.
    """

    loss: Callable[[ScenarioModel, Any], Tensor]  # mean loss on a collated batch
    per_sample_loss: Callable[[ScenarioModel, Any], Tensor]  # [B] losses
    collate: Callable[[Sequence[Any]], Any]
    build_model: Callable[[], nn.Module]  # a fresh model of the same architecture (attacker's copy)
    # LM scenarios: (model, batch, part) -> (logits [B,T,V], targets [B,T] or None, mask [B,T] bool), already
    # shifted so logits[:, t] predicts targets[:, t]; ``part`` is one of ``parts`` (e.g. "text", "image").
    logits: Callable[[ScenarioModel, Any, str], tuple[Tensor, Tensor | None, Tensor]] | None = None
    tokens: TokenSpec | None = None
    caption: CaptionSpec | None = None
    diffusion_ops: DiffusionOps | None = None
    # an item's padded length where a batch pads to its longest item (token sequences): per-sample scoring
    # batches items of similar length together (bench.signals.length_sorted); None: items batched as given
    length: Callable[[Any], int] | None = None


@dataclass(frozen=True)
class Public:
    """Side information the harness gives an attack besides its view's model and message.

    Membership attacks with ``uses_aux``: the attacker's labelled auxiliary members / non-members.
    Reconstruction probes (``client_update``): the global state the intercepted client started from, its
    learning rate, local steps, batch size and the FL mode, so a weights message can be turned back into
    an update direction ([InvGrad]).
    """

    aux_members: Sequence[Any] = ()
    aux_nonmembers: Sequence[Any] = ()
    global_state: Mapping[str, Tensor] | None = field(default=None, compare=False)
    lr: float | None = None
    local_steps: int | None = None
    num_samples: int | None = None
    mode: FLMode | None = None
    batchnorm_stats: str | None = None  # FLConfig.batchnorm_stats of the intercepted update (None: "batch")
    optimizer: str | None = None  # FLConfig.optimizer of the intercepted client (None: not stated)


@dataclass(frozen=True)
class Observation:
    """What an attack observes, built by the harness from the transcript (docs/design.md s.2)."""

    view: View
    model: nn.Module | None
    message: Message | None
    api: TaskAPI
    public: Public = field(default_factory=Public)
    seed: int = 0  # the cell seed: attacks seed their randomness from it
    # signals shared by the attacks of one (task, defense, seed) cell group, keyed by model state and
    # candidates (a bench.signal_cache.SignalCache, in memory only); None = every attack computes its own
    signals: Any = None
    # reference models and population samples for reference-model attacks ([RMIA], [LiRA]): a
    # bench.reference.Reference the harness builds for attacks with ``uses_reference``; None = not provided
    reference: Any = None
    # the pre-trained base model's builder (``api.build_model``: the checkpoint the fine-tuning started from,
    # public in LoRA fine-tuning) for attacks with ``uses_base``; None = not provided
    base_model: Callable[[], nn.Module] | None = None


@dataclass
class Scores:
    """Per-candidate membership scores: higher means more likely a member."""

    scores: dict[str, Tensor]  # several named score variants (e.g. MaxRenyi-K%% for each alpha, K)
    primary: str = ""
    # score name -> (aux members' scores, aux non-members' scores) on attacker data the attack did not fit
    # on (e.g. cross-validated): the harness picks the ASR threshold there (metrics.asr_aux), never on the
    # evaluation candidates
    calibration: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # what the attack states about how it scored (JSON-able; the record's ``attack_details``), e.g. each
    # slice's token count so a reader sees what MaxRenyi-K% of a slice means
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.scores:
            raise ValueError("Scores needs at least one score vector")
        if not self.primary:
            self.primary = next(iter(self.scores))
        unknown = [k for k in (self.primary,) if k not in self.scores]
        if unknown:
            raise ValueError(f"Scores: {unknown} are not among the score names {sorted(self.scores)}")


@dataclass
class Reconstructions:
    """Reconstructed inputs aligned with the targets, in the task's input space [N, C, H, W]."""

    images: Tensor
    labels: Tensor | None = None
    details: dict[str, Any] = field(default_factory=dict)


def params_of(obj: Any) -> dict[str, Any]:
    """Hyper-parameters of a defense or attack dataclass, as plain values; a field declared
    ``param(..., added=True)`` is left out at its default (``bench.params``: earlier records stay valid)."""
    if not dataclasses.is_dataclass(obj):
        return {}
    return {
        f.name: getattr(obj, f.name)
        for f in dataclasses.fields(obj)
        if f.init and not (f.metadata.get(ADDED_KEY) and getattr(obj, f.name) == f.default)
    }


class Defense(abc.ABC):
    """Base class: a dataclass whose fields are the hyper-parameters (docs/design.md s.4).

    ``setting`` is "federated" (global/client views) or "central" (one trainer releasing a model).
    ``grid`` lists the configurations `--defense NAME` expands to; ``{}`` means the defaults.
    """

    name: ClassVar[str] = ""
    setting: ClassVar[Setting] = "federated"
    grid: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)
    paper: ClassVar[str] = ""
    # the optional TaskAPI fields this defense reads: set on every task its applies() accepts (checked
    # over every scenario by tests/test_scenario_conformance.py)
    requires: ClassVar[tuple[str, ...]] = ()

    def applies(self, task: TaskSpec) -> str | None:
        """Return None when the defense applies to the task, else the reason it does not. Reads the
        :class:`TaskSpec` fields only (a full :class:`TaskAPI` is one), so it can be decided statically."""
        return None

    def fl_mode(self) -> str | None:
        """Force the FL protocol ("fedavg" or "fedsgd"); None keeps the scenario's."""
        return None

    def setup(self, model: nn.Module, task: TaskAPI) -> nn.Module:
        """Prepare the global model before round 0 (e.g. add private modules). Default: unchanged."""
        return model

    def dp_delta(self) -> float | None:
        """The DP delta this configuration fixes; None: the scenario's (``bench.run_state.resolve_delta``)."""
        return None

    def start_run(self, run: DefenseRun) -> None:
        """Put this training run's mutable objects (e.g. a server optimiser) in ``run.state``. Default: none."""
        return None

    def sensitivity_note(self) -> str:
        """The neighbouring relation and L2 sensitivity behind the epsilon (recorded as privacy.sensitivity)."""
        return ""

    @abc.abstractmethod
    def client_step(self, state: ClientState, ctx: RoundCtx) -> Message:
        """Train locally from ``state`` and return the message this client sends."""

    @abc.abstractmethod
    def aggregate(self, global_state: dict[str, Tensor], msgs: Sequence[Message], ctx: RoundCtx) -> dict[str, Tensor]:
        """Combine the round's messages into the new global state (shared names only)."""

    def epsilon(self, *, delta: float) -> float | None:
        """The paper's per-release epsilon; None where no formal guarantee is claimed."""
        return None

    def epsilon_composed(
        self, *, delta: float, rounds: int, sample_rate: float, names: Sequence[str] | None = None
    ) -> float | None:
        """Epsilon over all rounds with client sampling (opacus accountant); None if not DP.
        ``names``: the shared parameter names (a defense whose release count depends on them)."""
        return None

    def downlink_names(self, ctx: RoundCtx, client: int) -> Sequence[str] | None:
        """Parameters the server sends this client this round; None = the whole global state."""
        return None


class Attack(abc.ABC):
    """Base class: a dataclass whose fields are the hyper-parameters.

    ``views``: the threat views the attack can observe; ``kind``: membership or reconstruction.
    """

    name: ClassVar[str] = ""
    views: ClassVar[tuple[View, ...]] = ()
    kind: ClassVar[AttackKind] = "membership"
    grid: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)
    paper: ClassVar[str] = ""
    uses_aux: ClassVar[bool] = False  # trains on the attacker's aux members / non-members (obs.public)
    uses_base: ClassVar[bool] = False  # scores with the pre-trained base model as well (obs.base_model)
    # compute-budget fields and their caps for a conformance run (``bench check``: output types, not
    # strength); a field whose value is None ("the scenario's") is capped too
    budget: ClassVar[Mapping[str, int]] = {}
    # the optional TaskAPI fields this attack reads: set on every task its applies() accepts
    requires: ClassVar[tuple[str, ...]] = ()

    def applies(self, task: TaskSpec) -> str | None:
        """None when the attack applies to the task, else the reason; reads :class:`TaskSpec` fields only."""
        return None

    def resolved(self, task: TaskSpec) -> dict[str, Any]:
        """The values this configuration leaves to the task (fields set to None, "the scenario's") as ``task``
        resolves them: the record keeps them, so a scenario that changes one makes its records stale."""
        return {}

    @abc.abstractmethod
    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores | Reconstructions:
        """Membership: score every candidate. Reconstruction: rebuild the inputs behind obs.message."""

    def run_batch(self, observations: Sequence[Observation]) -> Sequence[Scores | Reconstructions]:
        """Reconstruction: every observation's reconstruction, in order (override to share work across
        targets). Default: ``run`` on each."""
        return [self.run(o, None) for o in observations]
