"""Core data types shared by the harness, the defenses and the attacks.

The harness owns ground truth; a defense sees a client's data and the global state; an attack sees
only an :class:`Observation` built by the harness for the threat view it declares (docs/design.md s.2).
"""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence

import torch
from torch import Tensor, nn

View = Literal["global_model", "client_model", "client_update", "released_model"]
VIEWS: tuple[str, ...] = ("global_model", "client_model", "client_update", "released_model")
AttackKind = Literal["membership", "reconstruction"]


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
    kind: str = "weights"
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
    task: "TaskAPI"
    generator: torch.Generator
    num_selected: int
    global_state: dict[str, Tensor] = field(default_factory=dict)
    shared_names: tuple[str, ...] = ()
    log: dict[str, list] = field(default_factory=dict)  # per-step diagnostics a defense wants logged
    extras: Mapping[str, Any] = field(default_factory=dict)  # defender-side data a scenario provides
    run: DefenseRun | None = None  # this training run's state (the same object every round); None: a lone round

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


@dataclass(frozen=True)
class TaskAPI:
    """The public functions of a scenario: what the model computes, never which data it saw.

    Attacks and defenses call these instead of knowing the model family.
    """

    name: str
    family: str  # "image-cls" | "llm-text" | "vlm-caption" | "ldm-t2i"
    loss: Callable[[nn.Module, Any], Tensor]  # mean loss on a collated batch
    per_sample_loss: Callable[[nn.Module, Any], Tensor]  # [B] losses
    collate: Callable[[Sequence[Any]], Any]
    build_model: Callable[[], nn.Module]  # a fresh model of the same architecture (attacker's copy)
    info: Mapping[str, Any] = field(default_factory=dict)  # input_shape, num_classes, lora, arch, ...
    # LM scenarios: (model, batch, part) -> (logits [B,T,V], targets [B,T] or None, mask [B,T] bool), already
    # shifted so logits[:, t] predicts targets[:, t]; ``part`` is one of info["parts"] (e.g. "text", "image").
    logits: Callable[[nn.Module, Any, str], tuple[Tensor, Tensor | None, Tensor]] | None = None


@dataclass(frozen=True)
class Observation:
    """What an attack observes, built by the harness from the transcript (docs/design.md s.2)."""

    view: str
    model: nn.Module | None
    message: Message | None
    api: TaskAPI
    public: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0  # the cell seed: attacks seed their randomness from it
    # signals shared by the attacks of one (task, defense, seed) cell group, keyed by model state and
    # candidates (a bench.signal_cache.SignalCache, in memory only); None = every attack computes its own
    signals: Any = None


@dataclass
class Scores:
    """Per-candidate membership scores: higher means more likely a member."""

    scores: dict[str, Tensor]  # several named score variants (e.g. MaxRenyi-K%% for each alpha, K)
    primary: str = ""
    keep: tuple[str, ...] = ()  # further variants whose per-candidate scores the record keeps (for intervals)
    # score name -> (aux members' scores, aux non-members' scores) on attacker data the attack did not fit
    # on (e.g. cross-validated): the harness picks the ASR threshold there (metrics.asr_aux), never on the
    # evaluation candidates
    calibration: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.scores:
            raise ValueError("Scores needs at least one score vector")
        if not self.primary:
            self.primary = next(iter(self.scores))
        unknown = [k for k in (self.primary, *self.keep) if k not in self.scores]
        if unknown:
            raise ValueError(f"Scores: {unknown} are not among the score names {sorted(self.scores)}")


@dataclass
class Reconstructions:
    """Reconstructed inputs aligned with the targets, in the task's input space [N, C, H, W]."""

    images: Tensor
    labels: Tensor | None = None
    details: dict[str, Any] = field(default_factory=dict)


def params_of(obj: Any) -> dict[str, Any]:
    """Hyper-parameters of a defense or attack dataclass, as plain values."""
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    return {}


class Defense(abc.ABC):
    """Base class: a dataclass whose fields are the hyper-parameters (docs/design.md s.4).

    ``setting`` is "federated" (global/client views) or "central" (one trainer releasing a model).
    ``grid`` lists the configurations `--defense NAME` expands to; ``{}`` means the defaults.
    """

    name: ClassVar[str] = ""
    setting: ClassVar[str] = "federated"
    grid: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)
    paper: ClassVar[str] = ""

    def applies(self, task: TaskAPI) -> str | None:
        """Return None when the defense applies to the task, else the reason it does not."""
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

    def epsilon_composed(self, *, delta: float, rounds: int, sample_rate: float,
                         names: Sequence[str] | None = None) -> float | None:
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
    views: ClassVar[tuple[str, ...]] = ()
    kind: ClassVar[str] = "membership"
    grid: ClassVar[tuple[Mapping[str, Any], ...]] = ({},)
    paper: ClassVar[str] = ""
    uses_aux: ClassVar[bool] = False  # trains on the attacker's aux members / non-members (obs.public)

    def applies(self, task: TaskAPI) -> str | None:
        return None

    @abc.abstractmethod
    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores | Reconstructions:
        """Membership: score every candidate. Reconstruction: rebuild the inputs behind obs.message."""
