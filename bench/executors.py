"""Where work units run: in this process, in local worker processes, or as Ray tasks.

A unit (``bench.units.Unit``: one training run or one attack cell) is executed by
``bench.units.execute_unit`` wherever it lands. Isolated executors run it in a child process with a
wall-clock budget and a memory cap (``RLIMIT_AS``); a child that overruns is killed and the unit comes
back ``failed`` with the reason, so one misbehaving defense cannot stall or take down the run. Worker
processes are reused across units and restarted only after a timeout or a crash (a fresh child per unit
would pay torch's import every time). Every executor's ``submit`` returns a ``concurrent.futures.Future``
of an outcome dict; scheduling is left to ``concurrent.futures`` and Ray.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import multiprocessing as mp
import os
import queue
import select
import signal
import sys
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from typing import Any, Callable, cast

from .device import gpu_memory_mb, placements
from .progress import UnitReport, unit_progress
from .units import InlineExecutor, Unit, execute_unit  # noqa: F401 -- executors sit above the units; InlineExecutor re-exported

# A worker's outcome: {"key", "kind", "status": ok|failed|n/a, "reason", "wall_s", "restart": bool, ...}
Outcome = dict


def total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_threads(jobs: int) -> int:
    """torch threads per worker: ``BENCH_THREADS`` if set, else 1 whatever ``jobs`` is.

    One thread, not cores // jobs: intra-op parallel reductions round differently with the thread count
    (measured: --jobs 1 at 2 threads and --jobs 2 at 1 thread differ in the 7th digit), and records must
    not depend on --jobs; independent single-thread workers also scale better (issue 12: two 1-thread
    processes gave 1.9x one, two threads in one process 1.3x quiet, 0.33x under load). Use --jobs for
    the cores, or BENCH_THREADS to trade that guarantee for threads."""
    raw = os.environ.get("BENCH_THREADS", "").strip()
    return int(raw) if raw else 1


def default_mem_cap_mb(jobs: int) -> int:
    """A generous per-worker address-space cap: 75% of RAM shared out over the jobs."""
    return int(0.75 * total_memory_bytes() / max(1, jobs) / 2**20)


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker process sets up once: threads, memory cap (MB, 0 = none), contributed modules."""

    threads: int = 1
    mem_cap_mb: int = 0
    timeout_s: float = 0.0  # per unit; 0 = no limit
    contrib: tuple[tuple[str, str], ...] = ()  # (module name, file) of contributed methods to re-import
    quiet: bool = True  # keep third-party loading noise out of the terminal
    device: str = "cpu"  # where the worker places models (bench.device)


def contributed_modules() -> tuple[tuple[str, str], ...]:
    """Contributed methods loaded from a path in this process (``Registry.load_path``): a worker must
    import them under the same module name before it can unpickle their instances."""
    return tuple(
        sorted(
            (name, file)
            for name, m in list(sys.modules.items())
            if name.startswith("_bench_contrib_") and (file := getattr(m, "__file__", None))
        )
    )


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup to run: records are written atomically


def _watch_owner(owner: int) -> None:
    """Block until process ``owner`` has exited, then kill this process. Linux: wait on its pidfd (readable
    once it exits, zombie or reaped, no pid reuse); elsewhere poll the pid (and our parent) every second."""
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:
        _die()
    except (AttributeError, OSError):  # not Linux >= 5.3
        fd = None
    if fd is not None:
        poller = select.poll()  # not select.select: it refuses descriptors >= 1024 (FD_SETSIZE)
        poller.register(fd, select.POLLIN)
        poller.poll()  # no timeout: until the owner exits (EINTR is retried, PEP 475)
        _die()
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            _die()
        except PermissionError:  # the pid now belongs to another user's process: ours is gone
            _die()
        if parent == owner and os.getppid() != owner:  # reparented: the owner is gone
            _die()


def die_with_owner(owner: int) -> None:
    """Make this worker die with the run's process ``owner``, even when that is SIGKILLed (then no
    shutdown code runs, and a worker would otherwise go on training). A forkserver worker's parent is
    the forkserver, which itself lives while any worker does, so PR_SET_PDEATHSIG (the parent's death)
    cannot see the run die: a daemon thread watches ``owner`` itself. PR_SET_PDEATHSIG is still set
    when the parent is the single-threaded forkserver, not when it is ``owner``: it fires when the
    parent *thread* that started us ends, and an executor's threads come and go."""
    parent = os.getppid()
    if parent != owner and sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before prctl took effect
            _die()
    threading.Thread(target=_watch_owner, args=(owner,), name="bench-owner-watch", daemon=True).start()


_PROGRESS: list = [None]  # in a worker: the queue its units report their done fraction to (or None)


