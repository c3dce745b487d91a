"""Benchmark: every score-based membership variant of a candidate against one forward pass of its model.

    BENCH_THREADS=1 nice -n 10 python -m pytest -n 0 tests/bench_signals.py --benchmark-only -q -s

A SmolLM2-135M-shaped Llama (random weights, 49,152-token vocabulary, 30 layers) and one 64-token
sequence. Each round times, back to back: the model's forward pass (the reference); MaxRényi's signals
and all its score variants (4 Rényi orders x 11 K, Min-K%, loss, 3 ModRényi: ``token_signals`` on the
already computed logits, then ``part_scores``) at the default ``chunk_rows=8`` and at the former 256;
and, when a VL-MIA checkout is found, VL-MIA's own per-token scoring (``metric_util.get_meta_metrics``
after its softmax / log-softmax) on the same logits. VL-MIA is not vendored: point ``VLMIA_METRIC_UTIL``
at its ``metric_util.py`` (default ``/tmp/peers/VL-MIA/metric_util.py``) or that comparison is skipped.
Issue 12's targets: all variants <= 0.1 of the forward pass, >= 5x faster than VL-MIA's scoring.
Times are the calling thread's CPU time (``time.thread_time``, user + system, page faults included): with
one intra-op thread all the work runs there, and unlike wall time it does not count the time other
processes hold the machine's cores (wall-clock ratios moved by 30% between runs on this shared machine).

The second benchmark times a repeated identical call through the cell group's ``SignalCache`` (what the
second score-based attack of a cell group pays) against computing it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import statistics
import time
from pathlib import Path

import pytest
import torch

from attacks.max_renyi import MaxRenyi, part_scores
from bench.signal_cache import SignalCache, model_fingerprint
from bench.signals import token_signals
from bench.types import TaskAPI
from tests import benchlib
from tests.benchlib import one_thread  # noqa: F401 - the fixture

ROUNDS = 5
T = 64
VLMIA = Path(os.environ.get("VLMIA_METRIC_UTIL", "/tmp/peers/VL-MIA/metric_util.py"))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py


@pytest.fixture(scope="module")
def smollm2_shaped():
    return benchlib.smollm2_shaped().eval()


def logits_api(logits: torch.Tensor, targets: torch.Tensor) -> TaskAPI:
    """A task whose ``api.logits`` hands back precomputed logits: the scoring alone is timed."""

    def fn(model, batch, part):  # one candidate: views, no copy
        i = int(batch[0])
        return logits[i : i + 1], targets[i : i + 1], torch.ones(1, logits.shape[1], dtype=torch.bool)

    return TaskAPI(
        name="bench",
        family="llm-text",
        loss=None,
        per_sample_loss=None,
        collate=torch.tensor,
        build_model=None,
        parts=("text",),
        logits=fn,
    )


def load_vlmia():
    if not VLMIA.is_file():
        return None
    spec = importlib.util.spec_from_file_location("vlmia_metric_util", VLMIA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_meta_metrics


def all_variants(api: TaskAPI, model, attack: MaxRenyi, chunk_rows: int, cache: SignalCache | None = None):
    sig = token_signals(
        api,
        model,
        [0],
        alphas=attack.alphas,
        mod_alphas=attack.mod_alphas,
        batch_size=1,
        chunk_rows=chunk_rows,
        parts=["text"],
        cache=cache,
        desc="",
    )
    return part_scores("text", sig["text"], alphas=attack.alphas, ks=attack.ks, mod_alphas=attack.mod_alphas)


@pytest.mark.benchmark(group="membership_scoring")
def test_bench_all_score_variants_over_forward_pass(benchmark, smollm2_shaped):
    model = smollm2_shaped
    ids = torch.randint(0, 49_152, (1, T + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    api, attack = logits_api(logits, ids[:, 1:]), MaxRenyi()
    vlmia = load_vlmia()
    times: dict[str, list[float]] = {"forward": [], "ours": [], "ours_chunk256": [], "vlmia": []}

    def vlmia_scoring():
        with torch.no_grad():
            p, logp = torch.softmax(logits[0], -1), torch.log_softmax(logits[0], -1)
            return vlmia(ids[0], p, logp)

    def forward():
        with torch.no_grad():
            return model(ids[:, :-1]).logits

    def one_round():
        steps = [
            ("forward", forward),
            ("ours", lambda: all_variants(api, model, attack, 8)),
            ("ours_chunk256", lambda: all_variants(api, model, attack, 256)),
        ]
        if vlmia is not None:
            steps.append(("vlmia", vlmia_scoring))
        for key, fn in steps:
            t = time.thread_time()  # this thread's CPU time (module doc)
            fn()
            times[key].append(time.thread_time() - t)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    med = {k: statistics.median(v[1:]) for k, v in times.items() if len(v) > 1}
    scores = all_variants(api, model, attack, 8)
    assert len(scores) == 4 * 11 + 10 + 1 + 3
    ratio = med["ours"] / med["forward"]
    benchmark.extra_info.update({f"{k}_s": v for k, v in med.items()}, variants_over_forward=ratio)
    print(
        f"\n{len(scores)} score variants of one {T}-token candidate: {med['ours'] * 1e3:.1f} ms "
        f"(chunk_rows=256: {med['ours_chunk256'] * 1e3:.1f} ms); forward pass {med['forward'] * 1e3:.0f} ms: "
        f"ratio {ratio:.3f} (target <= 0.1)"
    )
    if "vlmia" in med:
        print(
            f"VL-MIA's scoring on the same logits: {med['vlmia'] * 1e3:.0f} ms = "
            f"{med['vlmia'] / med['forward']:.2f}x the forward pass; ours is {med['vlmia'] / med['ours']:.1f}x "
            f"faster (target >= 5x)"
        )
        benchmark.extra_info["vlmia_over_ours"] = med["vlmia"] / med["ours"]


@pytest.mark.benchmark(group="membership_scoring")
def test_bench_cached_signals_over_computing(benchmark, smollm2_shaped):
    """The second score-based attack of a cell group on the same candidates: a cache hit (model state
    hash memoised, candidate hashes) against the forward passes and statistics it saves."""
    model = smollm2_shaped
    ids = torch.randint(0, 49_152, (8, T + 1), generator=torch.Generator().manual_seed(1))

    def logits(m, batch, part):
        x = ids[batch]
        return m(x[:, :-1]).logits, x[:, 1:], torch.ones(len(batch), T, dtype=torch.bool)

    api = TaskAPI(
        name="bench",
        family="llm-text",
        loss=None,
        per_sample_loss=None,
        collate=torch.tensor,
        build_model=None,
        parts=("text",),
        logits=logits,
    )
    attack, items = MaxRenyi(), list(range(len(ids)))
    cache = SignalCache()
    kw = dict(alphas=attack.alphas, mod_alphas=attack.mod_alphas, batch_size=attack.batch_size, cache=cache)
    t = time.perf_counter()
    first = token_signals(api, model, items, **kw)
    computed = time.perf_counter() - t
    again = benchmark.pedantic(lambda: token_signals(api, model, items, **kw), rounds=ROUNDS, iterations=1)
    assert again is first and cache.hits == ROUNDS and cache.misses == 1
    ratio = benchmark.stats.stats.median / computed
    t = time.perf_counter()
    model_fingerprint(model)  # what a cell with a freshly built model pays once for its cache key
    hashed = time.perf_counter() - t
    benchmark.extra_info.update(computed_s=computed, ratio=ratio, model_hash_s=hashed)
    print(
        f"\nsignals of {len(items)} candidates: computed {computed:.2f} s, from the group's cache "
        f"{benchmark.stats.stats.median * 1e3:.2f} ms: ratio {ratio:.4f}; hashing the model's state for the "
        f"key (once per model object) {hashed:.2f} s = {hashed / computed:.3f} of computing"
    )


@pytest.mark.benchmark(group="membership_scoring")
def test_bench_per_sample_gradient_norms(benchmark):
    """gradient_mia's features: per-sample per-tensor gradient norms (torch.func vmap) per candidate against
    one forward+backward of the same model on one candidate; the second use in the cell group is a hit."""
    from torch.nn import functional as F

    from bench.scenarios.image_cls import SPECS
    from models.image import resnet34

    model = resnet34(SPECS["smoke"].resnet, num_classes=10, img_size=32, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    cands = [(torch.randn(3, 32, 32, generator=g), int(torch.randint(0, 10, (), generator=g))) for _ in range(16)]

    def per_sample_loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1], reduction="none")

    api = TaskAPI(
        name="bench",
        family="image-cls",
        loss=lambda m, b: per_sample_loss(m, b).mean(),
        per_sample_loss=per_sample_loss,
        collate=lambda xs: (torch.stack([x for x, _ in xs]), torch.tensor([y for _, y in xs])),
        build_model=None,
    )
    from bench.loss_signals import per_sample_grad_norms

    times: dict[str, list[float]] = {"fb": [], "norms": []}
    x1, y1 = api.collate(cands[:1])

    def forward_backward():
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x1), y1).backward()

    def one_round():
        for key, fn in (
            ("fb", forward_backward),
            ("norms", lambda: per_sample_grad_norms(api, model, cands, batch_size=8, desc="")),
        ):
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    fb, norms = statistics.median(times["fb"][1:]), statistics.median(times["norms"][1:]) / len(cands)
    cache = SignalCache()
    per_sample_grad_norms(api, model, cands, batch_size=8, desc="", seed=0, cache=cache)
    t = time.perf_counter()
    per_sample_grad_norms(api, model, cands, batch_size=8, desc="", seed=0, cache=cache)
    hit = (time.perf_counter() - t) / len(cands)
    assert cache.hits == 1
    benchmark.extra_info.update(forward_backward_s=fb, per_candidate_s=norms, cached_per_candidate_s=hit)
    print(
        f"\nper-sample gradient norms: {norms * 1e3:.1f} ms per candidate = {norms / fb:.2f}x one forward+backward "
        f"({fb * 1e3:.1f} ms); from the group's cache {hit * 1e6:.0f} us per candidate ({hit / fb:.4f}x)"
    )


def text_items(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Token items with llm-text default's length profile: 40% at the 32-token cap, the rest 8-31 tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = [
        32 if float(torch.rand((), generator=g)) < 0.4 else int(torch.randint(8, 32, (), generator=g)) for _ in range(n)
    ]
    return [
        {"input_ids": torch.randint(0, 49_152, (L,), generator=g), "attention_mask": torch.ones(L, dtype=torch.long)}
        for L in lengths
    ]


@pytest.mark.benchmark(group="membership_scoring")
def test_bench_text_scoring_by_length_and_vmap(benchmark, smollm2_shaped):
    """Text scoring as llm-text does it, each pair measured back to back in one run: per-sample losses with the
    items batched by length (``TaskAPI.length``) over in the given order, and LoRA per-sample gradient norms by
    ``torch.func.vmap`` (possible since the per-sample loss passes no padding mask) over one backward per sample."""
    import copy

    from bench.loss_signals import per_sample_grad_norms, per_sample_losses
    from bench.scenarios.llm_text import lm_loss, lm_per_sample_loss
    from bench.text_data import collate_pad, token_length
    from models import llm

    model = llm.add_lora(copy.deepcopy(smollm2_shaped), r=8, alpha=16.0, dropout=0.0, seed=0).eval()
    with torch.no_grad():  # LoRA B away from zero: the gradients of a trained adapter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(0))
    api = TaskAPI(
        name="bench",
        family="llm-text",
        loss=lm_loss,
        per_sample_loss=lm_per_sample_loss,
        collate=lambda xs: collate_pad(xs, 0),
        build_model=None,
        length=token_length,
    )
    given = dataclasses.replace(api, length=None)
    scored, grads = text_items(64, 0), text_items(16, 1)
    times: dict[str, list[float]] = {"given": [], "by_length": [], "loop": [], "vmap": []}
    steps = [
        ("given", lambda: per_sample_losses(given, model, scored, batch_size=16, desc="")),
        ("by_length", lambda: per_sample_losses(api, model, scored, batch_size=16, desc="")),
        ("loop", lambda: per_sample_grad_norms(api, model, grads, batch_size=8, use_vmap=False, desc="")),
        ("vmap", lambda: per_sample_grad_norms(api, model, grads, batch_size=8, desc="")),
    ]
    out: dict[str, torch.Tensor] = {}

    def one_round():
        for key, fn in steps:
            t = time.thread_time()
            r = fn()
            times[key].append(time.thread_time() - t)
            out[key] = r[0] if isinstance(r, tuple) else r

    benchmark.pedantic(one_round, rounds=3, iterations=1, warmup_rounds=1)
    torch.testing.assert_close(out["by_length"], out["given"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out["vmap"], out["loop"], rtol=1e-3, atol=1e-6)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    sort_gain, vmap_gain = med["given"] / med["by_length"], med["loop"] / med["vmap"]
    benchmark.extra_info.update({f"{k}_s": v for k, v in med.items()}, sort_gain=sort_gain, vmap_gain=vmap_gain)
    print(
        f"\nlosses of {len(scored)} items: given order {med['given']:.2f} s, by length {med['by_length']:.2f} s "
        f"({sort_gain:.2f}x faster); LoRA gradient norms of {len(grads)} items: one backward each "
        f"{med['loop']:.2f} s, vmap {med['vmap']:.2f} s ({vmap_gain:.2f}x faster)"
    )
