"""Expert parallelism applied to a built K3Model from outside.

Each rank of the expert-parallel group keeps only its home experts' weights (experts
e // (E / R) == its EP rank), so their optimizer state and updates stay home, and every MoE
layer gets an expert-parallel dispatcher: MoonEP (static shapes, no host sync) or the dynamic
all-to-all baseline. Gradients: dense parameters are summed over the data-parallel ranks (every
rank when EP is carved out of DP, as in Megatron), expert weights over the expert-data-parallel
ranks (the ranks holding the same experts), once backward has returned the copies' gradients
to their owners: by FSDP2 (`fully_shard` with data_shard=full, `replicate` with none and
optimizer), layer by layer while backward runs on, the experts their own unit over the
expert-data-parallel mesh; by hand after the backward under the pipeline and with the host
optimizer (`allreduce_expert_parallel_gradients`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from model.k3 import K3Model
from parallel.data_parallel import allreduce_gradients
from parallel.grad_norm import scale_grads_, squared_grad_norm
from parallel.moonep.dispatcher import MoonEPDispatcher
from parallel.moonep.dynamic import DynamicDispatcher
from parallel.moonep.transport import (
    CollectiveTransport,
    SymmMemTransport,
    symm_mem_unavailable,
)
from parallel.strides import contiguous_strides

DISPATCHES = ("moonep", "dynamic")
TRANSPORTS = {"collective": CollectiveTransport, "symm_mem": SymmMemTransport}


def apply_expert_parallel(model: K3Model, ep_group: dist.ProcessGroup, dispatch: str = "moonep",
                          transport: str = "collective", alignment: int = 1) -> None:
    """Shards every MoE layer's experts over `ep_group` and installs its dispatcher (in place;
    call before building the optimizer)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"parallel.expert_dispatch={dispatch!r} is invalid: one of {DISPATCHES}")
    if transport not in TRANSPORTS:
        raise ValueError(f"parallel.moonep.transport={transport!r} is invalid: one of "
                         f"{tuple(TRANSPORTS)}")
    # A dry run (the fake process group) models the GPU job: its stand-in exchange needs no
    # device.
    if (transport == "symm_mem" and dist.get_backend(ep_group) != "fake"
            and (reason := symm_mem_unavailable()) is not None):
        raise ValueError(f"parallel.moonep.transport='symm_mem' {reason}: use collective")
    ranks, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    for moe in model.moe_layers():
        experts = moe.experts
        num_experts = experts.w1.shape[0]
        if num_experts % ranks:
            raise ValueError(f"model.moe.num_experts={num_experts} is not divisible by "
                             f"parallel.expert={ranks}")
        per_rank = num_experts // ranks
        home = slice(rank * per_rank, (rank + 1) * per_rank)
        experts.w1 = nn.Parameter(experts.w1.detach()[home].clone())
        experts.w2 = nn.Parameter(experts.w2.detach()[home].clone())
        experts.num_experts = per_rank
        if dispatch == "moonep":
            dispatcher = MoonEPDispatcher(num_experts, TRANSPORTS[transport](ep_group),
                                          alignment)
            experts.group_weights = dispatcher.group_weights
        else:
            dispatcher = DynamicDispatcher(num_experts, ep_group)
        moe.dispatcher = dispatcher
    mark_expert_parameters(model)


def mark_expert_parameters(model: K3Model) -> None:
    """Tags the (sharded) expert weights; again after FSDP2 has replaced them by DTensors."""
    for moe in model.moe_layers():
        moe.experts.w1.expert_parallel = moe.experts.w2.expert_parallel = True


