"""Expert parallelism on k3_tiny: 3 AdamW steps on gloo ranks equal one process on the same
global batch (losses, every expert's gradient, home + copied contributions, Quantile Balancing
biases, parameters), with MoonEP and with the dynamic baseline, plain and MXFP4 QAT (SPEC 10),
in float64 within 1e-9. Composed with FSDP2 and tensor parallelism through the training loop's
own builder and step (`check_composed_layouts`). float64 experts run the per-expert loop (CPU
F.grouped_mm takes bf16/fp16/fp32 only), so one EP4 step in fp32 checks the grouped GEMM path
against the float64 one process (`check_grouped_gemm_layout`). The one-process references
(plain, MXFP4 QAT, the training loop's) are computed once in the test process and read by every
rank and layout."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from model.batch import K3Batch
from model.config import k3_tiny
from model.k3 import K3Model
from model.moe import update_balancers
from parallel.data_parallel import fill_missing_gradients
from parallel.expert_parallel import (
    ExpertShardedState,
    allreduce_expert_parallel_gradients,
    apply_expert_parallel,
    is_expert_parameter,
)
from parallel.topology import Topology
from tests.helpers.moonep_helpers import run_world
from tests.helpers.parallel_harness import GLOBAL_ROWS, full, global_batch, tiny_config
from tests.helpers.parallel_harness import layout as with_layout
from tests.helpers.tolerances import assert_close_rms, rel_rms
from train.checkpoint import Checkpointer
from train.optim.factory import set_lr
from train.schedule import lr_at

STEPS, ROWS, SEQ = 3, 4, 32  # global batch: 4 rows of 32 tokens per step
# float64 layouts against one process: they differ only in the order of their sums. Measured
# worst (every rank, printed with pytest -s): losses 2.3e-16, expert gradients 1.3e-13 (EP2),
# the composed layouts' gradients 5.1e-13 (EP2 x TP2), parameters 1.8e-13, QB biases equal.
TOL = 1e-9
# The fp32 case (`check_grouped_gemm_layout`) against the float64 one process, first step only.
# Measured: loss 1.3e-8, worst expert gradient 1.7e-6 to 2.3e-6 over runs (one process in
# fp32, through the same grouped GEMM, is itself 1.3e-8 and 1.8e-6 from float64); bounds 8x
# and 4x those. After the
# first step AdamW's sign-like update and Quantile Balancing's discrete bias step turn fp32
# round-off into O(10%) differences (one process in fp32: QB bias 0.43 after step 1, gradients
# 0.34 at step 2), which no layout could match.
FP32_LOSS_TOL, FP32_GRAD_TOL = 1e-7, 1e-5
WORST: dict[str, float] = {}  # this rank's worst relative error per check, printed at the end


def check_close(ref: torch.Tensor, x: torch.Tensor, tol: float, what: str, kind: str) -> None:
    """assert_close_rms, keeping the worst error of each kind of check."""
    WORST[kind] = max(WORST.get(kind, 0.0), rel_rms(ref, x))
    assert_close_rms(ref, x, tol, what)


def global_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(1, 2048, (ROWS, SEQ + 1), generator=gen) for _ in range(STEPS)]


def batch_of(rows: torch.Tensor) -> K3Batch:
    cu = torch.arange(rows.shape[0] + 1) * SEQ
    return K3Batch(rows[:, :-1].contiguous(), rows[:, 1:].contiguous(), cu)


def build(qat: bool, fp32: bool = False) -> K3Model:
    """k3_tiny in float64: AdamW's first steps are sign-like, so in fp32 the gradient components
    below the round-off of a differently ordered sum flip their update and the comparison
    measures noise; in float64 it measures the layout. (`fp32`: the same model in fp32.)"""
    torch.manual_seed(0)
    model = K3Model(k3_tiny())
    if not fp32:
        model = model.double()
    if qat:
        from train.precision.qat import apply_mx_qat

        apply_mx_qat(model)
    return model


def adamw(model: K3Model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def train(model: K3Model, rows_of_step, reduce_grads, reduce_stats, opt=None) -> list[dict]:
    """AdamW steps as k3-train's defaults take them (optim/adamw.yaml: peak lr 3e-3, linear
    warmup over 10 steps, betas 0.9/0.95, decay 0.1); per step the loss, each MoE layer's
    expert gradients and biases."""
    opt = opt or adamw(model)
    balancers = [m.balancer for m in model.moe_layers()]
    records = []
    for step, rows in enumerate(rows_of_step):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * (step + 1) / 10
        out = model(batch_of(rows))
        loss = out.loss_sum / (ROWS * SEQ)
        loss.backward()
        fill_missing_gradients(model)
        reduce_grads(model)
        opt.step()
        update_balancers(balancers, reduce_stats)
        records.append({
            "loss": reduce_stats(loss.detach().clone()),
            "grads": [(m.experts.w1.grad.clone(), m.experts.w2.grad.clone())
                      for m in model.moe_layers()],
            "bias": [b.bias.clone() for b in balancers]})
        opt.zero_grad(set_to_none=True)
    return records


def _sum_over(group):
    def reduce(t):
        dist.all_reduce(t, group=group)
        return t
    return reduce


def one_process(qat: bool) -> dict:
    """The reference of `check_layout`: every row of each global batch in one process; the
    per-step records and every parameter after the last step."""
    model = build(qat)
    records = train(model, global_batches(), lambda m: None, lambda t: t)
    return {"records": records,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def check_layout(name, ep_group, dp_group, edp_group, dp_ranks, dispatch, qat, reference):
    """One layout against `reference` (`one_process(qat)`): this rank's rows are its position
    among dp_ranks (each a distinct slice)."""
    rank = dist.get_rank()
    position, width = dp_ranks.index(rank), len(dp_ranks)
    rows_per_rank = ROWS // width
    batches = global_batches()
    ref, ref_params = reference["records"], reference["params"]
    model = build(qat)
    apply_expert_parallel(model, ep_group, dispatch)
    mine = [b[position * rows_per_rank:(position + 1) * rows_per_rank] for b in batches]
    got = train(model, mine,
                lambda m: allreduce_expert_parallel_gradients(m, dp_group, edp_group),
                _sum_over(dp_group))
    per_rank = k3_tiny().moe.num_experts // dist.get_world_size(ep_group)
    ep_rank = dist.get_rank(ep_group)
    home = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    tol = TOL
    # MXFP4 QAT is discontinuous (a weight at an FP4 code boundary takes the other code after
    # the slightest change), so it needs float64 to stay float64 everywhere: the MX quantiser
    # and the model's fp32-or-wider parts do (model/dtypes.py); an fp32 cast anywhere turned a
    # different summation order's 1e-16 into 1e-7 noise and code flips (9e-5 at step 3).
    for step, (r, g) in enumerate(zip(ref, got)):
        what = f"{name}, step {step + 1}"
        check_close(r["loss"], g["loss"], tol, f"loss ({what})", f"{name} loss")
        for layer, (rg, gg) in enumerate(zip(r["grads"], g["grads"], strict=True)):
            for w_ref, w in zip(rg, gg, strict=True):
                check_close(w_ref[home], w, tol, f"expert grad layer {layer} ({what})",
                            f"{name} expert grad")
        for rb, gb in zip(r["bias"], g["bias"], strict=True):
            check_close(rb, gb, tol, f"QB bias ({what})", f"{name} QB bias")
    assert len(got) == len(ref) == STEPS
    for pname, p in model.named_parameters():
        expected = ref_params[pname]
        if p.shape != expected.shape:  # sharded experts: this rank's home slice
            expected = expected[home]
        check_close(expected, p, tol, f"{pname} after {STEPS} steps ({name})", f"{name} params")


def check_grouped_gemm_layout(name, ep_group, dp_group, edp_group, dp_ranks, reference
                              ) -> None:
    """EP4 (MoonEP) in fp32, whose experts take F.grouped_mm (float64 takes the per-expert loop:
    model/moe/experts.py runs grouped_mm on CPU for bf16/fp16/fp32 only): the first step's loss
    and every home expert's gradient against the float64 one process (`reference`), within the
    fp32 bounds above; and every MoE layer's two expert GEMMs of the forward really were
    F.grouped_mm calls, with no per-expert loop."""
    from model.moe import experts as experts_module

    rank = dist.get_rank()
    position, width = dp_ranks.index(rank), len(dp_ranks)
    rows_per_rank = ROWS // width
    model = build(False, fp32=True)
    apply_expert_parallel(model, ep_group, "moonep")
    first = global_batches()[0][position * rows_per_rank:(position + 1) * rows_per_rank]
    calls = {"grouped_mm": 0, "loop": 0}
    grouped_mm, loop = F.grouped_mm, experts_module.GroupedExperts._forward_loop

    def counting_grouped_mm(*args, **kwargs):
        calls["grouped_mm"] += 1
        return grouped_mm(*args, **kwargs)

    def counting_loop(self, *args, **kwargs):
        calls["loop"] += 1
        return loop(self, *args, **kwargs)

    F.grouped_mm = counting_grouped_mm  # experts.py looks F.grouped_mm up at every call
    experts_module.GroupedExperts._forward_loop = counting_loop
    try:
        got = train(model, [first],
                    lambda m: allreduce_expert_parallel_gradients(m, dp_group, edp_group),
                    _sum_over(dp_group))
    finally:
        F.grouped_mm, experts_module.GroupedExperts._forward_loop = grouped_mm, loop
    assert calls == {"grouped_mm": 2 * len(model.moe_layers()), "loop": 0}, calls
    per_rank = k3_tiny().moe.num_experts // dist.get_world_size(ep_group)
    home = slice(dist.get_rank(ep_group) * per_rank, (dist.get_rank(ep_group) + 1) * per_rank)
    r, g = reference["records"][0], got[0]
    check_close(r["loss"], g["loss"], FP32_LOSS_TOL, f"loss ({name})", f"{name} loss")
    for layer, (rg, gg) in enumerate(zip(r["grads"], g["grads"], strict=True)):
        for w_ref, w in zip(rg, gg, strict=True):
            assert w.dtype == torch.float32
            check_close(w_ref[home], w, FP32_GRAD_TOL, f"expert grad layer {layer} ({name})",
                        f"{name} expert grad")


def logical(t: torch.Tensor, sharded: bool, ep_group) -> torch.Tensor:
    """The full [E, ...] tensor of a sharded expert tensor (EP ranks' shards in rank order)."""
    if not sharded:
        return t.detach()
    out = t.new_empty(t.shape[0] * dist.get_world_size(ep_group), *t.shape[1:])
    dist.all_gather_into_tensor(out, t.detach().contiguous(), group=ep_group)
    return out


def _only(mesh):
    """ExpertShardedState's `mesh_of` that has this one mesh (by its dimension names)."""
    return lambda *dims: {mesh.mesh_dim_names: mesh}[dims]


def check_checkpoint_reshards(root: str, pair, stride, everyone) -> None:
    """Saved under EP2 x DP2 after one step; loaded into EP4 and into whole (unsharded) models:
    every parameter and AdamW moment bit-equal to the saved logical tensors."""
    rank = dist.get_rank()
    batches = global_batches()[:1]
    model = build(False)
    apply_expert_parallel(model, pair)
    opt = adamw(model)
    train(model, [b[rank:rank + 1] for b in batches],
          lambda m: allreduce_expert_parallel_gradients(m, everyone, stride),
          _sum_over(everyone), opt)
    mesh_2x2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    saver = Checkpointer(root, 1, rank, 4,
                         sharded=ExpertShardedState(model, _only(mesh_2x2), ep=2))
    path = saver.save(1, model, [opt], {})
    saved = {}
    for name, p in model.named_parameters():
        shard = is_expert_parameter(p)
        saved[name] = [logical(t, shard, pair)
                       for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]
    mesh_1x4 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("edp", "ep"))
    for layout, mesh in (("EP4", mesh_1x4), ("whole", None)):
        loaded = build(False)
        if mesh is not None:
            apply_expert_parallel(loaded, everyone)
        loaded_opt = adamw(loaded)
        sharded = None if mesh is None else ExpertShardedState(loaded, _only(mesh), ep=4)
        assert Checkpointer(root, 1, rank, 4, sharded).load(path, loaded, [loaded_opt],
                                                            lambda s: None) == 1
        for name, p in loaded.named_parameters():
            got = (p, loaded_opt.state[p]["exp_avg"], loaded_opt.state[p]["exp_avg_sq"])
            for what, expected, value in zip(("weight", "exp_avg", "exp_avg_sq"), saved[name],
                                             got):
                value = logical(value, mesh is not None and is_expert_parameter(p), everyone)
                assert torch.equal(expected, value), (layout, name, what)


