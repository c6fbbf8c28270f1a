"""Pipeline parallelism: the K3 stack split into stages, run by torch.distributed.pipelining.

Stages hold contiguous layers, balanced by cost (the caller passes each layer's FLOPs, e.g.
from model/flops.py: MoE vs dense MLP, KDA vs MLA attention); the first stage also holds the
embedding and the vision tower, the last one the LM head (out-mix, final norm, projection, loss).
A rank holds `virtual_stages` stages: stage s lives on pipeline rank s % pp for the looped
schedules (1F1B, Interleaved1F1B), and ranks r and 2*pp-1-r hold the two halves of a "V" for
ZBVZeroBubble and DualPipeV.

What crosses a stage boundary is a tuple of tensors (never None or a dict: torch's pipelining
cannot send those, and a peer that receives one hangs): the running partial sum first, then
the AttnRes blocks completed so far, the embedding among them. Their number is fixed by the
layer indices, so every boundary has static shapes. The batch's side inputs (tokens, labels,
cu_seqlens, vision) are not sent: every stage reads its own copy of the micro-batches
(`PipelineStep.step` gets them on every pipeline rank) by the index of the micro-batch each
forward runs, which the schedule's stages hand to their module (`_Stage`).

Collectives stay outside the schedule: the global token count is summed before it (the last
stage divides each micro-batch's loss by it), and gradient norms, QB statistics and max logits
are reduced after it, over the groups of one stage (its dp x cp ranks), so ranks that hold
different layers never wait for each other inside a step. Under tensor parallelism the only
collectives inside are the stage's own tensor-parallel ones, which its ranks run in the same
order; the boundary tensors are the activations' local parts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Placement, Shard

from model.attnres import BlockState
from model.batch import K3Batch
from model.dtypes import compute_dtype
from model.k3 import K3Model

SCHEDULES = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def split_layers(layer_costs: Sequence[float], num_stages: int,
                 head_cost: float = 0.0) -> list[range]:
    """Contiguous layer ranges, one per stage, minimising the most expensive stage (the last
    one also pays `head_cost`); every stage gets at least one layer. Exact: dynamic programming
    over the split points, O(stages * layers^2), nothing for ~100 layers."""
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers "
                         f"(one per stage), the model has {n}")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, stage: int) -> float:  # layers i..j-1 on `stage`
        return prefix[j] - prefix[i] + (head_cost if stage == num_stages - 1 else 0.0)

    # best[s][j]: the least max-cost of splitting layers [0, j) into s + 1 stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, num_stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                value = max(best[s - 1][i], cost(i, j, s))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds, j = [n], n
    for s in range(num_stages - 1, 0, -1):
        j = cut[s][j]
        bounds.append(j)
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def stage_ids(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The stage indices pipeline rank `pp_rank` runs, in order."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual_stages)]


def rank_stages(layer_costs: Sequence[float], head_cost: float, pp: int, pp_rank: int,
                virtual_stages: int, schedule: str) -> tuple[list[range], list[int]]:
    """(every stage's layers, the stages pipeline rank `pp_rank` runs)."""
    return (split_layers(layer_costs, pp * virtual_stages, head_cost),
            stage_ids(pp_rank, pp, virtual_stages, schedule))


def crossing_blocks(first_layer: int, block_size: int) -> int:
    """AttnRes blocks completed before layer `first_layer` (the embedding is block 0, pushed by
    layer 0): the block tensors a stage starting there receives."""
    return 0 if first_layer == 0 else 1 + (first_layer - 1) // block_size


class StageModule(nn.Module):
    """One pipeline stage of a K3 model: forward(*inputs, mb) -> boundary tuple, or the summed
    token loss on the last stage. `model` is this rank's pruned K3Model (shared modules).

    `activations` (tensor parallelism: the tensor-parallel mesh and the activations' placement
    between blocks, Replicate or Shard(1) under sequence parallelism): the boundary tensors are
    the DTensors' local parts, wrapped again on arrival. Gradients cross as local parts too:
    a partial-sum gradient is completed by `from_local`'s backward, inside the stage's own
    tensor-parallel group."""

    def __init__(self, model: K3Model, layers: range, first: bool, last: bool,
                 boundary_dtype: torch.dtype, loss_dtype: torch.dtype,
                 activations: tuple[DeviceMesh, Placement] | None = None):
        super().__init__()
        self.first, self.last = first, last
        self.boundary_dtype, self.loss_dtype = boundary_dtype, loss_dtype
        self.activations = activations
        self.block_size = model.cfg.attnres_block_size
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layers})
        self.embed = model.embed if first else None
        self.vision = model.vision if first else None
        self.head = model.head if last else None
        self._model = (model,)  # not a submodule: its parameters are the union of the stages'
        self.micro_batches: list[K3Batch] = []
        self.micro_batch = 0  # the index of the micro-batch the next forward runs (_Stage)
        # Sees each micro-batch before the stage's layers run it (context parallelism binds its
        # fragment there, as K3Model's forward pre-hook does without a pipeline).
        self.on_batch = None
        self.autocast = contextlib.nullcontext  # the forward's precision region, set per step

    def forward(self, *inputs: torch.Tensor):
        with self.autocast():
            return self._forward(inputs, self.micro_batches[self.micro_batch])

    def _forward(self, inputs: tuple[torch.Tensor, ...], batch: K3Batch):
        if self.on_batch is not None:
            self.on_batch(batch)
        if self.first:
            state = BlockState(self._model[0].embed_inputs(batch), self.block_size)
        else:
            inputs = tuple(self._wrap(x) for x in inputs)
            state = BlockState(inputs[0], self.block_size)
            state.blocks = list(inputs[1:])
        self._model[0].run_layers(state, batch, list(self.layers.values()))
        if self.last:
            return _local(self.head(state.sources(), batch.labels)[0]).to(self.loss_dtype)
        # In the boundary's dtype, the receive buffers' (under bf16 autocast every block and
        # the partial sum are bf16 already, the embedding's too).
        return tuple(_local(x).to(self.boundary_dtype) for x in (state.partial, *state.blocks))

    def _wrap(self, x: torch.Tensor) -> torch.Tensor:
        if self.activations is None:
            return x
        mesh, placement = self.activations
        return DTensor.from_local(x, mesh, [placement])


