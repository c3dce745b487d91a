"""BatchNorm statistics of a client update: "batch" (train mode) or "public" (the global model's running statistics).

Reconstruction probes are batch-1 updates; batch-1 train-mode BatchNorm is an instance norm, so the harness makes them
with the public statistics (breaching's honest-but-curious case) and inverting gradients inverts in eval mode.
"""

from dataclasses import replace

import pytest
import torch
from torch import nn

from attacks.inverting_gradients import InvertingGradients
from bench.fl import local_train, train_mode
from bench.task import config_hash
from bench.types import ClientState, FLConfig, RoundCtx
from tests.test_reconstruction_attacks import bn_cnn, client_gradient, observe, photo, task_api


class _Api:
    @staticmethod
    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    @staticmethod
    def collate(items):
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _train(stats: str) -> nn.Module:
    model = _bn_model()
    data = [(torch.randn(4, generator=torch.Generator().manual_seed(i)), i % 3) for i in range(8)]
    fl = FLConfig(batch_size=4, local_epochs=1, lr=0.1, batchnorm_stats=stats)
    ctx = RoundCtx(round=0, rounds=1, fl=fl, task=_Api(), generator=torch.Generator().manual_seed(0), num_selected=1)  # type: ignore[arg-type]
    ctx = replace(ctx, shared_names=tuple(n for n, _ in model.named_parameters()))
    local_train(ClientState(0, model, data, {}), ctx)
    return model


def test_public_statistics_leave_the_running_statistics_alone_and_batch_statistics_update_them():
    # arrange
    fresh = _bn_model()[1]
    # act
    public, batch = _train("public")[1], _train("batch")[1]
    # assert: eval-mode BatchNorm during local training, every other module in train mode
    assert not public.training and torch.equal(public.running_mean, fresh.running_mean)
    assert batch.training and not torch.equal(batch.running_mean, fresh.running_mean)


def test_train_mode_names_the_choices_for_an_unknown_setting():
    with pytest.raises(ValueError, match="batch, public"):
        train_mode(_bn_model(), FLConfig(batchnorm_stats="frozen"))


def test_the_default_batchnorm_setting_keeps_earlier_config_hashes():
    assert config_hash("t", "smoke", FLConfig(), {"a": 1}) == "543b17deb92cf736"
    assert config_hash("t", "smoke", FLConfig(batchnorm_stats="public"), {"a": 1}) != "543b17deb92cf736"


def test_inverting_gradients_inverts_in_the_mode_the_observation_states():
    # arrange: one BatchNorm CNN's eval-mode gradient, observed with and without the public statistics
    model, api = bn_cnn(), task_api("cnn", bn_cnn)
    grads = client_gradient(model, photo("chelsea"), 3, train=False)
    atk = InvertingGradients(iterations=1)
    # act
    public = atk.run(observe(model, grads, api, batchnorm_stats="public"))
    unstated = atk.run(observe(model, grads, api))
    # assert
    assert public.details["model_mode"] == "eval" and unstated.details["model_mode"] == "train"
