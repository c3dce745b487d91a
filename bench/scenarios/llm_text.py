"""Scenario ``llm-text``: a causal LM fine-tuned with LoRA on private text split over clients.

Members and non-members come from one pool of texts (a stratified held-out split, same category
histogram), so a membership attack on the un-fine-tuned base model should sit at AUROC 0.5 (the
distribution-shift check, docs/design.md s.2). Clients get the member texts by Dirichlet(0.5) over
categories (Hsu et al. 2019). Presets:

- ``smoke``: tiny random Llama over SmolLM2's tokenizer (restricted to the ids the texts use), a few
  hundred fortunes, over-fits fast.
- ``default``: SmolLM2-135M-Instruct + LoRA r=16 on every linear layer, AdamW lr 5e-3 (wd 1e-6 and batch 8
  as [FedRand] s.5; rank, targets and lr raised so the undefended baseline memorises within a CPU budget),
  on the Debian fortunes, 32 tokens per text, 250 evaluation candidates per side.
- ``paper``: LLaMA-2-7B 4-bit on Alpaca-GPT4 with DP-FedLoRA's settings ([DP-FedLoRA] s.V-A).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Subset

from bench.fl import split_clients
from bench.progress import progress
from bench.registry import register_scenario
from bench.task import Task, preset_entry
from bench.text_data import (
    ALPACA_GPT4_ID,
    CompactVocab,
    TextCorpus,
    TokenizedTexts,
    collate_pad,
    compact_name,
    load_alpaca_gpt4,
    load_fortunes,
    stratified_split,
    token_length,
)
from bench.types import FLConfig, LoraSpec, TaskAPI, TokenSpec
from models import llm


@dataclass(frozen=True)
class Spec:
    """What a preset pins (one entry of :data:`SPECS`, keyed by ``bench.task.PRESETS``)."""

    model: str  # "tiny-llama" | "smollm2-135m" | "llama-2-7b"
    data: str  # "fortunes" | "alpaca-gpt4"
    n_members: int
    n_nonmembers: int
    n_test: int
    max_len: int
    fl: FLConfig
    lora_r: int
    lora_alpha: float
    lora_dropout: float
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    tiny: dict = field(default_factory=dict)  # tiny_llama sizes (smoke)
    notes: dict = field(default_factory=dict)  # recorded in the task config, e.g. the lr schedule
    max_membership: int = 64
    compact_vocab: bool = False  # tiny model over the ids the corpus uses (text_data.CompactVocab)
    data_seed: int = 0
    model_seed: int = 0
    central_epochs: int | None = None  # the released (central LoRA) model's epochs; None = fl.local_epochs


SPECS: dict[str, Spec] = {
    # Over-fits on purpose (many local epochs, high lr, small clients) so that the positive controls of
    # the membership attacks have something to find; a FedAvg run takes seconds.
    "smoke": Spec(
        model="tiny-llama",
        data="fortunes",
        n_members=96,
        n_nonmembers=96,
        n_test=64,
        max_len=32,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=2,
            local_epochs=2,
            batch_size=8,
            lr=1e-2,
            optimizer="adamw",
            weight_decay=0.0,
            dirichlet_alpha=0.5,
        ),
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        tiny=dict(hidden=64, layers=5, heads=4, intermediate=128),
        max_membership=32,
        compact_vocab=True,
    ),
    # Calibrated for the positive control (issue 11): the undefended FedAvg baseline must leak clearly in
    # every view, with >= 250 evaluation candidates per side (bench.cells holds back max(8, 250 // 4) = 62
    # per side for the attacker's aux split, so 312 members and 400 non-members). All 4 clients train in
    # every round (1 local epoch, no step cap: ~8-12 steps of batch 8 x 32 tokens each); the central LoRA
    # (released view) trains as many epochs as a member sees in FedAvg. LoRA r=16 on every linear layer,
    # AdamW lr 5e-3 (FedRand's r=8 on q,v at 3e-4 memorised nothing measurable at this budget).
    # Measured here (calibration loop /tmp/lm/calib2.py: FedAvg, this preset but capped at 8 local steps per
    # round (~0.8 epoch), seed 0, loss attack on 100 members vs 100 label-unmatched non-members; base model
    # on the same candidates 0.466):
    #   round (steps)     1 (32)   2 (64)   3 (96)   4 (128)
    #   global AUROC      0.563    0.639    0.743    0.851
    #   client (pooled)   0.564    0.722    0.858    0.921
    # so 4 uncapped rounds (~4 epochs, ~156 steps) clear AUROC 0.75 in both views. Wall time on this 2-core
    # machine shared with ~7 processes: 7.7-27 s per step (248 s per 32 steps at the lightest load); not yet
    # confirmed with `bench run` at 250 candidates per side (see the lm report).
    "default": Spec(
        model="smollm2-135m",
        data="fortunes",
        n_members=312,
        n_nonmembers=400,
        n_test=128,
        max_len=32,
        fl=FLConfig(
            num_clients=4,
            clients_per_round=4,
            rounds=4,
            local_epochs=1,
            batch_size=8,
            lr=5e-3,
            optimizer="adamw",
            weight_decay=1e-6,
            dirichlet_alpha=0.5,
            max_local_steps=None,
        ),
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        max_membership=250,
        central_epochs=4,
    ),
    # DP-FedLoRA s.V-A: 20 clients, 2 per round, 200 rounds of 10 local steps, AdamW, batch 16,
    # 512 tokens, LoRA r=32 alpha=64; 20,000 Alpaca-GPT4 samples (its public script's --dataset_sample).
    "paper": Spec(
        model="llama-2-7b",
        data="alpaca-gpt4",
        n_members=20000,
        n_nonmembers=2000,
        n_test=1000,
        max_len=512,
        fl=FLConfig(
            num_clients=20,
            clients_per_round=2,
            rounds=200,
            local_epochs=1,
            batch_size=16,
            lr=5e-5,
            optimizer="adamw",
            weight_decay=0.0,
            dirichlet_alpha=None,
            max_local_steps=10,
        ),
        lora_r=32,
        lora_alpha=64,
        lora_dropout=0.05,
        notes={
            "lr_schedule": "paper: cosine over rounds from 5e-5 to 1e-6; the harness trains with the constant lr 5e-5",
            "split": "IID as in OpenFedLLM (Alpaca has no categories)",
            "loss": "causal-LM loss over the whole prompt + response",
        },
    ),
}


# ----------------------------------------------------------------------------------------------
# task API: losses and shifted logits


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def lm_logits(model: nn.Module, batch: dict[str, Tensor], part: str = "text") -> tuple[Tensor, Tensor, Tensor]:
    """(logits [B,T-1,V], targets [B,T-1], mask [B,T-1] bool): ``logits[:, t]`` predicts token t+1;
    the mask keeps positions whose context token and target token are both real (not padding)."""
    if part != "text":
        raise ValueError(f"llm-text has only the part 'text', got {part!r}")
    dev = _device(model)
    ids = batch["input_ids"].to(dev)
    am = batch["attention_mask"].to(dev)
    out = model(input_ids=ids, attention_mask=am)
    logits = out.logits[:, :-1].float()
    return logits, ids[:, 1:], (am[:, 1:] & am[:, :-1]).bool()


def token_nll(model: nn.Module, batch: dict[str, Tensor], *, pass_mask: bool = True) -> tuple[Tensor, Tensor]:
    """(nll [B,T-1] zero at padding, mask [B,T-1]): next-token NLL from one forward pass.

    Cross-entropy runs on the contiguous [B*T, V] logits with the shifted labels (last position
    ignored): slicing the logits first makes log-softmax and its backward 3x slower on CPU.
    ``pass_mask=False``: the padding mask is not given to the model. Batches are right-padded (collate_pad), so
    under causal attention no real position attends to padding and its output is the same (exact up to
    rounding); the forward then has none of transformers' data-dependent mask checks, which ``torch.func.vmap``
    cannot batch (gradient_mia's per-sample gradients fell back to one backward per sample). Training and the
    utility keep the mask (their numbers, and the training runs' hashes, stay as they were).
    """
    dev = _device(model)
    ids = batch["input_ids"].to(dev)
    am = batch["attention_mask"].to(dev)
    logits = model(input_ids=ids, attention_mask=am if pass_mask else None).logits
    mask = (am[:, 1:] & am[:, :-1]).bool()
    labels = torch.cat([ids[:, 1:].masked_fill(~mask, -100), torch.full_like(ids[:, :1], -100)], dim=1)  # vmap
    B, T, V = logits.shape
    nll = F.cross_entropy(logits.reshape(B * T, V).float(), labels.reshape(B * T), reduction="none")
    return nll.view(B, T)[:, :-1], mask


def lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """Mean next-token cross-entropy over all real tokens of the batch (what HF's ``labels`` loss is)."""
    nll, mask = token_nll(model, batch)
    return nll.sum() / mask.sum().clamp(min=1)


def lm_per_sample_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """[B]: each text's mean token NLL (log-perplexity); the scoring path, without the padding mask (token_nll)."""
    nll, mask = token_nll(model, batch, pass_mask=False)
    return nll.sum(1) / mask.sum(1).clamp(min=1)


def make_utility(test_data, collate: Callable, batch_size: int) -> Callable[[nn.Module], dict[str, float]]:
    def utility(model: nn.Module) -> dict[str, float]:
        """Held-out token-weighted loss and perplexity on ``test_data``."""
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        dl = DataLoader(test_data, batch_size=batch_size, shuffle=False, collate_fn=collate)
        with torch.no_grad():
            for batch in progress(dl, desc="utility llm-text", leave=False):
                nll, mask = token_nll(model, batch)
                total += float(nll.sum())
                count += int(mask.sum())
        model.train(was_training)
        loss = total / max(count, 1)
        return {"test_loss": loss, "perplexity": math.exp(min(loss, 50.0))}

    return utility


# ----------------------------------------------------------------------------------------------
# building blocks per preset


def _corpus(p: Spec) -> tuple[TextCorpus, dict[str, Any]]:
    if p.data == "fortunes":
        c = load_fortunes()
        return c, {"data": "debian fortunes + fortunes-min", "data_source": c.source, "corpus_size": len(c)}
    corpus, commit = load_alpaca_gpt4()
    return corpus, {"data": ALPACA_GPT4_ID, "data_revision": commit, "corpus_size": len(corpus)}


def _tokenizer_and_base(
    p: Spec, texts: Sequence[str] | None = None
) -> tuple[Any, Callable[[], nn.Module], Any, dict[str, Any]]:
    """The tokenizer, a factory of fresh base models (loaded once, deep-copied per call), the model
    config (read without loading weights for the paper model) and what to record in the task config.
    ``texts``: restrict the tiny model's vocabulary to the ids these texts use (smoke)."""
    if p.model == "tiny-llama":
        tok = llm.default_tokenizer()
        if texts is not None:
            tok = CompactVocab(tok, texts)
        make = lambda: llm.tiny_llama(tok, p.model_seed, **p.tiny)  # noqa: E731
        return tok, make, make().config, _model_record(p, tok.name_or_path)
    if p.model == "smollm2-135m":
        base, tok = llm.smollm2_base()
        return tok, (lambda: copy.deepcopy(base)), base.config, _model_record(p, None)
    from transformers import AutoConfig

    path = llm.resolve_local(llm.LLAMA2_ID, llm.LLAMA2_REVISION)  # fails at once, naming hub id and revision
    tok = llm.paper_tokenizer()

    def paper_base() -> nn.Module:  # re-loaded per call: bitsandbytes 4-bit weights do not deep-copy safely
        return llm.paper_llm(llm.LLAMA2_ID, llm.LLAMA2_REVISION)[0]

    return (
        tok,
        paper_base,
        AutoConfig.from_pretrained(str(path), local_files_only=True),
        {"model": llm.LLAMA2_ID, "model_revision": llm.LLAMA2_REVISION, "quantization": "4-bit nf4"},
    )


def _model_record(p: Spec, tokenizer: str | None) -> dict[str, Any]:
    """The model as ``Task.config`` records it on smoke / default (``tokenizer``: the tiny model's)."""
    if p.model == "tiny-llama":
        return {"model": f"tiny-llama(random, seed {p.model_seed}, {p.tiny})", "tokenizer": tokenizer}
    return {"model": f"{llm.SMOLLM2_NAME} ({llm.SMOLLM2_PACKAGE} {llm.md.version(llm.SMOLLM2_PACKAGE)} GGUF)"}


def _task_config(
    p: Spec, model_cfg: dict[str, Any], data_cfg: dict[str, Any], sizes: tuple[int, int, int], client_sizes: list[int]
) -> dict[str, Any]:
    """``Task.config``: the model and data records, the split sizes (members, non-members, test), the clients'."""
    return {
        **model_cfg,
        **data_cfg,
        "max_len": p.max_len,
        "n_members": sizes[0],
        "n_nonmembers": sizes[1],
        "n_test": sizes[2],
        "client_sizes": client_sizes,
        "lora": {"r": p.lora_r, "alpha": p.lora_alpha, "dropout": p.lora_dropout, "targets": list(p.lora_targets)},
        "data_seed": p.data_seed,
        "model_seed": p.model_seed,
        **p.notes,
    }


def _compact_tokenizer_name(texts: Sequence[str]) -> str:
    """``CompactVocab(llm.default_tokenizer(), texts).name_or_path`` read with the ``tokenizers`` library from the
    cached SmolLM2 tokenizer files, so planning imports no ``transformers`` (ids as ``tokenizer(texts,
    add_special_tokens=False)`` gives them, plus the bos / eos / pad / unk ids its tokenizer_config names)."""
    import json

    from tokenizers import Tokenizer

    folder = llm.smollm2_tokenizer_dir()
    if folder is None:
        raise FileNotFoundError("no cached SmolLM2 tokenizer yet (building the task converts it)")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    specials = set()
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        t = cfg.get(key)
        t = t.get("content") if isinstance(t, dict) else t
        i = tok.token_to_id(t) if isinstance(t, str) else None
        if i is not None:
            specials.add(i)
    used = {i for enc in tok.encode_batch(list(texts), add_special_tokens=False) for i in enc.ids}
    return compact_name(llm.smollm2_tokenizer_name(), len(specials | used))


def _declared_config(preset: str) -> dict[str, Any]:
    """``Task.config`` on smoke / default from the corpus and the split alone (no model, no ``transformers``):
    what :func:`build_task` records, for planning a cached run (bench.specs)."""
    p = preset_entry(SPECS, preset)
    corpus, data_cfg = _corpus(p)
    n = len(corpus)
    members, nonmembers, test = stratified_split(
        corpus.labels, [p.n_members / n, p.n_nonmembers / n, p.n_test / n], seed=p.data_seed
    )
    tokenizer = None
    if p.model == "tiny-llama":
        used = [corpus.texts[i] for idx in (members, nonmembers, test) for i in idx] if p.compact_vocab else None
        if used is None:
            raise ValueError("only the compact smoke vocabulary is declared")
        tokenizer = _compact_tokenizer_name(used)
    parts = split_clients(
        [int(corpus.labels[i]) for i in members], p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed
    )
    return _task_config(
        p, _model_record(p, tokenizer), data_cfg, (len(members), len(nonmembers), len(test)), [len(c) for c in parts]
    )


# Attacker-side population texts per preset (reference models, [RMIA] / [LiRA]): corpus texts in no other role;
# half train the reference models (>= the members' count), half are RMIA's z samples (bench.reference). None on
# smoke: its compact vocabulary covers the candidates' tokens only, so other texts would be out of distribution.
N_POPULATION = {"smoke": 0, "default": 1200, "paper": 0}


def _population(corpus: TextCorpus, used: Sequence[Sequence[int]], n: int, seed: int) -> list[int]:
    """Up to ``n`` corpus positions that are no member, non-member or test text, in a seeded order."""
    taken = {int(i) for idx in used for i in idx}
    order = np.random.default_rng([seed, 0x504F50]).permutation(len(corpus)).tolist()
    return [i for i in order if i not in taken][: max(n, 0)]


def build_task(preset: str) -> Task:
    p = preset_entry(SPECS, preset)
    if not p.compact_vocab:  # the model first: a missing paper model fails at once, naming it
        tok, make_base, hf_config, model_cfg = _tokenizer_and_base(p)
    corpus, data_cfg = _corpus(p)
    n = len(corpus)
    want = p.n_members + p.n_nonmembers + p.n_test
    if want > n:
        raise ValueError(f"preset {preset} needs {want} texts, the corpus has {n}")
    members, nonmembers, test = stratified_split(
        corpus.labels, [p.n_members / n, p.n_nonmembers / n, p.n_test / n], seed=p.data_seed
    )
    if p.compact_vocab:
        used = [corpus.texts[i] for idx in (members, nonmembers, test) for i in idx]
        tok, make_base, hf_config, model_cfg = _tokenizer_and_base(p, used)

    def texts(idx: Sequence[int]) -> TokenizedTexts:
        return TokenizedTexts([corpus.texts[i] for i in idx], [corpus.labels[i] for i in idx], tok, p.max_len)

    member_ds, nonmember_ds, test_ds = texts(members), texts(nonmembers), texts(test)
    pop = _population(corpus, (members, nonmembers, test), N_POPULATION[preset], p.data_seed)
    parts = split_clients(member_ds.labels, p.fl.num_clients, p.fl.dirichlet_alpha, seed=p.data_seed)
    client_data = [Subset(member_ds, idx) for idx in parts]
    pid = llm.pad_id(tok)

    def collate(items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        return collate_pad(items, pid)

    def build_model() -> nn.Module:
        """The base LM with fresh LoRA adapters (A from model_seed, B = 0): deterministic."""
        return llm.add_lora(
            make_base(),
            r=p.lora_r,
            alpha=p.lora_alpha,
            dropout=p.lora_dropout,
            targets=p.lora_targets,
            seed=p.model_seed,
        )

    api = TaskAPI(
        name="llm-text",
        family="llm-text",
        arch="llama",
        num_layers=int(hf_config.num_hidden_layers),
        lora=LoraSpec(r=p.lora_r, alpha=p.lora_alpha, targets=tuple(p.lora_targets)),
        parts=("text",),
        tokens=TokenSpec(
            vocab_size=int(hf_config.vocab_size), max_len=p.max_len, pad_id=pid, num_categories=len(corpus.categories)
        ),
        loss=lm_loss,
        per_sample_loss=lm_per_sample_loss,
        collate=collate,
        build_model=build_model,
        logits=lm_logits,
        length=token_length,
        population_size=len(pop),
    )
    sizes = (len(member_ds), len(nonmember_ds), len(test_ds))
    config = _task_config(p, model_cfg, data_cfg, sizes, [len(c) for c in parts])
    return Task(
        scenario="llm-text",
        variant="",
        preset=preset,
        api=api,
        fl=p.fl,
        client_data=client_data,
        test_data=test_ds,
        utility=make_utility(test_ds, collate, p.fl.batch_size),
        nonmembers=nonmember_ds,
        central_data=member_ds,
        central_epochs=p.central_epochs or p.fl.local_epochs,
        max_membership=p.max_membership,
        config=config,
        population=texts(pop) if pop else None,
    )


# Transformer blocks of the non-tiny models (their configs' num_hidden_layers), so planning loads no model.
NUM_LAYERS = {"smollm2-135m": 30, "llama-2-7b": 32}


def specs(preset: str):
    """The task as ``bench list`` plans it, without loading the corpus or a model (bench.specs); None on
    ``paper`` (building checks its model and data are there)."""
    from bench.specs import DeclaredTask, LazyConfig
    from bench.types import TaskSpec

    p = preset_entry(SPECS, preset)
    if preset == "paper":
        return None
    # the configuration is declared where it needs no model: the smoke tokenizer read from its cached files
    known = p.model != "tiny-llama" or llm.smollm2_tokenizer_dir() is not None
    layers = p.tiny["layers"] if p.model == "tiny-llama" else NUM_LAYERS[p.model]
    return [
        DeclaredTask(
            "llm-text",
            TaskSpec(
                name="llm-text",
                family="llm-text",
                arch="llama",
                num_layers=layers,
                lora=LoraSpec(r=p.lora_r, alpha=p.lora_alpha, targets=tuple(p.lora_targets)),
                parts=("text",),
                population_size=N_POPULATION[preset],
            ),
            p.fl,
            config=LazyConfig(functools.partial(_declared_config, preset)) if known else None,
        )
    ]


@register_scenario(name="llm-text")
def build(preset: str) -> list[Task]:
    return [build_task(preset)]
