"""Data parallelism with torch's own machinery (`parallel.data_shard`):

- none: FSDP2's `replicate` (DDP semantics: parameters replicated, gradients all-reduced per
  decoder layer while backward runs on).
- optimizer: ZeRO-1, K3's and Megatron's distributed optimizer: `replicate` for the gradients,
  optimizer state only for the parameters this rank owns (whole tensors, balanced by size);
  owners broadcast the updated parameters after the step. With dp_replicate > 1 (Megatron's
  partial distributed optimizer) ownership and the broadcast stay within one replica (the
  dp_shard ranks) while gradients are still all-reduced over every data-parallel rank.
- full: FSDP2 `fully_shard` per decoder layer (parameters, gradients, state sharded); HSDP when
  the mesh is 2-D (dp_replicate x dp_shard).

Gradients are reduced in fp32 (float64 for a float64 model) and summed, not averaged: the loss
of every micro-batch is already divided by the global number of loss tokens, so the sum over
ranks is exactly the gradient of the single-process run on the same global batch (divide factor
1).

Why ZeRO-1 is ours: torch's ZeroRedundancyOptimizer keeps its own partitioned optimizer whose
`state_dict` must be consolidated on one rank, so DCP's layout-free optimizer checkpoints cannot
read it, and it cannot broadcast DTensor (tensor-parallel) parameters. Owning whole tensors here
keeps Per-Head Muon's matrices whole on their owner as well.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from model.dtypes import compute_dtype
from model.k3 import K3Model

MODES = ("none", "optimizer", "full")


def fill_missing_gradients(model: nn.Module) -> None:
    """Zero gradients for parameters a step did not reach (e.g. the vision encoder on a text-only
    batch): every parameter then gets an optimizer update (and optimizer state) every step."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def _units(model: K3Model, roots: list[nn.Module] | None = None
           ) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules that reduce (FSDP: gather) their parameters together: (each decoder layer,
    the roots). The root holds the embedding, LM head and vision encoder: the vision tower runs
    on some ranks' batches only, so it shares the root's reduction, which zero-fills unused
    gradients. `roots`: a pipeline rank's stage modules, whose forwards the schedule calls, in
    place of the model (whose own forward a stage never runs)."""
    return list(model.layers.values()), roots if roots is not None else [model]


def _shard_beside_strided_rows(param: nn.Parameter) -> Shard | None:
    """FSDP2's dim for a parameter: dim 1 for a TP strided row shard (the fused gate/up weight),
    whose rows FSDP2's default dim-0 shard would split a second time: the two strided shards of
    one dim compute correctly but gather (full_tensor, checkpoints) to a wrong row order."""
    if isinstance(param, DTensor) and any(isinstance(p, _StridedShard) and p.dim == 0
                                          for p in param.placements):
        return Shard(1)
    return None


def apply_data_parallel(model: K3Model, mesh: DeviceMesh, mode: str,
                        expert_mesh: DeviceMesh | None = None,
                        roots: list[nn.Module] | None = None,
                        param_dtype: torch.dtype | None = None) -> None:
    """Wraps `model` in place for data parallelism over `mesh` (1-D: every data-parallel rank for
    modes none and optimizer, the shard ranks for full; 2-D dp_replicate x dp_shard for HSDP
    with mode full). `expert_mesh` (under expert or expert tensor parallelism): the expert-data-
    parallel ranks, which hold the same experts; each MoE layer's experts become their own unit
    sharded (replicated) over it first, so the enclosing layer leaves them out (torchtitan's
    dp_shard_mod_ep). `roots`: see `_units` (pipeline stages; torch's schedules then hold back
    the reduce-scatters until a step's last micro-batch). `param_dtype` (mode full): the dtype
    FSDP2 gathers the decoder layers' parameters in (None: as they are, the fp32 master); the
    routers then become units of their own gathered as they are, since their scores are computed
    in fp32 (a near-tie decided on bf16-rounded weights routes a token elsewhere)."""
    if mode not in MODES:
        raise ValueError(f"parallel.data_shard={mode!r}: must be one of {list(MODES)}")
    reduce_dtype = compute_dtype(*{p.dtype for p in model.parameters()})
    as_held = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    gathered, routers = as_held, []
    if mode == "full" and param_dtype not in (None, reduce_dtype):
        # Inputs as they come: autocast casts where an op computes in bf16, and a cast here
        # would copy every AttnRes block into each layer (and into its checkpoint).
        gathered = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                        cast_forward_inputs=False)
        routers = [moe.router for moe in model.moe_layers()]
    layers, roots = _units(model, roots)
    # The roots gather as held: a stage accumulates its gradients over the micro-batches in
    # fp32, and FSDP2 zero-fills an unused parameter's (a text batch's vision tower) in the
    # gathered dtype, which it then cannot reduce-scatter beside the accumulated ones.
    units = [(unit, mesh, gathered) for unit in layers] + [(unit, mesh, as_held) for unit in roots]
    if expert_mesh is not None:
        units = [(moe.experts, expert_mesh, gathered) for moe in model.moe_layers()] + units
    units = [(router, mesh, as_held) for router in routers] + units
    for unit, unit_mesh, policy in units:
        if mode == "full":
            fully_shard(unit, mesh=unit_mesh, mp_policy=policy,
                        shard_placement_fn=_shard_beside_strided_rows)
        else:
            from torch.distributed._composable.replicate_with_fsdp import replicate

            replicate(unit, mesh=unit_mesh, mp_policy=policy)
    for unit, *_ in units:
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)  # a sum: see the module docstring
        # Plain SUM collectives (gloo has no PREMUL_SUM; the factor is 1 anyway).
        unit.set_force_sum_reduction_for_comms(True)
        # Ranks reach different parameters (images on some ranks only): zero gradients for the
        # others keep every rank's reduction the same size.
        unit.set_reduce_scatter_unused_params(True, recurse=False)


@contextlib.contextmanager
def gathered_for_decode(model: nn.Module) -> Iterator[None]:
    """Every FSDP2 unit of `model` holds its whole parameters inside (resharded after).
    FSDP2 gathers a unit's parameters in the pre-hook of its forward, which decoding's calls
    (`K3Model.decode`, not a module call) never run: a generation under data parallelism
    gathers them once for all its calls, as RL frameworks do for their rollouts (the
    whole model per rank, less what expert and tensor parallelism keep split)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if isinstance(model, FSDPModule):
        # Decoding calls some units' forwards (the experts') without the root's: each would
        # take itself for the root, and the next training forward would fail. FSDP2 has no
        # public call that settles the root before its first forward; this is what that
        # forward's pre-hook runs first.
        model._get_fsdp_state()._lazy_init()
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class ZeroOneOwnership:
    """ZeRO-1: which data-parallel rank owns (updates, keeps optimizer state for) each parameter.

    `partitions`: (named parameters, the group of ranks that hold them alike) pairs: the dense
    parameters over one replica's data-parallel ranks, under expert parallelism the experts
    over their expert-data ranks. Greedy by size, largest first, onto the least loaded rank of
    the group; ties by name, so every rank computes the same assignment without communication.
    """

    def __init__(self, partitions: list[tuple[list[tuple[str, torch.Tensor]],
                                              dist.ProcessGroup]]):
        self.groups: dict[str, dist.ProcessGroup] = {}  # parameter -> its partition's group
        self.owner: dict[str, int] = {}  # parameter -> its owner's rank in that group
        for named_params, group in partitions:
            load = [0] * dist.get_world_size(group)
            for name, p in sorted(named_params, key=lambda item: (-item[1].numel(), item[0])):
                rank = min(range(len(load)), key=lambda r: (load[r], r))
                self.owner[name], self.groups[name] = rank, group
                load[rank] += p.numel()

    def owns(self, name: str) -> bool:
        return self.owner[name] == dist.get_rank(self.groups[name])

    @torch.no_grad()
    def broadcast_updates(self, named_params) -> None:
        """Every parameter from its owner to the other ranks of its group (one HSDP replica's
        shard ranks, every data-parallel rank, the expert-data ranks): one broadcast per owner
        and dtype of all it updated, flattened, not one per parameter. `named_params`: the
        model's, as they are now (materialising a model built on meta replaces its parameter
        objects)."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for name, p in named_params:
            group = self.groups.get(name)
            if group is None or dist.get_world_size(group) == 1:
                continue
            local = _local(p)
            buckets.setdefault((id(group), self.owner[name], local.dtype), [group]).append(local)
        for (_, owner, _), (group, *tensors) in buckets.items():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=dist.get_global_rank(group, owner), group=group)
            torch._foreach_copy_(tensors, [part.view_as(t) for part, t in
                                           zip(flat.split([t.numel() for t in tensors]), tensors)])


def allreduce_gradients(params: list[torch.Tensor], group, bucket_bytes: int = 64 << 20) -> None:
    """Sums the gradients of `params` over `group` in flat buckets, for plans that torch's
    DDP / FSDP2 `replicate` cannot express: those reduce every parameter of a module over one
    mesh, while expert parallelism reduces dense and expert weights over different groups, and a
    pipeline stage reduces only the parameters it holds."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        grad = _local(p.grad)  # tensor-parallel DTensors: their partial sums completed first
        bucket.append(grad)
        size += grad.numel() * grad.element_size()
        if size >= bucket_bytes:
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, group)


def _reduce_bucket(grads: list[torch.Tensor], group) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
