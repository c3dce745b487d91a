"""The execution engine: worker processes (--jobs), per-unit isolation (timeouts, memory cap, sys.exit),
the plan (--dry-run) and the Ray executor, on the toy task and a cheap smoke slice."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
from dataclasses import dataclass

import pytest

from bench.executors import LocalExecutor, WorkerConfig, default_threads
from bench.runner import plan, run
from bench.store import Store
from defenses.fedavg import FedAvg
from defenses.fedsgd import FedSGD
from tests.toy import ToyLossMIA, ToyMeanRecon, toy_task


@dataclass
class ToyLossVariant(ToyLossMIA):
    """The toy loss attack with another setting: a second cell of the same attack name (the same signals)."""

    margin: float = 1.0


ATTACKS = [ToyLossMIA(), ToyMeanRecon()]


@dataclass
class Sleepy(FedAvg):
    """A contributed defense that hangs in its client step."""

    name = "sleepy"

    def client_step(self, state, ctx):
        time.sleep(10**6)


@dataclass
class Exiting(FedAvg):
    name = "exiting"

    def client_step(self, state, ctx):
        sys.exit(0)


@dataclass
class Hungry(FedAvg):
    """Asks for far more memory than the worker's cap."""

    name = "hungry"

    def client_step(self, state, ctx):
        import torch

        return torch.ones(2**31, dtype=torch.float64)  # 16 GiB


def task():
    t = toy_task()
    t.source = functools.partial(toy_task)  # how a worker process rebuilds it
    return t


def metrics_of(out) -> dict:
    return {
        (r["defense_label"], r["attack_label"], r["view"]): (r["status"], r.get("metrics"), r.get("per_candidate"))
        for r in Store(out).records()
    }


def test_jobs_2_and_jobs_1_give_identical_records(tmp_path):
    defenses = [FedAvg(), FedSGD()]

    run(
        [task()],
        defenses,
        ATTACKS,
        [0],
        tmp_path / "j1",
        executor=LocalExecutor(1, WorkerConfig(threads=default_threads(1), timeout_s=300)),
    )
    s2 = run(
        [task()],
        defenses,
        ATTACKS,
        [0],
        tmp_path / "j2",
        executor=LocalExecutor(2, WorkerConfig(threads=default_threads(2), timeout_s=300)),
    )

    one, two = metrics_of(tmp_path / "j1"), metrics_of(tmp_path / "j2")
    assert len(two) == len(plan([task()], defenses, ATTACKS, [0])) and s2.counts["failed"] == 0
    assert two == one
    assert sum(v[0] == "ok" for v in two.values()) >= 5


class Recording:
    """A two-worker executor that runs nothing: each unit 'takes' 0.05 s in a thread and reports ok, and the
    executor logs when each unit ran, to check what the scheduler lets run side by side."""

    name = "recording"
    jobs = 2

    def __init__(self):
        import concurrent.futures as cf

        self.pool, self.log = cf.ThreadPoolExecutor(2), []

    def _run(self, unit):
        t0 = time.monotonic()
        time.sleep(0.05)
        self.log.append((unit.kind, unit.key, unit.affinity, t0, time.monotonic()))
        return {"key": unit.key, "kind": unit.kind, "status": "ok", "wall_s": 0.05, "written": True}

    def submit(self, unit):
        return self.pool.submit(self._run, unit)

    def shutdown(self, *, kill=False):
        self.pool.shutdown(wait=True)


def test_cells_that_share_signals_never_run_side_by_side(tmp_path):
    # arrange: the base model's cells score the same candidates in every view; two loss variants of one view
    ex = Recording()
    attacks = [ToyLossMIA(), ToyLossVariant(margin=2.0), ToyMeanRecon()]

    # act
    summary = run([task()], [FedAvg()], attacks, [0], tmp_path, executor=ex)

    # assert
    cells = [e for e in ex.log if e[0] == "cell"]
    keys = {e[1]: e[2] for e in cells}
    by_key: dict = {}
    for e in cells:
        by_key.setdefault(e[2], []).append(e)
    shared = {k: v for k, v in by_key.items() if len(v) > 1}
    assert summary.counts["failed"] == 0 and len(cells) == len(keys)
    assert any("|base|" in k and k.endswith("|clients") for k in shared)  # the base model's views: one key
    assert any("|fedavg|" in k and k.endswith("|global_model") for k in shared)  # two variants of one view
    for k, runs in shared.items():
        runs.sort(key=lambda e: e[3])
        assert all(a[4] <= b[3] for a, b in zip(runs, runs[1:])), f"{k} ran side by side"
    overlapped = any(a[3] < b[4] and b[3] < a[4] for a in cells for b in cells if a[2] != b[2])
    assert overlapped  # other cells still run two at a time


