"""Reference models for reference-model membership inference ([RMIA] offline, [LiRA] offline).

The attacker trains R reference models with the target's recipe (the scenario's model, data sizes and FL
settings, the same defense configuration and budget: what a server or a model user knows) on population data
(``Task.population``) disjoint from every evaluation candidate, each with its own seed: the offline setting,
no reference model ever trains on a candidate. Per cell seed the population is split once into a training
pool (each reference model draws the target's training-set size from it) and a z pool ([RMIA]'s population
samples z, in no reference model's training data). Federated recipe: the draw is split over the
clients as the target's data is: an IID target's draw is cut into chunks of the target clients' sizes; a
Dirichlet(alpha) target's (``FLConfig.dirichlet_alpha``) is split by the same ``bench.fl.split_clients`` and
alpha over the population items' labels, seeded by the reference's own seed. Central recipe (released model):
one set of the central training size. The client view's reference model is the reference run's client of the
same index: one client's local training under the same protocol. The defender's own data (``Task.extras``:
[SMP-LoRA]'s D_aux for MP- / SMP-LoRA) plays the same part in a reference run (:func:`reference_extras`).

Reference runs are cached like training runs (safetensors + JSON, ``bench.cachefile``, written atomically)
under ``<cache>/reference/<key>``, the key = the target's train key + the reference index + a fingerprint of
the reference's training data (+ the split when it is Dirichlet), so every cell and view of a (task, defense,
seed) reuses them. The engine trains them as units of their own before the cells that use them
(:func:`reference_units`, :func:`train_reference`); a cell finding one missing trains it in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import numpy as np
from torch import nn
from torch.utils.data import Dataset

from . import cachefile
from .checkpoint import Checkpoint, path_for
from .fl import TrainResult, client_model_state, run_federated, seeded_fedsgd, split_clients
from .signal_cache import fingerprint
from .store import stable_hash
from .task import Task
from .training import build_trained_model, decode_run, keep_target_client, label, run_key, save_run, train_key
from .types import Defense, n_items

REF_SALT = 0x524D4941  # "RMIA": the population split's random stream, apart from every other draw
DEFAULT_COUNT = {"smoke": 2}  # reference models when the attack leaves R to the preset; 4 elsewhere ([RMIA])
_MEMO: dict[str, TrainResult] = {}  # this process's last reference runs (a cell group's cells reuse them)
_MEMO_MAX = 8
# the content hash of each reference run's population items, by (population object, n_train, seed, r): a plan asks
# for the same run's key several times (cached? checkpointed? identities?) and hashing its items took ~30% of a
# whole-matrix dry run; the population object is kept beside its hash, so a new object with a reused id misses
_DATA_FP: dict[tuple[int, int, int, int], tuple[Any, str]] = {}


def default_count(preset: str) -> int:
    return DEFAULT_COUNT.get(preset, 4)


def ref_seed(seed: int, r: int) -> int:
    """Reference model ``r``'s training seed: its own stream, never the target's."""
    return 1_000_003 * (r + 1) + seed


def training_sizes(task: Task, defense: Defense | None) -> list[int]:
    """The target's training-set sizes: one per client, or the central training set's (released model)."""
    if defense is not None and defense.setting == "central":
        if task.central_data is None:
            raise ValueError(f"task {task.id} has no central training set")
        return [n_items(task.central_data)]
    return [n_items(c) for c in task.client_data]


@dataclass(frozen=True)
class PopulationSplit:
    """Positions in ``Task.population``: the reference models' training pool and the z pool (disjoint)."""

    train_pool: list[int]
    z_pool: list[int]


def population_split(n_population: int, n_train: int, seed: int) -> PopulationSplit:
    """Half the population (in a seeded order) is the training pool, the rest the z pool; the training pool
    must hold one reference training set."""
    half = n_population // 2
    if half < n_train:
        raise ValueError(
            f"the population has {n_population} items; reference models need a training pool of "
            f"{n_train} (the target's training-set size) plus as many z samples, {2 * n_train} in all"
        )
    perm = np.random.default_rng([seed, REF_SALT]).permutation(n_population).tolist()
    return PopulationSplit(perm[:half], perm[half:])