# Expert parallelism composed with sharded data and tensor parallelism (world 4). Megatron's rank
# order puts the EP2 groups on consecutive ranks: under TP2 they are the tensor-parallel pairs.
COMPOSED = {"EP2 x FSDP2": dict(data=4, expert=2, data_shard="full"),
            "EP2 x TP2 +SP": dict(tensor=2, expert=2, sequence_parallel=True),
            "EP2 x TP2": dict(tensor=2, expert=2, sequence_parallel=False)}


def _logical(param: torch.Tensor, value: torch.Tensor, topology) -> torch.Tensor:
    """`value` (the parameter or its gradient) as the full logical tensor."""
    whole = full(value)  # DTensors (TP, FSDP2) gathered over their meshes
    if topology is None or not is_expert_parameter(param):
        return whole
    return logical(whole, True, topology.group("ep"))


def run_loop(cfg, topology) -> dict:
    """STEPS of k3-train's own step (build_parallel_model, train_step: clipping, QB, AdamW at
    the default schedule's warmup lr) on this rank's data-parallel share of the harness's global
    batches: per step the loss, every gradient (before clipping) and the QB biases; every
    parameter after the last."""
    from train.loop import build_parallel_model, train_step

    cpu = torch.device("cpu")
    torch.manual_seed(cfg.seed)
    model, precision, parallel, optimizers = build_parallel_model(cfg, topology, cpu)
    dp, dp_rank = (1, 0) if topology is None else (topology.dp, topology.rank_in("dp"))
    rows = GLOBAL_ROWS // dp
    record = {"loss": [], "grads": [], "bias": []}
    o = cfg.optim
    for step in range(STEPS):
        set_lr(optimizers, lr_at(step, peak_lr=o.lr, total_steps=cfg.steps,
                                 warmup_steps=o.warmup_steps, schedule=o.schedule,
                                 min_lr_ratio=o.min_lr_ratio))
        batch = global_batch(step, dp_rank * rows, rows)
        result = train_step(model, optimizers, [batch], cpu, precision, parallel, cfg.optim,
                            on_gradients=lambda m: record["grads"].append(
                                {n: _logical(p, p.grad, topology)
                                 for n, p in m.named_parameters()}))
        assert result.finite
        record["loss"].append(result.loss.detach().clone())
        record["bias"].append([moe.balancer.bias.clone() for moe in model.moe_layers()])
    record["params"] = {n: _logical(p, p, topology) for n, p in model.named_parameters()}
    return record


