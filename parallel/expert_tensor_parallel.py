"""Expert tensor parallelism (`parallel.expert_tensor` > 1): every expert's intermediate
dimension split over the etp ranks (Megatron's ETP), applied to a built K3Model from outside.

Each rank still routes its own tokens (its 1/tp of them under tensor parallelism). Before the
dispatch the etp peers all-gather their latent tokens and routings, so every peer dispatches the
same entries: the expert-parallel groups of the peers (one per etp coordinate) then make the same
MoonEP plan and run it side by side, each rank's GEMMs on its slice of every expert's
intermediate rows. After the combine a reduce-scatter over the peers sums their partial outputs
and hands each its own tokens back. Backward runs the transposes: the reduce-scatter of the
all-gather sums the peers' partial gradients of the tokens and routing weights. Gathering
before the dispatch, not after it as Megatron's token dispatcher does, keeps the peers' plans,
and so the expert copies they fetch, the same.

Weights: w1 [E, 2I, L] (gate rows then up rows) is _StridedShard(1, split_factor=2), each rank
its slice of the gate rows and of the up rows (as the dense MLP's fused gate/up under tensor
parallelism); w2 [E, L, I] is Shard(2). Both are DTensors on the etp mesh, so checkpoints,
Muon's per-expert matrices and the gradient norm see whole experts; the GEMMs take the local
slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from model.k3 import K3Model
from model.moe.dispatch import Dispatched

from .tensor_parallel import localise_when_run


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[S, ...] -> [etp * S, ...], the peers' rows in etp order; backward: reduce-scatter."""
    return funcol.wait_tensor(funcol.all_gather_single_autograd(x.contiguous(), 0, group))


def _scatter_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[etp * S, ...] partial sums -> this rank's [S, ...] summed; backward: all-gather."""
    return funcol.wait_tensor(funcol.reduce_scatter_single_autograd(x.contiguous(), "sum", 0,
                                                                    group))


class ExpertTensorParallelDispatcher:
    """Wraps a MoE layer's dispatcher (local, MoonEP or the dynamic baseline): its dispatch sees
    the etp peers' tokens and routings gathered, its combine's partial sums are summed and
    scattered back over the peers (see the module docstring)."""

    def __init__(self, inner, group: dist.ProcessGroup):
        self.inner = inner
        self.group = group
        self.num_experts = inner.num_experts

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weight: torch.Tensor) -> Dispatched:
        # Expert ids fit int32 (half the bytes of the router's int64).
        ids = funcol.wait_tensor(funcol.all_gather_single(topk_idx.to(torch.int32), 0,
                                                          self.group))
        return self.inner.dispatch(_gather(x, self.group), ids.long(),
                                   _gather(topk_weight, self.group))

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return _scatter_sum(self.inner.combine(expert_out, dispatched), self.group)


def expert_shards() -> dict[str, object]:
    """The etp placement of each expert weight (GroupedExperts' names)."""
    return {"w1": _StridedShard(1, split_factor=2), "w2": Shard(2)}


def apply_expert_tensor_parallel(model: K3Model, mesh: DeviceMesh) -> None:
    """Splits every MoE layer's experts (this rank's home experts under expert parallelism) over
    the 1-D etp `mesh` and wraps its dispatcher (in place; after expert parallelism installed
    its dispatchers, before data parallelism and the optimizer)."""
    placements = expert_shards()
    for moe in model.moe_layers():
        experts = moe.experts
        for name, placement in placements.items():
            param = getattr(experts, name)
            # Every rank holds the same values (or none yet, on meta): each keeps its slice.
            experts.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, mesh, [placement], src_data_rank=None),
                requires_grad=param.requires_grad))
        # The GEMMs take the local slices when they run (FSDP2, where it shards the experts
        # over the expert-data ranks, has gathered them into the etp DTensors by then, also
        # when activation checkpointing recomputes the layer); their gradients are the shards.
        localise_when_run(experts, lambda p: p.placements[0])
        moe.dispatcher = ExpertTensorParallelDispatcher(moe.dispatcher, mesh.get_group())