def reference_indices(split: PopulationSplit, n_train: int, seed: int, r: int) -> list[int]:
    """Reference ``r``'s training data: ``n_train`` positions drawn from the training pool without replacement."""
    rng = np.random.default_rng([seed, REF_SALT, r + 1])
    return [split.train_pool[i] for i in rng.choice(len(split.train_pool), n_train, replace=False).tolist()]


def dirichlet_alpha(task: Task, defense: Defense | None) -> float | None:
    """The target's client split: Dirichlet(alpha) label skew, or None (IID chunks; the central setting)."""
    central = defense is not None and defense.setting == "central"
    return None if central else task.fl.dirichlet_alpha


def population_labels(task: Task, positions: list[int]) -> list[int]:
    """The labels of population items at ``positions`` (what a Dirichlet split skews by): the population
    dataset's ``labels`` (every scenario's datasets carry them)."""
    labels = getattr(task.population, "labels", None)
    if labels is None:
        raise ValueError(
            f"task {task.id} splits its clients Dirichlet({task.fl.dirichlet_alpha}) by label, but its population "
            f"data ({type(task.population).__name__}) has no `labels` to split the reference clients by"
        )
    return [int(labels[i]) for i in positions]


# Task.extras keys holding evaluation candidates (ldm-t2i: D_te^m, D_te^nm): no reference run holds them.
CANDIDATE_EXTRAS = ("te_members", "te_nonmembers")


def reference_extras(task: Task, items: list[Any]) -> dict[str, Any]:
    """``Task.extras`` of a reference run trained on ``items``: the target's recipe, no evaluation candidate.

    The defender's proxy data D_aux of MP- / SMP-LoRA ([SMP-LoRA] Alg. 1-2: a proxy attack h trained on
    D_aux^m vs D_aux^nm, which the LoRA learns to fool) plays the same part for a reference model:

    - ``aux_members`` (D_aux^m, part of the target's training set) becomes the first |D_aux^m| reference items, a
      random part of the reference's own training set (``items`` is a seeded draw): the proxy's members must be
      members of the model it is played against; the target's D_aux^m are non-members of every reference model.
    - ``aux_nonmembers`` (D_aux^nm) is kept: in neither the target's nor any reference's training data, and no
      evaluation candidate, since the task scores only its ``eval_subsets`` (ldm-t2i: D_te^m vs D_te^nm; D_aux
      is the attacker's aux split). A task without ``eval_subsets`` may score any non-member, so it is refused.
    - :data:`CANDIDATE_EXTRAS` are dropped (no defense reads them); other entries (flags) are kept.
    """
    out = {k: v for k, v in task.extras.items() if k not in CANDIDATE_EXTRAS}
    if "aux_nonmembers" in out and not task.eval_subsets:
        raise ValueError(
            f"task {task.id}: its defender-side aux_nonmembers may be evaluation candidates (no eval_subsets); "
            "a reference run must not hold them"
        )
    if "aux_members" in out:
        n_aux = len(out["aux_members"])
        if n_aux > len(items):
            raise ValueError(f"{n_aux} aux members for a reference training set of {len(items)} items")
        out["aux_members"] = list(items[:n_aux])
    return out


def client_parts(sizes: list[int], alpha: float | None, labels: list[int] | None, split_seed: int) -> list[list[int]]:
    """Each client's positions in a reference run's items: IID chunks of the target clients' ``sizes``, or a
    Dirichlet(alpha) split over ``labels`` by ``bench.fl.split_clients`` seeded ``split_seed``, as the target's."""
    n = sum(sizes)
    if alpha is None:
        starts = np.cumsum([0, *sizes]).tolist()
        return [list(range(starts[i], starts[i + 1])) for i in range(len(sizes))]
    if labels is None or len(labels) != n:
        raise ValueError(f"a Dirichlet({alpha}) reference split needs one label per item ({n} items)")
    return [list(part) for part in split_clients(labels, len(sizes), alpha, split_seed)]