def _init_worker(cfg: WorkerConfig, owner: int = 0, progress_queue=None) -> None:
    """Runs once in each fresh worker process (before any unit): dies with ``owner``, then sets up limits;
    its units report progress to ``progress_queue``."""
    import importlib.util

    if owner:
        die_with_owner(owner)
    if progress_queue is not None:
        progress_queue.cancel_join_thread()  # exiting never waits for the parent to read
        _PROGRESS[0] = progress_queue
    if cfg.mem_cap_mb > 0:
        import resource

        cap = cfg.mem_cap_mb * 2**20
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    os.environ["BENCH_THREADS"] = str(cfg.threads)
    os.environ["BENCH_QUIET"] = "1"  # the parent draws the only progress bar
    os.environ["BENCH_DEVICE"] = cfg.device
    if cfg.mem_cap_mb > 0:
        os.environ["BENCH_MEM_CAP_MB"] = str(cfg.mem_cap_mb)
    if cfg.quiet:
        from .progress import silence_third_party

        silence_third_party()
    # tqdm's default lock is a multiprocessing RLock: a named semaphore here (forkserver / spawn) that a
    # killed worker (timeout, crash, interrupted run) leaks, which the resource tracker then reports at
    # shutdown. Bars in a worker are off or local to it: a thread lock is all they need.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    import torch

    torch.set_num_threads(cfg.threads)
    for name, path in cfg.contrib:
        if name in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load contributed module {name} from {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)


def on_slot(unit, device: str):
    """``unit`` on its worker slot's ``device`` where the run asked for a bare ``cuda`` and the slot is pinned to
    one GPU (:func:`bench.device.placements`); anything else unchanged (an explicit device, the CPU)."""
    if isinstance(unit, Unit) and unit.device == "cuda" and device.startswith("cuda:"):
        return replace(unit, device=device)
    return unit


def _run_in_worker(unit) -> Outcome:
    q = _PROGRESS[0]
    if q is None:
        return execute_unit(unit)
    key = unit.key
    with unit_progress(lambda f: q.put_nowait((key, f))):
        return execute_unit(unit)


