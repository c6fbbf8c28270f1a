"""`k3-train ... dry_run.world_size=N dry_run.rank=R`: one whole optimizer step of rank R of an
N-rank job, in one process, with no real storage: torch's fake process group at world N,
`FakeTensorMode` for every parameter, activation and optimizer state, and the real topology,
parallel plans, MoonEP dispatch and optimizers. What it measures goes to
`<run_dir>/dry_run.json`:

    world_size, rank, layout          the job and the validated layout
    parameters_on_rank                elements of the parameters this rank holds (its shards)
    peak_memory_bytes                 a step's peak of tensor memory on the device, in
                                      the CUDA allocator's 512-byte blocks (step_probes.py),
                                      with the optimizer state a first step only makes
                                      in its update
    memory_bytes                      what the peak is made of at known points: parameters
                                      and buffers, the gradients once reduced, the optimizer
                                      state after the step
    collective_bytes                  {op: bytes per step}: the buffer of every collective
                                      this rank calls (all_reduce's and broadcast's tensor,
                                      all_gather's output, reduce_scatter's and all_to_all's
                                      input, send's and recv's tensor); collective_calls: how
                                      many calls
    planned_memory_bytes              k3-plan's memory per GPU for the same layout
    planned_collective_bytes          k3-plan's bytes per op for a rank of this rank's
                                      pipeline stage (train/collective_sizing.py)

The step runs on the CPU's fake tensors in the dtypes the target device would use: a run meant
for GPUs (device auto or cuda) computes under bf16 autocast as precision=auto does there
(torch's CUDA autocast needs a CUDA build, so the fake tensors live on the CPU). The batches
are synthetic, of the stage's shape (rows, sequence length, one document per row); no dataset
is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.ops import dispatch
from parallel.topology import Topology

from .config import TrainConfig, validate_train_config
from .step_probes import CollectiveBytes, StepMemory, allocator_bytes

log = logging.getLogger("k3.train")

@contextlib.contextmanager
def _gpu_sized_tiles():
    """The torch forms of attention and KDA loop in Python over tiles and chunk blocks sized
    for a CPU core's cache (1 MiB of scores, 2^18 elements). The dry run stands for a GPU,
    where those forms are fused kernels (flash attention, fla's KDA): it takes tiles of 1024 x
    1024 and all of a sequence's chunks at once, about 50x fewer operators (each a Python
    dispatch on fake tensors). Their temporaries (tens of MiB a layer) move the peak by far
    less than its parts."""
    from model.ops import attention
    from model.ops.kda import bounded

    saved = attention.BLOCK_Q, attention.BLOCK_K, attention.TILE_ELEMENTS, bounded._BLOCK_ELEMENTS
    attention.BLOCK_Q = attention.BLOCK_K = 1024
    attention.TILE_ELEMENTS = 2 ** 24
    bounded._BLOCK_ELEMENTS = 2 ** 26
    try:
        yield
    finally:
        (attention.BLOCK_Q, attention.BLOCK_K, attention.TILE_ELEMENTS,
         bounded._BLOCK_ELEMENTS) = saved


def _flash_attention_forward(q, k, v, q_segments, k_segments, scale, causal, q_offset):
    """A flash attention kernel's outputs, as much device memory as it makes: o [B, H, T, Dv]
    in fp32 (the attention output K3 keeps), the rows' logsumexp and maxima [B, H, T]; its
    score tiles live in on-chip memory. Fake tensors only (declines real ones: their values
    would be unset)."""
    if not isinstance(q, FakeTensor):
        return None
    B, H, T, _ = q.shape
    fp32 = dict(dtype=torch.float32)
    return (q.new_empty(B, H, T, v.shape[-1], **fp32), q.new_empty(B, H, T, **fp32),
            q.new_empty(B, H, T, **fp32))


def _flash_attention_backward(q, k, v, q_segments, k_segments, o, lse, grad_o, scale, causal,
                              q_offset):
    if not isinstance(q, FakeTensor):
        return None
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _KDAChunkShapes(torch.autograd.Function):
    """fla's chunk_kda as a dry run counts it: o in the input dtype, the final states in fp32;
    it keeps its inputs for the backward (recomputing the chunk states there)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, states: int):
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        _, _, H, K = q.shape
        final = (q.new_empty(states, H, K, v.shape[-1], dtype=torch.float32) if states
                 else None)
        return v.new_empty(v.shape), final

    @staticmethod
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        return *grads, None if initial_state is None else torch.empty_like(initial_state), None


def _kda_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
               lower_bound):
    """kda_chunk's registered-kernel seam ("kda_recurrence"), fake tensors only."""
    if not isinstance(q, FakeTensor):
        return None
    sequences = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return _KDAChunkShapes.apply(q, k, v, g, beta, initial_state,
                                 sequences if output_final_state else 0)