def reference_task(
    task: Task,
    defense: Defense | None,
    items: list[Any],
    *,
    labels: list[int] | None = None,
    split_seed: int = 0,
) -> Task:
    """The target task with its training data replaced by ``items``: chunked to the target's sizes (IID), or
    split Dirichlet(alpha) over ``labels`` by ``bench.fl.split_clients`` seeded ``split_seed`` as the target's.

    The defender's data follows the recipe (:func:`reference_extras`). A reference task is trained, never scored:
    its non-members, population, reconstruction targets and ``eval_subsets`` (positions in the target's pools,
    which it does not have) are cleared."""
    sizes = training_sizes(task, defense)
    if sum(sizes) != len(items):
        raise ValueError(f"{len(items)} reference items for training sets of sizes {sizes}")
    parts = client_parts(sizes, dirichlet_alpha(task, defense), labels, split_seed)
    chunks = [cast(Dataset, [items[i] for i in part]) for part in parts]  # a list is a map-style dataset
    central = defense is not None and defense.setting == "central"
    return replace(
        task,
        client_data=chunks,
        central_data=chunks[0] if central else None,
        extras=reference_extras(task, items),
        nonmembers=None,
        population=None,
        recon_targets=None,
        eval_subsets=None,
        source=None,
    )


def _cache_dirs(cache_root: Path) -> tuple[Path, Path]:
    return cache_root / "reference", cachefile.quarantine_for(cache_root / "reference")


@dataclass(frozen=True)
class RefSpec:
    """Reference run ``r`` of a (task, defense, seed) target: its training items, their labels (Dirichlet
    splits only) and its cache key."""

    key: str
    items: list[Any]
    labels: list[int] | None
    n_train: int


def reference_spec(task: Task, defense: Defense, seed: int, r: int) -> RefSpec:
    if task.population is None:
        raise ValueError(f"task {task.id} has no population data for reference models")
    n_train = sum(training_sizes(task, defense))
    split = population_split(n_items(task.population), n_train, seed)
    positions = reference_indices(split, n_train, seed, r)
    items = [task.population[i] for i in positions]
    alpha = dirichlet_alpha(task, defense)
    memo = (id(task.population), n_train, seed, r)
    if (hit := _DATA_FP.get(memo)) is None or hit[0] is not task.population:
        if len(_DATA_FP) >= 256:  # bounded: a process that builds many tasks (the tests) keeps no old populations
            _DATA_FP.clear()
        hit = _DATA_FP[memo] = (task.population, fingerprint(items))
    desc: dict[str, Any] = {
        "target": train_key(task, defense, seed),
        "reference": r,
        "seed": ref_seed(seed, r),
        "data": hit[1],
    }
    if alpha is not None:  # only then: IID reference runs keep their cache keys
        desc["split"] = f"dirichlet({alpha})"
    if seeded_fedsgd(task.fl, defense, ref_seed(seed, r)):  # bench.fl.batch_gradient: the batches changed
        desc["fedsgd_batches"] = "seeded"
    labels = population_labels(task, positions) if alpha is not None else None
    return RefSpec(stable_hash(desc), items, labels, n_train)


def reference_cached(
    task: Task, defense: Defense, seed: int, r: int, cache_root: Path, *, readonly: bool = False
) -> bool:
    """True when reference run ``r``'s cache entry exists and is intact (a damaged one is quarantined now;
    ``readonly``: reported, left in place)."""
    root, qdir = _cache_dirs(Path(cache_root))
    key = reference_spec(task, defense, seed, r).key
    return cachefile.verify(root / key, quarantine_dir=None if readonly else qdir)


