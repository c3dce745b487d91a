"""The cell group's in-memory signal cache: a hit returns exactly what recomputing gives, a changed
model or candidate list recomputes, and the score-based attacks give the same scores with and
without it (the loss attack's threshold and proxy share one forward pass over the candidates)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from attacks.gradient_mia import GradientMIA
from attacks.loss_mia import LossMIA
from attacks.max_renyi import MaxRenyi
from bench.signal_cache import SignalCache, fingerprint, group_cache, model_fingerprint
from bench.signals import length_sorted
from bench.types import Observation, Public, TaskAPI
from tests.benchlib import one_thread  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/benchlib.py: tiny models, one intra-op thread


def test_fingerprints_follow_content_not_identity():
    a, b = (torch.arange(6.0), 3), (torch.arange(6.0), 3)
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint((torch.arange(6.0), 4))
    assert fingerprint(torch.zeros(2, 3)) != fingerprint(torch.zeros(3, 2))
    assert fingerprint(torch.zeros(2, dtype=torch.bfloat16)) != fingerprint(torch.zeros(2))
    m1, m2 = nn.Linear(3, 2), nn.Linear(3, 2)
    m2.load_state_dict(m1.state_dict())
    assert model_fingerprint(m1) == model_fingerprint(m2)
    with torch.no_grad():
        m2.bias[0] += 1e-6
    assert model_fingerprint(m1) != model_fingerprint(m2)


def test_cache_computes_an_identical_call_once_and_recomputes_otherwise():
    cache, calls = SignalCache(), []
    model = nn.Linear(2, 1)

    def compute(tag):
        calls.append(tag)
        return torch.tensor([float(len(calls))])

    first = cache.get("loss", model, [1, 2], lambda: compute("a"))
    assert cache.get("loss", model, [1, 2], lambda: compute("b")) is first
    cache.get("loss", model, [2, 1], lambda: compute("c"))  # another order: another batch composition
    cache.get("other", model, [1, 2], lambda: compute("d"))
    with torch.no_grad():
        model.weight.add_(1.0)
    cache.forget_model(model)  # changed in place: the memoised state hash is dropped
    cache.get("loss", model, [1, 2], lambda: compute("e"))
    assert calls == ["a", "c", "d", "e"] and cache.hits == 1 and cache.misses == 4


def test_candidates_that_cannot_be_hashed_are_computed_every_time():
    cache, model = SignalCache(), nn.Linear(2, 1)
    opaque = [object()]
    a = cache.get("loss", model, opaque, lambda: torch.tensor([1.0]))
    b = cache.get("loss", model, opaque, lambda: torch.tensor([2.0]))
    assert (a.item(), b.item()) == (1.0, 2.0) and cache.uncached == 2 and len(cache) == 0


def test_group_cache_lives_for_one_group():
    a = group_cache(("task", "defense", 0))
    assert group_cache(("task", "defense", 0)) is a
    b = group_cache(("task", "defense", 1))
    assert b is not a and len(b) == 0


# ----------------------------------------------------------------------------------------------
# attacks through the cache


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 11):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)))


def lm_api() -> TaskAPI:
    def logits(model, batch, part):
        return model(batch[:, :-1]), batch[:, 1:], torch.ones(batch.shape[0], batch.shape[1] - 1, dtype=torch.bool)

    def per_sample_loss(model, batch):
        lg, tg, _ = logits(model, batch, "text")
        return nn.functional.cross_entropy(lg.transpose(1, 2), tg, reduction="none").mean(1)

    return TaskAPI(
        name="tiny-lm",
        family="llm-text",
        loss=lambda m, b: per_sample_loss(m, b).mean(),
        per_sample_loss=per_sample_loss,
        collate=torch.stack,
        build_model=TinyLM,
        parts=("text",),
        logits=logits,
    )


def items(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 11, (7,), generator=g) for _ in range(n)]


def observe(model, cache, seed=3) -> Observation:
    return Observation(
        "global_model",
        model,
        None,
        lm_api(),
        Public(aux_members=items(10, 1), aux_nonmembers=items(10, 2)),
        seed=seed,
        signals=cache,
    )


@pytest.mark.parametrize(
    "attack",
    [MaxRenyi(batch_size=4), LossMIA(method="proxy", epochs=2), GradientMIA(n_estimators=5)],
    ids=["max_renyi", "loss_mia", "gradient_mia"],
)
def test_attacks_score_the_same_with_and_without_the_cache(attack):
    model, cands = TinyLM(), items(12, 0)
    alone = attack.run(observe(model, None), cands)
    cache = SignalCache()
    first = attack.run(observe(model, cache), cands)
    again = attack.run(observe(TinyLM(), cache), cands)  # a rebuilt model object with the same weights
    assert cache.hits >= 1
    for name, s in alone.scores.items():
        assert torch.equal(torch.as_tensor(first.scores[name]), torch.as_tensor(s)), name
        assert torch.equal(torch.as_tensor(again.scores[name]), torch.as_tensor(s)), name


def test_loss_threshold_and_proxy_share_one_pass_over_the_candidates():
    model, cands, cache = TinyLM(), items(12, 0), SignalCache()
    LossMIA(method="threshold").run(observe(model, cache), cands)
    LossMIA(method="proxy", epochs=2).run(observe(model, cache), cands)
    assert cache.hits == 1 and cache.misses == 2  # candidates shared; the proxy's aux computed once


def test_attack_randomness_follows_the_cell_seed():
    model, cands = TinyLM(), items(12, 0)
    attack = LossMIA(method="proxy", epochs=3, lr=1e-2)
    a, b, c = (attack.run(observe(model, None, seed=s), cands).scores["proxy"] for s in (3, 4, 3))
    assert torch.equal(a, c) and not torch.equal(a, b)
    assert not any(f.name == "seed" for f in dataclasses.fields(LossMIA))


def test_length_sorted_batches_by_length_and_gives_the_way_back():
    api = dataclasses.replace(lm_api(), length=len)
    items = ["ccc", "a", "bb", "dddd", "e"]
    ordered, back = length_sorted(api, items)
    assert [len(x) for x in ordered] == [1, 1, 2, 3, 4] and ordered[:2] == ["a", "e"]  # stable on ties
    results = torch.tensor([float(len(x)) for x in ordered])
    assert results[back].tolist() == [3.0, 1.0, 2.0, 4.0, 1.0]
    assert length_sorted(lm_api(), items) == (items, None)  # no length: batched as given


def test_a_spilled_signal_is_read_back_by_a_fresh_cache_without_computing(tmp_path):
    model, items = nn.Linear(2, 1), [(torch.ones(2), 0), (torch.zeros(2), 1), (torch.full((2,), 3.0), 0)]
    first_cache = SignalCache(tmp_path / "signals")
    first = first_cache.get(("losses", (), 8, 0), model, items, lambda: torch.arange(3.0, dtype=torch.float64))

    again_cache = SignalCache(tmp_path / "signals")  # another process, or the same cell after a kill
    again = again_cache.get(("losses", (), 8, 0), model, items, lambda: pytest.fail("recomputed a spilled signal"))
    other = again_cache.get(("losses", (), 8, 1), model, items, lambda: torch.zeros(3, dtype=torch.float64))

    assert torch.equal(first, again) and again.dtype == torch.float64
    assert (again_cache.hits, again_cache.loaded, again_cache.misses) == (1, 1, 1)
    assert not torch.equal(other, first)  # another seed is another entry
    assert len(list((tmp_path / "signals").rglob("*.json"))) == 2


def test_only_one_cpu_tensor_per_candidate_is_spilled(tmp_path):
    model, items = nn.Linear(2, 1), [1, 2]
    cache = SignalCache(tmp_path / "signals")
    cache.get("dict", model, items, lambda: {"a": torch.zeros(2)})  # structured results stay in memory
    cache.get("scalar", model, items, lambda: torch.tensor(1.0))  # not one value per candidate
    cache.get("loss", model, items, lambda: torch.zeros(2))

    assert len(list((tmp_path / "signals").rglob("*.json"))) == 1
    assert not list(tmp_path.glob("quarantine"))


@pytest.mark.parametrize(
    "attack", [MaxRenyi(batch_size=4), GradientMIA(n_estimators=5)], ids=["per_token_statistics", "gradient_norms"]
)
def test_structured_signals_are_spilled_and_read_back_bit_identical(tmp_path, attack):
    model, cands = TinyLM(), items(12, 0)
    first_cache = SignalCache(tmp_path / "signals")
    first = attack.run(observe(model, first_cache), cands)

    again_cache = SignalCache(tmp_path / "signals")  # the cell run again after a kill, or another worker
    again = attack.run(observe(TinyLM(), again_cache), cands)

    assert first_cache.misses >= 1 and again_cache.loaded == first_cache.misses and again_cache.misses == 0
    for name, s in first.scores.items():
        assert torch.equal(torch.as_tensor(again.scores[name]), torch.as_tensor(s)), name


def test_per_token_statistics_keep_every_slice_order_and_field(tmp_path):
    from bench.signals import PARTS_CODEC, PartSignals

    mask = torch.tensor([[True, True], [True, False]])
    out = {
        "image": PartSignals(mask=mask, entropy={0.5: torch.ones(2, 2), float("inf"): torch.zeros(2, 2)}),
        "text": PartSignals(
            mask=mask,
            entropy={2: torch.full((2, 2), 3.0)},
            target_logprob=-torch.ones(2, 2),
            mod_entropy={1: mask * 1.0},
        ),
    }
    model = nn.Linear(2, 1)
    SignalCache(tmp_path).get("tokens", model, [1, 2], lambda: out, PARTS_CODEC)

    back = SignalCache(tmp_path).get("tokens", model, [1, 2], lambda: pytest.fail("recomputed"), PARTS_CODEC)

    assert list(back) == ["image", "text"] and list(back["image"].entropy) == [0.5, float("inf")]
    assert back["image"].target_logprob is None and back["image"].mod_entropy == {}
    assert torch.equal(back["text"].mask, mask) and back["text"].mask.dtype == torch.bool
    assert torch.equal(back["text"].entropy[2], out["text"].entropy[2])
    assert torch.equal(back["text"].target_logprob, out["text"].target_logprob)
    assert torch.equal(back["text"].mod_entropy[1], out["text"].mod_entropy[1])


def test_a_damaged_spilled_signal_is_quarantined_and_recomputed(tmp_path):
    model, items = nn.Linear(2, 1), [1, 2]
    SignalCache(tmp_path / "cache" / "signals").get("loss", model, items, lambda: torch.zeros(2))
    (tensor_file,) = (tmp_path / "cache" / "signals").rglob("*.safetensors")
    tensor_file.write_bytes(tensor_file.read_bytes()[:-3])  # a torn write

    cache = SignalCache(tmp_path / "cache" / "signals")
    got = cache.get("loss", model, items, lambda: torch.ones(2))

    assert torch.equal(got, torch.ones(2)) and (cache.loaded, cache.misses) == (0, 1)
    assert list((tmp_path / "quarantine").rglob("*.json"))  # kept for inspection, with the reason


def test_a_pass_read_back_from_disk_is_reported_as_done_before_this_run(tmp_path):
    """A resumed cell's spilled passes land on the run's bar as restored work (bench.progress.Resumed), not as work
    done at once in this run, so its ETA comes from the passes it computes."""
    from bench.progress import Resumed, progress, unit_progress

    model, items = nn.Linear(2, 1), [1, 2]
    SignalCache(tmp_path).get("pass 1", model, items, lambda: torch.zeros(2))  # spilled by the killed run
    cache, reports = SignalCache(tmp_path), []

    with unit_progress(reports.append):
        for i in progress(range(4), unit=True):
            cache.get(f"pass {i}", model, items, lambda: torch.ones(2))

    assert [r for r in reports if isinstance(r, Resumed)] == [Resumed(0.5)]  # pass 1 of 4 done: half the unit
    assert cache.loaded == 1 and cache.misses == 3


def test_each_spilled_pass_keeps_the_cells_done_fraction_for_a_later_plan(tmp_path):
    """A killed cell's plan counts what its spilled passes hold (bench.runplan): each spill reports the cell's
    fraction after that pass to ``on_saved`` (bench.units writes it to the cell's marker)."""
    from bench.progress import on_saved, progress, unit_progress
    from bench.signal_cache import marker_path, spilled_share, write_marker

    model, items, cache, saved = nn.Linear(2, 1), [1, 2], SignalCache(tmp_path), []
    marker = marker_path(tmp_path, "cell")

    with unit_progress(lambda f: None), on_saved(saved.append):
        for i in progress(range(4), unit=True):
            cache.get(f"pass {i}", model, items, lambda: torch.ones(2))
            if i == 1:
                write_marker(marker, saved[-1])
                cache.get("not one per candidate", model, items, lambda: {"a": torch.ones(2)})  # memory only: silent

    assert saved == [0.25, 0.5, 0.75, 1.0]
    assert spilled_share(marker) == 0.5
    marker.write_text("{torn")
    assert spilled_share(marker) == spilled_share(tmp_path / "none.json") == 0.0