# The dry run's attention and KDA through the model's kernel seams (model/ops/dispatch.py): the
# torch forms' Python loops over tiles and chunks take minutes at long context (a 1M-token CP
# fragment is ~10^5 attention tiles and 2048 sequential KDA chunks a layer).
GPU_KERNEL_SHAPES = {"attention_forward": _flash_attention_forward,
                     "attention_backward": _flash_attention_backward,
                     "kda_recurrence": _kda_chunk}


def _fused_situ_glu_forward(gate, up, beta_gate, beta_up):
    """SiTU-GLU as `fused_kernels=true` runs it on a GPU (one Triton kernel from inductor): its
    output only, where the torch form makes five fp32 intermediates of the activation's size
    (at k3_full's expert width and 16K tokens, 9 GiB a layer's backward)."""
    if not isinstance(gate, FakeTensor):
        return None
    return torch.empty_like(gate)


def _fused_situ_glu_backward(gate, up, grad_out, beta_gate, beta_up):
    if not isinstance(gate, FakeTensor):
        return None
    return torch.cat([torch.empty_like(gate), torch.empty_like(up)], dim=-1)


# With fused_kernels=true: the element-wise kernels whose torch forms' intermediates are large
# at full size (the others' are a few hundred MiB).
FUSED_KERNEL_SHAPES = {"situ_glu_forward": _fused_situ_glu_forward,
                       "situ_glu_backward": _fused_situ_glu_backward}