class _Stage(PipelineStage):
    """torch's PipelineStage telling its StageModule which micro-batch each forward runs (the
    schedule's chunk id), so that the batch's side inputs need no index tensor (whose value a
    stage would read on the host)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self.submod.micro_batch = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


def _local(x: torch.Tensor) -> torch.Tensor:
    return x.to_local() if isinstance(x, DTensor) else x


def prune_to_stages(model: K3Model, splits: Sequence[range], ids: Sequence[int]) -> K3Model:
    """Keeps in `model` (in place) only what stages `ids` hold; parameter names are unchanged,
    so checkpoints and optimizer groups see the single-process names."""
    keep = {str(i) for s in ids for i in splits[s]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if 0 not in ids:
        model.embed = None
        model.vision = None
    if len(splits) - 1 not in ids:
        model.head = None
    return model


class PipelineStep:
    """This rank's stages and schedule for micro-batches of shape `micro_batch` (rows, tokens).

    `model` is the whole single-process model built with the run's seed (so every stage starts
    from the single-process weights); it is pruned in place to this rank's stages and kept as
    `self.model` for the optimizer, checkpoints and the MoE/MLA bookkeeping.
    `step(micro_batches, global_tokens)` runs forward and backward of one optimizer step and
    returns this rank's share of the step's loss (the last stage's summed token loss over
    `global_tokens`; zero elsewhere: sum it over the pipeline group, ParallelPlan.sum_over_stages);
    `eval_loss_sum(micro_batches)` runs the forwards only and returns the share of the summed
    token loss. `activations`: see StageModule (tensor parallelism). `activation_dtype`: the
    dtype the boundary tensors cross in (the autocast dtype: bf16 under precision=bf16, as
    Megatron sends them); None: the parameters' (fp32 masters, float64 for fp64)."""

    def __init__(self, model: K3Model, layer_costs: Sequence[float], head_cost: float,
                 pp_group, schedule: str, virtual_stages: int, n_microbatches: int,
                 micro_batch: tuple[int, int], device: torch.device,
                 activations: tuple[DeviceMesh, Placement] | None = None,
                 activation_dtype: torch.dtype | None = None):
        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pipeline_schedule={schedule!r}: one of {list(SCHEDULES)}")
        self.pp_group = pp_group
        pp, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
        num_stages = pp * virtual_stages
        self.splits, self.ids = rank_stages(layer_costs, head_cost, pp, pp_rank, virtual_stages,
                                            schedule)
        self.model = prune_to_stages(model, self.splits, self.ids)
        # The loss crosses in its compute dtype on every stage, so that the stages' sums add up.
        param_dtype = next(self.model.parameters()).dtype
        self._boundary_dtype = activation_dtype or param_dtype
        self._loss_dtype = compute_dtype(param_dtype)
        self.modules = [StageModule(self.model, self.splits[s], s == 0, s == num_stages - 1,
                                    self._boundary_dtype, self._loss_dtype, activations)
                        for s in self.ids]
        # Sequence parallelism: a boundary tensor holds this rank's part of the sequence.
        self._seq_shards = (activations[0].size() if activations is not None
                            and isinstance(activations[1], Shard) else 1)
        # Static boundary shapes: no metadata-inference forward, which would run the layers on
        # uninitialised tensors and feed them to the QB histograms and the max-logit records.
        boundaries = {s: self._boundary(s, micro_batch, device) for s in self.ids}
        self.stages = [_Stage(m, s, num_stages, device, *boundaries[s], group=pp_group)
                       for m, s in zip(self.modules, self.ids, strict=True)]
        self._inputs = {s: inputs for s, (inputs, _) in boundaries.items()}
        self._holder = {s: dist.get_global_rank(pp_group, r) for r in range(pp)
                        for s in stage_ids(r, pp, virtual_stages, schedule)}
        self.n_microbatches = n_microbatches
        self._global_tokens = torch.ones(())
        # Each micro-batch's loss is already over the global token count: no 1/n scaling.
        kwargs = {"n_microbatches": n_microbatches, "loss_fn": self._loss, "scale_grads": False}
        cls = SCHEDULES[schedule]
        self.schedule = (cls(self.stages[0], **kwargs) if cls is Schedule1F1B
                         else cls(self.stages, **kwargs))
        self.has_last = num_stages - 1 in self.ids
        self.has_first = 0 in self.ids

    def _boundary(self, stage: int, micro_batch: tuple[int, int], device: torch.device):
        """(inputs, outputs) of a stage as tensors of the shapes and dtypes that cross."""
        cfg, (b, t) = self.model.cfg, micro_batch
        dtype = self._boundary_dtype
        layers = self.splits[stage]

        def crossing(first_layer: int) -> tuple[torch.Tensor, ...]:
            count = 1 + crossing_blocks(first_layer, cfg.attnres_block_size)  # partial, blocks
            return tuple(torch.empty(b, t // self._seq_shards, cfg.hidden_size, dtype=dtype,
                                     device=device, requires_grad=True) for _ in range(count))

        inputs = ((torch.zeros(b, t, dtype=torch.long, device=device),) if stage == 0
                  else crossing(layers.start))
        outputs = ((torch.empty((), dtype=self._loss_dtype, device=device),)
                   if stage == len(self.splits) - 1 else crossing(layers.stop))
        return inputs, outputs

    def _loss(self, loss_sum: torch.Tensor, _target) -> torch.Tensor:
        return loss_sum / self._global_tokens

    def step(self, micro_batches: list[K3Batch], global_tokens: torch.Tensor,
             autocast=contextlib.nullcontext) -> torch.Tensor:
        """`autocast`: the precision region of the stage forwards (the schedule runs the
        backwards too, which must stay outside it, as in the loop without a pipeline)."""
        self._check(micro_batches)
        self._global_tokens = global_tokens.reshape(()).clamp_min(1.0)
        for m in self.modules:
            m.micro_batches, m.autocast = micro_batches, autocast
        args = (torch.cat([mb.tokens for mb in micro_batches]),) if self.has_first else ()
        losses: list[torch.Tensor] = []
        try:
            # The last stage needs a target to chunk (its loss comes from the stage's labels).
            target = torch.cat([mb.labels for mb in micro_batches]) if self.has_last else None
            self.schedule.step(*args, target=target, return_outputs=False,
                               losses=losses if self.has_last else None)
        finally:
            for m in self.modules:
                m.micro_batches, m.autocast = [], contextlib.nullcontext
        if self.has_last:
            return torch.stack([loss.detach() for loss in losses]).sum()
        return torch.zeros((), dtype=self._loss_dtype, device=global_tokens.device)

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: list[K3Batch]) -> torch.Tensor:
        """Forward only: this rank's share of the micro-batches' summed token loss (the last
        stage's; zero elsewhere). Not through the schedule: torch's multi-stage schedules run
        their backward actions in `eval` too. Every pipeline rank walks the stages in order,
        one micro-batch at a time; a stage's outputs go to the next stage's rank by a blocking
        send that its receive, posted at the same point of the walk, completes."""
        self._check(micro_batches)
        me, last = dist.get_rank(), len(self.splits) - 1
        total = torch.zeros((), dtype=self._loss_dtype, device=self._inputs[self.ids[0]][0].device)
        for m in self.modules:
            m.micro_batches = micro_batches
        try:
            for i in range(len(micro_batches)):
                inputs: tuple[torch.Tensor, ...] = ()
                for s in range(last + 1):
                    nxt = self._holder.get(s + 1)
                    if self._holder[s] == me:
                        module = self.modules[self.ids.index(s)]
                        module.micro_batch = i
                        out = module(*inputs)
                        if s == last:
                            total += out.to(self._loss_dtype)
                        elif nxt == me:
                            inputs = out
                        else:
                            for t in out:
                                dist.send(t.contiguous(), dst=nxt, group=self.pp_group)
                    elif nxt == me:
                        inputs = tuple(torch.empty_like(t, requires_grad=False)
                                       for t in self._inputs[s + 1])
                        for t in inputs:
                            dist.recv(t, src=self._holder[s], group=self.pp_group)
        finally:
            for m in self.modules:
                m.micro_batches = []
        return total

    def _check(self, micro_batches: list[K3Batch]) -> None:
        if len(micro_batches) != self.n_microbatches:
            raise ValueError(f"the schedule was built for {self.n_microbatches} micro-batches, "
                             f"got {len(micro_batches)}")

