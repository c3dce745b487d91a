"""Per-sample losses (optionally at fixed diffusion timesteps) and per-sample per-parameter-tensor gradient norms: the
signals of the loss- and gradient-based membership attacks, computed once per (model state, candidates) and shared
through the cell's signal cache (docs/design.md s.7). The language-model attacks' per-token signals are in
:mod:`bench.signals`.

Optional scenario hooks (``api.diffusion_ops``, :class:`bench.types.DiffusionOps`, with ``api.diffusion``):

- ``loss_at_timestep``: ``(model, batch, t: int) -> [B]`` per-sample loss at diffusion step ``t`` of
  ``api.diffusion.num_timesteps``. When present, loss signals are taken at ``n`` stratified timesteps
  ``t_j = floor((j + 1/2) T / n)`` (the ten uniformly spaced steps of GSA, Pang et al. 2023), and the
  scalar per-sample loss is their mean (GSA1: losses averaged before back-propagation).
- ``loss_at_timesteps`` (optional): ``(model, batch, ts: list[int]) -> [B, len(ts)]``, the same losses
  from one batched forward.
- ``prepare`` (optional): ``(model, batch, ts) -> batch`` with its item-keyed inputs (ldm-t2i: latents, evaluation
  noise) computed ahead, so per-sample gradients run under ``torch.func.vmap``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from .signal_cache import PER_CANDIDATE, Codec, SignalCache, cached
from .signals import batches, eval_mode, length_sorted
from .types import Observation, TaskAPI


def loss_timesteps(api: TaskAPI, n: int) -> list[int]:
    """The ``n`` stratified timesteps floor((j + 1/2) T / n), or [] when the task has no timestep hook."""
    if n <= 0 or api.diffusion_ops is None or api.diffusion is None:
        return []
    T = int(api.diffusion.num_timesteps)
    return sorted({min(T - 1, int((j + 0.5) * T / n)) for j in range(n)})


def loss_matrix(api: TaskAPI, model: nn.Module, batch: Any, timesteps: Sequence[int]) -> Tensor:
    """Per-sample loss signal [B, F]: the losses at ``timesteps`` if given, else ``per_sample_loss`` [B, 1]."""
    if timesteps:
        ops = api.diffusion_ops
        if ops is None:
            raise ValueError(f"task {api.name!r} has no per-timestep loss (api.diffusion_ops)")
        if ops.loss_at_timesteps is not None:  # all timesteps in one forward (~10x faster than one per step)
            return ops.loss_at_timesteps(model, batch, [int(t) for t in timesteps])
        fn = ops.loss_at_timestep
        return torch.stack([fn(model, batch, int(t)) for t in timesteps], dim=1)
    return api.per_sample_loss(model, batch).reshape(-1, 1)


@torch.no_grad()
def per_sample_losses(
    api: TaskAPI,
    model: nn.Module,
    items: Sequence[Any],
    *,
    batch_size: int = 16,
    timesteps: Sequence[int] = (),
    desc: str = "losses",
    seed: int | None = None,
    cache: SignalCache | None = None,
) -> Tensor:
    """[N, F] per-sample losses (F = len(timesteps), or 1 for ``api.per_sample_loss``), float64.

    ``seed``: run under that torch seed (diffusion noise); only a seeded call is cached (``cache``),
    since an unseeded one depends on the caller's random state."""

    def compute() -> Tensor:
        out = []
        ordered, back = length_sorted(api, items)
        with seeded(seed) if seed is not None else contextlib.nullcontext(), eval_mode(model):
            for chunk in batches(ordered, batch_size, desc):
                out.append(loss_matrix(api, model, api.collate(list(chunk)), timesteps).detach().double().cpu())
        if not out:
            return torch.zeros(0, max(1, len(timesteps)), dtype=torch.float64)
        return torch.cat(out) if back is None else torch.cat(out)[back]

    kind = ("losses", tuple(int(t) for t in timesteps), batch_size, seed)
    return cached(cache if seed is not None else None, kind, model, items, compute)


def cell_losses(
    obs: Observation, model: nn.Module, items: Sequence[Any], *, timesteps: Sequence[int], batch_size: int, desc: str
) -> Tensor:
    """:func:`per_sample_losses` as an attack of a cell takes them: seeded by the cell (``obs.seed``: the same
    diffusion noise for every model scored) and shared through ``obs.signals`` with the cell group's other attacks."""
    return per_sample_losses(
        obs.api, model, items, batch_size=batch_size, timesteps=timesteps, desc=desc, seed=obs.seed, cache=obs.signals
    )


