"""Pipeline parallelism (parallel/pipeline.py): the stage split, and PP layouts on 4 gloo ranks
(PP4 1F1B and Interleaved1F1B x2, PP2 x DP2 with 1F1B, ZBVZeroBubble and DualPipeV, PP2 x TP2
with and without sequence parallelism) that reproduce one process over 3 optimizer steps of the
training loop's own `train_step` on the layout's `ParallelPlan` (parallel/apply.py): losses,
gradient norms, gradients, parameters, QB biases (statistics pooled per stage) and QK-Clip (each
MLA layer's per-head max logits as the stage's ranks reduce them, the heads clipped, the weights
after clipping and the stage's logged max logit, every step, equal to the same layer's in one
process), then the validation loss through the stages' forward-only walk, all in float64 within
1e-9; and one step of PP2 x DP2 under bf16 autocast (loss, gradient norm and
validation loss).
The one-process references are computed once in the test process and read by every rank.
Collectives run under a 120 s process-group timeout, so a stage waiting on a peer fails instead
of hanging."""

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
from parallel.apply import parallelize, shard_stages
from parallel.data_parallel import fill_missing_gradients
from parallel.pipeline import crossing_blocks, split_layers, stage_ids
from parallel.topology import Topology
from tests.helpers.parallel_harness import full
from tests.helpers.tolerances import rel_rms
from train.config import ParallelConfig, PrecisionConfig, TrainConfig
from train.flops import head_forward_flops_per_token, layer_forward_flops_per_token
from train.loop import train_step
from train.optim.qk_clip import QKClip
from train.precision.recipe import PrecisionRecipe

SEQ, STEPS, TOL = 32, 3, 1e-9
# float64 (precision=fp64): the stages sum the AttnRes block gradients per stage and then across
# the boundary, tensor parallelism in its own partial sums; in fp32 that order alone put PP2 x TP2
# 1.06e-5 from one process after 3 steps even with SGD (TP2 x DP2 without the pipeline too), and
# AdamW amplifies it. In float64 the order costs ~1e-12 (measured worst over the 7 layouts:
# gradients 3.6e-12 and parameters 2.6e-12 under PP2 x TP2, the per-head max logits 1.4e-13, the
# clipped q_b/kv_b weights 2.7e-13, losses 3.5e-16, QB biases equal), so 1e-9 measures the layout.
# QK-Clip's tau: k3_tiny's max logits on these batches are 0.038-0.060, so 0.047 clips some heads
# and not others (the one-process run clips 1, 4 and 3 of the 4 heads in its 3 steps; no head
# within 0.9% of tau): the layouts must reduce the same max logits and clip the same heads.
TAU = 0.047
FP64 = PrecisionConfig(name="fp64")
# bf16 autocast, one step of PP2 x DP2: the stage outputs cross in bf16, and FSDP2 gathers the
# layers' parameters in bf16 where one process casts its fp32 ones at each operator (its norms
# and gates compute with fp32 weights). The summed figures (loss, gradient norm, validation
# loss) are held to 5e-3, under bf16's 7.8e-3 epsilon (measured: loss 2.1e-5, gradient norm
# 5.5e-4, validation loss 1.9e-4; with DDP's fp32 parameters 1.6e-5, 9.9e-4 and 4.7e-5; QK-Clip
# at TAU clipping in that step); single tensors are not: bf16 rounding flips routing choices and
# the signs of AdamW's tiny first updates (one process in bf16 is 45% from itself in fp32 in its
# worst gradient tensor and 43% in its worst parameter; PP2 x DDP2 is 18% and 35% from it).
BF16, BF16_TOL = PrecisionConfig(name="bf16"), 5e-3
# FSDP2: the decoder layers gathered in bf16, the routers and the stage roots in fp32
# (parallel.fsdp_param_dtype=compute), gradients accumulated over the micro-batches in fp32.
BF16_LAYOUT = ParallelConfig(pipeline=2, data=2, data_shard="full")
BF16_CHECKED = ("loss", "grad_norm", "val_loss_sum")


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
    """AdamW, as k3-train's AdamW groups use it: each element's update divided by its own
    gradient size, which in float64 still leaves a different order of sums at ~1e-13."""
    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def _mla_layers(model) -> list[tuple[str, torch.nn.Module]]:
    """(layer name, GatedMLA) of the model's (this stage's) MLA layers."""
    return [(n, layer.attn) for n, layer in model.layers.items()
            if layer.attn in model.mla_layers()]