def test_a_unit_takes_the_free_slot_that_last_ran_its_affinity():
    # arrange
    from bench.executors import SlotPool

    pool = SlotPool(_slots("cpu", "cpu"), capacity=lambda d: None)
    a, b = pool.take(None, "x"), pool.take(None, "y")
    pool.give(b)
    pool.give(a)  # the free list now starts with b, which last ran "y"

    # act
    again = pool.take(None, "x")
    other = pool.take(None, "z")

    # assert
    assert again is a and other is b and (a.last, b.last) == ("x", "z")


def test_a_hanging_defense_is_killed_at_the_timeout_and_the_rest_finishes(tmp_path):
    # generous for the honest units on a loaded machine (30 s was too short beside two busy workers at nice 19)
    cfg = WorkerConfig(threads=1, timeout_s=90)
    t0 = time.time()

    summary = run([task()], [Sleepy(), FedAvg()], [ToyLossMIA()], [0], tmp_path, executor=LocalExecutor(1, cfg))

    assert time.time() - t0 < 480
    recs = {(r["defense_label"], r["view"]): r for r in Store(tmp_path).records()}
    hung = [r for (d, _), r in recs.items() if d == "sleepy"]
    assert hung and all(r["status"] == "failed" and "timed out after 90 s" in r["reason"] for r in hung)
    fine = recs[("fedavg", "global_model")]
    assert fine["status"] == "ok", fine.get("reason")
    assert summary.counts["failed"] == len(hung)


def test_sys_exit_and_memory_hogs_are_recorded_failed(tmp_path):
    cfg = WorkerConfig(threads=1, timeout_s=120, mem_cap_mb=6000)

    run([task()], [Exiting(), Hungry(), FedAvg()], [ToyLossMIA()], [0], tmp_path, executor=LocalExecutor(1, cfg))

    recs = list(Store(tmp_path).records())
    by = {}
    for r in recs:
        by.setdefault(r["defense_label"], []).append(r)
    assert all(r["status"] == "failed" and "SystemExit(0)" in r["reason"] for r in by["exiting"])
    assert all(r["status"] == "failed" and "exceeded memory cap (6000 MB)" in r["reason"] for r in by["hungry"])
    assert all(r["status"] == "ok" for r in by["fedavg"])


def test_sys_exit_in_the_inline_executor_does_not_end_the_run(tmp_path):
    summary = run([toy_task()], [Exiting(), FedAvg()], [ToyLossMIA()], [0], tmp_path)

    assert summary.counts["ok"] >= 2 and summary.counts["failed"] >= 1


def test_cli_exiting_contributed_defense_fails_its_cells_and_leaderboards_are_written(tmp_path):
    from bench.cli import main

    contrib = tmp_path / "quitter.py"
    contrib.write_text(
        "import sys\nfrom dataclasses import dataclass\nfrom bench.registry import register_defense\n"
        "from defenses.fedsgd import FedSGD\n\n\n@register_defense\n@dataclass\nclass Quitter(FedSGD):\n"
        "    def client_step(self, state, ctx):\n        sys.exit(0)\n"
    )
    out = tmp_path / "out"

    code = main(
        [
            "run",
            "--scenario",
            "image-cls",
            "--defense",
            f"{contrib},fedsgd",
            "--attack",
            "april",
            "--preset",
            "smoke",
            "--out",
            str(out),
            "--jobs",
            "1",
        ]
    )

    assert code == 0
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    quit_ = [r for r in recs if r["defense"] == "quitter" and r["status"] != "n/a"]
    assert quit_ and all(r["status"] == "failed" and "SystemExit" in r["reason"] for r in quit_)
    assert any(r["defense"] == "fedsgd" and r["status"] == "ok" for r in recs)
    assert (out / "leaderboards" / "image-cls.csv").exists()