def attack_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters whose gradients are features: the trainable ones (e.g. LoRA), else all."""
    named = dict(model.named_parameters())
    chosen = {n: p for n, p in named.items() if p.requires_grad}
    return chosen or named


class _LossOf(nn.Module):
    """Wraps ``model`` so ``torch.func.functional_call`` can swap its parameters inside a task loss."""

    def __init__(self, model: nn.Module, api: TaskAPI, timesteps: Sequence[int]):
        super().__init__()
        self.model = model
        self.api = api
        self.timesteps = list(timesteps)

    def forward(self, batch: Any) -> Tensor:
        return loss_matrix(self.api, self.model, batch, self.timesteps).mean(1)


def _encode_norms(out: Any, n: int) -> tuple[dict[str, Tensor], list[str]] | None:
    """(norms [N, L], the L tensor names) of :func:`per_sample_grad_norms`: the per-candidate tensor as
    :data:`PER_CANDIDATE` writes it, the names as its layout."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list)):
        return None
    t, names = out
    encoded = PER_CANDIDATE.encode(t, n)
    if encoded is None or t.shape[1:] != (len(names),):
        return None
    return encoded[0], [str(x) for x in names]


def _decode_norms(tensors: dict[str, Tensor], names: list[str], n: int) -> tuple[Tensor, list[str]]:
    t = PER_CANDIDATE.decode(tensors, None, n)
    if t.shape[1:] != (len(names),):
        raise ValueError(f"spilled gradient norms of shape {tuple(t.shape)} for {len(names)} tensors")
    return t, list(names)


# per-sample gradient norms with their tensor names: spilled like losses (a killed gradient-MIA cell resumes)
GRAD_NORMS_CODEC = Codec("grad_norms", _encode_norms, _decode_norms)


@contextlib.contextmanager
def explicit_attention(model: nn.Module) -> Iterator[None]:
    """Fused scaled-dot-product attention has no vmap batching rule on CPU (torch runs it one sample at a time,
    with a warning), so per-sample gradients use the mathematically identical explicit softmax(QK^T)V path:
    timm's ``fused_attn = False`` and diffusers' ``AttnProcessor`` (default ldm-t2i UNet: vmap with SDPA 1.16x
    the loop's speed, with the explicit path 1.27x; one thread, 16 candidates x 10 timesteps)."""
    fused = [m for m in model.modules() if getattr(m, "fused_attn", False) is True]
    # diffusers models (UNet, VAE); Any: nn.Module types unknown attributes as Tensor | Module
    unets: list[Any] = [
        m for m in model.modules() if hasattr(m, "set_attn_processor") and hasattr(m, "attn_processors")
    ]
    kept = [u.attn_processors for u in unets]
    try:
        for m in fused:
            m.fused_attn = False  # type: ignore[assignment]  # torch types Module attributes as Tensor | Module
        if unets:
            from diffusers.models.attention_processor import AttnProcessor

            for u in unets:
                u.set_attn_processor(AttnProcessor())
        yield
    finally:
        for m in fused:
            m.fused_attn = True  # type: ignore[assignment]
        for u, procs in zip(unets, kept):
            u.set_attn_processor(procs)


_VMAP_FAILED: set[type] = set()  # model classes torch.func.vmap could not batch in this process


def _grad_norms_vmap(wrapper: _LossOf, params: dict[str, Tensor], batch: Any, chunk: int) -> Tensor:
    from torch.func import functional_call, grad, vmap
    from torch.utils._pytree import tree_map

    def loss_one(p: dict[str, Tensor], sample: Any) -> Tensor:
        one = tree_map(lambda x: x.unsqueeze(0) if isinstance(x, Tensor) else x, sample)
        return functional_call(wrapper, p, (one,))[0]

    def norms_one(p: dict[str, Tensor], sample: Any) -> Tensor:
        g = grad(loss_one)(p, sample)
        return torch.stack([g[n].float().norm() for n in p])

    return vmap(norms_one, in_dims=(None, 0), randomness="different", chunk_size=chunk)(params, batch)


