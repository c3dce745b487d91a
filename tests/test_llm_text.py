"""Tests of the llm-text scenario: fortunes parsing, splits, LM losses and logits shift, LoRA
injection, the pinned-hub loader (real path on a tiny checkpoint saved here; missing-asset error)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.assets import AssetMissing
from bench.text_data import (
    TokenizedTexts,
    clean_text,
    collate_pad,
    load_alpaca_gpt4,
    load_fortunes,
    parse_strfile,
    stratified_split,
)
from models import llm
from tests.assets import hub_snapshot, need

HAVE_FORTUNES = llm.Path("/usr/share/games/fortunes/fortunes").is_file()
SCENARIO = "llm-text"  # the smoke / batch fixtures (tests/conftest.py)


# ----------------------------------------------------------------------------------------------
# strfile parsing and the fortunes corpus


def _write_strfile(path: Path, entries: list[str]) -> None:
    path.write_text("\n%\n".join(entries) + "\n%\n")


def test_parse_strfile_splits_on_percent_lines(tmp_path):
    f = tmp_path / "cat"
    f.write_text("First one.\n%\nSecond,\n  two lines.\n%\n%\nThird 100% sure.\n%\n")
    assert parse_strfile(f) == ["First one.", "Second,\n  two lines.", "Third 100% sure."]


def test_clean_text_strips_indentation_and_blank_runs():
    assert clean_text("\n\n  Hello\t\tworld  \n\n\n\n\t\t-- Someone\n\n") == "Hello world\n\n-- Someone"


def test_load_fortunes_skips_index_files_and_symlinks_dedupes_and_filters(tmp_path):
    long_text = "word " * 200
    _write_strfile(
        tmp_path / "alpha", ["A fortune about cats and dogs.", "Tiny", long_text, "Another text about the sea."]
    )
    _write_strfile(
        tmp_path / "beta",
        ["a FORTUNE about cats, and dogs!", "| | | | | | | | | | | | | | | |", "Beta has its own saying here."],
    )
    (tmp_path / "alpha.dat").write_bytes(b"\x00\x01binary index")
    os.symlink(tmp_path / "alpha", tmp_path / "alpha.u8")
    os.symlink(tmp_path / "beta", tmp_path / "gamma")  # a duplicate category under another name
    c = load_fortunes(str(tmp_path), min_chars=20, max_chars=300)
    assert c.categories == ["alpha", "beta"]
    assert c.texts == ["A fortune about cats and dogs.", "Another text about the sea.", "Beta has its own saying here."]
    assert c.labels == [0, 0, 1]


def test_load_fortunes_missing_names_the_debian_packages(tmp_path):
    with pytest.raises(AssetMissing, match="apt-get install fortunes fortunes-min"):
        load_fortunes(str(tmp_path / "nowhere"))


def test_real_fortunes_corpus_is_large_clean_and_deterministic():
    need(HAVE_FORTUNES, "apt-get install fortunes fortunes-min")
    c = load_fortunes()
    assert 12000 < len(c) < 15500 and len(c.categories) > 30
    assert len({t.lower() for t in c.texts}) == len(c)
    assert all(20 <= len(t) <= 600 for t in c.texts)
    assert c.texts[:50] == load_fortunes.__wrapped__().texts[:50]


# ----------------------------------------------------------------------------------------------
# splits, tokenisation, collation


def test_stratified_split_is_disjoint_with_equal_category_histograms():
    rng = np.random.default_rng(0)
    labels = rng.choice(5, size=1000, p=[0.4, 0.3, 0.15, 0.1, 0.05])
    a, b, c = stratified_split(labels, [0.3, 0.3, 0.2], seed=1)
    assert not (set(a) & set(b) or set(a) & set(c) or set(b) & set(c))
    assert (len(a), len(b), len(c)) == (300, 300, 200)
    ha, hb, hc = (np.bincount(labels[s], minlength=5) for s in (a, b, c))
    assert np.array_equal(ha, hb)  # equal fractions -> identical category histograms
    assert np.abs(hc / 200 - np.bincount(labels) / 1000).max() < 0.01
    assert stratified_split(labels, [0.3, 0.3, 0.2], seed=1) == [a, b, c]
    assert stratified_split(labels, [0.3, 0.3, 0.2], seed=2) != [a, b, c]


def test_collate_pads_right_and_masks():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "attention_mask": torch.ones(3, dtype=torch.long), "category": 1},
        {"input_ids": torch.tensor([8]), "attention_mask": torch.ones(1, dtype=torch.long), "category": 0},
    ]
    b = collate_pad(items, pad_id=99)
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 99, 99]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["category"].tolist() == [1, 0]


@pytest.fixture(scope="module")
def tok():
    return llm.default_tokenizer()


def test_tokenized_texts_add_bos_eos_and_truncate(tok):
    ds = TokenizedTexts(["Hello there, general.", "word " * 100], [3, 4], tok, max_len=16)
    ids = ds[0]["input_ids"].tolist()
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert tok.decode(ids[1:-1]).strip().lower() == "hello there, general."
    assert len(ds[1]["input_ids"]) == 16 and ds[1]["category"] == 4


# ----------------------------------------------------------------------------------------------
# the smoke task (the ``smoke`` and ``batch`` fixtures of tests/conftest.py)


def test_smoke_task_shape_and_info(smoke):
    api = smoke.api
    assert smoke.id == "llm-text" and smoke.preset == "smoke"
    assert api.lora is not None and api.parts == ("text",) and api.arch == "llama"
    assert api.num_layers == 5 and 500 <= api.tokens.vocab_size < 30000  # compact vocabulary of the texts
    assert len(smoke.client_data) == smoke.fl.num_clients == 4
    assert all(len(c) > 0 for c in smoke.client_data)
    item = smoke.client_data[0][0]
    assert item["input_ids"].dtype == torch.long and item["attention_mask"].shape == item["input_ids"].shape
    assert len(item["input_ids"]) <= api.tokens.max_len


def test_compact_vocab_round_trips_the_real_tokenizer():
    from bench.text_data import CompactVocab
    from models import llm

    base = llm.default_tokenizer()
    texts = ["The quick brown fox.", "A fortune: you will write tests."]
    tok = CompactVocab(base, texts)

    ids = tok(texts[1])["input_ids"]
    assert max(ids) < len(tok) < 100
    assert tok.decode(ids) == base.decode(base(texts[1], add_special_tokens=False)["input_ids"])
    assert tok.eos_token_id is not None and tok.eos_token_id < len(tok)
    unk = tok.unk_token_id if tok.unk_token_id is not None else tok.eos_token_id
    assert tok(["zebra unseen"])["input_ids"][0].count(unk) >= 1


def test_the_smoke_tokenizer_name_does_not_depend_on_which_cache_folder_holds_it(tmp_path, monkeypatch):
    """The smoke config records the tokenizer's name: converting the model beside the tokenizer-only cache (a
    VLM or default build) must not change it, or every recorded llm-text cell would be redone."""
    import shutil

    from bench.scenarios import llm_text

    src = llm.smollm2_tokenizer_dir() or llm.smollm2_tokenizer().name_or_path  # converted once if needed
    model_dir, tok_dir = tmp_path / "model", tmp_path / "tokenizer"
    monkeypatch.setattr(llm, "_smollm2_dirs", lambda *, create=True: (model_dir, tok_dir))
    texts = ["The quick brown fox.", "A fortune: you will write tests."]

    def names() -> list[str]:
        return [llm.default_tokenizer().name_or_path, llm_text._compact_tokenizer_name(texts)]

    shutil.copytree(src, tok_dir, ignore=shutil.ignore_patterns("*.safetensors"))  # the tokenizer-only cache
    only_tokenizer = names()
    shutil.copytree(tok_dir, model_dir)  # the model converted beside it: read from there now
    assert llm.smollm2_tokenizer_dir() == model_dir

    assert names() == only_tokenizer and only_tokenizer[0] == str(model_dir)


def _texts(ds) -> list[str]:
    if isinstance(ds, torch.utils.data.Subset):
        return [ds.dataset.texts[i] for i in ds.indices]
    return list(ds.texts)


def test_members_nonmembers_test_are_disjoint_and_same_distribution(smoke):
    members = [t for c in smoke.client_data for t in _texts(c)]
    nonmembers, test = _texts(smoke.nonmembers), _texts(smoke.test_data)
    assert len(set(members)) == len(members)
    assert not (set(members) & set(nonmembers) or set(members) & set(test) or set(nonmembers) & set(test))
    k = smoke.api.tokens.num_categories
    hm = np.bincount([c for d in smoke.client_data for c in (d.dataset.labels[i] for i in d.indices)], minlength=k)
    hn = np.bincount(smoke.nonmembers.labels, minlength=k)
    tv = 0.5 * np.abs(hm / hm.sum() - hn / hn.sum()).sum()
    assert tv < 0.02, f"members and non-members differ in category distribution (TV {tv:.3f})"
    # the client split is non-IID: at least one client's category histogram is far from the pool's
    tvs = []
    for d in smoke.client_data:
        hc = np.bincount([d.dataset.labels[i] for i in d.indices], minlength=k)
        tvs.append(0.5 * np.abs(hc / hc.sum() - hm / hm.sum()).sum())
    assert max(tvs) > 0.3


def test_logits_are_shifted_and_loss_matches_hf(smoke, batch):
    model = smoke.api.build_model().eval()
    with torch.no_grad():
        logits, targets, mask = smoke.api.logits(model, batch, "text")
        full = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        hf_loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss = smoke.api.loss(model, batch)
    B, T = batch["input_ids"].shape
    assert logits.shape == (B, T - 1, smoke.api.tokens.vocab_size)
    assert torch.equal(targets, batch["input_ids"][:, 1:])
    assert torch.equal(mask, batch["attention_mask"][:, 1:].bool())
    torch.testing.assert_close(logits, full[:, :-1].float())
    torch.testing.assert_close(loss, hf_loss, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        smoke.api.logits(model, batch, "image")


def test_per_sample_loss_is_consistent_with_loss_and_padding(smoke, batch):
    model = smoke.api.build_model().eval()
    with torch.no_grad():
        ps = smoke.api.per_sample_loss(model, batch)
        loss = smoke.api.loss(model, batch)
        alone = torch.stack(
            [smoke.api.per_sample_loss(model, smoke.api.collate([smoke.test_data[i]]))[0] for i in range(6)]
        )
    n_tok = (batch["attention_mask"][:, 1:].sum(1)).float()
    assert ps.shape == (6,)
    torch.testing.assert_close((ps * n_tok).sum() / n_tok.sum(), loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ps, alone, rtol=1e-4, atol=1e-4)  # right padding does not change a sample's loss


def test_build_model_is_deterministic_and_only_lora_trains(smoke):
    m1, m2 = smoke.api.build_model(), smoke.api.build_model()
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    trainable = [n for n, p in m1.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert any("lora_B" in n for n in trainable) and any("lora_A" in n for n in trainable)


def test_lora_b_zero_init_equals_base_and_b_matters(tok, batch):
    base = llm.tiny_llama(tok, seed=3)
    with torch.no_grad():
        ref = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.clone()
    lora = llm.add_lora(base, r=4, alpha=8, dropout=0.0, seed=5).eval()
    b_params = [p for n, p in lora.named_parameters() if "lora_B" in n]
    assert b_params and all(torch.count_nonzero(p) == 0 for p in b_params)
    with torch.no_grad():
        out = lora(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert torch.equal(out, ref)
        for p in b_params:
            p.normal_(0, 0.5)
        moved = lora(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert not torch.allclose(moved, ref, atol=1e-3)
    a_same = [
        p
        for n, p in llm.add_lora(llm.tiny_llama(tok, seed=3), r=4, alpha=8, dropout=0.0, seed=5).named_parameters()
        if "lora_A" in n
    ]
    a_other = [
        p
        for n, p in llm.add_lora(llm.tiny_llama(tok, seed=3), r=4, alpha=8, dropout=0.0, seed=6).named_parameters()
        if "lora_A" in n
    ]
    a_orig = [p for n, p in lora.named_parameters() if "lora_A" in n]
    assert all(torch.equal(x, y) for x, y in zip(a_orig, a_same))
    assert not all(torch.equal(x, y) for x, y in zip(a_orig, a_other))


def test_utility_reports_loss_and_perplexity(smoke):
    model = smoke.api.build_model()
    u = smoke.utility(model)
    assert set(u) == {"test_loss", "perplexity"}
    assert np.isfinite(u["test_loss"]) and u["perplexity"] == pytest.approx(np.exp(u["test_loss"]), rel=1e-6)
    # an untrained random model is close to uniform over the vocabulary
    assert abs(u["test_loss"] - np.log(smoke.api.tokens.vocab_size)) < 2.0
    assert model.training is True or model.training is False


# ----------------------------------------------------------------------------------------------
# paper preset: pinned hub assets, offline


REV = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_model(cache: Path, repo: str, tok) -> tuple[Path, torch.nn.Module]:
    """A tiny checkpoint laid out exactly as the Hugging Face cache stores a snapshot."""
    snap = hub_snapshot(cache, repo, REV)
    model = llm.tiny_llama(tok, seed=11, hidden=32, layers=1, heads=2)
    model.save_pretrained(str(snap))
    tok.save_pretrained(str(snap))
    return snap, model


def test_paper_loader_real_path_on_a_tiny_checkpoint(tmp_path, tok, batch):
    snap, saved = _fake_hub_model(tmp_path, "bench-test/tiny-llama", tok)
    model, tok2 = llm.paper_llm(
        "bench-test/tiny-llama", REV, load_in_4bit=False, cache_dir=tmp_path, dtype=torch.float32
    )
    assert len(tok2) == len(tok)
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        b = saved.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(a, b)
    model_from_path, _ = llm.paper_llm(str(snap), REV, load_in_4bit=False, dtype=torch.float32)
    assert model_from_path.config.hidden_size == 32


def test_paper_loader_fails_at_once_when_not_cached(tmp_path):
    t0 = time.time()
    with pytest.raises(AssetMissing) as e:
        llm.paper_llm(llm.LLAMA2_ID, llm.LLAMA2_REVISION, cache_dir=tmp_path)
    msg = str(e.value)
    assert llm.LLAMA2_ID in msg and llm.LLAMA2_REVISION in msg and "huggingface-cli download" in msg
    assert time.time() - t0 < 5


def test_paper_4bit_config_is_nf4():
    cfg = llm.bnb_4bit_config()
    assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "nf4"


def test_alpaca_loader_formats_a_cached_snapshot_and_fails_when_missing(tmp_path):
    snap = hub_snapshot(tmp_path, "vicgalle/alpaca-gpt4", REV, kind="dataset", main=False) / "data"
    snap.mkdir()
    rows = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    ]
    (snap / "train.jsonl").write_text("\n".join(__import__("json").dumps(r) for r in rows))
    corpus, commit = load_alpaca_gpt4(REV, cache_dir=tmp_path)
    assert commit == REV and corpus.labels == [0, 1]
    assert corpus.texts[0].endswith("### Instruction:\nName a colour.\n\n### Response: Blue.")
    assert "### Input:\n2 and 3" in corpus.texts[1]
    with pytest.raises(AssetMissing, match="vicgalle/alpaca-gpt4"):
        load_alpaca_gpt4(REV, cache_dir=tmp_path / "empty")


def test_paper_preset_builds_from_the_local_cache(monkeypatch, tmp_path, tok):
    """The paper preset's build path (LLaMA-2's pinned snapshot for tokenizer and config, Alpaca-GPT4's cached
    snapshot for the corpus) on a tiny Llama and 40 rows saved here; sizes shrunk. The 4-bit model itself is
    loaded only by ``build_model`` (bitsandbytes, a GPU), not here."""
    import dataclasses
    import json

    from huggingface_hub import constants

    from bench.scenarios import llm_text

    hub = tmp_path / "hub"
    snap = hub_snapshot(hub, llm.LLAMA2_ID, llm.LLAMA2_REVISION, main=False)
    llm.tiny_llama(tok, seed=11, hidden=32, layers=3, heads=2).save_pretrained(str(snap))
    tok.save_pretrained(str(snap))
    data = hub_snapshot(hub, "vicgalle/alpaca-gpt4", REV, kind="dataset") / "data"
    data.mkdir()
    rows = [{"instruction": f"Say {i}.", "input": "loud" if i % 4 == 0 else "", "output": f"{i}!"} for i in range(40)]
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    paper = llm_text.SPECS["paper"]
    small = dataclasses.replace(
        paper, n_members=20, n_nonmembers=8, n_test=8, fl=dataclasses.replace(paper.fl, num_clients=4)
    )
    monkeypatch.setitem(llm_text.SPECS, "paper", small)

    (task,) = llm_text.build("paper")

    assert task.config["data_revision"] == REV and task.config["model_revision"] == llm.LLAMA2_REVISION
    assert task.api.num_layers == 3 and task.api.tokens.vocab_size == len(tok) and len(task.client_data) == 4
    member_texts = {
        tok.decode(task.client_data[c][i]["input_ids"]) for c in range(4) for i in range(len(task.client_data[c]))
    }
    other = {tok.decode(d[i]["input_ids"]) for d in (task.nonmembers, task.test_data) for i in range(len(d))}
    assert len(member_texts) == 20 and len(other) == 16 and not member_texts & other
    assert all("### Instruction:\nSay " in t for t in member_texts | other)


def test_paper_preset_fails_at_once_without_the_model(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    from bench.scenarios.llm_text import build

    if (Path.home() / ".cache/huggingface/hub/models--meta-llama--Llama-2-7b-hf").exists():
        pytest.skip("LLaMA-2-7B is cached here")
    t0 = time.time()
    with pytest.raises(AssetMissing, match="meta-llama/Llama-2-7b-hf"):
        build("paper")
    assert time.time() - t0 < 5


# ----------------------------------------------------------------------------------------------
# the real SmolLM2 (slow: converted once, then loads from the safetensors cache)


@pytest.mark.slow
def test_smollm2_loads_from_cache_and_lora_model_equals_base(tok):
    model, tok2 = llm.smollm2_base()
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    assert not hasattr(model.config, "quantization_config")
    ids = TokenizedTexts(["The quick brown fox jumps over the lazy dog."], [0], tok2, 32)
    b = collate_pad([ids[0]], llm.pad_id(tok2))
    with torch.no_grad():
        ref = model(**{k: b[k] for k in ("input_ids", "attention_mask")}).logits.clone()
        lora = llm.add_lora(model, r=8, alpha=16, dropout=0.05, seed=0).eval()
        out = lora(**{k: b[k] for k in ("input_ids", "attention_mask")}).logits
    torch.testing.assert_close(out, ref)
    # a pretrained model predicts English far better than uniform (ln 49152 = 10.8)
    from bench.scenarios.llm_text import lm_loss

    with torch.no_grad():
        assert float(lm_loss(lora, b)) < 6.0


# ----------------------------------------------------------------------------------------------
# the smoke preset over-fits under plain FedAvg (what the attacks' positive controls rely on)


@pytest.mark.slow
def test_smoke_fedavg_client_models_overfit_their_members(smoke):
    import dataclasses

    from sklearn.metrics import roc_auc_score

    from bench.fl import client_model_state, fedavg_aggregate, load_state, run_federated, standard_message
    from bench.types import Defense

    @dataclasses.dataclass
    class PlainFedAvg(Defense):
        def client_step(self, state, ctx):
            return standard_message(state, ctx)

        def aggregate(self, global_state, msgs, ctx):
            return fedavg_aggregate(global_state, msgs, ctx)

    def losses(model, ds):
        dl = torch.utils.data.DataLoader(ds, batch_size=16, collate_fn=smoke.api.collate)
        model.eval()
        with torch.no_grad():
            return torch.cat([smoke.api.per_sample_loss(model, b) for b in dl]).numpy()

    task = dataclasses.replace(smoke, fl=dataclasses.replace(smoke.fl, local_epochs=4))
    _, res = run_federated(task, PlainFedAvg(), seed=0)
    model = smoke.api.build_model()
    nonmember_loss = losses(model, smoke.nonmembers)
    base_members = np.concatenate([losses(model, d) for d in smoke.client_data])
    y = np.r_[np.ones(len(base_members)), np.zeros(len(nonmember_loss))]
    assert abs(roc_auc_score(y, -np.r_[base_members, nonmember_loss]) - 0.5) < 0.15  # no distribution shift
    aucs = []
    for k, latest in res.client_latest.items():
        load_state(model, client_model_state(res.global_state, latest))
        lm, ln = losses(model, smoke.client_data[k]), losses(model, smoke.nonmembers)
        aucs.append(roc_auc_score(np.r_[np.ones(len(lm)), np.zeros(len(ln))], -np.r_[lm, ln]))
    assert len(aucs) == 4 and min(aucs) >= 0.8, aucs