@contextlib.contextmanager
def _fake_world_patches():
    """Two places where torch reads a value on the host that a fake world cannot give:

    - _StridedShard works out which rows a rank holds with a small host tensor (an arange it
      splits, then reads with .tolist()); under FakeTensorMode it would be fake and unreadable.
      Its inputs and outputs are integers, so it runs on real tensors here.
    - A pipeline schedule's first step has the stages vote whether their boundary shapes are
      known (STATIC) or must be sent around first (DYNAMIC), multiplying the votes across the
      stages and reading the product; on the fake process group no stage answers. Every stage
      here declares its boundaries (parallel/pipeline.py), so each decides its mode from its
      own vote, as the real product would (a stage that needs DYNAMIC stops the dry run).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = _StridedShard.local_shard_size_and_offset
    warmup = _PipelineSchedule._warmup_p2p

    @functools.wraps(strided)
    def on_real_tensors(*args, **kwargs):
        with unset_fake_temporarily():
            return strided(*args, **kwargs)

    def own_votes(self, stages, has_backward, p2p_done):
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} does not declare its "
                                   "boundary shapes: a dry run cannot infer them")
            stage._inference_mode = InferenceMode.STATIC

    _StridedShard.local_shard_size_and_offset = on_real_tensors
    _PipelineSchedule._warmup_p2p = own_votes
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = strided
        _PipelineSchedule._warmup_p2p = warmup


def synthetic_micro_batches(cfg: TrainConfig, topology: Topology | None) -> list[K3Batch]:
    """This rank's micro-batches of one step: the stage's rows and length, one document per
    row, every position a loss token (the most the loss and the MoE see). Without context
    parallelism the rows carry no document boundaries (cu_seqlens None, which means one
    document per row): attention then runs as one fused operator, as flash attention does on a
    GPU, not as the CPU's tiles (whose Python loop would cost the dry run minutes and stand for
    no GPU kernel)."""
    dp, cp = (1, 1) if topology is None else (topology.dp, topology.cp)
    count = cfg.stage.global_batch_size // (cfg.stage.micro_batch_size * dp)
    rows, seq = cfg.stage.micro_batch_size, cfg.stage.seq_len
    generator = torch.Generator().manual_seed(cfg.seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(4, cfg.model.vocab_size, (rows, seq), generator=generator)
        bounds = cu_seqlens_from_lengths([[seq]] * rows, seq) if cp > 1 else None
        out.append(K3Batch(tokens, tokens.roll(-1, 1), bounds))
    return out


def dry_run_config(cfg: TrainConfig) -> TrainConfig:
    """The run as the dry run executes it: on the CPU's fake tensors, with the precision the
    target device would use (precision=auto means bf16 on a GPU), no checkpoints read, no W&B."""
    cfg = dataclasses.replace(cfg)
    target_gpu = cfg.device in ("auto", "cuda")
    precision = dataclasses.replace(cfg.precision)
    if precision.name == "auto":
        precision.name = "bf16" if target_gpu else "fp32"
    precision.te = "off"  # Transformer Engine needs a real GPU
    cfg.precision = precision
    cfg.device = "cpu"
    cfg.compile = cfg.fused_kernels = False  # no compiled kernels on fake tensors
    return cfg


@dataclasses.dataclass
class StepMeasurement:
    parameters: int  # elements of the parameters this rank holds
    peak_memory_bytes: int
    memory_bytes: dict[str, int]  # parameters and buffers, reduced gradients, optimizer state
    collective_bytes: dict[str, int]
    collective_calls: dict[str, int]


def measure_step(cfg: TrainConfig, topology: Topology | None, fake=None,
                 kernels: dict | None = None) -> StepMeasurement:
    """Builds this rank's part of the model as k3-train does and runs one optimizer step on
    synthetic micro-batches under the probes; `fake`: a FakeTensorMode the storage is made in
    (the dry run), None: real tensors; `kernels`: the only registered kernels that run (default
    none: the torch forms). The layout is applied on the meta device (process groups and meshes
    are real); only the storage made from then on is fake."""
    from .loop import build_parallel_model, train_step

    device = torch.device("cpu")
    micro_batches = synthetic_micro_batches(cfg, topology)
    memory, counter, sizes = StepMemory(), CollectiveBytes(), {}
    storage = (lambda: fake) if fake is not None else contextlib.nullcontext
    with dispatch.kernels_enabled(False), _fake_world_patches():
        model, precision, parallel, optimizers = build_parallel_model(
            cfg, topology if topology is not None and topology.world_size > 1 else None, device,
            storage=storage)
        params = [_local(p) for p in model.parameters()]
        sizes["parameters"] = _nbytes(params) + _nbytes(list(model.buffers()))
        memory.track([params, list(model.buffers())])

        peaks = {}

        def after_backward(model):  # the reduced gradients, before clipping
            sizes["gradients"] = _nbytes([_local(p.grad) for p in model.parameters()
                                          if p.grad is not None])
            peaks["forward_backward"] = memory.restart_peak()

        # Only `kernels` in the step: building on the CPU registers the native kernels.
        with storage(), memory, counter, dispatch.only(kernels or {}):
            train_step(model, optimizers, micro_batches, device, precision, parallel, cfg.optim,
                       on_gradients=after_backward, check_finite=False)
        state = [list(opt.state.values()) for opt in optimizers]
        sizes["optimizer_state"] = _nbytes(state)
    # The first step makes the optimizer state in its update; every later step's forward and
    # backward run beside it (and are otherwise the same: the gradients start unset each step).
    peak = max(peaks["forward_backward"] + _nbytes(state, rounded=True), memory.peak)
    return StepMeasurement(sum(p.numel() for p in params), peak, sizes,
                           dict(sorted(counter.bytes.items())),
                           dict(sorted(counter.calls.items())))


def run_dry(cfg: TrainConfig) -> int:
    """The dry run (module docstring); writes <run_dir>/dry_run.json, returns the exit code."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .sizing import plan

    world, rank = cfg.dry_run.world_size, cfg.dry_run.rank
    run_cfg = dry_run_config(cfg)
    validate_train_config(run_cfg, world, data=False)
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    topology = Topology.from_config(run_cfg.parallel, world, run_cfg.model).initialize("cpu")
    try:
        planned = plan(cfg, world_size=world, pp_rank=topology.rank_in("pp"))
        with _gpu_sized_tiles():
            kernels = {**GPU_KERNEL_SHAPES, **(FUSED_KERNEL_SHAPES if cfg.fused_kernels else {})}
            measured = measure_step(run_cfg, topology,
                                    FakeTensorMode(allow_non_fake_inputs=True), kernels)
        layout = topology.describe()
    finally:
        topology.destroy()
        dist.destroy_process_group()
    result = {"world_size": world, "rank": rank, "layout": layout,
              "parameters_on_rank": measured.parameters,
              "peak_memory_bytes": measured.peak_memory_bytes,
              "memory_bytes": measured.memory_bytes,
              "collective_bytes": measured.collective_bytes,
              "collective_calls": measured.collective_calls,
              "planned_memory_bytes": round(planned["memory_per_gpu"]["total_gib"] * 2**30),
              "planned_collective_bytes": planned["collective_bytes"],
              "seconds": round(time.perf_counter() - started, 1)}
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "dry_run.json").write_text(json.dumps(result, indent=2) + "\n")
    planned_bytes = result["planned_collective_bytes"]
    log.info("dry run of rank %d of %d: peak %.2f GiB (planned %.2f GiB), %s; wrote %s", rank,
             world, result["peak_memory_bytes"] / 2**30, result["planned_memory_bytes"] / 2**30,
             ", ".join(f"{k} {v / 2**30:.2f} GiB (planned {planned_bytes.get(k, 0) / 2**30:.2f})"
                       for k, v in result["collective_bytes"].items()),
             run_dir / "dry_run.json")
    return 0


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _nbytes(tensors, rounded: bool = False) -> int:
    """Bytes of the distinct storages under `tensors` (nested lists and dicts of tensors);
    `rounded`: each in the allocator's blocks, as StepMemory counts them."""
    from torch.utils._pytree import tree_leaves

    seen = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            nbytes = storage.nbytes()
            seen[storage._cdata] = allocator_bytes(nbytes) if rounded else nbytes
    return sum(seen.values())