def _grad_norms_loop(wrapper: _LossOf, params: dict[str, nn.Parameter], items: Sequence[Any], collate) -> Tensor:
    rows = []
    plist = list(params.values())
    for it in items:
        loss = wrapper(collate([it]))[0]
        gs = torch.autograd.grad(loss, plist, allow_unused=True)
        rows.append(torch.stack([g.float().norm() if g is not None else torch.zeros(()) for g in gs]))
    return torch.stack(rows)


def per_sample_grad_norms(
    api: TaskAPI,
    model: nn.Module,
    items: Sequence[Any],
    *,
    batch_size: int = 8,
    timesteps: Sequence[int] = (),
    use_vmap: bool = True,
    memory_mb: float = 1024.0,
    desc: str = "per-sample grads",
    seed: int | None = None,
    cache: SignalCache | None = None,
) -> tuple[Tensor, list[str]]:
    """[N, L] L2 norms of each sample's loss gradient w.r.t. each parameter tensor, and the tensor names.

    Per-sample gradients via ``torch.func`` (functional_call + vmap, chunked to ~``memory_mb`` of
    gradients); when the model or the task loss is not vmappable (data-dependent control flow,
    non-tensor batch fields, ...) it falls back to one backward pass per sample. ``seed`` / ``cache``
    as in :func:`per_sample_losses`: a seeded call is computed once per (model state, candidates).
    """

    def compute() -> tuple[Tensor, list[str]]:
        with seeded(seed) if seed is not None else contextlib.nullcontext():
            return _per_sample_grad_norms(
                api,
                model,
                items,
                batch_size=batch_size,
                timesteps=timesteps,
                use_vmap=use_vmap,
                memory_mb=memory_mb,
                desc=desc,
            )

    kind = ("grad_norms", tuple(int(t) for t in timesteps), batch_size, use_vmap, memory_mb, seed)
    return cached(cache if seed is not None else None, kind, model, items, compute, GRAD_NORMS_CODEC)


def _per_sample_grad_norms(
    api: TaskAPI,
    model: nn.Module,
    items: Sequence[Any],
    *,
    batch_size: int,
    timesteps: Sequence[int],
    use_vmap: bool,
    memory_mb: float,
    desc: str,
) -> tuple[Tensor, list[str]]:
    params = attack_parameters(model)
    names = list(params)
    wrapper = _LossOf(model, api, timesteps)
    numel = sum(p.numel() for p in params.values())
    chunk = max(1, int(memory_mb * 2**20 / (4 * max(numel, 1))))
    out: list[Tensor] = []
    vmap_ok = use_vmap and type(model) not in _VMAP_FAILED
    frozen = [p for p in params.values() if not p.requires_grad]
    ordered, back = length_sorted(api, items)
    with eval_mode(model), explicit_attention(model):
        try:
            for p in frozen:
                p.requires_grad_(True)
            for chunk_items in batches(ordered, batch_size, desc):
                if vmap_ok:
                    try:
                        detached = {f"model.{n}": p.detach() for n, p in params.items()}
                        batch = api.collate(list(chunk_items))
                        if api.diffusion_ops is not None and api.diffusion_ops.prepare is not None:
                            with torch.no_grad():
                                batch = api.diffusion_ops.prepare(model, batch, timesteps)
                        out.append(_grad_norms_vmap(wrapper, detached, batch, chunk).detach().double())
                        continue
                    except Exception as e:  # noqa: BLE001 - any vmap incompatibility: use the exact loop
                        vmap_ok = False
                        _VMAP_FAILED.add(type(model))  # later calls go straight to the loop, warned once
                        warnings.warn(
                            f"per-sample gradients: torch.func.vmap failed ({type(e).__name__}: "
                            f"{str(e)[:200]}); falling back to one backward pass per sample",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                out.append(_grad_norms_loop(wrapper, params, chunk_items, api.collate).detach().double())
        finally:
            for p in frozen:
                p.requires_grad_(False)
    if not out:
        return torch.zeros(0, len(names), dtype=torch.float64), names
    return (torch.cat(out) if back is None else torch.cat(out)[back]), names


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run tiny-tensor loops (a small MLP, a few hundred steps) on one intra-op thread: thread
    hand-offs cost more than the arithmetic there, and on a busy 2-core machine far more."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with a fixed torch CPU seed without disturbing the caller's random stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
