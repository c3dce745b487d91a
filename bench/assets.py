"""Where cached assets live, and the error for a missing offline asset."""

from __future__ import annotations

import os
from pathlib import Path


class AssetMissing(RuntimeError):
    """A model or data set is not available offline; the message says what and how to get it."""


def cache_dir(*parts: str, create: bool = True) -> Path:
    """``$BENCH_CACHE`` (default ``~/.cache/bench``) / parts, created on demand (``create=False``: only the path,
    for planners that must write nothing)."""
    root = Path(os.environ.get("BENCH_CACHE", Path.home() / ".cache" / "bench"))
    p = root.joinpath(*parts)
    if create:
        p.mkdir(parents=True, exist_ok=True)
    return p


def hub_missing(hub_id: str, revision: str, what: str = "model") -> AssetMissing:
    return AssetMissing(
        f"the paper preset needs the {what} {hub_id!r} at revision {revision!r} in the local Hugging Face cache "
        f"(offline mode). Fetch it on a machine with hub access: "
        f"`huggingface-cli download {hub_id} --revision {revision}` and copy ~/.cache/huggingface here, "
        f"or set HF_HOME to a cache that holds it."
    )