@contextlib.contextmanager
def _float64_default():
    """The composed layouts' runs build their models in float64 (see `build`)."""
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


def composed_one_process() -> dict:
    """The reference of `check_composed_layouts`: `run_loop` in one process, in float64."""
    with _float64_default():
        return run_loop(tiny_config("adamw"), None)


def check_composed_layouts(world: int, ref: dict) -> None:
    """Each layout of COMPOSED against one process (`ref`: `composed_one_process()`) in float64
    (see `build`) within TOL: the loss, the QB biases and every gradient of each of 3 AdamW
    steps, every parameter after the last."""
    with _float64_default():
        for name, parallel in COMPOSED.items():
            cfg = with_layout(tiny_config("adamw"), **parallel)
            topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
            got = run_loop(cfg, topology)
            topology.destroy()
            for step in range(STEPS):
                what = f"{name}, step {step + 1}"
                check_close(ref["loss"][step], got["loss"][step], TOL, f"loss ({what})",
                            f"{name} loss")
                assert ref["grads"][step].keys() == got["grads"][step].keys()
                for pname, expected in ref["grads"][step].items():
                    check_close(expected, got["grads"][step][pname], TOL,
                                f"{pname} grad ({what})", f"{name} grad")
                for layer, (rb, gb) in enumerate(zip(ref["bias"][step], got["bias"][step],
                                                     strict=True)):
                    check_close(rb, gb, TOL, f"QB bias layer {layer} ({what})",
                                f"{name} QB bias")
            assert len(got["loss"]) == len(ref["loss"]) == STEPS
            assert ref["params"].keys() == got["params"].keys()
            for pname, expected in ref["params"].items():
                check_close(expected, got["params"][pname], TOL,
                            f"{pname} after {STEPS} steps ({name})", f"{name} params")


