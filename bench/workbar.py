"""The run's cost-weighted "work" bar (bench.runner.run): each unit (training run, reference run, attack cell)
moves it by its estimated cost (bench.costs.CostModel), a running unit by the fraction it reports
(bench.progress), never back and never beyond its cost; the postfix names the units that are running."""

from __future__ import annotations

import time
from typing import Any

from .progress import REPORT_S, Resumed, UnitReport, progress_bar


def unit_label(unit: Any, group: list) -> str:
    """What the postfix calls a running unit: a training or reference run by its defense and seed, an attack cell
    by its defense, attack and view (before, cells had none: the postfix kept naming a finished reference run)."""
    if not group:
        return ""
    if unit.kind == "cell":
        return f"{group[0].defense_label} x {unit.attack.name}/{unit.view} seed {unit.seed}"
    what = "training" if unit.kind == "train" else f"reference run {unit.ref_index}"
    return f"{what} {group[0].defense_label} seed {unit.seed}"


class WorkBar:
    """One run's bar and what it has shown: per running unit, the fraction of its cost already on the bar."""

    def __init__(self, total_s: float) -> None:
        self.bar = progress_bar(total=max(total_s, 1e-9), desc="work", unit="s", weighted=True)
        self.running: dict[str, Any] = {}  # by key: the units submitted and not finished (bench.runner.Unit)
        self._shown: dict[str, float] = {}  # by key: the fraction of its cost already on the bar
        self._moved = 0.0  # seconds of estimated work on the bar so far
        self._labels: dict[str, str] = {}  # by key: what a training or reference unit is, for the postfix
        self._active: dict[str, float] = {}  # by key: when a labelled unit last reported progress (it runs)
        self._text = ""  # the postfix naming the running units; "" while it shows something else

    def start(self, unit: Any, label: str = "") -> None:
        """``unit`` is submitted; ``label`` names it in the postfix while it reports progress."""
        self.running[unit.key] = unit
        if label:
            self._labels[unit.key] = label

    def drop(self, key: str) -> None:
        """A unit that could not be submitted after all."""
        self.running.pop(key, None)
        self._labels.pop(key, None)

    def move(self, seconds: float, *, before: bool = False) -> None:
        """Advance by ``seconds`` of estimated work, never past the total (rounding in the units' cost sum
        made tqdm warn). ``before``: work done before this run (a resumed unit's checkpoint), left out of the
        rate the ETA comes from (tqdm's ``initial``: with ``smoothing=0`` the rate is (n - initial) / elapsed)."""
        step = max(0.0, min(seconds, self.bar.total - self._moved))
        self._moved += step
        if before:  # a disabled bar (BENCH_QUIET=1) has no ``initial``: a resumed unit failed on it
            self.bar.initial = getattr(self.bar, "initial", 0.0) + step
        self.bar.update(step)

    def grow(self, seconds: float) -> None:
        """Work found during the run (stale records redone, bench.runner.run): the total grows by ``seconds``."""
        if seconds > 0:
            self.bar.total += seconds
            self.bar.refresh()

    def advance(self, key: str, fraction: UnitReport) -> None:
        """A running unit reports it is ``fraction`` done: the bar moves by that share of its cost, never
        back and never beyond it (the rest lands when the unit finishes); a string is its set-up step; a
        :class:`Resumed` fraction was done before this run (on the bar, not in its rate)."""
        u = self.running.get(key)
        if isinstance(fraction, str):
            if u is not None:
                self.note(fraction)
            return
        self._show_running(key)
        before = isinstance(fraction, Resumed)
        share = min(max(fraction.fraction if isinstance(fraction, Resumed) else float(fraction), 0.0), 1.0)
        if u is not None and share > self._shown.get(key, 0.0):
            self.move((share - self._shown.get(key, 0.0)) * u.cost, before=before)
            self._shown[key] = share

    def finish(self, unit: Any) -> None:
        """``unit`` finished: the rest of its cost lands."""
        self.running.pop(unit.key, None)
        self._labels.pop(unit.key, None)
        self._active.pop(unit.key, None)
        self.move(unit.cost * (1.0 - self._shown.pop(unit.key, 0.0)))

    def note(self, text: str) -> None:
        """Show ``text`` in the postfix until the running units are named again."""
        self.bar.set_postfix_str(text)
        self._text = ""

    def close(self) -> None:
        self.bar.close()

    def _show_running(self, key: str) -> None:
        """The postfix names the labelled units that reported within the last few seconds (a unit waiting in
        the executor's queue never reports), so it never shows a finished unit's set-up step."""
        now = time.monotonic()
        self._active[key] = now
        fresh = [k for k, t in self._active.items() if k in self._labels and now - t < 10 * REPORT_S]
        text = ", ".join(self._labels[k] for k in fresh)
        text = text if len(text) <= 90 else text[:87] + "..."
        if text and text != self._text:
            self._text = text
            self.bar.set_postfix_str(text)