class Slot:
    """One reusable worker process with a per-unit wall-clock budget; killed and replaced on overrun or crash.

    ``stop`` (shared by an executor's slots) set: no worker starts any more. The pool is only created,
    submitted to and taken out under ``_lock``, so a shutdown racing the slot's thread sees every worker."""

    def __init__(
        self,
        cfg: WorkerConfig,
        context: str = "forkserver",
        *,
        report: bool = True,
        stop: threading.Event | None = None,
    ):
        self.cfg = cfg
        self.context = context
        self.report = report  # the worker's units send their done fraction (``poll``)
        self._stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._pool: cf.ProcessPoolExecutor | None = None
        # the current worker's progress queue, a multiprocessing Queue (one writer: a killed worker tears no other's)
        self._queue: Any = None
        self.last = ""  # the affinity of the last unit given to this slot (its worker's signal cache: SlotPool)

    def _ensure(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            ctx = mp.get_context(self.context)
            if self.context == "forkserver":  # workers fork from a server that has torch imported already
                ctx.set_forkserver_preload(["bench.runner"])
            self._queue = ctx.Queue() if self.report else None
            self._pool = cf.ProcessPoolExecutor(
                max_workers=1, mp_context=ctx, initializer=_init_worker, initargs=(self.cfg, os.getpid(), self._queue)
            )
        return self._pool

    def poll(self) -> list[tuple[str, UnitReport]]:
        """(unit key, done fraction or set-up step) reports sent by the worker since the last call."""
        q, got = self._queue, cast("list[tuple[str, UnitReport]]", [])
        while q is not None:
            try:
                got.append(q.get_nowait())
            except (queue.Empty, OSError, EOFError):  # nothing more, or the queue was closed meanwhile
                break
        return got

    def _discard(self, kill: bool, pool: cf.ProcessPoolExecutor | None = None) -> list[int | None]:
        """Take the pool out of the slot (only if it is still ``pool``, when given: else whoever took it ends
        it) and end it, killing its worker first if ``kill``; the worker's exit codes."""
        with self._lock:
            if pool is not None and pool is not self._pool:
                return []
            pool, self._pool, self._queue = self._pool, None, None
        if pool is None:
            return []
        # ProcessPoolExecutor has no public way to kill a worker before Python 3.14 (terminate_workers)
        procs = list((getattr(pool, "_processes", None) or {}).values())
        if kill:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
        pool.shutdown(wait=True, cancel_futures=True)  # not killed: waits for the unit in flight
        return [p.exitcode for p in procs]

    def run(self, unit, fn=None, *, flag: str = "--cell-timeout") -> Outcome:
        """``fn(unit)`` (default ``execute_unit``) in the worker; ``flag`` names the budget in a timeout reason."""
        t0 = time.time()
        fut: cf.Future | None = None
        for _ in range(2):  # a worker that died while idle broke its pool (submit raises): replace it once
            with self._lock:
                if self._stop.is_set():
                    return _failed(unit, "not run: the run was stopped", t0)
                pool = self._ensure()
                with contextlib.suppress(BrokenProcessPool):
                    fut = pool.submit(fn or _run_in_worker, on_slot(unit, self.cfg.device))
            if fut is not None:
                break
            self._discard(True, pool)
        if fut is None:
            return _failed(unit, "worker process died before the unit started, on a fresh worker too", t0)
        budget = self.cfg.timeout_s or None
        try:
            out = fut.result(timeout=budget)
        except cf.TimeoutError:
            self._discard(True, pool)
            return _failed(unit, f"timed out after {budget:g} s ({flag}); the worker was killed", t0)
        except BrokenProcessPool:
            codes = self._discard(False, pool)
            code = next((c for c in codes if c is not None), None)
            cap = f"; memory cap {self.cfg.mem_cap_mb} MB" if self.cfg.mem_cap_mb else ""
            return _failed(unit, f"worker process died (exit code {code}){cap}", t0)
        except BaseException as e:  # e.g. the outcome could not be unpickled
            self._discard(True, pool)
            return _failed(unit, f"worker error: {type(e).__name__}: {e}", t0)
        if out.get("restart"):  # e.g. after a MemoryError the worker's heap is suspect
            self._discard(True, pool)
        return out

    def close(self, *, kill: bool = False) -> None:
        """Start no worker after this and end the current one (``kill``: without waiting for its unit)."""
        self._stop.set()
        self._discard(kill)


def _failed(unit, reason: str, t0: float) -> Outcome:
    return {
        "key": unit.key,
        "kind": unit.kind,
        "status": "failed",
        "reason": reason,
        "wall_s": time.time() - t0,
        "written": False,
    }


class SlotPool:
    """The free worker slots. A unit that declares its GPU memory (``Unit.gpu_mem_mb``) takes a free slot whose
    GPU has that much of its capacity not reserved by the declared units running there (a unit larger than the GPU
    runs only on an idle one), and waits for one otherwise; undeclared units and CPU slots take the first free
    slot, as a plain queue would. ``capacity(device)``: a GPU's memory in MiB (None: not budgeted)."""

    def __init__(self, slots: list, capacity: Callable[[str], int | None] = gpu_memory_mb):
        self._free = list(slots)
        self._capacity = functools.lru_cache(maxsize=None)(capacity)
        self._reserved: dict[str, int] = {}
        self._cond = threading.Condition()

    def _fits(self, device: str, need: int) -> bool:
        cap = self._capacity(device) if device.startswith("cuda") else None
        used = self._reserved.get(device, 0)
        return cap is None or used == 0 or used + need <= cap

    def take(self, need: int | None = None, affinity: str = ""):
        """A free slot for a unit needing ``need`` MiB (reserved until :meth:`give`); blocks until there is one.
        A unit with an ``affinity`` (bench.runplan.share_key) prefers the free slot that last ran one of its
        kind: that worker's cache holds the signals it would compute again."""
        with self._cond:
            while True:
                fits = [i for i, slot in enumerate(self._free) if not need or self._fits(slot.cfg.device, need)]
                if fits:
                    i = next((i for i in fits if affinity and self._free[i].last == affinity), fits[0])
                    slot = self._free.pop(i)
                    slot.last = affinity
                    if need:
                        self._reserved[slot.cfg.device] = self._reserved.get(slot.cfg.device, 0) + need
                    return slot
                self._cond.wait()

    def give(self, slot, need: int | None = None) -> None:
        with self._cond:
            if need:
                self._reserved[slot.cfg.device] -= need
            self._free.append(slot)
            self._cond.notify_all()


class LocalExecutor:
    """``jobs`` worker processes on this machine; a thread per slot waits on its worker (and its budget)."""

    name = "local"

    def __init__(self, jobs: int, cfg: WorkerConfig, *, context: str = "forkserver"):
        self.jobs = jobs
        self._stop = threading.Event()  # set by shutdown: no slot starts a worker (or a unit) after it
        self._kill = False  # once an interrupted run asked to kill, every later shutdown kills too
        # one worker per slot; with several GPUs and --device cuda each slot is pinned to one (bench.device);
        # units that declare their GPU memory share a GPU within its capacity
        self._all = [Slot(replace(cfg, device=d), context, stop=self._stop) for d in placements(cfg.device, jobs)]
        self._slots = SlotPool(self._all)
        self._threads = cf.ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="bench-slot")

    def _run(self, unit) -> Outcome:
        need = getattr(unit, "gpu_mem_mb", None)
        slot = self._slots.take(need, getattr(unit, "affinity", ""))
        try:
            return slot.run(unit)
        finally:
            self._slots.give(slot, need)

    def submit(self, unit) -> cf.Future:
        return self._threads.submit(self._run, unit)

    def poll_progress(self) -> list[tuple[str, UnitReport]]:
        """(unit key, done fraction) of the units running, reported since the last call (bench.progress)."""
        return [r for s in self._all for r in s.poll()]

    def shutdown(self, *, kill: bool = False) -> None:
        """Stop the workers, starting no queued unit; ``kill`` (an interrupted run) kills the units in flight
        before any wait, so a unit ending meanwhile cannot free a slot for the next one."""
        self._kill = self._kill or kill
        self._stop.set()
        self._threads.shutdown(wait=False, cancel_futures=True)
        for s in self._all:
            s.close(kill=self._kill)
        self._threads.shutdown(wait=True)