def reference_checkpoint(task: Task, defense: Defense, seed: int, r: int, cache_root: Path) -> Path:
    """Reference run ``r``'s round checkpoint while it trains (bench/checkpoint.py), beside its cache entry."""
    return path_for(_cache_dirs(Path(cache_root))[0] / reference_spec(task, defense, seed, r).key)


def identities(task: Task, defense: Defense, seed: int, n: int, cache_root: Path) -> list[str] | None:
    """The first ``n`` reference runs' identities, which a reference-model record carries (``training.references``):
    each cached entry's tensor SHA-256, 16 hex digits, as ``bench.training.identity``; None when one is not cached.
    A record scored against other reference runs (retrained after their cache was lost) is stale."""
    root = _cache_dirs(Path(cache_root))[0]
    heads = [cachefile.head(root / reference_spec(task, defense, seed, r).key) for r in range(n)]
    if any(h is None or not isinstance(h.get("sha256"), str) for h in heads):
        return None
    return [cast(dict, h)["sha256"][:16] for h in heads]


def made_with(record: dict[str, Any], refs: list[str]) -> bool:
    """Whether ``record`` was scored against the reference runs ``refs`` names; a record that names none (from
    before schema revision 7, or an attack without reference models) is not contradicted."""
    got = record.get("training", {}).get("references") if isinstance(record.get("training"), dict) else None
    return got is None or got == refs


def _train(task: Task, defense: Defense, seed: int, r: int, spec: RefSpec, stem: Path | None) -> TrainResult:
    """Train reference run ``r`` now and cache it at ``stem`` (atomically; None: memory only), resuming from
    its round checkpoint (bench/checkpoint.py) when an earlier attempt left one."""
    ckpt = Checkpoint(path_for(stem), key=stem.name) if stem is not None else None
    _, res = run_federated(
        reference_task(task, defense, spec.items, labels=spec.labels, split_seed=ref_seed(seed, r)),
        defense,
        ref_seed(seed, r),
        desc=f"reference {r} {task.id} {label(defense)} s{seed}",
        checkpoint=ckpt,
    )
    keep_target_client(res, task, seed)  # as the target run keeps
    if stem is not None:
        key = {**run_key(task, defense, seed), "reference": r, "n_train": spec.n_train}
        save_run(stem, res, key, f"reference cache {r} for {label(defense)} seed {seed}")
    if ckpt is not None:
        ckpt.clear()
    return res


def get_reference(task: Task, defense: Defense, seed: int, r: int, cache_root: Path | None) -> TrainResult:
    """Reference run ``r`` of the (task, defense, seed) target: loaded from the cache or trained now (and
    cached). ``cache_root`` None: trained in memory only (checks and tests)."""
    spec = reference_spec(task, defense, seed, r)
    if spec.key in _MEMO:
        return _MEMO[spec.key]
    stem = None
    if cache_root is not None:
        root, qdir = _cache_dirs(Path(cache_root))
        stem = root / spec.key
        hit = cachefile.load(stem, decode_run, quarantine_dir=qdir)
        if hit is not None:
            return _remember(spec.key, hit)
        with cachefile.building(stem):  # another run training it: wait, then read its entry
            hit = cachefile.load(stem, decode_run, quarantine_dir=qdir)
            return _remember(spec.key, hit if hit is not None else _train(task, defense, seed, r, spec, stem))
    return _remember(spec.key, _train(task, defense, seed, r, spec, stem))


def train_reference(task: Task, defense: Defense, seed: int, r: int, cache_root: Path) -> bool:
    """The engine's reference unit: train and cache reference run ``r`` unless an intact entry exists; the
    result is not kept in memory, so every cell reads the stored copy whoever trained it (as training units
    do). Returns True when it trained."""
    spec = reference_spec(task, defense, seed, r)
    root, qdir = _cache_dirs(Path(cache_root))
    if cachefile.verify(root / spec.key, quarantine_dir=qdir):
        return False
    with cachefile.building(root / spec.key):  # another run training it: wait, then find it cached
        if cachefile.verify(root / spec.key, quarantine_dir=qdir):
            return False
        _MEMO.pop(spec.key, None)
        _train(task, defense, seed, r, spec, root / spec.key)
    return True


