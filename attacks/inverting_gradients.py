"""Inverting gradients: optimise dummy images until their gradient points the same way as the client's.

Geiping et al. 2020, "Inverting Gradients - How easy is it to break privacy in federated learning?"
(NeurIPS): minimise ``1 - cos(grad L(x', y), g) + tv * TV(x')`` over x' with Adam on the *signed*
gradient, a step learning-rate schedule (x0.1 at 3/8, 5/8, 7/8 of the iterations) and the image
boxed to the valid pixel range; labels come from the last layer (Zhao et al. 2020, iDLG; Yin et al.
2021 for batches). [FLRSP] Eq. 4-5 describe this attack as "adversarial optimisation" and
run it with Adam, lr 1e-4, 24,000 iterations; the defaults here follow the Inverting Gradients
preset (lr 0.1, step decay); the iteration count defaults to the scenario's
``api.image.inversion_iterations`` (300 where a task gives none).

Defaults chosen on the default preset (session 2026-12-02, seed 0 only, 8 targets; SSIM minus random images'
on the same targets; seeds 1-2 then measured as held out, leaderboards/README.md): the start is uniform in the
valid box (``init="rand"``; the Gaussian start of Geiping et al.'s code gave ViT FedSGD 0.106, ResNet34 FedSGD
0.171 against 0.151, 0.198), and the best of 4 restarts by matching loss (Geiping et al.'s code runs up to 32;
with the uniform start, 1 -> 4 restarts: ViT FedSGD 0.151 -> 0.216, ResNet34 FedSGD 0.198 -> 0.230, ResNet34
FedAvg 0.198 -> 0.226, ViT FedAvg with the sign pairing below 0.144 -> 0.175). A message that holds only the
gradient's signs (one step of an Adam client, below) is matched by sign agreement (``similarity="auto"`` picks
``"sign"`` there): ``1 - <g, t> / (|g|_1 |t|_inf)`` (Hoelder's pairing), 0 exactly when the dummy's gradient
has the message's signs, so the true image is a minimiser, while the cosine with a sign vector is
|g|_1 / (|g|_2 sqrt(n)) < 1 at the true image (0.33-0.38 on the default ViT) and prefers images whose gradients
are flat. On the default ViT's FedAvg probes, seed 0: 0.144 against the cosine's 0.081 (uniform start);
against an SGD client's update (ResNet34 FedAvg) the sign pairing is worse (0.132 against 0.198), so "auto"
keeps the cosine there.

Each target is optimised on its own. Compiled (``compiled="auto"`` on cells of >= COMPILE_MIN_ITERATIONS
iterations; attacks/_compiled_matching.py): torch.func's gradient of the cosine of torch.func's gradient,
one ``torch.compile``d graph per architecture, 2.0x one forward+backward of ResNet34 with train-mode
BatchNorm and 1.2-1.35x of the ViT per iteration (thread CPU time, one thread; ``tests/bench_inversion.py``).
Eager, with plain autograd: the client's gradient with ``create_graph`` w.r.t. the matched parameters
only, the cosine as per-tensor dot products against target norms computed once, its derivative in
closed form, then one vector-Jacobian product to the dummy image (3.5-4.0x of ResNet34, 2.8x of the ViT;
breaching's iteration 4.3x, README). Where it goes (profiled, 32 px, batch 1): the
double backward runs 7 convolutions per conv layer against a forward+backward's 3, and train-mode
BatchNorm's double backward adds ~0.5 of a forward+backward (3.2x in eval mode). Measured no faster (eager):
channels_last, MKLDNN on/off, a closed-form BatchNorm double backward as an ``autograd.Function``
(1.25x slower: Python per-op overhead); the TV gradient in closed form, in-place box clamps and foreach
cotangents gave 1-3% (the same iterates, bit for bit).
Jointly optimising several targets with ``torch.func.vmap``
was measured slower per target-iteration on ResNet34 and the ViT (1.5x), so targets are not batched:
the engine runs cells in parallel processes instead. The cell seed (``obs.seed``) seeds the start.

Modelling choices (documented for the leaderboard reader):
- The model is inverted in the mode the client used: ``model_mode="auto"`` means "eval" when the observation says
  the client normalised with the global model's BatchNorm statistics (``Public.batchnorm_stats == "public"``: the
  harness's reconstruction probes, as in breaching's honest-but-curious case and Geiping et al.'s own code), else
  "train". Train-mode BatchNorm normalises with the batch's own statistics; when a
  layer has a single value per channel (batch 1, 1x1 feature map) torch refuses it in train mode, so the client could
  not have used it either: the attack then falls back to eval mode and says so. Note: with batch 1,
  train-mode BatchNorm is an instance norm at every layer and inversion converges far more slowly
  (default ResNet34, 300 iterations: SSIM 0.06 in train mode against 0.37 in eval mode, bench/cells.py).
- Only the parameters present in the message are matched (a defense may withhold some). Exact
  zeros are matched as zeros by default, as the standard attack the FLRSP paper ran does; the
  adaptive variant ``mask_zeros=True`` ignores them (an honest-but-curious server knows FLRSP's
  zeros mean "not sent": it averages non-zero entries only).
- A ``weights`` message (FedAvg) is turned into the update direction ``(global - weights) /
  (lr * local_steps)``; with several local SGD steps the client's steps are unrolled on the dummy
  (Geiping et al. 2020, s.5), which assumes a plain-SGD client.
- The loss is the cross-entropy of an image classifier (the image-cls scenarios' task loss).
- An Adam / AdamW client (the default ViT's: ``image-cls`` trains it with Adam): one step from fresh
  optimiser state moves each weight by lr * m / (sqrt(v) + eps) = lr * g / (|g| + eps), i.e. ~lr * sign(g), so
  a one-step weights message holds the gradient's signs only (measured on the default ViT's FedAvg probes:
  cosine 1.000 with sign(g), 0.33-0.38 with g). The attack matches it by sign agreement (``similarity="auto"``,
  above) and the record notes it (``details.note``, ``details.similarity``). Before (the cosine of the dummy's
  gradient with that sign vector, as a plain-SGD update): default ViT, 300 iterations, SSIM minus random images'
  0.04-0.10 against FedSGD's 0.07-0.17 (3 seeds each, session 2026-11-27); matching a soft sign of the dummy's
  gradient (g / sqrt(g^2 + (c rms g)^2)) was worse (c = 0.1: 0.019, c = 1: 0.011, against 0.044 on seed 0);
  four restarts raised FedSGD's gap to 0.12-0.20 and left FedAvg's at 0.08-0.11 (with the cosine, the
  matching loss that ranks restarts does not point at the true image).
- The default ViT's reconstructions hold the right patches in the wrong places and with unmatched offsets (the
  patch-permutation ambiguity of [GradViT]). Measured no better there (seed 0, 8 targets, SSIM minus random images',
  FedSGD / FedAvg; 300 iterations: 0.106 / 0.065; session 2026-12-01): 1,200 iterations 0.117 / 0.066, 3,000
  (FedAvg) 0.071; TV weight 0, 0.02, 1.0: 0.063 / 0.027, 0.061 / 0.020, 0.094 / 0.086; the layer-wise cosine 0.101 /
  0.088; a [GradViT]-style patch prior (squared differences across patch borders, weight 0.1, 1, 10) 0.095-0.112 /
  0.044-0.066. A uniform start in the valid box gave 0.151 / 0.081 (with the patch prior 0.171 / 0.105), one seed:
  not made the default. A greedy search over swaps of the 16 patches after the optimisation, keeping a swap when it
  lowers the attack's own matching loss (session 2026-12-02, FedSGD seed 0, scratch): 0.117 against 0.106 without,
  the loss moving in the fourth digit (the matching loss barely prefers another order). [GradViT]'s remedy adds an
  image prior from a pre-trained CNN's BatchNorm statistics (not built).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor, nn

from attacks._client_update import (
    adaptive_client_note,
    attacker_copy,
    box,
    forward_ok,
    infer_labels,
    signs_only,
    total_variation_grad,
    update_direction,
)
from attacks._compiled_matching import compiled_matching_step, compiler_missing
from attacks._gradient_matching import Matcher, SimulatedUpdate
from bench.params import param
from bench.progress import nested, progress
from bench.registry import register_attack
from bench.types import Attack, Observation, Reconstructions, TaskSpec


def _scenario_iterations(task: TaskSpec) -> int:
    """The task's inversion budget for a configuration that sets none (300 where the task declares no image)."""
    return task.image.inversion_iterations if task.image is not None else 300


