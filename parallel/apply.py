"""The one entry from the training loop into parallelism: `parallelize(model, topology, cfg)`.

Order (torchtitan's): expert parallelism (`shard_experts`, before precision and the
optimizer) -> tensor/sequence parallelism -> context parallelism -> activation checkpointing ->
torch.compile -> data parallelism. Context-parallel ranks hold different tokens of one model
replica, so for the gradients (and ZeRO-1 ownership) they are data-parallel ranks: data
parallelism runs over dp_shard x cp (torchtitan's dp_shard_cp). The returned `ParallelPlan` is
everything the loop needs that depends on the layout, so the loop never branches on it: the
loss context, the optimizer's ownership and Muon exchange, the gradient finish and norm, the
post-step broadcast, and the reductions over named groups (loss tokens over dp x cp, Quantile
Balancing over the ranks that route different tokens to the same experts, QK-Clip's max logit
over dp x cp with heads apart under tensor parallelism).

Pipeline parallelism: `shard_stages` first keeps this rank's stages of the model (before
precision and the optimizer see it), then `parallelize` applies tensor parallelism to them and
hands them to the schedule (`ParallelPlan.pipeline`). A stage's gradients are summed over its
dp x cp ranks after the schedule (torch's data-parallel wrappers hook the model's own forward,
which a stage never runs); the gradient norm and the logged figures add the stages up.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from model.flops import head_forward_flops_per_token, layer_forward_flops_per_token
from model.init import LocalPart
from model.k3 import K3Model
from model.mla import GatedMLA
from model.ops.fused import enable_fused_kernels

from .activation_checkpointing import apply_activation_checkpointing, compile_sublayers
from .context_parallel import ContextParallel, apply_context_parallel, shard_batch
from .data_parallel import (
    ZeroOneOwnership,
    allreduce_gradients,
    apply_data_parallel,
    fill_missing_gradients,
)
from .expert_parallel import (
    ExpertShardedState,
    allreduce_expert_parallel_gradients,
    apply_expert_parallel,
    clip_grad_norm_expert_parallel,
    is_expert_parameter,
    mark_expert_parameters,
)
from .expert_tensor_parallel import apply_expert_tensor_parallel
from .grad_norm import scale_grads_, squared_grad_norm
from .local_parts import local_part
from .muon_exchange import DTensorExchange, LocalExchange, MatrixExchange
from .tensor_parallel import apply_tensor_parallel, loss_context, reduce_partial_gradients

if TYPE_CHECKING:
    from .pipeline import PipelineStep


def qb_count_dtype(tokens_per_step: int) -> torch.dtype:
    """The integer dtype Quantile Balancing's counts are summed in over the ranks: a count
    never exceeds the step's tokens, so int32 below 2**31 of them, int64 beyond."""
    return torch.int32 if tokens_per_step < 2**31 else torch.int64


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