def ensure_references(task: Task, defense: Defense, seed: int, cache_root: Path, n: int | None = None) -> int:
    """Train and cache the first R reference runs of a (task, defense, seed) now (what the engine's reference
    units do one run each, :func:`train_reference`); returns R."""
    n = int(n) if n else default_count(task.preset)
    for r in range(n):
        train_reference(task, defense, seed, r, cache_root)
    return n


def reference_count(task: Task, attacks: list[Any]) -> int:
    """R a set of attack configurations needs on ``task``: the largest of their ``n_reference`` (None = the
    preset's default); 0 when none uses reference models."""
    counts = [
        int(getattr(a, "n_reference", None) or default_count(task.preset))
        for a in attacks
        if getattr(a, "uses_reference", False)
    ]
    return max(counts, default=0)


def _remember(key: str, res: TrainResult) -> TrainResult:
    while len(_MEMO) >= _MEMO_MAX:
        _MEMO.pop(next(iter(_MEMO)))
    _MEMO[key] = res
    return res


@dataclass(frozen=True)
class Tuning:
    """Items to tune [RMIA]'s offline ``a`` on (:meth:`Reference.tuning`): reference model 0's members and
    non-members, and ``out[i, j]``: reference j + 1 did not train on item i (members first)."""

    members: list[Any]
    nonmembers: list[Any]
    out: np.ndarray


