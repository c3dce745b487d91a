"""The execution engine: worker processes (--jobs), per-unit isolation (timeouts, memory cap, sys.exit),
the plan (--dry-run) and the Ray executor, on the toy task and a cheap smoke slice."""
from __future__ import annotations

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
    return {(r["defense_label"], r["attack_label"], r["view"]): (r["status"], r.get("metrics"), r.get("per_candidate"))
            for r in Store(out).records()}


def test_jobs_2_and_jobs_1_give_identical_records(tmp_path):
    defenses = [FedAvg(), FedSGD()]

    run([task()], defenses, ATTACKS, [0], tmp_path / "j1",
        executor=LocalExecutor(1, WorkerConfig(threads=default_threads(1), timeout_s=300)))
    s2 = run([task()], defenses, ATTACKS, [0], tmp_path / "j2",
             executor=LocalExecutor(2, WorkerConfig(threads=default_threads(2), timeout_s=300)))

    one, two = metrics_of(tmp_path / "j1"), metrics_of(tmp_path / "j2")
    assert len(two) == len(plan([task()], defenses, ATTACKS, [0])) and s2.counts["failed"] == 0
    assert two == one
    assert sum(v[0] == "ok" for v in two.values()) >= 5


def test_a_hanging_defense_is_killed_at_the_timeout_and_the_rest_finishes(tmp_path):
    cfg = WorkerConfig(threads=1, timeout_s=30)  # generous for the honest units on a loaded CI machine
    t0 = time.time()

    summary = run([task()], [Sleepy(), FedAvg()], [ToyLossMIA()], [0], tmp_path, executor=LocalExecutor(1, cfg))

    assert time.time() - t0 < 240
    recs = {(r["defense_label"], r["view"]): r for r in Store(tmp_path).records()}
    hung = [r for (d, _), r in recs.items() if d == "sleepy"]
    assert hung and all(r["status"] == "failed" and "timed out after 30 s" in r["reason"] for r in hung)
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
    contrib.write_text("import sys\nfrom dataclasses import dataclass\nfrom bench.registry import register_defense\n"
                       "from defenses.fedsgd import FedSGD\n\n\n@register_defense\n@dataclass\nclass Quitter(FedSGD):\n"
                       "    def client_step(self, state, ctx):\n        sys.exit(0)\n")
    out = tmp_path / "out"

    code = main(["run", "--scenario", "image-cls", "--defense", f"{contrib},fedsgd", "--attack", "april",
                 "--preset", "smoke", "--out", str(out), "--jobs", "1"])

    assert code == 0
    recs = [json.loads(p.read_text()) for p in (out / "records").glob("*/*.json")]
    quit_ = [r for r in recs if r["defense"] == "quitter" and r["status"] != "n/a"]
    assert quit_ and all(r["status"] == "failed" and "SystemExit" in r["reason"] for r in quit_)
    assert any(r["defense"] == "fedsgd" and r["status"] == "ok" for r in recs)
    assert (out / "leaderboards" / "image-cls.csv").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    from bench.cli import main

    out = tmp_path / "never"
    code = main(["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "april", "--preset", "smoke",
                 "--out", str(out), "--dry-run", "--jobs", "2"])

    text = capsys.readouterr().out
    assert code == 0 and not out.exists()
    assert "cells planned" in text and "1 to train" in text and "estimated time" in text and "2 job(s)" in text


@pytest.mark.parametrize("flags, problem", [(["--jobs", "0"], "--jobs"), (["--jobs", "x"], "--jobs"),
                                            (["--cell-timeout", "-1"], "--cell-timeout"),
                                            (["--cell-timeout", "nan"], "--cell-timeout"),
                                            (["--executor", "slurm"], "executor"), (["--device", "tpu"], "device"),
                                            (["--mem-cap", "-5"], "--mem-cap"),
                                            (["--ray-address", "ray://h:1"], "--executor ray")])
def test_bad_engine_flags_exit_2_and_write_nothing(tmp_path, capsys, flags, problem):
    from bench.cli import main

    out = tmp_path / "never"
    code = main(["run", "--scenario", "image-cls", "--defense", "fedsgd", "--attack", "april", "--preset", "smoke",
                 "--out", str(out), *flags])

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
    owner = subprocess.Popen([sys.executable, "-c", OWNER, context, str(marker)], cwd=ROOT, stdout=log, stderr=log,
                             start_new_session=True, env={**os.environ, "BENCH_THREADS": "1"})
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


NOISE = ("Loading weights", "Loaded pretrained weights", "MiniLM captions", "will save all extracted features",
         "leaked semaphore", "resource_tracker", "Kernel Inception Distance", "huggingface", "transformers")


def test_a_run_keeps_third_party_noise_out_of_the_terminal_but_not_its_own_warnings(tmp_path):
    import os
    import subprocess

    from bench.controls import failures
    from tests.test_faults import ROOT

    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "bench", "run", "--preset", "smoke", "--scenario", "ldm-t2i,vlm-caption",
                          "--defense", "fedavg", "--attack", "loss_mia", "--jobs", "2", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800, env={**os.environ, "BENCH_THREADS": "1"})

    assert res.returncode == 0, res.stderr[-3000:]
    heard = [n for n in NOISE if n in res.stderr or n in res.stdout]
    assert not heard, f"{heard} in the output:\n{res.stderr[-3000:]}"
    for line in failures(Store(out).records()):  # our own warnings still reach the terminal
        assert line in res.stderr
    assert "cells:" in res.stdout and "work:" in res.stderr  # the plan's summary and the run's own bar
