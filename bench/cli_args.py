"""The command line's arguments: the parser, and every flag checked before anything is written (a bad value is a
UsageError naming the problem and the valid choices; bench.cli prints it and exits with code 2)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn, overload

from .params import seed_count
from .registry import SCENARIOS, UsageError, unique_names, unknown_message
from .task import PRESETS
from .types import VIEWS

# Default wall-clock budget per unit (one training run or one attack cell), by preset.
CELL_TIMEOUT_S = {"smoke": 900.0, "default": 4 * 3600.0, "paper": 24 * 3600.0}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own usage errors also exit 2, with our prefix
        self.print_usage(sys.stderr)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m bench", description="Privacy attacks x defenses benchmark for federated and LoRA fine-tuning"
    )
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="run the defense x attack matrix and regenerate leaderboards")
    r.add_argument("--scenario", default="all", help="name, comma list or 'all'")
    r.add_argument("--defense", default="all", help="name[:param=value...], comma list, a .py path, or 'all'")
    r.add_argument("--attack", default="all", help="name[:param=value...], comma list, a .py path, or 'all'")
    r.add_argument("--preset", default="default", help=f"one of {', '.join(PRESETS)}")
    r.add_argument(
        "--grid",
        default="",
        choices=["", "defaults", "full"],
        help="a bare defense name runs its paper grid ('full') or its default configuration only "
        "('defaults'); default: 'defaults' on the smoke preset, 'full' otherwise",
    )
    r.add_argument(
        "--seeds", default="1", help="number of seeds N (seeds 0..N-1), or seeds A-B, or a list A,B,... (e.g. 1-2)"
    )
    r.add_argument("--out", default="results", help="output directory (records, cache, leaderboards)")
    r.add_argument("--no-leaderboard", action="store_true", help="do not regenerate leaderboards after the run")
    r.add_argument("--jobs", default="1", help="worker processes running independent units at once (default 1)")
    r.add_argument("--executor", default="local", help="local (worker processes here) or ray (a Ray cluster)")
    r.add_argument(
        "--ray-address",
        default=None,
        help="address of a running Ray cluster (e.g. ray://host:10001); default: start a local one",
    )
    r.add_argument(
        "--cell-timeout",
        default=None,
        help="wall-clock budget in seconds per training run and per attack cell; the worker is killed "
        "at the limit and the cell recorded failed (default per preset: "
        + ", ".join(f"{k} {v:g}" for k, v in CELL_TIMEOUT_S.items())
        + ")",
    )
    r.add_argument(
        "--mem-cap",
        default=None,
        help="address-space cap per worker in MB (RLIMIT_AS; 0 = none; default 75%% of RAM / jobs, at least twice "
        "what a worker maps at start-up; none on CUDA)",
    )
    r.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    r.add_argument(
        "--precision",
        default="fp32",
        help="fp32 (default), bf16 or fp16 (CUDA only): autocast for the llm-text, vlm-caption and "
        "ldm-t2i training and scoring; image-cls stays fp32",
    )
    r.add_argument(
        "--dry-run", action="store_true", help="print the plan (cells, training runs, estimated time) and exit"
    )
    r.add_argument(
        "--redo-before",
        default=None,
        metavar="TIME",
        help="also redo the selected cells whose records were started before TIME (ISO 8601, UTC unless it has "
        "an offset, e.g. 2026-11-28T07:00), e.g. after changing a method's code; give the same TIME to resume",
    )
    r.add_argument(
        "--view",
        default="all",
        help=f"threat views to run: a comma list of {', '.join(VIEWS)}, or 'all' (default), e.g. only the view a "
        "claim reads",
    )
    r.add_argument(
        "--task",
        default="all",
        help="tasks to run: a comma list of the scenarios' task ids (e.g. image-cls/vit), or 'all' (default)",
    )
    r.add_argument(
        "--verbose",
        action="store_true",
        help="show third-party loading output and warnings; with --dry-run, list the cells to run",
    )
    ls = sub.add_parser("list", help="list scenarios, defenses, attacks, and which cells apply")
    ls.add_argument("--preset", default="smoke", help="preset used to build the scenarios for the matrix")
    ls.add_argument("--scenario", default="all")
    lb = sub.add_parser("leaderboard", help="regenerate leaderboards from stored records")
    lb.add_argument("--out", default="results")
    lbx = lb.add_mutually_exclusive_group()
    lbx.add_argument(
        "--restore",
        default=None,
        metavar="SNAPSHOT",
        help="first copy a published snapshot's records (e.g. leaderboards/default) into --out",
    )
    lbx.add_argument(
        "--publish",
        default=None,
        metavar="SNAPSHOT",
        help="then replace SNAPSHOT with the tables, gzipped records and grids (e.g. leaderboards/default)",
    )
    ck = sub.add_parser("check", help="conformance checks for a defense or an attack on the smoke preset")
    ck.add_argument(
        "--defense", default=None, help="NAME[:k=v], a list, or a .py file (exactly one of --defense / --attack)"
    )
    ck.add_argument("--attack", default=None, help="NAME[:k=v], a list, or a .py file")
    ck.add_argument("--scenario", default="")
    ck.add_argument(
        "--timeout",
        default=None,
        help="wall-clock seconds per configuration, run in a child process that is killed at the limit "
        "(default 3 x BENCH_CHECK_BUDGET_S: 1800 s unless that is set)",
    )
    return p


def scenario_names(arg: str) -> list[str]:
    names = SCENARIOS.names() if arg.strip() == "all" else [s.strip() for s in arg.split(",") if s.strip()]
    for n in names:
        SCENARIOS.get(n)
    if not names:
        raise UsageError(unknown_message("scenario", arg, SCENARIOS.names()))
    return unique_names(names, "scenario")


def view_names(arg: str) -> tuple[str, ...] | None:
    """``--view``: None for 'all', else the named views (each one of VIEWS, none twice)."""
    if arg.strip() == "all":
        return None
    names = [v.strip() for v in arg.split(",") if v.strip()]
    for n in names or [arg]:
        if n not in VIEWS:
            raise UsageError(unknown_message("view", n, [*VIEWS, "all"]))
    return tuple(unique_names(names, "view"))


def task_ids(arg: str, names: list[str], preset: str) -> tuple[str, ...] | None:
    """``--task``: None for 'all', else the named task ids, checked against the scenarios' declared tasks before
    anything is built or written (an unknown or repeated id is a usage error listing the choices)."""
    from .specs import declared

    if arg.strip() == "all":
        return None
    decl = [declared(SCENARIOS.get(n), preset) for n in names]
    known = [d.id for ds in decl for d in ds or ()] if all(ds is not None for ds in decl) else None
    ids = [n.strip() for n in arg.split(",") if n.strip()]
    for n in ids or [arg]:
        if not ids or known is not None and n not in known:
            raise UsageError(unknown_message("task", n, [*(known or []), "all"]))
    return tuple(unique_names(ids, "task"))


def only_tasks(tasks: list, ids: tuple[str, ...] | None) -> list:
    """The tasks ``--task`` names (all for None), in the scenarios' order; a name no built task has is an error."""
    if ids is None:
        return tasks
    missing = [i for i in ids if i not in {t.id for t in tasks}]
    if missing:
        raise UsageError(unknown_message("task", missing[0], [*(t.id for t in tasks), "all"]))
    return [t for t in tasks if t.id in ids]


