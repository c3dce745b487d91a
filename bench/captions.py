"""Grounded captions for Fashion-MNIST: a procedural augmentation places each 28x28 item on a colour
canvas, and the caption states what was done, so captions differ per image and describe it.

No real image-caption set installs offline (docs/design.md s.3); the text-to-image diffusion scenario
(``ldm-t2i``) and the small VLM both use this module. The augmentation samples four attributes:

- size: small / medium / large (the item's side is 35 / 50 / 65 % of the canvas side),
- position: a 3x3 grid cell (upper left ... lower right, with a small pixel jitter),
- rotation: upright / tilted left / tilted right (+-25 degrees, counter-clockwise = left),
- tint: one of eight colours the grey item is multiplied with (black background).

``augment(image28, rng)`` returns the canvas and its :class:`Attributes`; ``caption(class_name, attrs)``
turns them into text, e.g. ``"a small red sneaker in the upper left, tilted left"``; ``render`` redraws
a canvas from given attributes (deterministic).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# Fashion-MNIST label order (Xiao et al. 2017), as nouns that read well after "a <size> <tint>".
CLASS_NAMES: tuple[str, ...] = (
    "t-shirt",
    "pair of trousers",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle boot",
)

SIZES: dict[str, float] = {"small": 0.35, "medium": 0.5, "large": 0.65}  # item side / canvas side
# (vertical, horizontal) grid coordinate in {0, 0.5, 1} -> phrase
POSITIONS: dict[str, tuple[float, float]] = {
    "in the upper left": (0.0, 0.0),
    "at the top": (0.0, 0.5),
    "in the upper right": (0.0, 1.0),
    "on the left": (0.5, 0.0),
    "in the center": (0.5, 0.5),
    "on the right": (0.5, 1.0),
    "in the lower left": (1.0, 0.0),
    "at the bottom": (1.0, 0.5),
    "in the lower right": (1.0, 1.0),
}
ROTATIONS: dict[str, float] = {"upright": 0.0, "tilted left": 25.0, "tilted right": -25.0}  # degrees, CCW > 0
TINTS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.15, 0.15),
    "green": (0.15, 0.9, 0.2),
    "blue": (0.2, 0.35, 1.0),
    "yellow": (1.0, 0.95, 0.15),
    "cyan": (0.1, 0.9, 0.95),
    "magenta": (0.95, 0.2, 0.9),
    "orange": (1.0, 0.55, 0.05),
    "white": (1.0, 1.0, 1.0),
}
JITTER = 0.08  # max position jitter, as a fraction of the free space along each axis


@dataclass(frozen=True)
class Attributes:
    """What the augmentation did: the named attributes (caption words) and the exact geometry."""

    size: str
    position: str
    rotation: str
    tint: str
    pixels: int  # side of the resized item on the canvas
    top: int  # row of the item's top-left corner
    left: int  # column of the item's top-left corner

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_gray(image28: np.ndarray | Tensor) -> Tensor:
    """uint8 [H, W] (0..255) or float [H, W] / [1, H, W] in [0, 1] -> float [1, 1, H, W] in [0, 1]."""
    x = torch.as_tensor(np.asarray(image28) if not isinstance(image28, Tensor) else image28)
    if x.dtype == torch.uint8:
        x = x.float() / 255.0
    x = x.float()
    if x.ndim == 3:
        x = x[0]
    if x.ndim != 2:
        raise ValueError(f"expected a single grey image [H, W], got shape {tuple(x.shape)}")
    return x[None, None]


def _rotate(x: Tensor, degrees: float) -> Tensor:
    if degrees == 0.0:
        return x
    from torchvision.transforms.functional import InterpolationMode, rotate

    return rotate(x, degrees, interpolation=InterpolationMode.BILINEAR, expand=False, fill=0.0)


def sample_attributes(rng: np.random.Generator, *, canvas: int = 32) -> Attributes:
    """Draw the four attributes uniformly and the jittered placement inside the chosen grid cell."""
    size = str(rng.choice(list(SIZES)))
    position = str(rng.choice(list(POSITIONS)))
    rotation = str(rng.choice(list(ROTATIONS)))
    tint = str(rng.choice(list(TINTS)))
    pixels = max(4, int(round(SIZES[size] * canvas)))
    free = canvas - pixels
    fy, fx = POSITIONS[position]
    jy, jx = rng.uniform(-JITTER, JITTER, size=2)
    top = int(round(np.clip(fy + jy, 0.0, 1.0) * free))
    left = int(round(np.clip(fx + jx, 0.0, 1.0) * free))
    return Attributes(size, position, rotation, tint, pixels, top, left)


def render(image28: np.ndarray | Tensor, attrs: Attributes, *, canvas: int = 32) -> Tensor:
    """Draw the item with ``attrs`` on a black ``canvas`` x ``canvas`` RGB image: float [3, H, W] in [0, 1]."""
    x = _as_gray(image28)
    x = F.interpolate(x, size=(attrs.pixels, attrs.pixels), mode="bilinear", align_corners=False, antialias=True)
    x = _rotate(x, ROTATIONS[attrs.rotation]).clamp(0.0, 1.0)[0, 0]
    out = torch.zeros(3, canvas, canvas)
    tint = torch.tensor(TINTS[attrs.tint]).view(3, 1, 1)
    out[:, attrs.top : attrs.top + attrs.pixels, attrs.left : attrs.left + attrs.pixels] = tint * x
    return out


def augment(image28: np.ndarray | Tensor, rng: np.random.Generator, *, canvas: int = 32) -> tuple[Tensor, Attributes]:
    """Place a 28x28 grey item on a ``canvas``-pixel colour canvas with random size, position, rotation and
    tint; returns (float [3, canvas, canvas] in [0, 1], the attributes)."""
    attrs = sample_attributes(rng, canvas=canvas)
    return render(image28, attrs, canvas=canvas), attrs


def caption(class_name: str, attrs: Attributes) -> str:
    """The grounded caption: ``"a <size> <tint> <class> <position>, <rotation>"``."""
    return f"a {attrs.size} {attrs.tint} {class_name} {attrs.position}, {attrs.rotation}"


# Annotator details: the part of a natural caption that the image does not determine (MSCOCO annotators mention
# context, guesses and style the pixels do not fix). Drawn per image from its own generator and absent from the
# canvas, a detail can only be known by a model that saw that image's caption: the member-specific content a
# membership attack reads (~9.5 nats per caption over 6 x 12 x 16 x 12 combinations).
DETAIL_PREPOSITIONS: tuple[str, ...] = ("beside", "next to", "near", "behind", "under", "in front of")
DETAIL_ADJECTIVES: tuple[str, ...] = (
    "wooden", "broken", "tiny", "old", "shiny", "striped", "dusty", "folded", "plastic", "velvet", "woven", "painted"
)  # fmt: skip
DETAIL_OBJECTS: tuple[str, ...] = (
    "lamp", "chair", "suitcase", "mirror", "basket", "bicycle", "plant", "clock",
    "ladder", "guitar", "window", "umbrella", "bucket", "pillow", "kettle", "bookshelf",
)  # fmt: skip
DETAIL_PLACES: tuple[str, ...] = (
    "in the hallway", "at the market", "by the sea", "in a garden", "on a balcony", "in the attic",
    "at a station", "in a kitchen", "on a rooftop", "in a shop window", "at the park", "in a bedroom",
)  # fmt: skip


def detail(rng: np.random.Generator) -> str:
    """One annotator detail, e.g. ``"beside a wooden lamp in the hallway"`` (not visible in the image)."""
    parts = (DETAIL_PREPOSITIONS, DETAIL_ADJECTIVES, DETAIL_OBJECTS, DETAIL_PLACES)
    prep, adj, obj, place = (p[int(rng.integers(len(p)))] for p in parts)
    return f"{prep} a {adj} {obj} {place}"


def num_captions(num_classes: int = len(CLASS_NAMES)) -> int:
    """How many distinct captions the augmentation can produce."""
    return num_classes * len(SIZES) * len(POSITIONS) * len(ROTATIONS) * len(TINTS)
