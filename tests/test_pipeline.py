"""Pipeline parallelism (parallel/pipeline.py): the stage split, and PP layouts on 4 gloo ranks
(PP4 1F1B and Interleaved1F1B x2, PP2 x DP2 with 1F1B, ZBVZeroBubble and DualPipeV) that
reproduce one process over 3 optimizer steps: losses, gradient norms, gradients, parameters,
QB biases (statistics pooled per stage) and QK-Clip (max logits reduced per stage). Collectives
run under a 120 s process-group timeout, so a stage waiting on a peer fails instead of hanging."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny
from model.k3 import K3Model
from parallel.data_parallel import allreduce_gradients, fill_missing_gradients
from parallel.pipeline import (
    PipelineStep,
    clip_pipeline_grads_,
    crossing_blocks,
    split_layers,
    stage_ids,
    step_loss,
)
from parallel.topology import Topology
from tests.tolerances import rel_rms
from train.config import ParallelConfig, PrecisionConfig
from train.distributed import all_reduce_sum
from train.flops import head_forward_flops_per_token, layer_forward_flops_per_token
from train.precision.plan import PrecisionPlan

SEQ, STEPS, TOL, TAU = 32, 3, 1e-5, 2.0


def test_split_balances_cost_and_keeps_every_stage_non_empty():
    assert split_layers([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    # an expensive layer stands alone; the head's cost pushes layers off the last stage
    assert split_layers([1, 1, 6, 1, 1], 3) == [range(0, 2), range(2, 3), range(3, 5)]
    assert split_layers([1, 1, 1, 1], 2, head_cost=2) == [range(0, 3), range(3, 4)]
    assert split_layers([5, 1, 1, 1], 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="5 pipeline stages"):
        split_layers([1] * 4, 5)
    cfg = k3_tiny()  # layer 0 dense, MoE after; MLA every 4th: the split follows the FLOPs
    costs = layer_forward_flops_per_token(cfg, SEQ)
    assert costs[0] < costs[1] and costs[3] != costs[1]
    splits = split_layers(costs, 2, head_forward_flops_per_token(cfg))
    assert [len(s) for s in splits] == [5, 3]


def test_stage_placement_and_crossing_blocks():
    assert [stage_ids(r, 4, 1, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]
    assert stage_ids(1, 4, 2, "Interleaved1F1B") == [1, 5]
    assert [stage_ids(r, 2, 2, "ZBVZeroBubble") for r in range(2)] == [[0, 3], [1, 2]]
    # block size 4: layer 0 pushes the embedding, layers 4 and 8 push blocks 1 and 2
    assert [crossing_blocks(i, 4) for i in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def _micro_batches(n: int, seed: int) -> list[K3Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(4, 2048, (1, SEQ), generator=g)
        labels = torch.randint(4, 2048, (1, SEQ), generator=g)
        labels[0, :int(torch.randint(0, 8, (), generator=g))] = -100  # uneven token counts
        first = int(torch.randint(4, SEQ - 4, (), generator=g))
        out.append(K3Batch(tokens, labels, cu_seqlens_from_lengths([[first, SEQ - first]], SEQ)))
    return out


def _optimizer(model):
    """SGD with momentum, whose update is linear in the gradient. The pipeline sums the AttnRes
    block gradients per stage and then across the boundary: a different order than one
    process, 3e-7 apart in the first step's gradients. AdamW divides every update by the
    gradient's own size and so amplifies that roundoff where gradients are near zero (as the
    data-parallel tests found, which hold AdamW's parameters to 1e-3)."""
    return torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)


def _reference_steps(model, batches_per_step):
    """One process: every micro-batch of the global batch, loss over the global token count."""
    precision = PrecisionPlan.build(PrecisionConfig(), torch.device("cpu"), model, TAU)
    opt = _optimizer(model)
    record = []
    for batches in batches_per_step:
        tokens = sum(mb.num_loss_tokens for mb in batches)
        loss = torch.zeros(())
        for mb in batches:
            step = model(mb).loss_sum / tokens
            step.backward()
            loss += step.detach()
        fill_missing_gradients(model)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        clip = precision.end_step(model, TAU, True)
        for moe in model.moe_layers():
            moe.balancer.update()
        opt.zero_grad(set_to_none=True)
        record.append((loss, norm, grads, clip))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: layer.mlp.balancer.bias.clone() for n, layer in model.layers.items()
              if layer.mlp in model.moe_layers()}
    return record, params, biases