def parse_seeds(raw: str) -> list[int]:
    return seed_count(raw)  # 1 <= N <= params.MAX_SEEDS


@overload
def positive_number(raw: str, flag: str, *, integer: bool = False, allow_zero: bool = False) -> float: ...
@overload
def positive_number(raw: None, flag: str, *, integer: bool = False, allow_zero: bool = False) -> None: ...
def positive_number(raw: str | None, flag: str, *, integer: bool = False, allow_zero: bool = False) -> float | None:
    if raw is None:
        return None
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        raise UsageError(f"{flag} must be {'a whole number' if integer else 'a number'}, got {raw!r}") from None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise UsageError(f"{flag} must be {'>= 0' if allow_zero else '> 0'} and finite, got {raw!r}")
    return v


MAX_MEM_CAP_MB = 2**32  # 4 PiB: far above any machine, and its byte count fits RLIMIT_AS


def address_space_mb() -> int:
    """This process's virtual address space in MB (Linux ``/proc/self/statm``; 0 elsewhere): a worker imports
    the same libraries, so an ``RLIMIT_AS`` below it kills every worker before its first cell."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return -(-pages * os.sysconf("SC_PAGE_SIZE") // 2**20)


def worker_config(a, preset: str, device: str):
    """(jobs, WorkerConfig) from the flags, every one checked before anything runs."""
    from .executors import WorkerConfig, contributed_modules, default_mem_cap_mb, default_threads

    if a.executor not in ("local", "ray"):
        raise UsageError(unknown_message("executor", a.executor, ["local", "ray"]))
    jobs = int(positive_number(a.jobs, "--jobs", integer=True))
    if jobs > 256:
        raise UsageError(f"--jobs must be at most 256, got {jobs}")
    timeout = positive_number(a.cell_timeout, "--cell-timeout")
    mem = positive_number(a.mem_cap, "--mem-cap", integer=True, allow_zero=True)
    if mem is not None and mem > MAX_MEM_CAP_MB:  # RLIMIT_AS is a 64-bit byte count
        raise UsageError(f"--mem-cap must be at most {MAX_MEM_CAP_MB} MB (0 = no cap), got {a.mem_cap!r}")
    if mem and mem < (need := address_space_mb()):  # a worker could not even import torch: every cell would fail
        raise UsageError(
            f"--mem-cap {int(mem)} MB is below the address space a worker needs just to load torch and the "
            f"benchmark ({need} MB here); give at least {need}, or 0 for no cap"
        )
    if mem is None:
        # CUDA maps huge address ranges. Elsewhere a share of RAM plus the address space the libraries map (counted
        # by RLIMIT_AS, mostly never resident): measured, vlm-caption default's projector alignment peaked at
        # 9.6 GB of address space for 6.2 GB resident, over a 9.0 GB cap of 75% of 24 GB / --jobs 2 alone
        lib = address_space_mb()
        mem = 0 if device.startswith("cuda") else max(default_mem_cap_mb(jobs) + lib, 2 * lib)
    cfg = WorkerConfig(
        threads=default_threads(jobs),
        mem_cap_mb=int(mem),
        timeout_s=timeout if timeout is not None else CELL_TIMEOUT_S[preset],
        contrib=contributed_modules(),
        quiet=not a.verbose,
        device=device,
    )
    if a.ray_address is not None and not a.ray_address.strip():
        raise UsageError("--ray-address must name a running cluster (e.g. ray://host:10001); got an empty string")
    if a.ray_address and a.executor != "ray":
        raise UsageError("--ray-address needs --executor ray")
    return jobs, cfg


def make_executor(a, jobs: int, cfg):
    from .executors import LocalExecutor, RayExecutor

    if a.executor == "ray":
        try:
            return RayExecutor(cfg, address=a.ray_address, num_gpus=1.0 if cfg.device.startswith("cuda") else 0.0)
        except RuntimeError as e:
            raise UsageError(str(e)) from None
    return LocalExecutor(jobs, cfg)


def idle_executor(jobs: int):
    """The executor of a run with every cell recorded: nothing is submitted, so no worker starts and no Ray
    cluster is started or contacted (as with --dry-run, the plan shows --jobs)."""
    from .runner import InlineExecutor

    ex = InlineExecutor()
    ex.jobs = jobs
    return ex


def redo_time(raw: str | None):
    """``--redo-before``'s time (UTC), or None; a value that is not an ISO 8601 time is a usage error."""
    if raw is None:
        return None
    from .runplan import parse_time

    try:
        t = parse_time(raw)
    except ValueError:
        raise UsageError(
            f"--redo-before {raw!r} is not an ISO 8601 date or time: give e.g. 2026-11-28, 2026-11-28T07:00 "
            "(UTC) or 2026-11-28T07:00+01:00"
        ) from None
    now = datetime.now(timezone.utc)
    if t > now:  # every resumed run would redo its own records again
        raise UsageError(f"--redo-before {raw!r} is in the future (now {now:%Y-%m-%dT%H:%M:%S}Z): give a past time")
    return t
