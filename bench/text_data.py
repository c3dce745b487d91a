"""Private text for the language-model scenarios: the Debian ``fortunes`` corpus and Alpaca-GPT4.

``fortunes`` / ``fortunes-min`` install ~13.8k short English texts under ``/usr/share/games/fortunes/``
in strfile format (entries separated by a line holding only ``%``; file name = category, which gives
the non-IID client splits). Alpaca-GPT4 (``vicgalle/alpaca-gpt4``) is the DP-FedLoRA paper's data
([DP-FedLoRA] s.V-A), read from the local Hugging Face cache only.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .assets import AssetMissing, cache_dir, hub_missing

FORTUNES_DIR = Path("/usr/share/games/fortunes")
INDEX_SUFFIXES = (".dat", ".u8", ".pos", ".idx")

ALPACA_GPT4_ID = "vicgalle/alpaca-gpt4"
# Not verified offline: no commit hash of this dataset could be checked from this machine. "main" is
# resolved to the commit hash of the locally cached snapshot, which is what the task config records.
ALPACA_GPT4_REVISION = "main"
# Alpaca prompt template as used by OpenFedLLM, which DP-FedLoRA builds on.
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response: {output}"
)
ALPACA_TEMPLATE_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
    "{instruction}\n\n### Input:\n{input}\n\n### Response: {output}"
)


@dataclass(frozen=True)
class TextCorpus:
    """Texts with an integer category each; ``categories[c]`` names category ``c``."""

    texts: list[str]
    labels: list[int]
    categories: list[str]
    source: str

    def __len__(self) -> int:
        return len(self.texts)


# ----------------------------------------------------------------------------------------------
# fortunes


def parse_strfile(path: str | os.PathLike) -> list[str]:
    """Entries of one strfile-format file: blocks separated by lines that hold only ``%``."""
    raw = Path(path).read_text(encoding="utf-8", errors="replace")
    entries: list[str] = []
    cur: list[str] = []
    for line in raw.splitlines():
        if line.rstrip() == "%":
            entries.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    entries.append("\n".join(cur))
    return [e for e in entries if e.strip()]


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPACES = re.compile(r" {2,}")
_BLANKS = re.compile(r"\s+")
_NON_LETTERS = re.compile(r"[\W\d_]+")
_NON_WORD = re.compile(r"\W+")


def clean_text(text: str) -> str:
    """Strip control characters and per-line indentation, collapse inner runs of blanks, keep line breaks."""
    text = _CONTROL.sub("", text.replace("\t", " "))
    lines = [_SPACES.sub(" ", ln.strip()) for ln in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def _dedupe_key(text: str) -> str:
    return _NON_WORD.sub(" ", text.lower()).strip()


def _prose_like(text: str, min_letter_frac: float) -> bool:
    """Drop ASCII-art pictures and tables: too few letters among the non-blank characters."""
    visible = len(_BLANKS.sub("", text))
    return visible > 0 and len(_NON_LETTERS.sub("", text)) / visible >= min_letter_frac


def strfile_sources(root: str | os.PathLike) -> list[Path]:
    """The category files of a fortunes directory: no index files (.dat, .u8), no symlinked duplicates."""
    root = Path(root)
    out = []
    for p in sorted(root.iterdir()):
        if p.is_symlink() or not p.is_file() or p.name.startswith(".") or p.suffix in INDEX_SUFFIXES:
            continue
        out.append(p)
    return out


@functools.lru_cache(maxsize=4)
def load_fortunes(
    root: str | os.PathLike = str(FORTUNES_DIR),
    *,
    min_chars: int = 20,
    max_chars: int = 600,
    min_letter_frac: float = 0.6,
) -> TextCorpus:
    """Every fortune, cleaned, de-duplicated (first occurrence in sorted file order wins), with its
    file as category; texts shorter than ``min_chars`` or longer than ``max_chars`` are dropped.
    Deterministic: no randomness, sorted traversal."""
    root = Path(root)
    files = strfile_sources(root) if root.is_dir() else []
    if not files:
        raise AssetMissing(
            f"no fortune files under {root}: the llm-text scenario needs the Debian packages "
            f"`fortunes` and `fortunes-min` (`apt-get install fortunes fortunes-min`)."
        )
    # parsing and cleaning ~15k fortunes takes seconds: the result is cached under $BENCH_CACHE/data, keyed by
    # the files' names, sizes and mtimes, the arguments and this module's source (any edit re-parses)
    stamp = json.dumps(
        [str(root), [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files], min_chars, max_chars]
        + [min_letter_frac, hashlib.sha256(Path(__file__).read_bytes()).hexdigest()]
    )
    cached = cache_dir("data") / f"fortunes-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}.json"
    try:
        d = json.loads(cached.read_text(encoding="utf-8"))
        return TextCorpus(list(d["texts"]), [int(c) for c in d["labels"]], list(d["categories"]), str(d["source"]))
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not cached yet (or damaged): parse
    corpus = _parse_fortunes(root, files, min_chars=min_chars, max_chars=max_chars, min_letter_frac=min_letter_frac)
    from .store import atomic_write_bytes

    atomic_write_bytes(cached, json.dumps(corpus.__dict__).encode())
    return corpus


def _parse_fortunes(
    root: Path, files: list[Path], *, min_chars: int, max_chars: int, min_letter_frac: float
) -> TextCorpus:
    """:func:`load_fortunes`'s corpus, parsed and cleaned from the strfile ``files``."""
    seen: set[str] = set()
    texts, labels, cats = [], [], []
    for path in files:
        kept = []
        for entry in parse_strfile(path):
            t = clean_text(entry)
            if not (min_chars <= len(t) <= max_chars) or not _prose_like(t, min_letter_frac):
                continue
            key = _dedupe_key(t)
            if key in seen:
                continue
            seen.add(key)
            kept.append(t)
        if kept:
            cats.append(path.name)
            texts.extend(kept)
            labels.extend([len(cats) - 1] * len(kept))
    return TextCorpus(texts, labels, cats, source=str(root))


