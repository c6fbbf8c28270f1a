"""Layout-independent initial values (model/init.py): any part of a parameter computed alone
equals that part of the whole, the draws have the distributions their rules name, and a seed
and a name decide them."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import k3_tiny
from model.init import (
    ONES,
    Mapped,
    Normal,
    Uniform,
    fill_,
    normal,
    parameter_key,
    uniform,
)
from model.k3 import K3Model


@pytest.mark.parametrize("rule", [Normal(0.02), Uniform(-0.5, 0.5), ONES,
                                  Mapped(lambda u: u * u)], ids=["normal", "uniform", "ones",
                                                                  "mapped"])
def test_any_grid_of_a_parameter_equals_that_grid_of_the_whole(rule):
    """Rows 3..9 and the strided columns of a [16, 10, 6] tensor, filled alone, equal the same
    elements of the whole tensor filled at once (a shard's values equal the unsharded model's)."""
    key = parameter_key(7, "layers.1.mlp.experts.w1")
    whole = fill_(torch.empty(16, 10, 6), rule, key, (16, 10, 6))
    rows, cols = torch.arange(3, 10), torch.tensor([0, 2, 4, 6, 8])
    part = fill_(torch.empty(7, 5, 6), rule, key, (16, 10, 6), [rows, cols, torch.arange(6)])
    assert torch.equal(part, whole[3:10][:, 0:10:2])


def test_filling_in_passes_equals_filling_at_once(monkeypatch):
    """A large shard is written in passes along dim 0: the same values as one pass."""
    import model.init as init

    key = parameter_key(0, "embed.weight")
    once = fill_(torch.empty(64, 33), Normal(1.0), key, (64, 33))
    monkeypatch.setattr(init, "_ELEMENTS_PER_PASS", 100)  # 3 rows per pass
    assert torch.equal(fill_(torch.empty(64, 33), Normal(1.0), key, (64, 33)), once)


def test_draws_have_their_distributions():
    """One million draws: standard normal moments and quantiles, uniform in (0, 1) with the
    right mean and variance; neighbouring indices uncorrelated."""
    index = torch.arange(1_000_000)
    z = normal(parameter_key(0, "w"), index)
    assert abs(float(z.mean())) < 5e-3 and abs(float(z.std()) - 1) < 5e-3
    assert abs(float((z < 1.0).double().mean()) - 0.841345) < 2e-3
    assert abs(float((z.abs() > 3).double().mean()) - 0.0026998) < 3e-4
    u = uniform(parameter_key(0, "w"), index)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 2e-3 and abs(float(u.var()) - 1 / 12) < 1e-3
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < 5e-3


def test_seed_and_name_decide_the_values():
    index = torch.arange(1000)
    a = normal(parameter_key(1, "layers.0.attn.q_proj.weight"), index)
    assert torch.equal(a, normal(parameter_key(1, "layers.0.attn.q_proj.weight"), index))
    for other in (parameter_key(2, "layers.0.attn.q_proj.weight"),
                  parameter_key(1, "layers.0.attn.k_proj.weight")):
        b = normal(other, index)
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.1


def test_model_parameters_follow_their_rules():
    """Every parameter of k3_tiny has a rule; the weights are Normal(0, init_std), norms one,
    A_h zero, the KDA decay bias the inverse softplus of a log-uniform dt in [1e-3, 0.1]."""
    cfg = k3_tiny()
    model = K3Model(cfg, seed=5)
    params = dict(model.named_parameters())
    assert abs(float(params["embed.weight"].detach().std()) - cfg.init_std) < 1e-3
    assert torch.equal(params["layers.0.attn_norm.weight"], torch.ones(cfg.hidden_size))
    assert torch.equal(params["layers.0.attn.a_log"], torch.zeros(cfg.kda.num_heads))
    dt = torch.nn.functional.softplus(params["layers.0.attn.decay_bias"].double())
    assert float(dt.min()) >= 1e-3 * (1 - 1e-6) and float(dt.max()) <= 0.1 * (1 + 1e-6)
    assert abs(float(dt.log().mean()) - (math.log(1e-3) + math.log(0.1)) / 2) < 0.4
    assert torch.equal(K3Model(cfg, seed=5).embed.weight, params["embed.weight"])
    assert not torch.equal(K3Model(cfg, seed=6).embed.weight, params["embed.weight"])