@pytest.mark.parametrize("verbose", [False, True])
def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys, verbose):
    from bench.cli import main

    out = tmp_path / "never"
    argv = ["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "april", "--preset", "smoke"]
    code = main([*argv, "--out", str(out), "--dry-run", "--jobs", "2", *(["--verbose"] if verbose else [])])

    text = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "cells planned" in text and "1 to train" in text and "estimated time" in text and "2 job(s)" in text
    # --verbose lists the cells by training run (the one training run of the plan)
    listed = [line for line in text.splitlines() if " fedsgd seed 0 [train]: april/client_update" in line]
    assert len(listed) == (1 if verbose else 0)


def test_task_filter_plans_only_the_named_tasks(tmp_path, capsys):
    from bench.cli import main

    argv = ["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "inverting_gradients"]
    code = main([*argv, "--preset", "smoke", "--out", str(tmp_path / "o"), "--dry-run", "--verbose"])
    both = capsys.readouterr().out
    code2 = main(
        [
            *argv,
            "--preset",
            "smoke",
            "--out",
            str(tmp_path / "o"),
            "--dry-run",
            "--verbose",
            "--task",
            "image-cls/resnet34",
        ]
    )
    one = capsys.readouterr().out

    assert code == code2 == 0
    assert "image-cls/vit fedsgd" in both and "image-cls/resnet34 fedsgd" in both
    assert "image-cls/vit" not in one and "image-cls/resnet34 fedsgd seed 0 [train]" in one


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--jobs", "0"], "--jobs"),
        (["--jobs", "x"], "--jobs"),
        (["--cell-timeout", "-1"], "--cell-timeout"),
        (["--cell-timeout", "nan"], "--cell-timeout"),
        (["--executor", "slurm"], "executor"),
        (["--device", "tpu"], "device"),
        (["--mem-cap", "-5"], "--mem-cap"),
        (["--ray-address", "ray://h:1"], "--executor ray"),
        (["--precision", "fp64"], "fp32, bf16, fp16"),
        (["--precision", "fp16", "--device", "cpu"], "CUDA"),
    ],
)
def test_bad_engine_flags_exit_2_and_write_nothing(tmp_path, capsys, flags, problem):
    from bench.cli import main

    out = tmp_path / "never"
    code = main(
        [
            "run",
            "--scenario",
            "image-cls",
            "--defense",
            "fedsgd",
            "--attack",
            "april",
            "--preset",
            "smoke",
            "--out",
            str(out),
            *flags,
        ]
    )

    assert code == 2 and not out.exists()
    assert problem in capsys.readouterr().err


def test_ray_executor_gives_the_local_executors_metrics(tmp_path):
    pytest.importorskip("ray")  # installed by setup.sh (extra "ray"); CI exercises it
    from bench.executors import RayExecutor

    cfg = WorkerConfig(threads=1, timeout_s=300)
    defenses = [FedAvg()]
    # the reference runs in a one-thread worker too: summation order depends on the thread count
    run([task()], defenses, ATTACKS, [0], tmp_path / "local", executor=LocalExecutor(1, cfg))

    run([task()], defenses, ATTACKS, [0], tmp_path / "ray", executor=RayExecutor(cfg, num_cpus=2))

    ray_recs = metrics_of(tmp_path / "ray")
    assert ray_recs == metrics_of(tmp_path / "local")
    assert sum(v[0] == "ok" for v in ray_recs.values()) >= 3


def test_the_worker_builds_every_model_on_the_units_device():
    from bench.runner import on_device

    t = toy_task()

    placed = on_device(t, "meta")

    assert {p.device.type for p in placed.api.build_model().parameters()} == {"meta"}
    assert on_device(t, "cpu") is t and placed.config_hash() == t.config_hash()  # same cells, same cache
    assert {p.device.type for p in t.api.build_model().parameters()} == {"cpu"}  # the original is untouched


