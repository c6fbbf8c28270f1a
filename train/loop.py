"""The training loop: one screen of logic, everything else in small helpers."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data_pipeline.manifest import manifest_path
from model.batch import K3Batch
from model.k3 import K3Model
from model.moe import update_balancers
from model.ops import cpu as cpu_kernels
from parallel.apply import ParallelPlan, parallelize, shard_experts, shard_stages
from parallel.topology import Topology

from .checkpoint import Checkpointer
from .checkpoint_integrity import resume_checkpoint
from .config import TrainConfig, validate_train_config
from .data import build_loader
from .distributed import DistEnv, init_distributed, init_topology, shutdown
from .flops import PeakFlops, training_flops_per_token, vision_training_flops
from .host_allocator import keep_freed_host_memory
from .init_from import load_initial_weights
from .init_from import resolve as resolve_init_source
from .metrics import MetricsLogger
from .optim.factory import build_optimizer, describe_groups, set_lr
from .optim.qk_clip import QKClip
from .precision.recipe import PrecisionRecipe
from .run_log import Eta
from .schedule import lr_at
from .signals import EXIT_DONE, EXIT_PREEMPTED, PreemptionFlag
from .startup_checks import check_kernel_compiler
from .step_stats import merge_stage_figures, moe_stats, peak_memory_gb
from .validation import Validator

log = logging.getLogger("k3.train")


class NonFiniteLossError(RuntimeError):
    pass


def kernels_in_use(cfg: TrainConfig, precision: PrecisionRecipe, device: torch.device) -> str:
    """What runs the work of the model's autograd functions, KDA and attention (the start-up
    log): the native kernels take fp32 CPU tensors only."""
    parts = []
    if (device.type == "cpu" and precision.dtype is None and not precision.fp64
            and cpu_kernels.kernels_in_use()):
        parts.append("native CPU")
    if cfg.fused_kernels:
        parts.append("fused (compiled)")
    if cfg.compile:
        parts.append("compiled sublayers")
    return " + ".join(parts) or "torch ops"


def seed_everything(seed: int, deterministic: bool) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Not also NaN-filling every torch.empty (torch's default under deterministic
        # algorithms, a pass over every new allocation): no operator here reads memory it has
        # not written, and the native kernels' tests hold every output element to the
        # references.
        torch.utils.deterministic.fill_uninitialized_memory = False


def inject_rank_failure(step: int, rank: int) -> None:
    """K3_FAULT_RANK_FAILURE=<rank>:<step>:kill|hang: that rank dies by SIGKILL, or stops
    answering, as step <step> starts while the others go on into its collectives (the
    failing-rank tests)."""
    spec = os.environ.get("K3_FAULT_RANK_FAILURE")
    if not spec:
        return
    at_rank, at_step, kind = spec.split(":")
    if int(at_rank) == rank and int(at_step) == step:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1e9)


@contextlib.contextmanager
def run_guard(topology: Topology, preempt: PreemptionFlag, current_step) -> Iterator[None]:
    """Around a run's steps: on a failure, which ranks did not arrive (at `current_step()`);
    always the signal handlers restored, the topology and the process group taken down (with a
    barrier only after success: a hung rank would hold the others in it)."""
    failed = True
    try:
        yield
        failed = False
    except Exception as err:
        if topology.initialized:
            name_unresponsive_ranks(topology, current_step(), err)
        raise
    finally:
        preempt.restore()
        topology.destroy()
        shutdown(barrier=not failed)


def finish_run(cfg: TrainConfig, metrics: MetricsLogger, run_dir: Path, step: int,
               env: DistEnv) -> None:
    """After the last step taken: the plot and W&B closed, DONE when every step was taken."""
    metrics.finish(run_dir / "training.png" if cfg.logging.plot else None)
    if step == cfg.steps:
        write_marker(run_dir / "DONE", step, env)


def set_scheduled_lr(cfg: TrainConfig, optimizers: list[torch.optim.Optimizer],
                     step: int) -> float:
    """The schedule's learning rate for step `step` (0-based), set on the optimizers."""
    lr = lr_at(step, peak_lr=cfg.optim.lr, total_steps=cfg.steps,
               warmup_steps=cfg.optim.warmup_steps, schedule=cfg.optim.schedule,
               min_lr_ratio=cfg.optim.min_lr_ratio)
    set_lr(optimizers, lr)
    return lr