def _reference_steps(model, batches_per_step, precision_cfg=FP64):
    """One process: every micro-batch of the global batch, loss over the global token count."""
    precision = PrecisionRecipe.build(precision_cfg, torch.device("cpu"), model)
    opt = _optimizer(model)
    qk_clip = QKClip(model, TAU).register([opt])  # clips in opt.step()
    record = []
    for batches in batches_per_step:
        tokens = sum(mb.num_loss_tokens for mb in batches)
        loss = torch.zeros((), dtype=torch.float64)
        for mb in batches:
            with precision.autocast():
                step = model(mb).loss_sum / tokens
            step.backward()
            loss += step.detach()
        fill_missing_gradients(model)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # before clipping
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        logits = {n: mla.max_logit.clone() for n, mla in _mla_layers(model)}  # per head
        opt.step()
        clip = qk_clip.end_step()
        for moe in model.moe_layers():
            moe.balancer.update()
        opt.zero_grad(set_to_none=True)
        clipped = {n: (mla.q_b.weight.detach().clone(), mla.kv_b.weight.detach().clone())
                   for n, mla in _mla_layers(model)}  # the weights QK-Clip scaled
        record.append((loss, norm, grads, clip, logits, clipped))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    biases = {n: layer.mlp.balancer.bias.clone() for n, layer in model.layers.items()
              if layer.mlp in model.moe_layers()}
    model.eval()
    with torch.no_grad(), precision.autocast():
        val = sum(model(mb).loss_sum for mb in batches_per_step[0])
    return record, params, biases, val


def _train_config(parallel: ParallelConfig, micro_batches: int,
                  precision: PrecisionConfig) -> TrainConfig:
    """What parallelize reads: the layout, the stage's batch shape, the clipping and tau."""
    cfg = TrainConfig(parallel=parallel, device="cpu")
    cfg.model = k3_tiny()
    cfg.stage.seq_len, cfg.stage.micro_batch_size = SEQ, 1
    cfg.stage.global_batch_size = micro_batches
    cfg.optim.clip_grad_norm, cfg.optim.qk_clip_tau = 1.0, TAU
    cfg.precision = precision
    return cfg