OWNER = """
import sys
from bench.executors import Slot, WorkerConfig
from tests.fault_run import sleeper
Slot(WorkerConfig(threads=1), sys.argv[1]).run(sys.argv[2], sleeper)  # a unit that would run for an hour
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc")
@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_a_busy_worker_dies_with_its_killed_owner(tmp_path, context):
    import os
    import signal
    import subprocess

    from tests.test_faults import ROOT, _session, _until

    marker = tmp_path / "worker.pid"
    log = open(tmp_path / "owner.log", "wb")  # noqa: SIM115 - the child's output, read on failure
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, context, str(marker)],
        cwd=ROOT,
        stdout=log,
        stderr=log,
        start_new_session=True,
        env={**os.environ, "BENCH_THREADS": "1"},
    )
    _until(lambda: marker.exists() or owner.poll() is not None, 300)  # the worker initialised and is in its unit
    assert owner.poll() is None and marker.exists(), (tmp_path / "owner.log").read_text()
    worker = int(marker.read_text())
    assert worker in _session(owner.pid)

    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    gone_after = _until(lambda: not _session(owner.pid), 30)  # the worker, the forkserver, the resource tracker

    left = _session(owner.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert gone_after <= 10, f"{left} still running {gone_after:.0f} s after the owner's kill -9 (worker {worker})"


def test_a_worker_that_died_idle_is_replaced_and_the_next_unit_runs():
    """A worker killed between two units leaves a broken pool, whose ``submit`` raises: the next unit runs on a
    fresh worker (it used to come back as an "executor error")."""
    import os
    import signal
    from types import SimpleNamespace

    from bench.executors import Slot
    from tests.fault_run import worker_pid
    from tests.test_faults import _until

    slot = Slot(WorkerConfig(threads=1, timeout_s=300), report=False)
    try:
        first = slot.run(SimpleNamespace(key="u1", kind="cell"), worker_pid)
        assert first["status"] == "ok", first
        pool = slot._pool
        os.kill(first["pid"], signal.SIGKILL)  # idle: between two units
        assert _until(lambda: getattr(pool, "_broken", False), 60) <= 60, "the pool never saw its worker die"

        second = slot.run(SimpleNamespace(key="u2", kind="cell"), worker_pid)
    finally:
        slot.close(kill=True)

    assert second["status"] == "ok" and second["pid"] != first["pid"], second


def test_cuda_workers_are_spread_over_the_gpus_and_an_explicit_device_is_kept():
    # arrange
    from bench.device import placements
    from bench.executors import Slot
    from bench.runner import Unit
    from tests.fault_run import unit_device

    unit = Unit(kind="cell", key="u1", task=None, defense=None, device="cuda")

    # act: the slot pinned to the second of two GPUs runs a unit of a bare --device cuda run (no GPU needed:
    # the unit only reports the device it arrived with)
    slot = Slot(WorkerConfig(threads=1, timeout_s=120, device="cuda:1"), report=False)
    try:
        out = slot.run(unit, unit_device)
        kept = slot.run(Unit(kind="cell", key="u2", task=None, defense=None, device="cuda:0"), unit_device)
    finally:
        slot.close(kill=True)

    # assert
    assert placements("cuda", 5, n_cuda=2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert placements("cuda", 2, n_cuda=1) == ["cuda", "cuda"] == placements("cuda", 2, n_cuda=0)
    assert placements("cuda:1", 2, n_cuda=2) == ["cuda:1", "cuda:1"] and placements("cpu", 2) == ["cpu", "cpu"]
    assert out["device"] == "cuda:1" and kept["device"] == "cuda:0", (out, kept)


def _slots(*devices):
    from types import SimpleNamespace

    return [SimpleNamespace(cfg=SimpleNamespace(device=d), name=f"{d}#{i}", last="") for i, d in enumerate(devices)]


def _take_later(pool, need):
    """``pool.take(need)`` in a thread: (the thread, a list that receives the slot)."""
    import threading

    got: list = []
    t = threading.Thread(target=lambda: got.append(pool.take(need)), daemon=True)
    t.start()
    t.join(0.3)
    return t, got


def test_units_that_declare_gpu_memory_share_a_gpu_within_its_capacity():
    # arrange: two 10,000 MiB GPUs with two worker slots each (no GPU needed: the capacity is given)
    from bench.executors import SlotPool

    pool = SlotPool(_slots("cuda:0", "cuda:0", "cuda:1", "cuda:1"), capacity=lambda d: 10_000)

    # act
    a = pool.take(6_000)
    b = pool.take(6_000)  # does not fit beside a: the other GPU
    waiting, got = _take_later(pool, 6_000)  # fits on neither GPU: waits
    small = pool.take(4_000)  # fits beside a 6,000 MiB unit
    blocked = waiting.is_alive()
    pool.give(a, 6_000)
    waiting.join(5)

    # assert
    assert a.cfg.device != b.cfg.device and small.cfg.device in ("cuda:0", "cuda:1")
    assert blocked and got and got[0].cfg.device == a.cfg.device


def test_undeclared_and_oversized_units_and_cpu_slots():
    # arrange
    from bench.executors import SlotPool

    gpu = SlotPool(_slots("cuda", "cuda"), capacity=lambda d: 10_000)
    cpu = SlotPool(_slots("cpu", "cpu"), capacity=lambda d: 1)

    # act: a unit larger than the GPU runs alone; undeclared units take any free slot; CPU slots are not budgeted
    big = gpu.take(12_000)
    waiting, got = _take_later(gpu, 1_000)
    blocked = waiting.is_alive()
    free = gpu.take(None)
    gpu.give(big, 12_000)
    waiting.join(5)
    both = (cpu.take(50_000), cpu.take(50_000))

    # assert
    assert blocked and got and free is not big and len({id(x) for x in both}) == 2


def test_a_unit_carries_its_tasks_gpu_memory_and_ray_asks_for_that_share_of_a_gpu(monkeypatch):
    # arrange
    from types import SimpleNamespace

    import bench.executors as ex
    from bench.runner import Unit
    from bench.scenarios.ldm_t2i import SPECS

    unit = Unit(kind="cell", key="u", task=SimpleNamespace(gpu_mem_mb=10_000), defense=None, device="cuda")
    ray = object.__new__(ex.RayExecutor)
    monkeypatch.setattr(ex, "gpu_memory_mb", lambda d: 40_000)

    # act
    ray._num_gpus = 1.0
    share, undeclared = ray.gpu_share(unit), ray.gpu_share(Unit(kind="cell", key="v", task=None, defense=None))
    ray._num_gpus = 0.0
    on_cpu = ray.gpu_share(unit)

    # assert: [SMP-LoRA] Appendix E reports ~10,000 MiB for SMP-LoRA on the paper preset
    assert unit.gpu_mem_mb == 10_000 and SPECS["paper"].gpu_mem_mb == 10_000 and SPECS["default"].gpu_mem_mb is None
    assert share == 0.25 and undeclared is None and on_cpu is None


WATCHER = """
import os, resource, sys, time
from bench.executors import die_with_owner
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != resource.RLIM_INFINITY and soft < 2048:
    resource.setrlimit(resource.RLIMIT_NOFILE, (2048 if hard == resource.RLIM_INFINITY else min(2048, hard), hard))
