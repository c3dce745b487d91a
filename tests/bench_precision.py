"""Benchmark: ``--precision bf16`` against fp32 on the CPU, for the LLM family's two hot units.

    BENCH_THREADS=1 nice -n 10 python -m pytest -n 0 tests/bench_precision.py --benchmark-only -q -s

A SmolLM2-135M-shaped Llama (random weights: the cost depends on the shapes only) with LoRA on q/v
(``models.llm.add_lora``, the llm-text default's rank 8), a batch of 16 x 64 tokens. Each round times,
back to back and in one process: a LoRA training step (forward, loss, backward) and a scoring forward
pass, each in fp32 and under ``bench.device.autocast`` at bf16 (the code path ``--precision bf16``
takes). bf16 pays off only where the CPU has bf16 matrix units (AVX512-BF16 / AMX, printed with the
result); elsewhere it can be slower than fp32. Times are thread CPU time (module doc of
``tests/bench_signals.py``). The losses of the two precisions are printed side by side: bf16 changes
the numbers (records name the precision and never mix with fp32 ones).
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import pytest
import torch

from bench.device import autocast
from models.llm import add_lora
from tests.benchlib import one_thread, smollm2_shaped  # noqa: F401 - the fixture

ROUNDS = 4
BATCH, T = 16, 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        return "unknown"
    return ", ".join(f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in words) or "none of avx512_bf16 / amx"


@pytest.mark.benchmark(group="precision")
def test_bench_bf16_over_fp32_llm(benchmark):
    model = add_lora(smollm2_shaped(), r=8, alpha=16, dropout=0.0, seed=0)
    ids = torch.randint(0, 49_152, (BATCH, T), generator=torch.Generator().manual_seed(0))
    tasks = {
        p: SimpleNamespace(config={"precision": p}, api=SimpleNamespace(family="llm-text")) for p in ("fp32", "bf16")
    }
    times: dict[str, list[float]] = {f"{k}_{p}": [] for k in ("train", "score") for p in tasks}
    losses: dict[str, float] = {}

    def train(p: str) -> float:
        model.zero_grad(set_to_none=True)
        with autocast(tasks[p], "cpu"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    def score(p: str) -> float:
        with torch.no_grad(), autocast(tasks[p], "cpu"):
            return float(model(input_ids=ids, labels=ids).loss)

    def one_round():
        for key, fn in (("train", train), ("score", score)):
            for p in tasks:
                t = time.thread_time()
                losses[f"{key}_{p}"] = fn(p)
                times[f"{key}_{p}"].append(time.thread_time() - t)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    ratios = {k: med[f"{k}_fp32"] / med[f"{k}_bf16"] for k in ("train", "score")}
    assert all(abs(losses[f"{k}_bf16"] / losses[f"{k}_fp32"] - 1) < 0.05 for k in ratios)  # the same computation
    benchmark.extra_info.update(
        {f"{k}_s": v for k, v in med.items()}, **{f"{k}_fp32_over_bf16": r for k, r in ratios.items()}
    )
    print(
        f"\nCPU bf16 units: {cpu_flags()}; LoRA training step {BATCH}x{T}: fp32 {med['train_fp32']:.2f} s, bf16 "
        f"{med['train_bf16']:.2f} s ({ratios['train']:.2f}x faster); scoring forward: fp32 {med['score_fp32']:.2f} s, "
        f"bf16 {med['score_bf16']:.2f} s ({ratios['score']:.2f}x faster); loss fp32 {losses['score_fp32']:.5f}, "
        f"bf16 {losses['score_bf16']:.5f}"
    )