def check_fsdp_checkpoint_round_trip(root: str, world: int) -> None:
    """EP2 x FSDP2 saved after one step of k3-train's step loads into a fresh EP2 x FSDP2 model
    built from another seed: every parameter and AdamW moment bit-equal as logical tensors.
    (k3-train's test resumes such a checkpoint in one process.)"""
    from train.loop import build_parallel_model, train_step

    cpu = torch.device("cpu")
    cfg = with_layout(tiny_config("adamw"), **COMPOSED["EP2 x FSDP2"])
    topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
    rank = topology.rank_in("dp")

    def state(model, optimizers):
        opt_state = {p: s for opt in optimizers for p, s in opt.state.items()}
        return {n: [_logical(p, t, topology) for t in (p, opt_state[p]["exp_avg"],
                                                         opt_state[p]["exp_avg_sq"])]
                for n, p in model.named_parameters()}

    torch.manual_seed(0)
    model, precision, parallel, optimizers = build_parallel_model(cfg, topology, cpu)
    train_step(model, optimizers, [global_batch(0, rank, 1)], cpu, precision, parallel,
               cfg.optim)
    saver = Checkpointer(root, 1, dist.get_rank(), world, parallel.sharded_state)
    path = saver.save(1, model, optimizers, {})
    saved = state(model, optimizers)
    torch.manual_seed(1)
    loaded, _, loaded_plan, loaded_opts = build_parallel_model(cfg, topology, cpu)
    loader = Checkpointer(root, 1, dist.get_rank(), world, loaded_plan.sharded_state)
    assert loader.load(path, loaded, loaded_opts, lambda s: None) == 1
    for name, values in state(loaded, loaded_opts).items():
        for what, expected, value in zip(("weight", "exp_avg", "exp_avg_sq"), saved[name],
                                         values, strict=True):
            assert torch.equal(expected, value), ("EP2 x FSDP2", name, what)
    topology.destroy()