while (fd := os.dup(0)) < 1100:  # descriptors 0..1099 taken: the watch's pidfd gets one >= 1100
    pass
os.close(fd)
die_with_owner(int(sys.argv[1]))
def pidfds():
    found = []
    for f in os.listdir("/proc/self/fd"):
        try:
            if "pidfd" in os.readlink(f"/proc/self/fd/{f}"):
                found.append(int(f))
        except OSError:  # listdir's own descriptor, closed meanwhile
            pass
    return found
while not pidfds():  # the watch thread has opened it
    time.sleep(0.05)
print("watching", pidfds()[0], flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfds and /proc are Linux")
def test_a_worker_watches_its_owner_through_a_descriptor_above_1023(tmp_path):
    """select.select refuses descriptors >= 1024 (FD_SETSIZE): the watch thread died, the worker outlived its owner."""
    import os
    import resource
    import signal
    import subprocess

    from tests.test_faults import ROOT

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard descriptor limit is below 1200")
    owner = subprocess.Popen(["sleep", "600"])
    log = tmp_path / "watcher.log"
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCHER, str(owner.pid)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=open(log, "wb"),  # noqa: SIM115 - read on failure
        env={**os.environ, "BENCH_THREADS": "1"},
    )
    try:
        line = watcher.stdout.readline().decode() if watcher.stdout else ""
        assert line.startswith("watching"), log.read_text()
        owner.kill()
        owner.wait()
        try:
            code = watcher.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        for p in (owner, watcher):
            if p.poll() is None:
                p.kill()
                p.wait()

    assert int(line.split()[1]) >= 1024
    assert code == -signal.SIGKILL, f"exit {code} after its owner died: {log.read_text()[-2000:]}"