def is_expert_parameter(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def allreduce_expert_parallel_gradients(model: nn.Module, dp_group: dist.ProcessGroup | None,
                                        edp_group: dist.ProcessGroup | None) -> None:
    """Sums dense gradients over `dp_group` and expert gradients over `edp_group` (None: the
    default group); call fill_missing_gradients first."""
    params = [p for p in model.parameters() if p.requires_grad]
    allreduce_gradients([p for p in params if not is_expert_parameter(p)], dp_group)
    allreduce_gradients([p for p in params if is_expert_parameter(p)], edp_group)


def clip_grad_norm_expert_parallel(model: nn.Module, max_norm: float,
                                   ep_group: dist.ProcessGroup,
                                   stage_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over the whole (logical) model when expert weights are
    sharded over `ep_group`: dense gradients are the same on every EP rank, each rank adds its
    home experts' squares (parallel.grad_norm), one all-reduce over the EP ranks gives the
    stage's norm; `stage_group` (pipeline parallelism) adds the stages' squares. Call after the
    gradient reductions; returns the total norm (a float64 device tensor, no host sync)."""
    params = [p for p in model.parameters() if p.grad is not None]
    experts = [p.grad for p in params if is_expert_parameter(p)]
    dense = [p.grad for p in params if not is_expert_parameter(p)]
    expert_sq = (squared_grad_norm(experts) if experts
                 else torch.zeros((), dtype=torch.float64, device=params[0].grad.device))
    dist.all_reduce(expert_sq, group=ep_group)
    squares = squared_grad_norm(dense) + expert_sq
    if stage_group is not None and dist.get_world_size(stage_group) > 1:
        dist.all_reduce(squares, group=stage_group)
    total = squares.sqrt()
    scale_grads_([p.grad for p in params], (max_norm / (total + 1e-6)).clamp(max=1.0))
    return total


@dataclass
class _ExpertLayout:
    """How one expert parameter is held and how checkpoints see it: `held_mesh` and
    `held_placements` its DTensor's (None: a plain tensor); `mesh` spans the stage's expert
    layout, `placements` are the held tensor's there, `saved` the checkpoint's (a strided etp
    shard made contiguous)."""

    held_mesh: DeviceMesh | None
    held_placements: list
    mesh: DeviceMesh
    placements: list
    saved: list


def _expert_layout(param: torch.Tensor, mesh_of: Callable[..., DeviceMesh]) -> _ExpertLayout:
    if not isinstance(param, DTensor):
        return _ExpertLayout(None, [], mesh_of("edp", "ep"), [Replicate(), Shard(0)],
                             [Replicate(), Shard(0)])
    held = param.device_mesh.mesh_dim_names
    # The expert-data ranks are in the held mesh when FSDP2 shards (or `replicate` copies) the
    # experts over them; else they hold the same copy.
    outer = ("ep",) if any(d.startswith("edp") for d in held) else ("edp", "ep")
    placements = [Replicate()] * (len(outer) - 1) + [Shard(0), *param.placements]
    saved = [Shard(pl.dim) if isinstance(pl, _StridedShard) else pl for pl in placements]
    return _ExpertLayout(param.device_mesh, list(param.placements), mesh_of(*outer, *held),
                         placements, saved)


class ExpertShardedState:
    """Shows torch.distributed.checkpoint the logical experts: in the model and optimizer state
    dicts (get_state_dict's, keyed by parameter name) each expert tensor becomes a DTensor of
    the full [E, ...] shape, so a checkpoint holds every expert once and loads into any expert
    layout or one process. Its mesh spans the stage's expert layout: ep outer (Shard(0): expert
    e's rows on EP rank e // (E/ep)), then the mesh the tensor is held on with its placements
    (FSDP2's expert-data ranks, with Shard(0) inside an EP rank's experts; the etp ranks),
    the expert-data ranks replicated where they do not shard it (a plain tensor: (edp, ep)).
    A strided etp shard (w1's gate and up rows) is moved to contiguous rows, which DCP's planner
    can describe: those wrapped tensors are copies, the others share the local tensors' storage
    (a load fills them); `unwrap` hands back this rank's tensors as they were held. Both methods
    return new dicts (the inputs may share their inner dicts with the live optimizer state).
    `mesh_of(*dims)`: the topology's meshes."""

    def __init__(self, model: nn.Module, mesh_of: Callable[..., DeviceMesh], ep: int):
        self.layouts = {name: _expert_layout(p, mesh_of) for name, p in model.named_parameters()
                        if is_expert_parameter(p)}
        self.ep = ep

    def _map(self, model_sd: dict, optim_sd: dict, fn) -> tuple[dict, dict]:
        model_sd = {k: fn(k, v) if k in self.layouts else v for k, v in model_sd.items()}
        if "state" not in optim_sd:  # flattened (one "state.<param>.<field>" key per tensor)
            return model_sd, {k: fn(name, v) if (name := self._flat_expert_state(k, v)) else v
                              for k, v in optim_sd.items()}
        state = {name: ({k: fn(name, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                         for k, v in entry.items()} if name in self.layouts else entry)
                 for name, entry in optim_sd.get("state", {}).items()}
        return model_sd, {**optim_sd, "state": state}

    def _flat_expert_state(self, key: str, value) -> str | None:
        """The expert parameter a flattened optimizer-state key belongs to, or None."""
        if not (key.startswith("state.") and isinstance(value, torch.Tensor) and value.dim()):
            return None
        name = key[len("state."):].rsplit(".", 1)[0]
        return name if name in self.layouts else None

    def wrap(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        def to_dtensor(name: str, t: torch.Tensor) -> DTensor:
            lay = self.layouts[name]
            home = t.shape  # this rank's home experts (a DTensor: all of them)
            logical = (home[0] * self.ep, *home[1:])
            out = DTensor.from_local(_local(t), lay.mesh, lay.placements, run_check=False,
                                     shape=logical, stride=contiguous_strides(logical))
            return out if lay.saved == lay.placements else out.redistribute(lay.mesh, lay.saved)

        return self._map(model_sd, optim_sd, to_dtensor)

    def unwrap(self, model_sd: dict, optim_sd: dict) -> tuple[dict, dict]:
        def as_held(name: str, t: DTensor) -> torch.Tensor:
            lay = self.layouts[name]
            if lay.saved != lay.placements:
                t = t.redistribute(lay.mesh, lay.placements)
            if lay.held_mesh is None:
                return t.to_local()
            home = (t.shape[0] // self.ep, *t.shape[1:])
            return DTensor.from_local(t.to_local(), lay.held_mesh, lay.held_placements,
                                      run_check=False, shape=home,
                                      stride=contiguous_strides(home))

        return self._map(model_sd, optim_sd, as_held)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