def checkpoint_and_stop(cfg: TrainConfig, step: int, env: DistEnv, preempt: PreemptionFlag,
                        run_dir: Path, ckpt: Checkpointer, model: K3Model,
                        optimizers: list[torch.optim.Optimizer], rank_state) -> bool:
    """After step `step`: a checkpoint with this rank's `rank_state()` when one is due
    (periodic, final, or every rank agrees a preemption signal came); returns whether the run
    must stop for the preemption (PREEMPTED written)."""
    preempted = preempt.agreed(env.device)
    periodic = cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0
    final = step == cfg.steps and cfg.checkpoint.save_at_end
    if periodic or preempted or final:
        path = ckpt.save(step, model, optimizers, rank_state())
        if env.is_main:
            log.info("checkpoint %s", path)
    if preempted and step < cfg.steps:
        log.warning("preemption signal received: checkpointed at step %d, exiting", step)
        write_marker(run_dir / "PREEMPTED", step, env)
        return True
    return False


def write_marker(path: Path, step: int, env: DistEnv) -> None:
    """DONE / PREEMPTED in the run directory: how the Slurm job script learns the outcome."""
    if env.is_main:
        path.write_text(json.dumps({"step": step, "time": time.time()}))


def forward_backward(model: K3Model, micro_batches: list[K3Batch], device: torch.device,
                     precision: PrecisionRecipe, parallel: ParallelPlan,
                     loss_of=None) -> torch.Tensor:
    """Accumulates gradients of the loss averaged over the global batch's loss units (tokens,
    or conversations under per-conversation averaging); returns the step's mean loss.
    `loss_of(model, index, micro_batch)`: a micro-batch's summed loss over its loss units in
    place of the model's token cross entropy (post-training objectives; not under pipeline
    parallelism)."""
    micro_batches = [parallel.local_batch(mb) for mb in micro_batches]
    # A tensor, not a host number: the count needs no sync (and a dry run's fake tensors have
    # no values to read). Summed in float64: per-document weights (1/n each) add up to their
    # document count in any grouping of ranks and micro-batches, to far below fp32's rounding.
    local_tokens = torch.stack([mb.loss_units() for mb in micro_batches])
    global_tokens = parallel.sum_loss_tokens(local_tokens.sum().reshape(1).to(device,
                                                                              torch.float64))
    if parallel.pipeline is not None:  # the schedule runs every micro-batch on every stage
        with parallel.loss_context():
            loss = parallel.pipeline.step([mb.to(device) for mb in micro_batches],
                                          global_tokens.float(), precision.autocast)
        return parallel.sum_loss_tokens(parallel.sum_over_stages(loss))
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(micro_batches):
        parallel.sync_gradients(last=i == len(micro_batches) - 1)
        with parallel.loss_context():
            with precision.autocast():
                summed = (model(mb.to(device)).loss_sum if loss_of is None
                          else loss_of(model, i, mb.to(device)))
            loss = summed / global_tokens.squeeze().clamp_min(1.0).to(summed.dtype)
            loss.backward()
        loss_sum = loss_sum + loss.detach()  # in the loss's dtype (float64 for fp64)
    return parallel.sum_loss_tokens(loss_sum)


@dataclass
class StepResult:
    loss: torch.Tensor
    grad_norm: torch.Tensor
    finite: bool
    clip_row: dict