def test_an_interrupted_ray_run_cancels_its_tasks(tmp_path):
    """shutdown(kill=True) force-cancels the tasks in flight and queued: on a Ray the run did not start (so
    shutdown does not stop it), no unit goes on after the run."""
    import concurrent.futures as cf
    import os

    ray = pytest.importorskip("ray")
    from bench.executors import RayExecutor
    from bench.runner import Unit
    from tests.test_faults import _until
    from tests.toy import MarkThenHang

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in "ZX"
        except (OSError, IndexError):
            return False

    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        ex = RayExecutor(WorkerConfig(threads=1, timeout_s=600))
        assert ex.jobs == 2
        hang = [MarkThenHang(marks=str(marks), tag=i) for i in range(3)]  # two run, one waits for a CPU
        units = [Unit("train", f"hang{i}", task(), d, out=str(tmp_path / "out")).portable() for i, d in enumerate(hang)]
        futures = [ex.submit(u) for u in units]
        _until(lambda: len(list(marks.iterdir())) >= 2, 300)
        first = sorted(p.name for p in marks.iterdir())
        assert len(first) == 2, first
        pids = [int(name.split(".")[1]) for name in first]  # the units' worker processes

        ex.shutdown(kill=True)

        gone_after = _until(lambda: not any(alive(p) for p in pids), 30)
        done, _ = cf.wait(futures, timeout=30)
        time.sleep(2)  # a queued task that was not cancelled would start now
        assert gone_after <= 20, f"units still running {gone_after:.0f} s after the shutdown: {pids}"
        assert len(done) == 3 and sorted(p.name for p in marks.iterdir()) == first
    finally:
        ray.shutdown()


NOISE = (
    "Loading weights",
    "Loaded pretrained weights",
    "MiniLM captions",
    "will save all extracted features",
    "leaked semaphore",
    "resource_tracker",
    "Kernel Inception Distance",
    "huggingface",
    "transformers",
)


@pytest.mark.parametrize("quiet", [True, False])
def test_a_third_party_bar_without_a_switch_is_hidden_only_when_quiet(quiet, monkeypatch, capsys):
    from tqdm.auto import tqdm

    from bench.progress import QUIET_ENV, third_party_output

    monkeypatch.setenv(QUIET_ENV, "1" if quiet else "0")

    with third_party_output():
        for _ in tqdm(range(3), desc="de-quantizing"):
            pass

    assert ("de-quantizing" in capsys.readouterr().err) is not quiet


def test_a_run_keeps_third_party_noise_out_of_the_terminal_but_not_its_own_warnings(tmp_path):
    import os
    import subprocess

    from bench.controls import failures
    from tests.test_faults import ROOT

    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "run",
        "--preset",
        "smoke",
        "--scenario",
        "ldm-t2i,vlm-caption",
        "--defense",
        "fedavg",
        "--attack",
        "loss_mia",
        "--jobs",
        "2",
        "--out",
        str(out),
    ]
    res = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**{k: v for k, v in os.environ.items() if k != "BENCH_QUIET"}, "BENCH_THREADS": "1"},
    )

    assert res.returncode == 0, res.stderr[-3000:]
    heard = [n for n in NOISE if n in res.stderr or n in res.stdout]
    assert not heard, f"{heard} in the output:\n{res.stderr[-3000:]}"
    for line in failures(Store(out).records()):  # our own warnings still reach the terminal
        assert line in res.stderr
    assert "cells:" in res.stdout and "work:" in res.stderr  # the plan's summary and the run's own bar


# ----------------------------------------------------------------------------------------------
# device placement: batches follow the model; no hard-coded device in the hot paths (no GPU here: these
# are the CPU-side guards; GPU runs are not measured on this machine)