# ----------------------------------------------------------------------------------------------
# Ray: the same units as Ray tasks; inside a task the unit still runs in an isolated child (a Slot
# kept per Ray worker process), so timeouts and memory caps behave as with the local executor.

_RAY_SLOTS: dict[WorkerConfig, Slot] = {}
_RAY_LOCK = threading.Lock()


def _ray_task(unit, cfg: WorkerConfig) -> Outcome:
    with _RAY_LOCK:
        slot = _RAY_SLOTS.setdefault(cfg, Slot(cfg, "spawn", report=False))  # no progress back from Ray
    return slot.run(unit)


class RayExecutor:
    """Submits units to a Ray cluster (``address``) or a local one started for this run (``num_cpus``)."""

    name = "ray"

    def __init__(
        self,
        cfg: WorkerConfig,
        *,
        address: str | None = None,
        num_cpus: int | None = None,
        num_gpus: float = 0.0,
        memory_mb: int = 0,
    ):
        try:
            import ray
        except ImportError:
            raise RuntimeError("--executor ray needs the 'ray' package: pip install 'privacy-fl-bench[ray]'") from None
        self._ray = ray
        self.cfg = cfg
        self._started = not ray.is_initialized()
        if self._started:
            env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            kw: dict[str, Any] = {
                "address": address,
                "include_dashboard": False,
                "log_to_driver": not cfg.quiet,
                "runtime_env": {"env_vars": env},
            }
            if address is None:
                kw["num_cpus"] = num_cpus or cpu_count()
            ray.init(**kw)
        total = ray.cluster_resources().get("CPU", 1)
        self.jobs = max(1, int(total // max(1, cfg.threads)))
        self._num_gpus = num_gpus
        self._remote = ray.remote(_ray_task).options(
            num_cpus=cfg.threads,
            num_gpus=num_gpus,
            max_retries=0,
            **({"memory": memory_mb * 2**20} if memory_mb else {}),
        )  # a scheduling request, not a cap
        self._lock = threading.Lock()
        self._refs: set = set()  # the tasks submitted and not yet done (``shutdown(kill=True)`` cancels them)

    def gpu_share(self, unit) -> float | None:
        """The fraction of a GPU a unit asks Ray for: its declared memory over a GPU's (this machine's first;
        Ray packs fractional GPUs), None to keep the whole-GPU default (undeclared, CPU runs, no local GPU)."""
        need = getattr(unit, "gpu_mem_mb", None)
        cap = gpu_memory_mb("cuda") if need and self._num_gpus else None
        return min(1.0, round(need / cap, 4)) if need and cap else None

    def submit(self, unit) -> cf.Future:
        share = self.gpu_share(unit)
        remote = self._remote if share is None else self._remote.options(num_gpus=share)
        ref = remote.remote(unit, self.cfg)
        with self._lock:
            self._refs.add(ref)
        fut = ref.future()
        fut.add_done_callback(functools.partial(self._forget, ref))
        return fut

    def _forget(self, ref, _fut: object = None) -> None:
        with self._lock:
            self._refs.discard(ref)  # holding a done task's ref would keep its outcome in the object store

    def shutdown(self, *, kill: bool = False) -> None:
        """Disconnect (and stop a Ray started for this run); ``kill`` (an interrupted run) first force-cancels
        the tasks in flight or queued, killing their Ray workers, so no unit goes on after the run exits, on
        a shared cluster too."""
        if kill:
            with self._lock:
                refs, self._refs = list(self._refs), set()
            for ref in refs:
                with contextlib.suppress(Exception):  # e.g. finished meanwhile: nothing to cancel
                    self._ray.cancel(ref, force=True)
        if self._started:
            self._started = False
            self._ray.shutdown()
