"""Progress bars (tqdm) that stay quiet when BENCH_QUIET=1, the done fraction of a running work unit (for
the run's bar), and the switch that keeps third-party loading noise (weight-loading bars, deprecation
warnings, transformers logging) out of the terminal."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import sys
import time
import warnings
from typing import Callable, Iterable, Iterator, Sequence, Sized, TypeVar

from tqdm.auto import tqdm

T = TypeVar("T")


def _disabled() -> bool:
    # BENCH_QUIET: a worker (the parent draws the only bar); QUIET_ENV: a run without --verbose, whose
    # loops (caption encoding, pre-training while the tasks are built) are loading noise to the user
    return os.environ.get("BENCH_QUIET") == "1" or os.environ.get(QUIET_ENV) == "1"


def progress(
    it: Iterable[T], *, desc: str = "", total: int | None = None, leave: bool = True, unit: bool = False
) -> Iterable[T]:
    """A tqdm loop. ``unit``: the loop is its work unit's main loop, so inside ``unit_progress`` its done
    fraction (refined by the tracked loops nested in it) goes to the run's progress bar."""
    n = total if total is not None else (len(it) if isinstance(it, Sized) else None)
    return tqdm(
        _tracked(it, n, unit, desc),
        desc=desc,
        total=n,
        leave=leave,
        disable=_disabled(),
        dynamic_ncols=True,
        mininterval=1.0,
    )


def nested(it: Iterable[T], *, total: int | None = None) -> Iterable[T]:
    """``it`` as a loop nested in a unit's main loop (no bar of its own): refines the reported fraction,
    e.g. the local epochs and batches of a training round."""
    return _tracked(it, total if total is not None else (len(it) if isinstance(it, Sized) else None), False)


# How far the current work unit is: a stack of [items done, items] of the tracked loops running, the
# outermost first; reported (at most every REPORT_S seconds) to the callback of ``unit_progress``.
_UNIT: dict = {"report": None, "stack": [], "last": 0.0, "saved": None}
REPORT_S = 0.5


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A unit's done fraction restored from a checkpoint (bench.checkpoint: a round or an epoch): work done before this
    run, which the run's bar shows as done but leaves out of its rate, so a resumed run's ETA is not a fraction
    of the time left (a vlm-caption run resumed at 2 of 6 rounds showed 57 min left of ~3 h)."""

    fraction: float


UnitReport = float | str | Resumed  # what a running unit reports: its done fraction, a set-up step, or a restored share


def resumed(done: int, n: int) -> None:
    """Report that a tracked loop about to start (the unit's main loop, or one nested where the loops it runs in
    stand now) resumes after ``done`` of its ``n`` items: the unit's fraction at that point, as done before."""
    if _UNIT["report"] is not None and n and done > 0:
        with _frame(min(done, n), n):
            _UNIT["report"](Resumed(unit_fraction()))


def restored_step() -> None:
    """Report that the step the innermost tracked loop (or stage) stands at was restored rather than run (a model
    pass read back from ``cache/signals`` or found in memory, bench.signal_cache): its share is done before this
    run, on the bar and out of its rate, so a cell resumed after a kill does not show an ETA from its instant
    passes."""
    if _UNIT["report"] is not None and _UNIT["stack"]:
        _UNIT["report"](Resumed(_fraction_after_step()))


def saved_step() -> None:
    """Report that the step the innermost tracked loop (or stage) stands at finished and its result is on disk (a
    model pass spilled to ``cache/signals``): the unit's fraction after it goes to the callback of
    :func:`on_saved`, which keeps it for a later run's plan (bench.signal_cache.write_marker)."""
    if _UNIT["saved"] is not None and _UNIT["stack"]:
        _UNIT["saved"](_fraction_after_step())


def _fraction_after_step() -> float:
    """The unit's done fraction once the step the innermost tracked loop (or stage) stands at is done."""
    frame = _UNIT["stack"][-1]
    frame[0] += 1
    try:
        return unit_fraction()
    finally:
        frame[0] -= 1


@contextlib.contextmanager
def on_saved(callback: Callable[[float], None] | None) -> Iterator[None]:
    """Within: :func:`saved_step` reports the unit's done fraction to ``callback``; the unit's loops are tracked
    for it even where no bar follows them (no ``unit_progress`` report: an inline or Ray run)."""
    before = (_UNIT["saved"], _UNIT["report"])
    _UNIT["saved"] = callback
    if _UNIT["report"] is None and callback is not None and not _UNIT["stack"]:
        _UNIT["report"] = lambda f: None
    try:
        yield
    finally:
        _UNIT["saved"], _UNIT["report"] = before


@contextlib.contextmanager
def unit_progress(report: Callable[[UnitReport], None] | None) -> Iterator[None]:
    """Within: ``report(fraction)`` gets the done fraction (0..1) of the unit's ``progress(..., unit=True)``
    loops and the loops nested in them (bench.runner: the parent's cost-weighted bar follows it); a
    ``progress`` loop that runs before the main loop (a pre-training while the task is built, e.g. the VLM
    projector's alignment) reports ``"<desc> i/n"`` instead, so a long set-up shows on the parent's bar too."""
    saved = dict(_UNIT)
    _UNIT.update(report=report, stack=[], last=0.0)
    try:
        yield
    finally:
        _UNIT.update(saved)


def unit_fraction() -> float:
    f, scale = 0.0, 1.0
    for frame in _UNIT["stack"]:
        done, n = min(frame[0], frame[1]), frame[1]
        if len(frame) > 2:  # a weighted stage: its steps' shares of the enclosing step (cumulative, ending at 1)
            edges = frame[2]
            start = edges[done - 1] if done else 0.0
            f += scale * start
            scale *= (edges[done] - start) if done < n else 0.0
        else:
            f += scale * done / n
            scale /= n
    return f