def _check_layout(parallel: ParallelConfig, reference, base: K3Model,
                  batches_per_step, precision_cfg=FP64) -> dict[str, float]:
    """Runs the layout's steps; returns the worst relative errors against one process."""
    record, ref_params, ref_biases, ref_val = reference
    cfg = _train_config(parallel, len(batches_per_step[0]), precision_cfg)
    t = Topology.from_config(parallel, 4, base.cfg).initialize("cpu")
    errors = {"loss": 0.0, "grad_norm": 0.0, "grads": 0.0, "params": 0.0,
              "qb_bias": 0.0, "val_loss_sum": 0.0, "max_logit": 0.0, "clipped_heads": 0.0,
              "clipped_weights": 0.0}
    try:
        dp, dp_rank = t.dp, t.rank_in("dp")
        per_rank = len(batches_per_step[0]) // dp
        model = copy.deepcopy(base)
        shard_stages(model, t, cfg)  # what build_parallel_model does, with the test's optimizer
        assert 0 < len(list(model.parameters())) < len(list(base.parameters()))
        precision = PrecisionRecipe.build(cfg.precision, torch.device("cpu"), model)
        plan = parallelize(model, t, cfg, activation_dtype=precision.dtype)
        assert plan.pipeline is not None and plan.pipeline.model is model
        for moe in model.moe_layers():  # QB statistics pooled over the ranks of this stage
            moe.balancer.reduce_fn = plan.sum_balancer_counts
        opt = _optimizer(model)
        named = dict(model.named_parameters())
        grads: dict[str, torch.Tensor] = {}  # reduced, before clipping
        mla_names = {id(mla): n for n, mla in _mla_layers(model)}
        layout_clip = plan.qk_clip_
        clips: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

        def recording_clip(mla, tau, factors):
            """The layout's QK-Clip, recording what it clipped by: the max logits it reduced
            (in place, this rank's heads), their max and the clipped-head count it returns."""
            top, count = layout_clip(mla, tau, factors)
            clips[mla_names[id(mla)]] = (mla.max_logit.clone(), top.clone(), count.clone())
            return top, count

        plan.qk_clip_ = recording_clip  # what QKClip calls in opt.step()
        QKClip(model, TAU, plan).register([opt])
        tp, tp_rank = t.tp, t.rank_in("tp")

        def keep_grads(m):
            grads.update({n: full(p.grad) for n, p in m.named_parameters()})

        for step, batches in enumerate(batches_per_step):
            mine = batches[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            clips.clear()
            result = train_step(model, [opt], mine, torch.device("cpu"), precision, plan,
                                cfg.optim, on_gradients=keep_grads)
            ref_loss, ref_norm, ref_grads, ref_clip, ref_logits, ref_clipped = record[step]
            errors["loss"] = max(errors["loss"], rel_rms(ref_loss, result.loss))
            errors["grad_norm"] = max(errors["grad_norm"], rel_rms(ref_norm, result.grad_norm))
            errors["grads"] = max(errors["grads"],
                                  max(rel_rms(ref_grads[n], grads[n]) for n in named))
            # QK-Clip of this stage's MLA layers, each against the same layer in one process:
            # the max logit of every head this rank holds (reduced over the data-parallel
            # ranks), the heads clipped, the weights after clipping; and the stage's logged max
            # logit is the max over those heads (one process logs the max over all layers).
            assert clips.keys() == {n for n, _ in _mla_layers(model)}, sorted(clips)
            held_tops = []
            for name, mla in _mla_layers(model):
                logits, top, count = clips[name]
                heads = ref_logits[name].numel() // tp  # tensor parallel: consecutive heads
                ref_heads = ref_logits[name][tp_rank * heads:(tp_rank + 1) * heads]
                errors["max_logit"] = max(errors["max_logit"], rel_rms(ref_heads, logits),
                                          rel_rms(ref_heads.max(), top))
                errors["clipped_heads"] += abs(int(count) - int((ref_heads > TAU).sum()))
                for ref_w, w in zip(ref_clipped[name], (mla.q_b.weight, mla.kv_b.weight)):
                    errors["clipped_weights"] = max(errors["clipped_weights"],
                                                    rel_rms(ref_w, full(w)))
                held_tops.append(ref_heads.max())
            if held_tops:
                errors["max_logit"] = max(errors["max_logit"],
                                          rel_rms(torch.stack(held_tops).max(),
                                                  result.clip_row["attn/max_logit"].double()))
            else:
                assert "attn/max_logit" not in result.clip_row
        errors["params"] = max(rel_rms(ref_params[n], full(p)) for n, p in named.items())
        errors["qb_bias"] = max(rel_rms(ref_biases[n], layer.mlp.balancer.bias)
                                for n, layer in model.layers.items()
                                if layer.mlp in model.moe_layers())
        model.eval()
        with plan.loss_context(), precision.autocast():
            val = plan.sum_loss_tokens(plan.eval_loss_sums(model, batches_per_step[0][
                dp_rank * per_rank:(dp_rank + 1) * per_rank]))
        errors["val_loss_sum"] = rel_rms(ref_val.double(), val[0])
        return errors
    finally:
        t.destroy()


LAYOUTS = [
    ParallelConfig(pipeline=4),
    ParallelConfig(pipeline=4, pipeline_schedule="Interleaved1F1B", virtual_stages=2),
    ParallelConfig(pipeline=2, data=2),
    ParallelConfig(pipeline=2, data=2, pipeline_schedule="ZBVZeroBubble", virtual_stages=2),
    ParallelConfig(pipeline=2, data=2, pipeline_schedule="DualPipeV", virtual_stages=2),
    ParallelConfig(pipeline=2, tensor=2),  # sequence parallel: boundaries hold T/2 tokens
    ParallelConfig(pipeline=2, tensor=2, sequence_parallel=False),
]


def _base_and_batches() -> tuple[K3Model, list[list[K3Batch]]]:
    """The model every run starts from and the micro-batches of each step."""
    torch.manual_seed(0)
    base = K3Model(k3_tiny())
    return base, [_micro_batches(8, seed=step) for step in range(STEPS)]


def _worker(rank: int, init_file: str, out_dir: str, references: str) -> None:
    torch.set_num_threads(1)
    # A collective that never completes raises after 120 s instead of hanging the test.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=120))
    try:
        base, batches_per_step = _base_and_batches()
        refs = torch.load(references, weights_only=False)
        errors = {_name(p): _check_layout(p, refs["fp64"], base, batches_per_step)
                  for p in LAYOUTS}
        bf16 = _check_layout(BF16_LAYOUT, refs["bf16"], base, batches_per_step[:1], BF16)
        errors["bf16_" + _name(BF16_LAYOUT)] = {k: bf16[k] for k in BF16_CHECKED}
        torch.save(errors, f"{out_dir}/errors{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _name(p: ParallelConfig) -> str:
    tp = f"_tp{p.tensor}{'_sp' if p.sequence_parallel else ''}" if p.tensor > 1 else ""
    return f"pp{p.pipeline}_dp{max(p.data, 1)}{tp}_{p.pipeline_schedule}_v{p.virtual_stages}"


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> str:
    """The one-process runs, computed once here (not on every rank): all steps in float64 and
    the first step under bf16 autocast."""
    base, batches_per_step = _base_and_batches()
    path = tmp_path_factory.mktemp("pipeline_refs") / "refs.pt"
    fp64 = _reference_steps(copy.deepcopy(base), batches_per_step)
    # QK-Clip really selects: some heads clipped, some left alone (see TAU).
    clipped = [int((logits > TAU).sum()) for step in fp64[0] for logits in step[4].values()]
    heads = sum(logits.numel() for step in fp64[0] for logits in step[4].values())
    assert 0 < sum(clipped) < heads, clipped
    torch.save({"fp64": fp64,
                "bf16": _reference_steps(copy.deepcopy(base), batches_per_step[:1], BF16)}, path)
    return str(path)


@pytest.mark.timeout(900)
def test_pipeline_layouts_match_one_process(tmp_path, references):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), references), nprocs=4,
             join=True)
    ranks = [torch.load(tmp_path / f"errors{r}.pt") for r in range(4)]
    worst = {layout: {k: torch.tensor([r[layout][k] for r in ranks]).max().item()  # keeps NaN
                      for k in ranks[0][layout]}
             for layout in ranks[0]}
    print(worst)
    bad = {layout: e for layout, e in worst.items()  # `not <=`: a NaN is beyond too
           if not all(v <= (BF16_TOL if layout.startswith("bf16") else TOL) for v in e.values())}
    assert not bad, f"beyond {TOL} (bf16: {BF16_TOL}): {bad}\nall: {worst}"
