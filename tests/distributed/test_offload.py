"""optim.offload=cpu: DeepSpeed's DeepSpeedCPUAdam equals torch.optim.AdamW (decoupled weight
decay, the model's own parameter groups with and without decay) within 1e-6 relative after 3
steps on k3_tiny's gradients; under data parallelism (replicated and ZeRO-1, its state then on
the owner's host only) 3 steps reproduce the one-process offloaded run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from model.config import k3_tiny
from model.k3 import K3Model
from parallel.topology import Topology
from tests.helpers.parallel_harness import (
    compare,
    global_batch,
    layout,
    run_steps,
    spawn,
    tiny_config,
)
from tests.helpers.tolerances import rel_rms
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


TOL = 1e-5
OFFLOADED = {"dp2": dict(data=2), "dp2_optimizer": dict(data=2, data_shard="optimizer")}


def _offloaded(optim: str = "adamw"):
    cfg = tiny_config(optim)
    cfg.optim.offload = "cpu"
    return cfg


def _offload_world(rank: int, world: int, refs_path: str) -> dict:
    from train.loop import build_parallel_model

    ref = torch.load(refs_path, weights_only=False)
    out = {}
    for name, parallel in OFFLOADED.items():
        cfg = layout(_offloaded(), **parallel)
        topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
        out[name] = compare(ref, run_steps(cfg, topology))
        model, _, _, optimizers = build_parallel_model(cfg, topology, torch.device("cpu"))
        held = [sum(len(g["params"]) for g in opt.param_groups) for opt in optimizers]
        counts = [None] * world
        dist.all_gather_object(counts, sum(held))
        out[name]["optimizers"] = sorted({type(opt).__name__ for opt in optimizers})
        out[name]["tensors_per_rank"] = counts
        out[name]["tensors"] = sum(1 for p in model.parameters() if p.requires_grad)
        topology.destroy()
    return out


@pytest.mark.slow
def test_offload_under_data_parallelism_matches_one_process(tmp_path):
    """Loss and gradients within 1e-5, parameters within the AdamW bound of
    tests/distributed/test_parallel.py; ZeRO-1 splits the tensors (and their host state) over the
    ranks."""
    refs = tmp_path / "ref.pt"
    torch.save(run_steps(_offloaded(), None, micro_batches=2), refs)
    got = spawn(_offload_world, 2, tmp_path / "w2", str(refs))
    for name, e in got.items():
        print(f"{name}: loss {e['loss']:.1e} grad {e['grad']:.1e} params {e['adamw_param']:.1e}")
        assert e["optimizers"] == ["DeepSpeedCPUAdam"], (name, e)
        assert max(e["loss"], e["grad_norm"], e["grad"], e["adamw_param"]) <= TOL, (name, e)
    assert got["dp2"]["tensors_per_rank"] == [got["dp2"]["tensors"]] * 2
    zero = got["dp2_optimizer"]
    assert sum(zero["tensors_per_rank"]) == zero["tensors"] and min(zero["tensors_per_rank"]) > 0