@contextlib.contextmanager
def _frame(i: int, n: int, edges: list[float] | None = None) -> Iterator[list]:
    """[done, items(, cumulative step shares)] on the unit's stack while inside (a tracked loop's position, or a
    stage)."""
    stack = _UNIT["stack"]
    frame: list = [i, n] if edges is None else [i, n, edges]
    stack.append(frame)
    try:
        yield frame
    finally:
        del stack[next(k for k, f in enumerate(stack) if f is frame)]


@contextlib.contextmanager
def stage(i: int, n: int | Sequence[float]) -> Iterator[None]:
    """Within: step ``i`` of the current tracked loop's iteration, so the loops run inside it refine that step's
    share of the fraction instead of restarting it (a cell's model building, scoring and threshold passes run one
    after another in one iteration). ``n``: the number of equal steps, or each step's weight (its expected cost:
    a cell's model building costs little beside its scoring, and equal thirds let a resumed cell's instant steps
    set the bar's rate). Outside a unit's main loop it does nothing."""
    if _UNIT["report"] is None or not _UNIT["stack"]:
        yield
        return
    if isinstance(n, int):
        with _frame(i, n):
            yield
        return
    total = float(sum(n))
    if not len(n) or total <= 0 or min(n) < 0:
        raise ValueError(f"stage weights must be >= 0 with a positive sum, got {list(n)}")
    edges = [c / total for c in itertools.accumulate(float(w) for w in n)]  # c / total: exactly 1.0 at the end
    with _frame(i, len(n), edges):
        yield


def _tracked(it: Iterable[T], n: int | None, unit: bool, desc: str = "") -> Iterator[T]:
    stack = _UNIT["stack"]
    if _UNIT["report"] is not None and n and desc and not (unit or stack):  # a unit's set-up loop
        yield from _setup(it, n, desc)
        return
    if _UNIT["report"] is None or not n or not (unit or stack):  # not inside a unit's main loop
        yield from it
        return
    with _frame(0, n) as frame:
        for i, x in enumerate(it):
            frame[0] = i
            now = time.monotonic()
            if now - _UNIT["last"] >= REPORT_S:
                _UNIT["last"] = now
                _UNIT["report"](unit_fraction())
            yield x


def _setup(it: Iterable[T], n: int, desc: str) -> Iterator[T]:
    for i, x in enumerate(it):
        now = time.monotonic()
        if now - _UNIT["last"] >= REPORT_S:
            _UNIT["last"] = now
            _UNIT["report"](f"{desc} {i}/{n}")
        yield x


def progress_bar(*, total: float, desc: str = "", unit: str = "it", weighted: bool = False) -> tqdm:
    """A manually updated bar (``.update(n)``). ``weighted``: ``total`` is estimated seconds of work and each
    unit advances it by its own estimate, so the ETA follows the expensive work, not the count of cells. Its rate is
    the average since the start (``smoothing=0``): progress lands in uneven jumps (a unit's share when it reports,
    the rest when it ends), and tqdm's default moving average then swung a 3 h job's ETA between 1:45 h and 27 h."""
    fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]" if weighted else None
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=os.environ.get("BENCH_QUIET") == "1",
        dynamic_ncols=True,
        mininterval=1.0,
        **({"smoothing": 0.0} if weighted else {}),  # else tqdm's own default
        bar_format=fmt,
    )


NOISY_LOGGERS = ("transformers", "diffusers", "huggingface_hub", "timm", "peft", "accelerate", "torch.distributed")
# UserWarnings a run triggers by design, once per metric or model built (regular expressions on the message)
NOISY_WARNINGS = (
    r"Metric `[A-Za-z ]+` will save all extracted features in buffer",  # torchmetrics KID, IS
    r"There is a performance drop because we have not yet implemented the batching rule",  # vmap over SDPA
)
QUIET_ENV = "BENCH_QUIET_THIRD_PARTY"


def silence_third_party() -> None:
    """Hide other libraries' progress bars, info logging and deprecation warnings (``--verbose`` skips this).
    Environment variables cover libraries imported later (and child processes); loggers those already loaded."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning,ignore::FutureWarning")
    os.environ[QUIET_ENV] = "1"  # third_party_stdout() in this process and its workers
    for cat in (DeprecationWarning, FutureWarning, PendingDeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)
    for pattern in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # libraries already imported read the environment too early: switch their bars off directly
    # (huggingface_hub's switch also covers a transformers imported later)
    for mod, fn in (
        ("huggingface_hub.utils", "disable_progress_bars"),
        ("transformers.utils.logging", "disable_progress_bar"),
        ("diffusers.utils.logging", "disable_progress_bar"),
    ):
        m = sys.modules.get(mod)
        if m is not None and hasattr(m, fn):
            getattr(m, fn)()


@contextlib.contextmanager
def third_party_stdout() -> Iterator[None]:
    """Around third-party code that prints to stdout (efficientnet-lite's "Loaded pretrained weights for
    ..."): the print goes nowhere once ``silence_third_party`` ran (not with ``--verbose``)."""
    if os.environ.get(QUIET_ENV) != "1":
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        yield


@contextlib.contextmanager
def third_party_output() -> Iterator[None]:
    """Around third-party code that draws its own tqdm bar with no switch to turn it off (transformers'
    "Converting and de-quantizing GGUF tensors..."): its stdout and stderr go nowhere once
    ``silence_third_party`` ran (not with ``--verbose``). Exceptions still propagate and are reported."""
    if os.environ.get(QUIET_ENV) != "1":
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield
