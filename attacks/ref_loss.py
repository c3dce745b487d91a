"""Reference-calibrated loss attack with the pre-trained base model as the reference: the score is how much lower
the target's loss on a candidate is than the base model's, so a candidate that is merely easy (low loss for any
model of the domain) no longer looks like a member.

[Watson] (difficulty calibration): s(x) = l(x; theta_ref) - l(x; theta), theta_ref a model not trained on x. For
fine-tuning, the checkpoint the fine-tuning started from is such a model and the attacker has it for free: it is
public in LoRA fine-tuning (the adapter is trained on a published checkpoint) and was sent to every client in
federated fine-tuning. [Mireshghallah] attack fine-tuned language models (full, head and adapter fine-tuning) with
this likelihood ratio against the pre-trained model. Variant ``neg_ratio`` = -l(x; theta) / l(x; theta_ref), the
ratio of log-perplexities [Carlini21] rank by (there against a smaller reference LM). ``neg_loss`` is the
uncalibrated loss attack on the same candidates (paired comparison in the record).

Cost: one more forward pass per candidate, no training (against [RMIA]'s reference runs). With a diffusion timestep
hook the loss is the mean over ``timesteps`` stratified steps, the same seeded noise for the target and the base.
The harness hands the base model over as ``obs.base_model`` (``uses_base``: ``api.build_model``). Built-in negative
control: when the target is the base model (the leaderboard's ``base`` row) every score is 0 (AUROC 0.5).

The calibration helps only where the base model is a good reference, i.e. where fine-tuning leaves the per-candidate
difficulty ranking in place. Measured on ``default`` (FedAvg, 250 + 250 candidates, the record's variants on the
same candidates): llm-text (fortunes, a domain SmolLM2 knows) calibrated 0.946-0.974 global against the plain loss
0.896-0.949; vlm-caption (captions in a format the un-fine-tuned LM never saw, which fine-tuning learns for every
caption alike) calibrated 0.523 / 0.523 / 0.520 global (seeds 0-2) against 0.638 / 0.606 / 0.644, client view
0.627 / 0.607 / 0.616 against 0.810 / 0.769 / 0.832: the base model's loss there measures how foreign the format is,
not how hard the candidate is, and subtracting it adds noise. A reference that saw the domain (RMIA's reference
runs) is the remedy. image-cls (the base: the default preset's model pre-trained on 6,000 Fashion-MNIST images
disjoint from the candidates; FedAvg seeds 0-2, global view, session 2026-11-29): calibrated 0.68-0.71 (ViT) /
0.66-0.69 (ResNet34) against the plain loss 0.76-0.77 / 0.77-0.79. ldm-t2i (the base: the LDM pre-trained on public
Fashion-MNIST images; the timestep-averaged denoising loss; seeds 0-1, session 2026-12-07) is where it helps most,
global / client: FedRand 0.956 / 0.979 against the plain loss 0.749 / 0.794, FedPara 0.905 / 0.901 against 0.686 /
0.684, FedSGD 0.992 (global) against 0.930, FLRSP's client view 0.752 against 0.535: how well the base model
already denoises a candidate is most of what the plain loss measures there.

The ``neg_ratio`` variant ranks better than the difference in every scenario measured (same records, same
candidates): llm-text global 0.966 / 0.989 / 0.990 (seeds 0-2) against 0.946 / 0.974 / 0.974, vlm-caption global
0.597 / 0.586 / 0.591 against 0.523 / 0.523 / 0.520 (still below the plain loss there), image-cls global ViT
0.849-0.855 and ResNet34 0.834-0.847, above the plain loss. The primary score stays the difference of [Watson]
(records made with it would otherwise mix two primaries); the attack-strength tables read every variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import Tensor, nn

from bench.loss_signals import cell_losses, loss_timesteps
from bench.params import param
from bench.registry import register_attack
from bench.types import Attack, Observation, Scores


@register_attack
@dataclass
class RefLoss(Attack):
    timesteps: int = param(10, ge=0, le=1000)  # diffusion steps the loss is taken at (only with api.diffusion_ops)
    batch_size: int = param(16, ge=1, le=4096)  # candidates per forward pass

    views = ("global_model", "client_model", "released_model")
    kind = "membership"
    paper = (
        "[Watson] (Watson et al. 2022): difficulty calibration against a reference model; [Mireshghallah] "
        "(Mireshghallah et al. 2022): the pre-trained model as the reference of a fine-tuned one"
    )
    uses_base = True  # the harness puts the base model's builder in obs.base_model
    budget = {"timesteps": 2}  # a conformance run's caps (bench.conformance.cap_budget)

    def run(self, obs: Observation, candidates: Sequence[Any] | None) -> Scores:
        if obs.model is None:
            raise ValueError(f"ref_loss needs a model in the observation (view {obs.view!r})")
        if obs.base_model is None:
            raise ValueError("ref_loss needs the pre-trained base model: obs.base_model is None")
        items = list(candidates or [])
        if not items:
            raise ValueError("ref_loss needs candidates to score")
        steps = loss_timesteps(obs.api, self.timesteps)

        def losses(model: nn.Module, what: str) -> Tensor:  # [N]: the mean over the diffusion steps, if any
            bs = self.batch_size
            return cell_losses(obs, model, items, timesteps=steps, batch_size=bs, desc=f"ref_loss {what}").mean(1)

        target = losses(obs.model, "target")
        base = obs.base_model().eval()
        ref = losses(base, "base model")
        del base
        scores = {
            "calibrated": ref - target,
            "neg_ratio": -target / ref.clamp(min=1e-12),
            "neg_loss": -target,
        }
        details = {"reference": "the pre-trained base model the fine-tuning started from (api.build_model)"}
        return Scores(scores, primary="calibrated", details=details)
