"""The matrix: every (task, defense configuration, attack configuration, view, seed) as a ``Cell`` (n/a with the
reason where a pair does not apply; the base model's cells for membership attacks), its stable id, and the
record fields a finished record must match to count (``Cell.expected``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from .fl import run_mode, seeded_fedsgd
from .recon_cells import PROBE_PROTOCOL, RANDOM_IMAGE_CONTROL
from .reference import default_count
from .store import provenance, stable_hash, utc_stamp
from .task import Task
from .training import label
from .types import Attack, Defense, params_of

# What records written before ``attack_resolved`` (schema revision 5) were made with: the scenarios' inversion
# budgets (bench/scenarios/_image_presets.py INVERSION_ITERATIONS, unchanged since 487459f and so for every record
# carrying the current reconstruction probe, 6d18091). Cells at these values keep those records.
LEGACY_RESOLVED: dict[tuple[str, str], dict[str, Any]] = {
    **{
        ("inverting_gradients", preset): {"iterations": n}
        for preset, n in (("smoke", 60), ("default", 300), ("paper", 24_000))
    },
    **{("rmia", preset): {"n_reference": n} for preset, n in (("smoke", 2), ("default", 4), ("paper", 4))},
}
FEDERATED_VIEWS = ("global_model", "client_model", "client_update")
CENTRAL_VIEWS = ("released_model",)


@dataclass
class Cell:
    task: Task
    defense: Defense | None  # None: the base model
    attack: Attack
    view: str
    seed: int
    na: str | None = None  # reason the cell does not apply
    error: str | None = None  # planning failed (e.g. applies() raised): recorded failed, never run

    @property
    def defense_label(self) -> str:
        return label(self.defense) if self.defense is not None else "base"

    @property
    def id(self) -> str:
        return stable_hash(
            {
                "task": self.task.id,
                "preset": self.task.preset,
                "cfg": self.task.config_hash(),
                "defense": self.defense_label,
                "attack": label(self.attack),
                "view": self.view,
                "seed": self.seed,
            }
        )

    def expected(self) -> dict[str, Any]:
        """Record fields a finished record must match besides the id: the resolved parameters (the id holds
        labels, which omit defaults, so a changed default makes an earlier record stale and the cell is redone)."""
        out: dict[str, Any] = {
            "defense_params": params_of(self.defense) if self.defense else {},
            "attack_params": params_of(self.attack),
        }
        if self.attack.kind == "reconstruction":  # records from before the random-image control or the probe are redone
            out["negative_control"] = RANDOM_IMAGE_CONTROL
            out["probe"] = PROBE_PROTOCOL
        resolved = self.attack.resolved(self.task.api) if hasattr(self.attack, "resolved") else {}
        if getattr(self.attack, "uses_reference", False) and getattr(self.attack, "n_reference", 0) is None:
            resolved = {**resolved, "n_reference": default_count(self.task.preset)}  # R left to the preset ([RMIA])
        # None (absent from the record) where the values are those every record without the field was made with
        legacy = LEGACY_RESOLVED.get((self.attack.name, self.task.preset))
        out["attack_resolved"] = resolved if resolved and resolved != legacy else None
        if self.defense is not None and (
            seeded_fedsgd(self.task.fl, self.defense, self.seed)
            or (getattr(self.attack, "uses_reference", False) and run_mode(self.task.fl, self.defense) == "fedsgd")
        ):  # its training (or its reference runs') changed batches: bench.fl.batch_gradient
            out["fedsgd_batches"] = "seeded"
        return out

    def skeleton(self) -> dict[str, Any]:
        return {
            "cell_id": self.id,
            "scenario": self.task.scenario,
            "task": self.task.id,
            "preset": self.task.preset,
            "defense": self.defense.name if self.defense else "base",
            "defense_label": self.defense_label,
            "attack": self.attack.name,
            "attack_label": label(self.attack),
            # the resolved parameters a later run compares against (a None one is absent: bench.store.Store.finished)
            **{k: v for k, v in self.expected().items() if v is not None},
            "attack_kind": self.attack.kind,
            "view": self.view,
            "seed": self.seed,
            "provenance": {**provenance(), "config_hash": self.task.config_hash(), "started_at": utc_stamp()},
        }


def views_of(defense: Defense) -> tuple[str, ...]:
    return CENTRAL_VIEWS if defense.setting == "central" else FEDERATED_VIEWS


def _applies(method: Defense | Attack, api) -> tuple[str | None, str | None]:
    """(n/a reason, error): a method whose applies() raises fails its cells; planning goes on."""
    try:
        return method.applies(api), None
    except Exception as e:  # noqa: BLE001 - contributed code
        return None, f"{method.name}.applies() raised {type(e).__name__}: {e}"


def plan(
    tasks: list[Task],
    defenses: list[Defense],
    attacks: list[Attack],
    seeds: list[int],
    *,
    views: Collection[str] | None = None,
) -> list[Cell]:
    """The matrix's cells: every task x seed x attack x (base model and each defense) x view; ``views``: only
    the cells in these threat views (``bench run --view``), e.g. to spend compute on the view a claim reads."""
    cells: list[Cell] = []
    for task in tasks:
        for seed in seeds:
            for attack in attacks:
                a_na, a_err = _applies(attack, task.api)
                if attack.kind == "membership":  # the base model on the same candidates, in every view run
                    exposed = {v for d in defenses if d.applies(task.api) is None for v in views_of(d)} or {
                        "global_model"
                    }
                    for base_view in (v for v in attack.views if v in exposed and v != "client_update"):
                        cells.append(Cell(task, None, attack, base_view, seed, na=a_na, error=a_err))
                for defense in defenses:
                    d_na, d_err = _applies(defense, task.api)
                    seen = [v for v in attack.views if v in views_of(defense)]
                    if not seen:
                        cells.append(
                            Cell(
                                task,
                                defense,
                                attack,
                                attack.views[0],
                                seed,
                                na=f"{attack.name} observes {'/'.join(attack.views)}; "
                                f"{defense.name} exposes {'/'.join(views_of(defense))}",
                            )
                        )
                        continue
                    for view in seen:
                        mode = run_mode(task.fl, defense)
                        v_na = (
                            (
                                f"client_model needs weight messages; {defense.name} sends gradients (FedSGD), "
                                f"so there is no client model to reconstruct"
                            )
                            if view == "client_model" and mode == "fedsgd"
                            else None
                        )
                        cells.append(
                            Cell(task, defense, attack, view, seed, na=d_na or a_na or v_na, error=d_err or a_err)
                        )
    return cells if views is None else [c for c in cells if c.view in views]