def _check_layout(parallel: ParallelConfig, rank: int, reference, base: K3Model,
                  batches_per_step) -> dict[str, float]:
    """Runs the layout's steps; returns the worst relative errors against one process."""
    record, ref_params, ref_biases = reference
    t = Topology.from_config(parallel, 4, base.cfg).initialize("cpu")
    errors = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "grads_step0": 0.0, "params": 0.0,
              "qb_bias": 0.0}
    try:
        dp_group, pp_group = t.group("dp_cp"), t.group("pp")
        dp, dp_rank = t.dp, t.rank_in("dp")
        per_rank = len(batches_per_step[0]) // dp
        cfg = base.cfg
        runner = PipelineStep(copy.deepcopy(base), layer_forward_flops_per_token(cfg, SEQ),
                              head_forward_flops_per_token(cfg), pp_group, t.pipeline_schedule,
                              t.virtual_stages, per_rank, (1, SEQ), torch.device("cpu"))
        model = runner.model
        assert 0 < len(list(model.parameters())) < len(list(base.parameters()))
        precision = PrecisionPlan.build(PrecisionConfig(), torch.device("cpu"), model, TAU)
        for moe in model.moe_layers():  # QB statistics pooled over the ranks of this stage
            moe.balancer.reduce_fn = lambda x: all_reduce_sum(x, dp_group)
        opt = _optimizer(model)
        for step, batches in enumerate(batches_per_step):
            mine = batches[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            tokens = all_reduce_sum(torch.tensor(float(sum(mb.num_loss_tokens for mb in mine))),
                                    dp_group)
            loss = all_reduce_sum(step_loss(runner.step(mine, tokens), pp_group), dp_group)
            fill_missing_gradients(model)
            allreduce_gradients([p for p in model.parameters() if p.requires_grad], dp_group)
            norm = clip_pipeline_grads_(model.parameters(), 1.0, pp_group)
            ref_loss, ref_norm, ref_grads, ref_clip = record[step]
            named = dict(model.named_parameters())
            errors["loss"] = max(errors["loss"], rel_rms(ref_loss, loss))
            errors["grad_norm"] = max(errors["grad_norm"], rel_rms(ref_norm, norm))
            errors["grads"] = max(errors["grads"], rel_rms(
                torch.cat([ref_grads[n].flatten() for n in named]),
                torch.cat([p.grad.flatten() for p in named.values()])))
            # Every tensor on its own while the parameters are the same; later, tensors that sum
            # many cancelling terms (KDA a_log: 2 numbers) carry the parameters' roundoff
            # (2e-5 at step 3), so the whole gradient and the final parameters are compared.
            if step == 0:
                errors["grads_step0"] = max(rel_rms(ref_grads[n], p.grad)
                                            for n, p in named.items())
            opt.step()
            clip = precision.end_step(model, TAU, True, group=dp_group)
            if model.mla_layers():  # this stage's max logit: at most the whole model's
                assert clip["attn/max_logit"] <= ref_clip["attn/max_logit"] * (1 + TOL)
            for moe in model.moe_layers():
                moe.balancer.update()
            opt.zero_grad(set_to_none=True)
        errors["params"] = max(rel_rms(ref_params[n], p) for n, p in model.named_parameters())
        errors["qb_bias"] = max(rel_rms(ref_biases[n], layer.mlp.balancer.bias)
                                for n, layer in model.layers.items()
                                if layer.mlp in model.moe_layers())
        return errors
    finally:
        t.destroy()


LAYOUTS = [
    ParallelConfig(pipeline=4),
    ParallelConfig(pipeline=4, pipeline_schedule="Interleaved1F1B", virtual_stages=2),
    ParallelConfig(pipeline=2, data=2),
    ParallelConfig(pipeline=2, data=2, pipeline_schedule="ZBVZeroBubble", virtual_stages=2),
    ParallelConfig(pipeline=2, data=2, pipeline_schedule="DualPipeV", virtual_stages=2),
]


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A collective that never completes raises after 120 s instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        base = K3Model(k3_tiny())
        batches_per_step = [_micro_batches(8, seed=step) for step in range(STEPS)]
        reference = _reference_steps(copy.deepcopy(base), batches_per_step)
        errors = {_name(p): _check_layout(p, rank, reference, base, batches_per_step)
                  for p in LAYOUTS}
        torch.save(errors, f"{out_dir}/errors{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _name(p: ParallelConfig) -> str:
    return f"pp{p.pipeline}_dp{max(p.data, 1)}_{p.pipeline_schedule}_v{p.virtual_stages}"


@pytest.mark.timeout(900)
def test_pipeline_layouts_match_one_process(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=4, join=True)
    ranks = [torch.load(tmp_path / f"errors{r}.pt") for r in range(4)]
    worst = {layout: {k: max(r[layout][k] for r in ranks) for k in ranks[0][layout]}
             for layout in ranks[0]}
    print(worst)
    bad = {layout: e for layout, e in worst.items() if max(e.values()) > TOL}
    assert not bad, f"beyond {TOL}: {bad}\nall: {worst}"