# ----------------------------------------------------------------------------------------------
# the attack

# compiled="auto" compiles a cell whose targets x restarts x iterations reach this: a warm compile (~15 s)
# pays for itself within a few hundred ResNet34 iterations, a cold one (2-5 min once per machine) within a
# default cell's 2,400 (module doc); smoke and conformance runs stay eager
COMPILE_MIN_ITERATIONS = 2_000


@dataclass
class _Job:
    """One observation prepared for the optimisation."""

    obs: Observation
    targets: dict[str, Tensor]
    masks: dict[str, Tensor] | None
    labels: Tensor
    label_source: str
    info: dict[str, Any]
    names: tuple[str, ...]
    batch: int
    unroll: int
    lr: float
    mode: str
    similarity: str  # resolved: global, per_param or sign


@register_attack
@dataclass
class InvertingGradients(Attack):
    """Cosine gradient matching + total variation (Geiping et al. 2020; [FLRSP] Eq. 4-5)."""

    views = ("client_update",)
    kind = "reconstruction"
    paper = "Geiping et al. 2020 (Inverting Gradients); [FLRSP] Eq. 4-5"
    budget = {"iterations": 10, "restarts": 1}  # a conformance run's caps (bench.conformance.cap_budget)
    requires = ("image",)  # the TaskAPI fields it reads (tests/test_scenario_conformance.py)

    # None: the scenario's (api.image.inversion_iterations; 24,000 in paper)
    iterations: int | None = param(None, ge=1, le=1_000_000)
    lr: float = param(0.1, gt=0.0, le=1e3)
    tv: float = param(0.2, ge=0.0, le=1e3)  # total-variation weight
    restarts: int = param(4, ge=1, le=100)  # the best of 4 by matching loss (module doc)
    signed: bool = True
    boxed: bool = True
    lr_decay: bool = True
    init: Literal["randn", "rand", "zeros"] = "rand"  # uniform in the valid box (module doc)
    # "auto": "sign" for a one-step weights message from an Adam / AdamW client (module doc), else "global"
    similarity: Literal["auto", "global", "per_param", "sign"] = "auto"
    mask_zeros: bool = False
    model_mode: Literal["auto", "train", "eval"] = "auto"
    unroll_local_steps: bool = True
    # "auto": compiled (attacks/_compiled_matching.py) when the cell runs >= COMPILE_MIN_ITERATIONS iterations
    # and a compiler is present, else eager; a failed auto compile falls back to eager and says so. An engine
    # choice like --device: the same function up to floating-point reassociation (tests/test_compiled_matching.py),
    # so it stays out of the cell's identity (added=True) and the record's details.engine says which ran
    compiled: Literal["auto", "on", "off"] = param("auto", added=True)

    def __post_init__(self) -> None:
        if (self.iterations is not None and self.iterations < 1) or self.restarts < 1:
            raise ValueError("iterations and restarts must be >= 1")
        if self.lr <= 0 or self.tv < 0:
            raise ValueError("lr must be > 0 and tv >= 0")

    def applies(self, api: TaskSpec) -> str | None:
        if api.family != "image-cls":
            return f"inverting gradients here inverts image classifiers (family is {api.family})"
        if api.image is None:
            return "the task does not publish its input shape"
        return None

    def run(self, obs: Observation, candidates: Sequence[Any] | None = None) -> Reconstructions:
        return self.run_batch([obs])[0]

    def run_batch(self, observations: Sequence[Observation]) -> list[Reconstructions]:
        """Reconstruct every observation's inputs, one target at a time (module doc: jointly
        optimising targets with ``vmap`` was slower per target-iteration on ResNet34 and the ViT)."""
        total = sum(self._iterations(o) for o in observations) * self.restarts
        auto = self.compiled == "auto" and total >= COMPILE_MIN_ITERATIONS
        engine = "compiled" if self.compiled == "on" or auto else "eager"
        return [
            self._optimise(self._prepare(o), engine)  # the unit's main loop: the run's bar follows the targets
            for o in progress(observations, desc="targets", leave=False, unit=True)
        ]

    def _iterations(self, obs: Observation) -> int:
        return self.iterations or _scenario_iterations(obs.api)

    def resolved(self, task: TaskSpec) -> dict[str, Any]:
        """The scenario's iteration budget when ``iterations`` is None (``api.image.inversion_iterations``)."""
        return {} if self.iterations else {"iterations": _scenario_iterations(task)}

    # -- preparation ------------------------------------------------------------------------

    def _prepare(self, obs: Observation) -> _Job:
        if obs.model is None or obs.message is None:
            raise ValueError("inverting gradients needs the global model and the client's message")
        targets, info = update_direction(obs)
        params = dict(obs.model.named_parameters())
        names = tuple(n for n in params if n in targets and targets[n].shape == params[n].shape)
        if not names:
            raise ValueError("the message holds none of the model's parameters")
        masks = None
        if self.mask_zeros:
            src = info.get("zero_weights") if info["kind"] == "weights" else None
            masks = {n: ~(src[n] if src is not None else targets[n] == 0) for n in names}
            targets = {n: torch.where(masks[n], targets[n], torch.zeros(())) for n in names}
        batch = int(obs.public.num_samples or obs.message.num_samples or 1)
        labels, source = infer_labels(targets, obs.model, obs.api.image.num_classes if obs.api.image else None, batch)
        unroll = info["local_steps"] if (info["kind"] == "weights" and self.unroll_local_steps) else 1
        info.pop("zero_weights", None)
        mode = self.model_mode
        if mode == "auto":  # the client's BatchNorm statistics (bench.fl.train_mode): its batch's or the public ones
            mode = "eval" if obs.public.batchnorm_stats == "public" else "train"
        if mode not in ("train", "eval"):
            raise ValueError(f"model_mode must be train or eval, got {mode!r}")
        similarity = self.similarity
        if similarity == "auto":
            similarity = "sign" if signs_only(obs, info["kind"], info["local_steps"]) else "global"
        return _Job(
            obs,
            {n: targets[n] for n in names},
            masks,
            labels,
            source,
            info,
            names,
            batch,
            unroll,
            float(info.get("lr", 1.0)),
            mode,
            similarity,
        )

    # -- the optimisation, one target at a time ----------------------------------------------

    def _init(self, size: tuple[int, ...], seed: int, restart: int, lo: Tensor, hi: Tensor) -> Tensor:
        """Restart r of a cell seeded ``seed`` starts from its own draw; every target of the cell
        starts from the same one (as in Geiping et al.'s code: one fixed seed per attack run)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + restart)
        if self.init == "randn":
            return torch.randn(size, generator=gen)
        if self.init == "rand":
            return lo.cpu() + (hi - lo).cpu() * torch.rand(size, generator=gen)
        return torch.zeros(size)

    def _optimise(self, job: _Job, engine: str = "eager") -> Reconstructions:
        its = self._iterations(job.obs)
        results = []
        for r in nested(range(self.restarts)):
            run = self.start(job, restart=r, iterations=its, engine=engine)
            desc = "inverting gradients" + (f" (restart {r + 1}/{self.restarts})" if self.restarts > 1 else "")
            for _ in progress(range(its), desc=desc, leave=False):
                run.step()
            results.append((run.final_loss(), run.X.detach()))
        losses = [m for m, _ in results]
        best = min(range(len(results)), key=losses.__getitem__)
        details = {
            "gradient_cosine_loss": losses[best],
            "restart_losses": losses,
            "iterations": its,
            "label_source": job.label_source,
            "model_mode": run.mode_note,
            "matched_params": len(job.names),
            "message_kind": job.info["kind"],
            "unrolled_steps": job.unroll,
            "mask_zeros": self.mask_zeros,
            "engine": run.engine,
            "similarity": job.similarity,
        }
        note = adaptive_client_note(job.obs, job.info["kind"], job.similarity)
        if note:
            details["note"] = note
        return Reconstructions(images=results[best][1].clone(), labels=job.labels.clone(), details=details)

    def start(self, job: _Job, *, restart: int, iterations: int, engine: str = "eager") -> _Run:
        """Set up one restart's optimisation (model copy, target norms, dummy, optimiser); ``engine``
        "compiled" runs each iteration as one compiled graph (attacks/_compiled_matching.py)."""
        api, target = job.obs.api, job.obs.model
        assert api.image is not None and target is not None  # applies() and _prepare() checked both
        shape = tuple(api.image.input_shape)
        model, mode = attacker_copy(target, job.mode)
        mode_note = mode
        if mode == "train" and not forward_ok(model, shape, job.batch):
            model, mode = attacker_copy(target, "eval")
            mode_note = "eval (train-mode BatchNorm cannot normalise a single value per channel)"
        params = dict(model.named_parameters())
        p0 = {n: params[n].requires_grad_(True) for n in job.names}  # only matched tensors get gradients
        device = next(iter(p0.values())).device
        lo, hi = (b.to(device) for b in box(api, shape[0]))
        match = Matcher(
            [job.targets[n].to(device) for n in job.names],
            [job.masks[n].to(device) for n in job.names] if job.masks is not None else None,
            similarity=job.similarity,
        )
        x0 = self._init((job.batch, *shape), job.obs.seed, restart, lo, hi).to(device)
        X = nn.Parameter(torch.max(torch.min(x0, hi), lo) if self.boxed else x0)
        opt = torch.optim.Adam([X], lr=self.lr)
        its = iterations
        sched = (
            torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[its * 3 // 8, its * 5 // 8, its * 7 // 8], gamma=0.1)
            if self.lr_decay
            else None
        )
        run = _Run(
            self,
            SimulatedUpdate(model, p0, unroll=job.unroll, lr=job.lr),
            match,
            job.labels.to(device),
            X,
            opt,
            sched,
            (lo, hi) if self.boxed else None,
            mode_note,
        )
        if engine == "compiled":
            missing = compiler_missing(device)
            if missing is None:
                run.fused = _fused_step(model, job, match, run.y, device)
                run.engine = "compiled"
            elif self.compiled == "on":
                raise RuntimeError(f"inverting_gradients compiled='on', but {missing}; use compiled='auto' or 'off'")
            else:
                run.engine = f"eager ({missing})"
        return run


@dataclass
class _Run:
    """One restart of the optimisation; ``step`` is one iteration (benchmarked in tests/bench_inversion.py)."""

    attack: InvertingGradients
    update: SimulatedUpdate
    match: Matcher
    y: Tensor
    X: nn.Parameter
    opt: torch.optim.Optimizer
    sched: Any
    box: tuple[Tensor, Tensor] | None
    mode_note: str
    fused: Callable[[Tensor], Tensor] | None = None  # the compiled iteration's input gradient, if any
    engine: str = "eager"

    def step(self) -> None:
        X = self.X
        gx = self._fused_grad(X) if self.fused is not None else None
        if gx is None:
            _, used, vs = self.match.cotangents(self.update(X, self.y))
            keep = [k for k, u in enumerate(used) if u.requires_grad]  # a parameter the input cannot reach has none
            gx = (
                torch.autograd.grad([used[k] for k in keep], [X], grad_outputs=[vs[k] for k in keep])[0]
                if keep
                else torch.zeros_like(X)
            )
        if self.attack.tv:  # the TV term's gradient in closed form: no autograd graph for it
            gx.add_(total_variation_grad(X.detach()), alpha=self.attack.tv)
        X.grad = gx.sign_() if self.attack.signed else gx
        self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if self.box is not None:
            with torch.no_grad():
                X.clamp_(min=self.box[0], max=self.box[1])

    def _fused_grad(self, X: Tensor) -> Tensor | None:
        """The compiled iteration's input gradient; under ``compiled="auto"`` a failure to compile switches
        this run to the eager path (recorded in ``engine``), under "on" it propagates."""
        assert self.fused is not None
        try:
            return self.fused(X.detach()).clone()
        except Exception as e:  # noqa: BLE001  # dynamo / inductor raise many types; "auto" must not fail the cell
            if self.attack.compiled == "on":
                raise
            self.fused, self.engine = None, f"eager (compile failed: {type(e).__name__}: {str(e)[:120]})"
            return None

    def final_loss(self) -> float:
        """The gradient-matching loss of the current dummy (restarts are ranked by it)."""
        return float(self.match(self.update(self.X.detach(), self.y, create_graph=False)).detach())


def _fused_step(model: nn.Module, job: _Job, match: Matcher, y: Tensor, device: torch.device) -> Callable:
    """The compiled iteration bound to this target: model, matched and other parameters (+ buffers),
    targets and norms as the compiled graph's inputs (attacks/_compiled_matching.py)."""
    params = dict(model.named_parameters())
    p = {n: params[n].detach() for n in job.names}
    rest = {n: t.detach() for n, t in params.items() if n not in p} | dict(model.named_buffers())
    step = compiled_matching_step()
    return functools.partial(
        step,
        model,
        y=y,
        p=p,
        rest=rest,
        targets=[job.targets[n].to(device) for n in job.names],
        masks=[job.masks[n].to(device, torch.float) for n in job.names] if job.masks is not None else None,
        tn=match.tn.to(device),
        layers=tuple(match.layers),
        unroll=job.unroll,
        lr=job.lr,
        similarity=job.similarity,
    )