HOT_PATHS = (
    "bench/scenarios",
    "bench/signals.py",
    "bench/loss_signals.py",
    "bench/cells.py",
    "bench/recon_cells.py",
    "bench/fl.py",
    "attacks",
    "defenses",
)
HARD_DEVICE = (
    r"""\.cpu\(\)|\.cuda\(|device\s*=\s*["'](cpu|cuda)|torch\.device\(\s*["'](cpu|cuda)"""
    r"""|\.to\(\s*["'](cpu|cuda)"""
)
# (file, the line's code) allowed: results leaving for storage / numpy at the end, never in an optimisation loop
DEVICE_ALLOWED = {
    ("bench/signals.py", "rows[part].setdefault(k, []).extend(torch.split(v.cpu(), counts))"),
    (
        "bench/loss_signals.py",
        "out.append(loss_matrix(api, model, api.collate(list(chunk)), timesteps).detach().double().cpu())",
    ),
    ("bench/cells.py", "return np.asarray(torch.as_tensor(t).detach().double().cpu())"),
    ("bench/recon_cells.py", "recon = torch.cat([o.images for o in outs]).detach().float().cpu().numpy()"),
    ("bench/recon_cells.py", "got = torch.cat(labels).cpu().numpy()"),
    # the restart's starting image is drawn on the CPU generator (the same draw on every device), then moved
    ("attacks/inverting_gradients.py", "return lo.cpu() + (hi - lo).cpu() * torch.rand(size, generator=gen)"),
}


def test_no_hard_coded_device_in_the_hot_paths():
    import re

    from tests.test_faults import ROOT

    files = [p for h in HOT_PATHS for p in ([ROOT / h] if h.endswith(".py") else sorted((ROOT / h).glob("*.py")))]
    found = set()
    for f in files:
        for line in f.read_text().splitlines():
            code = line.split("#", 1)[0].strip()
            if re.search(HARD_DEVICE, code):
                found.add((str(f.relative_to(ROOT)), code))
    assert len(files) > 20
    assert found - DEVICE_ALLOWED == set(), "hard-coded device (follow the model's device, or allow-list it here)"


@pytest.mark.parametrize("scenario", ["image-cls", "llm-text", "vlm-caption", "ldm-t2i"])
def test_every_scenarios_losses_follow_the_models_device(scenario):
    """A batch built on the CPU, a model on the ``meta`` device: the losses (training and scoring) must run
    on the model's device, which fails at once when a batch stays behind."""
    import traceback

    from bench.cli import build_tasks

    task = build_tasks([scenario], "smoke")[0]
    model = task.api.build_model().to("meta")
    batch = task.api.collate(list(task.client_data[0])[:2])

    for fn in (task.api.loss, task.api.per_sample_loss):
        try:
            out = fn(model, batch)
        except RuntimeError as e:  # transformers builds its attention mask from values: past the batch placement
            where = "".join(traceback.format_tb(e.__traceback__))
            assert "cannot be called on meta tensors" in str(e) and "masking_utils" in where, where
            continue
        assert out.device.type == "meta"


def test_bf16_llm_text_runs_records_its_precision_and_keeps_fp32_keys(tmp_path):
    from bench.cli import build_tasks
    from bench.device import with_precision
    from bench.training import train_key

    (fp32,) = build_tasks(["llm-text"], "smoke")
    (bf16,) = build_tasks(["llm-text"], "smoke", "bf16")

    summary = run([bf16], [FedAvg()], [ToyLossMIA()], [0], tmp_path)

    recs = list(Store(tmp_path).records())
    assert recs and summary.counts["failed"] == 0 and summary.counts["ok"] >= 4
    assert {r["provenance"]["precision"] for r in recs} == {"bf16"}
    assert train_key(with_precision(fp32, "fp32"), FedAvg(), 0) == train_key(fp32, FedAvg(), 0)  # fp32 unchanged
    assert train_key(bf16, FedAvg(), 0) != train_key(fp32, FedAvg(), 0)  # a bf16 run never reuses fp32 training