def _world_of_four(rank: int, world: int, root: str, references: str) -> None:
    assert world == 4
    refs = torch.load(references, weights_only=False)
    everyone = dist.group.WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    single = [dist.new_group([r]) for r in range(4)]
    pair, stride = pairs[rank // 2], strided[rank % 2]
    plain, qat = refs["plain"], refs["mxfp4_qat"]
    check_grouped_gemm_layout("EP4 fp32 grouped GEMM", everyone, everyone, single[rank],
                              [0, 1, 2, 3], plain)
    for dispatch in ("moonep", "dynamic"):
        check_layout(f"EP4 {dispatch}", everyone, everyone, single[rank], [0, 1, 2, 3],
                     dispatch, False, plain)
    # EP2 x DP2: EP inside consecutive pairs, expert-data-parallel across them.
    check_layout("EP2 x DP2", pair, everyone, stride, [0, 1, 2, 3], "moonep", False, plain)
    # EP2 alone, each pair its own 2-rank job, without and with MXFP4 QAT.
    pair_ranks = [2 * (rank // 2), 2 * (rank // 2) + 1]
    check_layout("EP2", pair, pair, single[rank], pair_ranks, "moonep", False, plain)
    check_layout("EP2 mxfp4_qat", pair, pair, single[rank], pair_ranks, "moonep", True, qat)
    check_layout("EP4 x mxfp4_qat", everyone, everyone, single[rank], [0, 1, 2, 3], "moonep",
                 True, qat)
    check_checkpoint_reshards(root, pair, stride, everyone)
    check_composed_layouts(world, refs["composed"])
    check_fsdp_checkpoint_round_trip(f"{root}/ep2_fsdp2", world)
    print(f"rank {rank} worst relative errors: "  # shown with pytest -s
          + "  ".join(f"{k} {v:.1e}" for k, v in WORST.items()), flush=True)


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> str:
    """The one-process references, computed once here (not on every rank for every layout)."""
    path = tmp_path_factory.mktemp("moonep_refs") / "refs.pt"
    torch.save({"plain": one_process(False), "mxfp4_qat": one_process(True),
                "composed": composed_one_process()}, path)
    return str(path)


@pytest.mark.timeout(600)
def test_expert_parallel_k3_tiny_matches_one_process(tmp_path, references):
    run_world(4, _world_of_four, str(tmp_path / "checkpoints"), references)