# ----------------------------------------------------------------------------------------------
# Alpaca-GPT4 (paper preset)


def load_alpaca_gpt4(
    revision: str = ALPACA_GPT4_REVISION, *, cache_dir: str | Path | None = None, max_samples: int | None = None
) -> tuple[TextCorpus, str]:
    """Alpaca-GPT4 from the local Hugging Face cache (offline), formatted with the Alpaca template.

    Returns the corpus and the resolved snapshot commit. Category = whether the example has an
    ``input`` field (the data set has no topic labels), so the Dirichlet split degrades to two groups.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snap = Path(
            snapshot_download(
                ALPACA_GPT4_ID, repo_type="dataset", revision=revision, cache_dir=cache_dir, local_files_only=True
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as e:
        raise hub_missing(ALPACA_GPT4_ID, revision, what="data set") from e
    rows = _read_rows(snap)
    texts, labels = [], []
    for r in rows:
        inp = (r.get("input") or "").strip()
        tpl = ALPACA_TEMPLATE_INPUT if inp else ALPACA_TEMPLATE
        texts.append(tpl.format(instruction=str(r["instruction"]).strip(), input=inp, output=str(r["output"]).strip()))
        labels.append(int(bool(inp)))
        if max_samples is not None and len(texts) >= max_samples:
            break
    return TextCorpus(texts, labels, ["no-input", "with-input"], source=f"{ALPACA_GPT4_ID}@{snap.name}"), snap.name


def _read_rows(snap: Path) -> list[dict[str, Any]]:
    files = sorted(p for p in snap.rglob("*") if p.suffix in (".parquet", ".json", ".jsonl") and p.is_file())
    if not files:
        raise AssetMissing(f"snapshot {snap} holds no .parquet/.json/.jsonl data files")
    rows: list[dict[str, Any]] = []
    for p in files:
        if p.suffix == ".parquet":
            import pandas as pd

            try:
                rows.extend(pd.read_parquet(p).to_dict("records"))
            except ImportError as e:
                raise AssetMissing(f"reading {p.name} needs a parquet engine: `pip install pyarrow`") from e
        elif p.suffix == ".jsonl":
            rows.extend(json.loads(ln) for ln in p.read_text().splitlines() if ln.strip())
        else:
            data = json.loads(p.read_text())
            rows.extend(data if isinstance(data, list) else data.get("data", []))
    return rows


# ----------------------------------------------------------------------------------------------
# splits and tokenisation


def stratified_split(labels: Sequence[int] | np.ndarray, fractions: Sequence[float], seed: int) -> list[list[int]]:
    """Disjoint index sets of ``round(f * n)`` items each with the same category mix as the whole.

    Per split, category quotas are ``f * n_c`` rounded by the largest-remainder method (ties broken by
    one seeded order of the categories, shared by all splits), so splits with equal fractions get
    *identical* category histograms; items are then drawn at random within each category.
    Fractions may sum to < 1 (the rest is unused).
    """
    fr = np.asarray(fractions, dtype=float)
    if (fr < 0).any() or fr.sum() > 1 + 1e-9:
        raise ValueError(f"fractions must be >= 0 and sum to <= 1, got {list(fractions)}")
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    cats, sizes = np.unique(labels, return_counts=True)
    tie = rng.permutation(len(cats))  # one tie-break order for every split
    quotas = np.zeros((len(fr), len(cats)), dtype=int)
    for s, f in enumerate(fr):
        exact = f * sizes
        q = np.floor(exact).astype(int)
        extra = int(round(f * len(labels))) - int(q.sum())
        order = np.lexsort((tie, -(exact - q)))  # largest remainder first, then the shared tie order
        q[order[: max(extra, 0)]] += 1
        quotas[s] = q
    out: list[list[int]] = [[] for _ in fr]
    for j, c in enumerate(cats):
        idx = rng.permutation(np.flatnonzero(labels == c))
        start = 0
        for s in range(len(fr)):
            take = min(int(quotas[s, j]), len(idx) - start)
            out[s].extend(idx[start : start + take].tolist())
            start += take
    return [sorted(o) for o in out]


class TokenizedTexts(torch.utils.data.Dataset):
    """Items ``{"input_ids", "attention_mask", "category"}`` (unpadded, <= max_len tokens each).

    Each text becomes ``[bos] + tokens + [eos]``, truncated to ``max_len``: the BOS lets the model
    score the first word, the EOS teaches it where a text ends.
    """

    def __init__(self, texts: Sequence[str], labels: Sequence[int], tokenizer, max_len: int):
        self.texts = list(texts)
        self.labels = [int(c) for c in labels]
        bos = tokenizer.bos_token_id
        eos = tokenizer.eos_token_id
        enc = tokenizer(self.texts, add_special_tokens=False)["input_ids"]
        self.ids = []
        for ids in enc:
            seq = ([bos] if bos is not None else []) + list(ids) + ([eos] if eos is not None else [])
            self.ids.append(torch.tensor(seq[:max_len], dtype=torch.long))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "category": self.labels[i]}


def token_length(item: dict[str, Any]) -> int:
    """A token item's length, what :func:`collate_pad` pads a batch to the longest of (``TaskAPI.length``)."""
    return int(item["input_ids"].numel())