def train_step(model: K3Model, optimizers: list[torch.optim.Optimizer],
               micro_batches: list[K3Batch], device: torch.device, precision: PrecisionRecipe,
               parallel: ParallelPlan, optim_cfg, on_gradients=None,
               check_finite: bool = True, loss_of=None) -> StepResult:
    """One optimizer step on the micro-batches of this rank; the same code for every layout.
    `on_gradients(model)` sees the reduced gradients before clipping (tests read them). QK-Clip
    runs as the optimizers' post-step hook (QKClip, registered by build_parallel_model).
    `check_finite=False` steps without reading the loss and norm on the host (the dry run's
    fake tensors have no values). `loss_of`: forward_backward's."""
    loss = forward_backward(model, micro_batches, device, precision, parallel, loss_of)
    parallel.finish_gradients()
    if on_gradients is not None:
        on_gradients(model)
    max_norm = optim_cfg.clip_grad_norm if optim_cfg.clip_grad_norm > 0 else math.inf
    grad_norm = parallel.clip_grad_norm_(max_norm)
    finite = bool(torch.isfinite(loss) & torch.isfinite(grad_norm)) if check_finite else True
    if finite:
        for opt in optimizers:  # in order: the last one's post-step hook runs QK-Clip
            opt.step()
        parallel.after_optimizer_step()  # ZeRO-1: each owner broadcasts what it clipped
    qk_clip = QKClip.of(optimizers)
    clip_row = qk_clip.end_step() if qk_clip is not None else {}
    balancers = [moe.balancer for moe in model.moe_layers() if moe.balancer is not None]
    if finite:  # every layer's histograms in one integer all-reduce
        update_balancers(balancers, parallel.sum_balancer_counts)
    else:
        for balancer in balancers:
            balancer.clear()
    model.zero_grad(set_to_none=True)  # all of them: a ZeRO-1 rank's optimizer holds only its own
    return StepResult(loss, grad_norm, finite, clip_row)


def build_layout_model(cfg: TrainConfig, topology: Topology | None, device: torch.device,
                       storage=contextlib.nullcontext
                       ) -> tuple[K3Model, PrecisionRecipe, ParallelPlan]:
    """`cfg.model` under this rank's layout, materialised and initialised from `cfg.seed` (see
    build_parallel_model), with its precision recipe: a model to train, or one that only runs
    forward (a post-training teacher)."""
    if device.type == "cpu":  # on every rank: the model's fp32 CPU ops take the C kernels
        cpu_kernels.install()
    with torch.device("meta"):
        model = K3Model(cfg.model, seed=cfg.seed)
    shard_stages(model, topology, cfg)
    shard_experts(model, topology, cfg)
    precision = PrecisionRecipe.build(cfg.precision, device, model)
    parallel = parallelize(model, topology, cfg, autocast=precision.autocast, device=device,
                           activation_dtype=precision.dtype)
    with storage():
        parallel.materialize(device, cfg.seed)
    return model, precision, parallel


def build_parallel_model(cfg: TrainConfig, topology: Topology | None, device: torch.device,
                         storage=contextlib.nullcontext
                         ) -> tuple[K3Model, PrecisionRecipe, ParallelPlan,
                                    list[torch.optim.Optimizer]]:
    """Model, precision, layout and optimizers, in that order (the optimizers see the sharded
    parameters), and QK-Clip on the optimizers (optim.qk_clip_tau > 0). The model is built on
    the meta device and the layout applied there; then only what this rank holds is
    materialised on `device` and initialised, each part equal to that part of the
    single-process model with the same seed (`cfg.seed`). `storage()`: the context the
    parameters are created in (the dry run's fake tensors)."""
    model, precision, parallel = build_layout_model(cfg, topology, device, storage)
    optimizers = build_optimizer(model, cfg.optim, owns=parallel.owns,
                                 exchange=parallel.exchange)
    if cfg.optim.qk_clip_tau > 0:
        QKClip(model, cfg.optim.qk_clip_tau, parallel).register(optimizers)
    for moe in model.moe_layers():
        if moe.balancer is not None:
            moe.balancer.reduce_fn = parallel.sum_balancer_counts
    return model, precision, parallel, optimizers