@dataclass
class Reference:
    """What a reference-model attack gets in ``Observation.reference`` for one scored model: reference
    models of the same view (and client), and population samples z. ``used`` records what was handed out
    (the record's statement of the attacker's knowledge)."""

    task: Task
    defense: Defense | None  # None: the target is the un-fine-tuned base model, and so is every reference
    view: str
    client: int | None
    seed: int
    cache_root: Path | None = None
    used: dict[str, Any] = field(default_factory=dict)
    _models: list[nn.Module] = field(default_factory=list, repr=False)

    def count(self, n: int | None) -> int:
        """R: ``n``, or the preset's default (2 on smoke, 4 elsewhere) when None."""
        return int(n) if n else default_count(self.task.preset)

    def models(self, n: int | None = None) -> list[nn.Module]:
        """The first R reference models, in eval mode (trained or loaded on first use)."""
        n = self.count(n)
        while len(self._models) < n:
            self._models.append(self._model(len(self._models)))
        recipe = (
            "base model (the target was not fine-tuned)"
            if self.defense is None
            else f"{label(self.defense)} on {self.task.id}, the target's FL settings and training-set sizes"
            + (
                "; each client's model against the reference run's client of the same index (one client's local "
                "training)"
                if self.view == "client_model"
                else ""
            )
        )
        self.used.update(
            {
                "setting": "offline",
                "n_reference": n,
                "recipe": recipe,
                "reference_data": "population, disjoint from every candidate",
            }
        )
        return self._models[:n]

    def knowledge(self) -> dict[str, Any]:
        """What the attacker was assumed to know, for the record's ``attack_details``: ``used`` plus the
        population's size, its split (reference training pool / z pool) and the reference clients' split."""
        out = dict(self.used)
        if self.task.population is not None:
            n_pop = n_items(self.task.population)
            n_train = sum(training_sizes(self.task, self.defense))
            alpha = dirichlet_alpha(self.task, self.defense)
            out.update(
                {
                    "population_size": n_pop,
                    "reference_train_pool": n_pop // 2,
                    "z_pool": n_pop - n_pop // 2,
                    "reference_train_size": n_train,
                    "reference_client_split": "central (one training set)"
                    if self.defense is not None and self.defense.setting == "central"
                    else f"dirichlet({alpha}) over the population labels, as the target"
                    if alpha is not None
                    else "IID chunks of the target clients' sizes, as the target",
                }
            )
            if self.defense is not None and "aux_nonmembers" in self.task.extras:  # reference_extras
                out["reference_defender_aux"] = (
                    "for MP-/SMP-LoRA's proxy: D_aux^m from the reference's own training set; D_aux^nm the target "
                    "defender's (no candidate)"
                )
        return out

    def tuning(self, n_refs: int, n_per_side: int) -> Tuning | None:
        """Data to tune [RMIA]'s offline ``a`` on, as its authors' code does: reference model 0 plays the target
        (the attacker knows what it trained on) and references 1..R-1 the references. Members: reference 0's
        training items (in the client view, those of the scored client), non-members: training-pool items it did
        not draw; up to ``n_per_side`` of each, seeded. None when there is nothing to tune on (a base-model target,
        whose references are all the base model, or R < 2)."""
        if self.defense is None or n_refs < 2 or self.task.population is None:
            return None
        sizes = training_sizes(self.task, self.defense)
        n_train = sum(sizes)
        split = population_split(n_items(self.task.population), n_train, self.seed)
        drawn = [reference_indices(split, n_train, self.seed, r) for r in range(n_refs)]
        own = drawn[0]
        if self.view == "client_model":
            alpha = dirichlet_alpha(self.task, self.defense)
            labels = population_labels(self.task, own) if alpha is not None else None
            parts = client_parts(sizes, alpha, labels, ref_seed(self.seed, 0))
            own = [own[i] for i in parts[self._client_index(0)]]
        rng = np.random.default_rng([self.seed, REF_SALT, 0x7475])  # "tu": the tuning draw's own stream
        taken = set(drawn[0])
        outside = [i for i in split.train_pool if i not in taken]
        members = sorted(rng.permutation(own)[:n_per_side].tolist())
        nonmembers = sorted(rng.permutation(outside)[:n_per_side].tolist())
        sets = [set(d) for d in drawn[1:]]
        out = np.array([[i not in d for d in sets] for i in members + nonmembers], dtype=bool)
        pop = self.task.population
        self.used["a_tuning"] = (
            f"reference 0 as the target ({len(members)} of its training items vs {len(nonmembers)} training-pool "
            f"items it did not draw), references 1-{n_refs - 1} as its references where they did not train on the item"
        )
        return Tuning([pop[i] for i in members], [pop[i] for i in nonmembers], out)

    def _client_index(self, r: int) -> int:
        """The client of reference run ``r`` that the client view scores: the target's index where kept."""
        res = get_reference(self.task, self.defense, self.seed, r, self.cache_root)  # type: ignore[arg-type]
        if not res.client_latest:
            raise ValueError("the reference run kept no client states (the defense sends no weights)")
        return self.client if self.client in res.client_latest else min(res.client_latest)

    def _model(self, r: int) -> nn.Module:
        api = self.task.api
        if self.defense is None:  # "no fine-tuning" is deterministic: one base model serves as every reference
            return self._models[0] if self._models else api.build_model().eval()
        res = get_reference(self.task, self.defense, self.seed, r, self.cache_root)
        state = res.global_state
        if self.view == "client_model":
            k = self._client_index(r)
            state = client_model_state(res.global_state, res.client_latest[k])
        return build_trained_model(self.task, self.defense, state, res.global_buffers)

    def population(self, n: int) -> list[Any]:
        """Up to ``n`` z samples from the z pool (in no reference model's training data)."""
        if self.task.population is None:
            raise ValueError(f"task {self.task.id} has no population data")
        split = population_split(n_items(self.task.population), sum(training_sizes(self.task, self.defense)), self.seed)
        z = [self.task.population[i] for i in split.z_pool[:n]]
        self.used["n_population_z"] = len(z)
        return z


def population_reason(task: Any) -> str | None:
    """Why a task (a :class:`bench.types.TaskSpec`) cannot feed reference models (for ``Attack.applies``), or None."""
    if int(task.population_size or 0) <= 0:
        return (
            "needs population data disjoint from the candidates to train reference models; this task "
            "has none (api.population_size is 0)"
        )
    return None