def test_the_work_bars_eta_is_the_average_rate_through_uneven_jumps(monkeypatch):
    # arrange: a weighted bar on a fake clock; work lands in jumps (a unit's share, then a long quiet stretch)
    monkeypatch.delenv("BENCH_QUIET", raising=False)
    from bench.progress import progress_bar

    clock = [0.0]
    bar = progress_bar(total=1000.0, desc="work", unit="s", weighted=True)
    bar._time = lambda: clock[0]
    bar.start_t = bar.last_print_t = 0.0
    bar.mininterval = bar.miniters = 0
    # act: 100 s of work in the first 100 s, then 1 s of work after 300 quiet seconds
    for t, step in ((50.0, 50.0), (100.0, 50.0), (400.0, 1.0)):
        clock[0] = t
        bar.update(step)
    d = bar.format_dict
    bar.close()
    # assert: remaining = elapsed x (left / done) = 400 x 899 / 101, not the last jump's 1 s per 300 s
    rate = d["rate"] if d["rate"] is not None else d["n"] / d["elapsed"]
    assert (d["total"] - d["n"]) / rate == pytest.approx(400 * 899 / 101, rel=1e-6)


def test_stages_keep_sibling_loops_from_restarting_the_units_fraction(monkeypatch):
    # arrange: two loops one after another in each iteration of a unit's main loop (a membership cell's scoring
    # and aux-threshold passes)
    import bench.progress
    from bench.progress import progress, stage, unit_progress

    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)
    staged: list = []
    bare: list = []

    # act
    for out, use in ((staged, True), (bare, False)):
        with unit_progress(out.append):
            for _ in progress(range(2), desc="parts", unit=True):
                for i in range(2):
                    with stage(i, 2) if use else contextlib.nullcontext():
                        for _ in progress(range(4), desc="pass"):
                            pass

    # assert: staged, the fraction only grows, to the last pass of the last part; bare, the second loop restarts it
    assert staged == sorted(staged) and len(staged) == 2 * (1 + 2 * 4) and staged[-1] == 1 / 2 + 1 / 4 + 3 / 16
    assert bare != sorted(bare)


def test_weighted_stages_give_each_step_its_share_of_the_units_fraction(monkeypatch):
    # arrange: a unit of two parts, each a cheap step, an expensive one of 4 passes and an empty one (weights 1, 8, 0)
    import bench.progress
    from bench.progress import progress, stage, unit_progress

    monkeypatch.setattr(bench.progress, "REPORT_S", 0.0)
    reports: list = []

    # act
    with unit_progress(reports.append):
        for _ in progress(range(2), desc="parts", unit=True):
            for i in range(3):
                with stage(i, (1, 8, 0)):
                    for _ in progress(range(4) if i == 1 else range(1), desc="pass"):
                        pass

    # assert: the cheap step is 1/9 of a part (half the unit), each of the 4 passes 2/9; the empty step adds nothing
    assert reports == sorted(reports)
    assert reports[:6] == pytest.approx([0.0, 0.0, 1 / 18, 1 / 18 + 1 / 9, 1 / 18 + 2 / 9, 1 / 18 + 3 / 9])
    assert reports[-2:] == pytest.approx([1 / 2 + 1 / 18 + 3 / 9, 1.0])  # the empty step starts where the part ends


def test_stage_weights_must_have_a_positive_sum(monkeypatch):
    from bench.progress import progress, stage, unit_progress

    with unit_progress(lambda f: None), pytest.raises(ValueError, match="positive sum"):
        for _ in progress(range(1), unit=True):
            with stage(0, (0, 0)):
                pass


def test_a_cells_model_building_is_a_small_step_and_the_aux_split_counts_only_where_the_harness_scores_it():
    from bench.cells import MODEL_STEP, Part, _part_steps

    part = Part(lambda: None, [0, 1], [2, 3], ([4, 5], [6, 7]))

    assert _part_steps(4, part, uses_aux=False) == (MODEL_STEP * 4, 4.0, 4.0)
    assert _part_steps(4, part, uses_aux=True) == (MODEL_STEP * 4, 4.0, 0.0)  # its calibration, no extra pass
    assert _part_steps(4, Part(lambda: None, [0], [1], ([], [])), uses_aux=False)[2] == 0.0
