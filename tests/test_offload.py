"""optim.offload=cpu: DeepSpeed's DeepSpeedCPUAdam equals torch.optim.AdamW (decoupled weight
decay, the model's own parameter groups with and without decay) within 1e-6 relative after 3
steps on k3_tiny's gradients."""

from __future__ import annotations

import pytest
import torch

from model.config import k3_tiny
from model.k3 import K3Model
from tests.parallel_harness import global_batch
from tests.tolerances import rel_rms
from train.config import OptimConfig, TrainConfig, validate_train_config
from train.optim.factory import build_optimizer, set_lr

pytestmark = pytest.mark.timeout(900)  # the first use builds DeepSpeed's CPU op (minutes)


def _model_and_optimizers(offload: str):
    torch.manual_seed(0)
    model = K3Model(k3_tiny())
    cfg = OptimConfig(name="adamw", offload=offload, lr=3e-3)
    optimizers = build_optimizer(model, cfg)
    set_lr(optimizers, cfg.lr)
    return model, optimizers


def test_cpu_offload_matches_torch_adamw():
    """Both optimizers get the same gradients each step (the reference model's), so what is
    compared is the optimizer alone, not fp32 noise that three forward passes amplify."""
    ref_model, ref_opts = _model_and_optimizers("none")
    model, opts = _model_and_optimizers("cpu")
    assert type(opts[0]).__name__ == "DeepSpeedCPUAdam"
    assert type(ref_opts[0]) is torch.optim.AdamW
    params = dict(model.named_parameters())
    for step in range(3):
        ref_model(global_batch(step)).loss_sum.backward()
        for name, p in ref_model.named_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            params[name].grad = p.grad.clone()
        for opt in ref_opts + opts:
            opt.step()
        ref_model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    worst = max(rel_rms(p, params[n]) for n, p in ref_model.named_parameters())
    assert worst <= 1e-6, worst


def test_offload_needs_host_parameters():
    cfg = TrainConfig()
    cfg.optim.offload = "cpu"
    cfg.parallel.data_shard = "full"
    with pytest.raises(Exception, match="optim.offload"):
        validate_train_config(cfg, 1)
    cfg.optim.offload = "disk"
    with pytest.raises(Exception, match="optim.offload='disk'"):
        validate_train_config(cfg, 1)