@dataclass
class ParallelPlan:
    model: K3Model
    topology: object | None  # parallel.topology.Topology; None: one process
    zero: ZeroOneOwnership | None = None
    data_parallel: bool = False
    exchange: MatrixExchange = LocalExchange()
    context: ContextParallel | None = None
    # The experts split outside the dense layout (expert or expert tensor parallelism): their
    # own gradient reductions, norm and checkpoint layout.
    expert_parallel: bool = False
    # Ranks that route different tokens to the same experts (Quantile Balancing's statistics).
    balancer_group: str = "dp_cp"
    # The dtype those counts are summed in: int32 (half of int64's bytes), which holds any count
    # of a step below 2**31 tokens (every counted token adds at most one to a count).
    balancer_count_dtype: torch.dtype = torch.int32
    pipeline: PipelineStep | None = None  # this rank's stages and their schedule
    # Data parallelism on plain host tensors (optim.offload=cpu): gradients summed after backward
    # by allreduce_gradients instead of FSDP2 `replicate`, whose DTensor parameters DeepSpeed's
    # host AdamW cannot step (its C++ op takes plain CPU tensors).
    plain_data_parallel: bool = False

    def _group(self, name: str):
        return None if self.topology is None else self.topology.group(name)

    @property
    def tp(self) -> int:
        return 1 if self.topology is None else self.topology.tp

    def local_batch(self, batch):
        """This rank's part of a micro-batch: its context-parallel fragment, or all of it."""
        if self.context is None:
            return batch
        return shard_batch(batch, self.context.rank, self.context.size, self.context.zigzag)

    def loss_context(self):
        """Wraps forward and backward (vocabulary-parallel cross entropy)."""
        return loss_context(self.tp)

    def materialize(self, device: torch.device, seed: int) -> None:
        """Storage on `device` for what this rank holds of a model built on meta (to_empty),
        initialised as the single-process model built with `seed` is (K3Model.init_weights)."""
        self.model.to_empty(device=device)
        if self.expert_parallel:  # to_empty made new parameters: tag the experts again
            mark_expert_parameters(self.model)
        self.model.init_weights(seed, self.locate)

    def locate(self, name: str, param: torch.Tensor) -> LocalPart:
        """The part of logical parameter `name` this rank holds, for K3Model.init_weights: its
        local shard (DTensor) and, under expert parallelism, where its home experts sit among
        all the experts."""
        if self.expert_parallel and is_expert_parameter(param):
            home = param.shape[0]  # this rank's experts (FSDP2's DTensor: the whole home stack)
            return local_part(param, self.topology.rank_in("ep") * home, home * self.topology.ep)
        return local_part(param)

    def owns(self, name: str) -> bool:
        """Whether this rank's optimizer updates (and keeps state for) parameter `name`."""
        return self.zero is None or self.zero.owns(name)

    def sum_loss_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """Over the ranks that hold different tokens of the same model replica step: dp x cp."""
        return _all_reduce(t, dist.ReduceOp.SUM, self._group("dp_cp"))

    def sum_over_replicas(self, t: torch.Tensor) -> torch.Tensor:
        """Over the data-parallel ranks, each of which reads other samples (its context-parallel
        and tensor-parallel peers read the same ones)."""
        return _all_reduce(t, dist.ReduceOp.SUM, self._group("dp"))

    def sum_over_stages(self, t: torch.Tensor) -> torch.Tensor:
        """Over the pipeline ranks (each holds other layers; one process: nothing to add)."""
        return _all_reduce(t, dist.ReduceOp.SUM, self._group("pp"))

    def stage_figures(self, row: dict, merge: Callable[[list[dict]], dict]) -> dict:
        """The logged MoE / QK-Clip figures of this rank's layers -> the whole model's (every
        pipeline rank calls it at the same steps: it gathers over the pipeline group);
        `merge(rows)` combines the stages' rows (the training loop's rule)."""
        group = self._group("pp")
        if group is None or dist.get_world_size(group) == 1:
            return row
        rows: list[dict] = [{}] * dist.get_world_size(group)
        dist.all_gather_object(rows, row, group=group)
        return merge(rows)

    def eval_loss_sums(self, model: K3Model, micro_batches: list) -> torch.Tensor:
        """Forward only: [summed token loss, loss tokens] (float64) of this rank's micro-batches
        (of one global batch under pipeline parallelism: the schedule's micro-batches)."""
        tokens = sum(float(mb.num_loss_tokens) for mb in micro_batches)
        if self.pipeline is not None:
            loss = self.sum_over_stages(self.pipeline.eval_loss_sum(micro_batches))
        else:
            loss = sum(model(mb).loss_sum.double() for mb in micro_batches)
        return torch.stack([torch.as_tensor(loss, dtype=torch.float64).reshape(()),
                            torch.tensor(tokens, dtype=torch.float64)])

    def sum_balancer_counts(self, t: torch.Tensor) -> torch.Tensor:
        """Quantile Balancing statistics over the ranks that route different tokens to the same
        experts: dp x cp (tensor-parallel ranks route the same gathered tokens), dp x cp x tp
        under expert x tensor parallelism (each tensor-parallel rank routes its own tokens); in
        `balancer_count_dtype`, returned in t's dtype."""
        group = self._group(self.balancer_group)
        if group is None or dist.get_world_size(group) == 1:
            return t
        return _all_reduce(t.to(self.balancer_count_dtype), dist.ReduceOp.SUM, group).to(t.dtype)

    def sync_gradients(self, last: bool) -> None:
        """Before a micro-batch's backward (without the pipeline, whose schedule does this for
        its stages): the replicas of modes none and optimizer reduce the gradients only after
        the step's last micro-batch (DDP's no_sync: the same sum, sent once); FSDP2 reduces
        each micro-batch's, whose whole gradients it would otherwise keep."""
        if not self.data_parallel or self.topology.data_shard == "full":
            return
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.set_requires_gradient_sync(last, recurse=False)

    def finish_gradients(self) -> None:
        """After backward: gradients for unreached parameters and, without data parallelism's
        reduction, the tensor-parallel partial sums completed. With plain data parallelism
        (offload) every gradient is summed over dp x cp here; under the pipeline each stage's
        over its dp x cp ranks; under expert parallelism in either case dense gradients over
        dp x cp and expert gradients over the expert-data ranks (FSDP2's fully_shard and
        replicate reduce each over its own mesh during backward)."""
        if self.data_parallel:  # FSDP2 / replicate reduced them during backward
            fill_missing_gradients(self.model)
            return
        reduce_partial_gradients(self.model)
        fill_missing_gradients(self.model)
        if self.expert_parallel:
            allreduce_expert_parallel_gradients(self.model, self._group("dp_cp"),
                                                self._group("edp"))
        elif self.plain_data_parallel or self.pipeline is not None:  # local parts under TP
            allreduce_gradients([p for p in self.model.parameters() if p.requires_grad],
                                self._group("dp_cp"))

    @property
    def sharded_state(self) -> ExpertShardedState | None:
        """What checkpoints need to store the experts at their logical shapes when they are
        split outside the dense layout (expert and expert tensor parallelism); None
        otherwise."""
        if not self.expert_parallel:
            return None
        return ExpertShardedState(self.model, self.topology.mesh, self.topology.ep)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over parameters that live on different meshes (dense
        DTensors on dp x tp, 1-D dp shards, plain tensors), one all-reduce per mesh group
        (parallel.grad_norm). Under expert parallelism the norm covers every rank's home
        experts; under pipeline parallelism every stage's parameters."""
        if self.expert_parallel:
            return clip_grad_norm_expert_parallel(
                self.model, max_norm, self._group("ep"),
                self._group("pp") if self.pipeline is not None else None)
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = self.sum_over_stages(squared_grad_norm([p.grad for p in params])).sqrt()
        if math.isfinite(max_norm):
            scale_grads_([p.grad for p in params], (max_norm / (total + 1e-6)).clamp(max=1.0))
        return total

    def after_optimizer_step(self) -> None:
        if self.zero is not None:
            self.zero.broadcast_updates(self.model.named_parameters())

    @torch.no_grad()
    def qk_clip_(self, mla: GatedMLA, tau: float, factors: Callable
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-Clip of one MLA layer from its recorded max logits (this rank's heads): the max
        over dp x cp, then every weight row scaled by its head's factor, whatever the layout of
        q_b/kv_b. `factors(max_logits, tau, nope, rope, v_dim) -> (q_b rows, kv_b rows, clipped
        heads)` is the clipping rule (train.optim.qk_clip.qk_clip_factors). Returns (max logit,
        clipped heads) of this rank's heads."""
        logits = _all_reduce(mla.max_logit, dist.ReduceOp.MAX, self._group("dp_cp"))
        q_rows, kv_rows, clipped = factors(logits, tau, mla.nope, mla.rope, mla.v_dim)
        _scale_rows_(mla.q_b.weight, q_rows)
        _scale_rows_(mla.kv_b.weight, kv_rows)
        return logits.max(), clipped


def _scale_rows_(weight: torch.Tensor, factors: torch.Tensor) -> None:
    """weight[i, :] *= factors[i] for the rows this rank holds. `factors` covers this rank's
    heads: all rows, or the tensor-parallel shard."""
    if not isinstance(weight, DTensor):
        weight.mul_(factors[:, None].to(weight.dtype))
        return
    mesh, names = weight.device_mesh, weight.device_mesh.mesh_dim_names
    held = [Shard(0) if names[i] == "tp" else Replicate() for i in range(mesh.ndim)]
    rows = DTensor.from_local(factors[:, None].to(weight.dtype), mesh, held,
                              shape=(weight.shape[0], 1), stride=(1, 1))
    target = [pl if isinstance(pl, (Shard, _StridedShard)) else Replicate()
              for pl in weight.placements]
    weight.to_local().mul_(rows.redistribute(mesh, target).to_local())


def shard_experts(model: K3Model, topology, cfg) -> None:
    """The first step of a layout, before precision wraps the experts and before the optimizer
    exists: under expert parallelism each rank keeps its home experts and every MoE layer gets
    the configured dispatcher (MoonEP or the dynamic baseline). No-op otherwise."""
    if topology is None or topology.ep == 1:
        return
    moonep = cfg.parallel.moonep
    apply_expert_parallel(model, topology.group("ep"), cfg.parallel.expert_dispatch,
                          moonep.transport, moonep.alignment)


def stage_costs(cfg) -> tuple[list[float], float]:
    """Each decoder layer's and the LM head's forward FLOPs per token: what stages balance."""
    return (layer_forward_flops_per_token(cfg.model, cfg.stage.seq_len),
            head_forward_flops_per_token(cfg.model))


def shard_stages(model: K3Model, topology, cfg) -> None:
    """Under pipeline parallelism, keeps in `model` only this rank's stages (parameter names
    unchanged); before precision, the other plans and the optimizer. No-op otherwise."""
    if topology is None or topology.pp == 1:
        return
    # Here, not at the top: torch's pipelining imports torch._dynamo (and sympy), a slow and
    # large import for every process, most of which never pipeline.
    from .pipeline import prune_to_stages, rank_stages

    prune_to_stages(model, *rank_stages(*stage_costs(cfg), topology.pp, topology.rank_in("pp"),
                                        topology.virtual_stages, topology.pipeline_schedule))


def _pipeline_step(model: K3Model, topology, cfg, mesh, device: torch.device,
                   activation_dtype: torch.dtype | None) -> PipelineStep:
    from .pipeline import PipelineStep  # see shard_stages

    micro_batches = cfg.stage.global_batch_size // (cfg.stage.micro_batch_size * topology.dp)
    # Under context parallelism a stage runs this rank's pieces of every row, each piece a row
    # of its local batch (two under zig-zag).
    pieces = 2 if topology.cp > 1 and topology.context_layout == "zigzag" else 1
    activations = None
    if topology.tp > 1:
        activations = (mesh["tp"], Shard(1) if topology.sequence_parallel else Replicate())
    return PipelineStep(model, *stage_costs(cfg), topology.group("pp"),
                        topology.pipeline_schedule, topology.virtual_stages, micro_batches,
                        (cfg.stage.micro_batch_size * pieces,
                         cfg.stage.seq_len // (topology.cp * pieces)), device,
                        activations, activation_dtype)


def _data_parallel_dims(topology) -> tuple[str, ...]:
    """The data-parallel dimensions of the layout's mesh (before "tp"): FSDP2 shards over
    dp_shard (x cp) and, for HSDP, replicates over dp_replicate; `replicate` (modes none and
    optimizer) all-reduces every gradient over all dp x cp ranks, one dimension (it takes 1-D
    meshes only; flattening two would create a process group outside the topology)."""
    if topology.data_shard != "full":
        return ("dp_cp",)
    return ("dp_replicate", "dp_shard_cp" if topology.cp > 1 else "dp_shard")


def _expert_data_dims(topology) -> tuple[str, ...]:
    """FSDP2's mesh of the experts: the expert-data ranks, 2-D (replicas x shards) under
    HSDP."""
    return ("edp_replicate", "edp_shard") if topology.dp_replicate > 1 else ("edp",)


def _expert_mesh(topology, etp: bool):
    """The expert-data ranks' mesh, which data parallelism reduces the experts' gradients over
    (FSDP2's, 2-D under HSDP; `replicate`'s, 1-D), or with `etp` the etp dimension of the mesh
    they form with the etp ranks (FSDP2 and `replicate` take the etp DTensors only from a mesh
    of the same root)."""
    dims = _expert_data_dims(topology) if topology.data_shard == "full" else ("edp",)
    if topology.etp == 1:
        return topology.mesh(*dims)
    mesh = topology.mesh(*dims, "etp")
    return mesh["etp"] if etp else mesh[dims if len(dims) > 1 else dims[0]]


def parallelize(model: K3Model, topology, cfg, autocast=contextlib.nullcontext,
                device: torch.device | None = None,
                activation_dtype: torch.dtype | None = None) -> ParallelPlan:
    """Applies the layout of `topology` (an initialized parallel.topology.Topology, or None for
    one process) to `model` in place, with activation checkpointing and compile from `cfg`
    (a TrainConfig). `model` may be on the meta device (then `device` is where it will be
    materialised: the pipeline's boundary buffers are made there). `activation_dtype`: the
    autocast dtype (None: none), which pipeline boundaries cross in."""
    if device is None:
        device = next(model.parameters()).device
    plan = ParallelPlan(model, topology)
    plan.expert_parallel = topology is not None and (topology.ep > 1 or topology.etp > 1)
    plan.balancer_count_dtype = qb_count_dtype(cfg.stage.global_batch_size * cfg.stage.seq_len)
    mesh = None
    if topology is not None and topology.world_size > 1:
        mesh = topology.mesh(*_data_parallel_dims(topology), "tp")
    if topology is not None and topology.etp > 1:
        apply_expert_tensor_parallel(model, _expert_mesh(topology, etp=True))
        mark_expert_parameters(model)  # new DTensor parameters
    if mesh is not None and topology.tp > 1:
        # The experts are split (Topology refuses them whole on every tensor-parallel rank):
        # each tensor-parallel rank routes its own tokens.
        apply_tensor_parallel(model, mesh["tp"], topology.sequence_parallel)
        plan.balancer_group = "dp_cp_tp"
    if mesh is not None and topology.cp > 1:
        plan.context = apply_context_parallel(model, topology)
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, autocast)
    if cfg.compile:
        compile_sublayers(model)
    enable_fused_kernels(cfg.fused_kernels)
    if topology is not None and topology.pp > 1:
        plan.pipeline = _pipeline_step(model, topology, cfg, mesh, device, activation_dtype)
        if plan.context is not None:
            for stage in plan.pipeline.modules:
                stage.on_batch = plan.context.bind
    if mesh is not None and topology.dp * topology.cp > 1:
        mode = topology.data_shard
        if mode == "full":
            dims = _data_parallel_dims(topology)
            if topology.dp_replicate == 1:
                dims = dims[-1:]
            # Under the pipeline each stage is FSDP2's root: the schedule runs the stages, never
            # the model's own forward.
            apply_data_parallel(model, mesh[dims] if len(dims) > 1 else mesh[dims[0]], mode,
                                (_expert_mesh(topology, etp=False)
                                 if plan.expert_parallel else None),
                                roots=plan.pipeline.modules if plan.pipeline else None,
                                param_dtype=(activation_dtype if cfg.parallel.fsdp_param_dtype
                                             == "compute" else None))
            if plan.expert_parallel:
                mark_expert_parameters(model)  # FSDP2 replaced them by DTensor parameters
            plan.data_parallel = True
        elif plan.pipeline is not None:
            pass  # each stage's summed after the schedule (finish_gradients)
        elif cfg.optim.offload == "cpu":  # validated: mode none or optimizer, tensor 1
            plan.plain_data_parallel = True
        else:
            # Per decoder layer while backward runs on; the experts over their expert-data ranks
            # as units of their own.
            apply_data_parallel(model, mesh[_data_parallel_dims(topology)[-1]], mode,
                                (_expert_mesh(topology, etp=False)
                                 if plan.expert_parallel else None))
            if plan.expert_parallel:
                mark_expert_parameters(model)  # replicate made them DTensor parameters
            plan.data_parallel = True
        if mode == "optimizer":
            # Owners within one replica (the shard dim x cp; the expert-data ranks for the
            # experts); every replica holds the same state for its copy, updated from the same
            # gradients.
            params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            experts = [(n, p) for n, p in params if is_expert_parameter(p)]
            partitions = [([(n, p) for n, p in params if not is_expert_parameter(p)],
                           topology.group("dp_shard_cp"))]
            if experts:
                partitions.append((experts, topology.group("edp_shard")))
            plan.zero = ZeroOneOwnership(partitions)
    if mesh is not None:
        plan.exchange = DTensorExchange()
    return plan