def start_run(cfg: TrainConfig, data: bool = True) -> tuple[DistEnv, Topology, Path]:
    """The process group, the checks that need it (the world size, the kernel compiler), the
    topology, the seeds and the run directory (its DONE marker cleared). `data=False`: the data
    config is not checked (post-training reads tasks)."""
    env = init_distributed(cfg.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    validate_train_config(cfg, env.world_size, data=data)
    check_kernel_compiler(cfg, env.device)
    topology = init_topology(cfg.parallel, env, cfg.model)
    seed_everything(cfg.seed, cfg.deterministic)
    run_dir = Path(cfg.run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "DONE").unlink(missing_ok=True)
    return env, topology, run_dir


def train(cfg: TrainConfig) -> int:
    """Runs (or resumes) the configured training; returns the process exit code."""
    if cfg.dry_run.world_size > 0:
        from .dry_run import run_dry

        return run_dry(cfg)
    host_memory = keep_freed_host_memory()
    env, topology, run_dir = start_run(cfg)
    dp_size = topology.dp
    accum = cfg.stage.global_batch_size // (cfg.stage.micro_batch_size * dp_size)
    model, precision, parallel, optimizers = build_parallel_model(
        cfg, topology if env.world_size > 1 else None, env.device)
    if env.is_main:
        log.info("layout: %s", topology.describe())
        log.info("optimizer groups:\n%s", describe_groups(model, optimizers))
    dp_rank = topology.rank_in("dp") if env.world_size > 1 else 0
    loader = build_loader(cfg, dp_rank=dp_rank, dp_size=dp_size)
    if cfg.epochs is not None:  # the same on every rank: the global batch's rows per epoch
        cfg.steps = cfg.epochs * (loader.steps_per_epoch // accum)
        if env.is_main:
            log.info("epochs=%d: %d optimizer steps", cfg.epochs, cfg.steps)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint.keep_last, env.rank,
                        env.world_size, parallel.sharded_state)
    step = 0
    latest, fallbacks = resume_checkpoint(ckpt) if cfg.checkpoint.resume else (None, [])
    if latest is not None:
        switched: list[str | None] = []  # a stage switch (context curriculum) maps the data
        step = ckpt.load(latest, model, optimizers,
                         lambda s: switched.append(loader.continue_from(s["loader"])),
                         verified=True)
        log.info("resumed from %s at step %d", latest, step)
        if switched and switched[0] is not None and env.is_main:
            log.info("stage %s continues the run (%s): its data from loader step %d",
                     cfg.stage.name, switched[0], loader.step)
    started_from = None
    if latest is None and cfg.init_from is not None:
        source = resolve_init_source(cfg.init_from)
        load_initial_weights(source, model, ckpt)
        started_from = f"{source.kind} {source.path.resolve()}"
        if env.is_main:
            log.info("model weights from %s", started_from)
    metrics = MetricsLogger(run_dir, env.rank, cfg.logging, cfg.steps, step,
                            run_config=asdict(cfg))
    if started_from is not None:
        metrics.note("init/source", started_from)
    if fallbacks:
        metrics.note("resume/rejected_checkpoints", " | ".join(fallbacks))
    validator = (Validator(cfg, manifest_path(Path(cfg.data.output_dir).resolve()), dp_rank,
                           dp_size) if cfg.eval.every > 0 else None)
    eta = Eta(cfg.steps)
    flops_per_token = training_flops_per_token(cfg.model, cfg.stage.seq_len)
    peak = PeakFlops.measure(env.device)
    preempt = PreemptionFlag()
    tokens_per_step = cfg.stage.global_batch_size * cfg.stage.seq_len
    batches = iter(loader)
    nonfinite_in_a_row = 0
    exit_code = EXIT_DONE
    if env.is_main:
        log.info("training %s for %d steps: dp=%d, %d micro-batch%s of %d x %d per rank, %s, "
                 "kernels: %s", cfg.model.name, cfg.steps, dp_size, accum,
                 "" if accum == 1 else "es", cfg.stage.micro_batch_size, cfg.stage.seq_len,
                 precision.describe(),
                 kernels_in_use(cfg, precision, env.device))
        log.info("host memory: %s", host_memory)
        log.info("layout: %s", topology.describe())
    with run_guard(topology, preempt, lambda: step):
        while step < cfg.steps:
            t0 = time.perf_counter()
            lr = set_scheduled_lr(cfg, optimizers, step)
            micro_batches = [next(batches) for _ in range(accum)]
            vision_flops = vision_training_flops(cfg.model, micro_batches)
            inject_rank_failure(step, env.rank)
            result = train_step(model, optimizers, micro_batches,
                                env.device, precision, parallel, cfg.optim)
            loss, grad_norm, finite = result.loss, result.grad_norm, result.finite
            nonfinite_in_a_row = 0 if finite else nonfinite_in_a_row + 1
            clip_row = {key: value.item() for key, value in result.clip_row.items()}
            step += 1
            elapsed = time.perf_counter() - t0
            evaluated = validator is not None and Validator.due(cfg, step)
            val = ({"val_loss": validator.loss(model, env, precision, parallel)}
                   if evaluated else {})
            eta_s = eta.update(step, time.perf_counter() - t0)
            if step % cfg.logging.log_every == 0 or step == cfg.steps or not finite or evaluated:
                tps = tokens_per_step / elapsed
                vision = torch.tensor([float(vision_flops)], dtype=torch.float64, device=env.device)
                model_flops = tokens_per_step * flops_per_token + float(
                    parallel.sum_over_replicas(vision))
                row = {"step": step, "loss": float(loss), **val, "lr": lr,
                       "grad_norm": float(grad_norm), "tokens_per_s": tps, "step_time_s": elapsed,
                       "eta_s": eta_s,
                       "model_flops": model_flops,
                       "mfu": model_flops / elapsed / (peak.flops * env.world_size),
                       "mfu_peak_source": peak.source, "peak_mem_gb": peak_memory_gb(env.device),
                       "skipped": not finite, "nonfinite_in_a_row": nonfinite_in_a_row,
                       **parallel.stage_figures({**moe_stats(model), **clip_row},
                                                merge_stage_figures)}
                metrics.log(row)
            if nonfinite_in_a_row >= cfg.max_nonfinite_in_a_row:
                raise NonFiniteLossError(
                    f"{nonfinite_in_a_row} steps in a row had a non-finite loss or gradient "
                    f"(last at step {step}); stopping. Lower optim.lr, check the data, or raise "
                    f"max_nonfinite_in_a_row.")
            if checkpoint_and_stop(cfg, step, env, preempt, run_dir, ckpt, model, optimizers,
                                   lambda: {"loader": loader.state_dict()}):
                exit_code = EXIT_PREEMPTED
                break
        finish_run(cfg, metrics, run_dir, step, env)
    return exit_code


def name_unresponsive_ranks(topology: Topology, step: int, err: Exception) -> None:
    """A failed step on one of several ranks: which ranks did not arrive (hung or dead), said on
    every rank that can tell, before the error ends this one."""
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
    missing = topology.unresponsive_ranks()
    if missing:
        log.error("rank %d: step %d failed (%s: %s); ranks that did not arrive within "
                  "parallel.timeout_s=%gs: %s", topology.rank, step + 1, type(err).__name__,
                  first, topology.timeout_s, missing)
    else:
        log.error("rank %d: step %d failed (%s: %s); every rank answered the roll call",
                  topology.rank, step + 1, type(err).__name__, first)