def collate_pad(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of items to the longest one; padded positions have attention_mask 0."""
    T = max(token_length(it) for it in items)
    ids = torch.full((len(items), T), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(items), T), dtype=torch.long)
    for b, it in enumerate(items):
        n = token_length(it)
        ids[b, :n] = it["input_ids"]
        mask[b, :n] = it["attention_mask"]
    cats = torch.tensor([int(it.get("category", -1)) for it in items], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": mask, "category": cats}


def compact_name(base: str, n_ids: int) -> str:
    """:class:`CompactVocab`'s ``name_or_path`` (what a smoke task's config records as its tokenizer)."""
    return f"{base} (compact, {n_ids} ids)"


class CompactVocab:
    """A real tokenizer restricted to the token ids a corpus uses (smoke presets).

    Tokenisation is the wrapped tokenizer's; ids are renumbered 0..n-1 over the tokens that occur in
    ``texts`` plus the special tokens, so a tiny model's embedding and output layer are ~10x smaller
    than the full 49k vocabulary (the output layer dominated a tiny Llama's compute). A token outside
    the kept set maps to the unknown token.
    """

    def __init__(self, tokenizer, texts: Sequence[str]):
        self.base = tokenizer
        specials = [
            t
            for t in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id)
            if t is not None
        ]
        used = {i for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"] for i in ids}
        self.to_base = sorted(set(specials) | used)
        self.from_base = {b: i for i, b in enumerate(self.to_base)}
        self.name_or_path = compact_name(getattr(tokenizer, "name_or_path", "tokenizer"), len(self.to_base))
        unk = self._map_special(tokenizer.unk_token_id)
        if unk is None:  # no unknown token: fall back to EOS (never needed for the corpus itself)
            unk = self._map_special(tokenizer.eos_token_id) or 0
        self._unk: int = unk

    def _map_special(self, t: int | None) -> int | None:
        return None if t is None else self.from_base[t]

    @property
    def bos_token_id(self) -> int | None:
        return self._map_special(self.base.bos_token_id)

    @property
    def eos_token_id(self) -> int | None:
        return self._map_special(self.base.eos_token_id)

    @property
    def pad_token_id(self) -> int | None:
        return self._map_special(self.base.pad_token_id)

    @property
    def unk_token_id(self) -> int | None:
        return self._map_special(self.base.unk_token_id)

    def __len__(self) -> int:
        return len(self.to_base)

    def encode_ids(self, ids: Sequence[int]) -> list[int]:
        return [self.from_base.get(int(i), self._unk) for i in ids]

    def __call__(self, texts, add_special_tokens: bool = False, **kw) -> dict[str, Any]:
        single = isinstance(texts, str)
        enc = self.base([texts] if single else list(texts), add_special_tokens=add_special_tokens, **kw)["input_ids"]
        ids = [self.encode_ids(e) for e in enc]
        return {"input_ids": ids[0] if single else ids}

    def decode(self, ids, skip_special_tokens: bool = False, **kw) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.base.decode([self.to_base[int(i)] for i in ids], skip_special_tokens=skip_special_tokens, **kw)

    def batch_decode(self, seqs, skip_special_tokens: bool = False, **kw) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kw) for s in seqs]
