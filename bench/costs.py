"""The cost model behind a run's plan: seconds per training run and per attack cell on one worker.

Rough defaults by preset and scenario family, replaced by the medians of earlier records' ``cost.train_wall_s`` /
``cost.attack_wall_s`` in the same ``--out`` wherever there are any (same task and defense / attack, else the same
method); a record made on another CPU is scaled to this one by the two machines' speed probes (bench.machine).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Rough seconds per unit on one worker thread, by preset and scenario family: a training run ("train"), an attack
# cell by attack name where one was measured, else by kind ("membership", "reconstruction"). Only a fallback:
# earlier records in --out replace them. The `default` figures are medians measured on the 2-core CPU machine of
# the published snapshots (leaderboards/default*, 2026-11-25/26, --jobs 2; vlm-caption's training: its 6-round budget,
# 4,982 s for FedAvg seed 0 on 2026-12-03); `paper` ones are guesses.
DEFAULT_COST_S: dict[str, dict[str, dict[str, float]]] = {
    "smoke": {
        "image-cls": {"train": 2, "membership": 1, "reconstruction": 3},
        "llm-text": {"train": 3, "membership": 2, "reconstruction": 2},
        "vlm-caption": {"train": 4, "membership": 2, "reconstruction": 2},
        "ldm-t2i": {"train": 4, "membership": 2, "reconstruction": 2},
    },
    "default": {
        "image-cls": {"train": 105, "membership": 5, "reconstruction": 70, "april": 1, "rmia": 10},
        "llm-text": {"train": 300, "membership": 50, "reconstruction": 120, "rmia": 860},
        "vlm-caption": {"train": 5000, "membership": 320, "reconstruction": 180, "loss_mia": 100},
        "ldm-t2i": {"train": 1200, "membership": 300, "reconstruction": 300},
    },
    "paper": {
        "image-cls": {"train": 3000, "membership": 600, "reconstruction": 6000},
        "llm-text": {"train": 6000, "membership": 1200, "reconstruction": 1200},
        "vlm-caption": {"train": 9000, "membership": 1800, "reconstruction": 1800},
        "ldm-t2i": {"train": 12000, "membership": 3000, "reconstruction": 3000},
    },
}
FALLBACK = {"train": 5.0, "membership": 2.0, "reconstruction": 5.0}


@dataclass
class CostModel:
    """Seconds per training run / attack cell; learned medians keyed by (task, defense configuration) and (task,
    attack configuration, view, base model or not): a base-model cell is far cheaper (e.g. rmia: its reference
    models are the base model), and configurations of one method can differ by 10x (``dp_gaussian`` in its FedSGD
    form trains 900 rounds, in its FedAvg form far fewer). A configuration without records of its own falls back
    to its method's median over every configuration (``by_name``); a cell on a trained target of an attack that
    states its ``relative_cost`` to its base-model cell (rmia: ~6x in the global view, ~17x in the client view of
    vlm-caption) to that base-model cell's measured cost times the ratio; then to the preset's defaults. A cell
    whose record says it computed no signal (``cost.signals_computed`` 0: an earlier cell of its group had computed
    them all, e.g. ``rmia(a=0.3)`` after ``rmia``) is learned apart (``follower_s``): its cost is its scoring alone,
    and it does not lower the medians of cells that compute. A cell that resumed part-way (``cost.signals_loaded``:
    passes read back from ``cache/signals``, and some computed) is not learned from: its time is partial."""

    train_s: dict[tuple[str, str], float] = field(default_factory=dict)  # (task, defense label)
    # (task, defense label) -> [(preset, config hash, seconds, rounds trained)]: each training run, so a run of the
    # task's current configuration is estimated from runs of that configuration (train_cost)
    train_runs: dict[tuple[str, str], list[tuple[str, str, float, int | None]]] = field(default_factory=dict)
    cell_s: dict[tuple[str, str, str, bool], float] = field(default_factory=dict)  # (task, attack label, view, base)
    by_name: dict[tuple, float] = field(default_factory=dict)  # the same keyed by the methods' names
    follower_s: dict[tuple, float] = field(default_factory=dict)  # cells that computed no signal (both keys)
    n_records: int = 0
    n_scaled: int = 0  # records made on another CPU whose costs were scaled by the speed probes (bench.machine)
    factors: tuple[float, ...] = ()  # the distinct scale factors applied (this machine's time / the record's)

    @classmethod
    def from_records(cls, out: Path, *, readonly: bool = False, device: str = "cpu") -> CostModel:
        """Medians of ``out``'s ok records' costs; on a CPU ``device``, a record made on another CPU is scaled
        by the two machines' speed probes (:func:`record_factor`)."""
        from .store import Store

        train, cell, by_name = defaultdict(list), defaultdict(list), defaultdict[tuple, list](list)
        runs = defaultdict[tuple, list](list)
        follower = defaultdict[tuple, list](list)
        n, scaled, factors = 0, 0, set()
        if (Path(out) / "records").is_dir():
            try:
                for r in Store(out, readonly=readonly).records():
                    cost = r.get("cost") or {}
                    if r.get("status") != "ok":
                        continue
                    n += 1
                    f = record_factor(r) if device == "cpu" else 1.0
                    if f != 1.0:
                        scaled += 1
                        factors.add(round(f, 2))
                    task, view, base = r["task"], r["view"], r["defense"] == "base"
                    if isinstance(t := cost.get("train_wall_s"), (int, float)):
                        dlabel = r.get("defense_label") or r["defense"]
                        train[(task, dlabel)].append(f * float(t))
                        rounds = cost.get("rounds") if isinstance(cost.get("rounds"), int) else None
                        cfg = str((r.get("provenance") or {}).get("config_hash", ""))
                        runs[(task, dlabel)].append((str(r.get("preset", "")), cfg, f * float(t), rounds))
                        by_name[("train", task, r["defense"])].append(f * float(t))
                    if isinstance(a := cost.get("attack_wall_s"), (int, float)):
                        label = r.get("attack_label") or r["attack"]
                        if (cost.get("signals_loaded") or 0) > 0 and (cost.get("signals_computed") or 0) > 0:
                            continue  # resumed part-way (passes read back from cache/signals): a partial cost
                        if cost.get("signals_computed") == 0 and (cost.get("signals_reused") or 0) > 0:
                            follower[(task, label, view, base)].append(f * float(a))
                            follower[("cell", task, r["attack"], view, base)].append(f * float(a))
                            continue
                        cell[(task, label, view, base)].append(f * float(a))
                        by_name[("cell", task, r["attack"], view, base)].append(f * float(a))
            except Exception as e:  # noqa: BLE001 - an estimate only: say so and use the defaults
                sys.stderr.write(
                    f"note: cost model uses its defaults (earlier records unreadable: {type(e).__name__}: {e})\n"
                )
                return cls()
        return cls(
            train_s={k: statistics.median(v) for k, v in train.items()},
            train_runs=dict(runs),
            cell_s={k: statistics.median(v) for k, v in cell.items()},
            by_name={k: statistics.median(v) for k, v in by_name.items()},
            follower_s={k: statistics.median(v) for k, v in follower.items()},
            n_records=n,
            n_scaled=scaled,
            factors=tuple(sorted(factors)),
        )

    @staticmethod
    def _default(task) -> dict[str, float]:
        return DEFAULT_COST_S.get(task.preset, {}).get(task.api.family, FALLBACK)

    def train_cost(self, task, defense) -> float:
        """Seconds of one training run: the median of runs of the task's current configuration; else, for a
        federated FedAvg-protocol run, other configurations' runs of the same preset scaled by rounds (a preset
        that changed its rounds trains that much longer per run); else any run of the defense or its method."""
        from .training import label

        lab = label(defense)
        scaled = self._by_config(task, defense, self.train_runs.get((task.id, lab), []))
        if scaled is not None:
            return scaled
        learned = self.train_s.get((task.id, lab), self.by_name.get(("train", task.id, defense.name)))
        return learned if learned is not None else self._default(task)["train"]

    @staticmethod
    def _by_config(task, defense, runs: list[tuple[str, str, float, int | None]]) -> float | None:
        """The median of ``runs`` of ``task``'s configuration, else of its preset's runs scaled by rounds (FedAvg
        protocol, federated: the rounds a record trained are the preset's); None where neither applies."""
        fl, cfg, preset = getattr(task, "fl", None), getattr(task, "config_hash", None), getattr(task, "preset", None)
        if not runs or fl is None or not callable(cfg):
            return None
        same = [s for p, h, s, _ in runs if p == preset and h == cfg()]
        if same:
            return statistics.median(same)
        from .fl import run_mode

        if defense.setting == "central" or run_mode(fl, defense) != "fedavg":
            return None
        per_round = [s * fl.rounds / n for p, _, s, n in runs if p == preset and n]
        return statistics.median(per_round) if per_round else None

    def cell_cost(self, cell, *, follower: bool = False) -> float:
        """Seconds of the cell; ``follower``: an earlier cell of the run computes its signals (bench.runplan.share_key),
        estimated from measured such cells where there are any, else as a cell that computes them."""
        base = cell.defense is None
        if follower:
            from .training import label

            got = self.follower_s.get((cell.task.id, label(cell.attack), cell.view, base))
            got = (
                got
                if got is not None
                else self.follower_s.get(("cell", cell.task.id, cell.attack.name, cell.view, base))
            )
            if got is not None:
                return got
        learned = self._learned(cell, base=base)
        if learned is not None:
            return learned
        if not base and callable(rel := getattr(cell.attack, "relative_cost", None)):  # e.g. rmia: from its base cell
            on_base = self._learned(cell, base=True)
            if on_base is not None:
                return on_base * float(rel(cell.task, cell.view))
        d = self._default(cell.task)
        return d.get(cell.attack.name, d.get(cell.attack.kind, d["membership"]))

    def _learned(self, cell, *, base: bool) -> float | None:
        """The median of the cell's configuration on a base-model or a trained target, else of its method's."""
        from .training import label

        got = self.cell_s.get((cell.task.id, label(cell.attack), cell.view, base))
        return got if got is not None else self.by_name.get(("cell", cell.task.id, cell.attack.name, cell.view, base))


def record_factor(rec: dict) -> float:
    """How much longer a record's work would take on this machine: the speed probes' ratio when the record was
    made on another CPU (``provenance.device``) with a comparable probe and this process runs on one too (1 when
    the record names this CPU and instruction set, the probes are within their noise of 10%, or nothing can be
    compared). The same CPU is never scaled: its probes move with the load at the moment they were taken (x0.3 to
    x1.2 between records of one machine), while the record's time was measured under the load a run has."""
    from .machine import cpu_here, same_cpu, speed_factor

    prov = rec.get("provenance") or {}
    if str(prov.get("device") or "cpu") != "cpu" or same_cpu(prov.get("machine"), cpu_here()):
        return 1.0
    f = speed_factor(prov.get("machine"))
    return 1.0 if f is None or abs(f - 1.0) <= 0.1 else f
