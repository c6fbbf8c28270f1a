"""Typed training configuration (Hydra structured configs) and its start-up validation.

Groups: model, data, stage, optim, parallel, precision, logging, checkpoint, eval, and for
post-training rollout, rl, mopd (all overridable on the command line). `validate_train_config`
runs before any process group or allocation and names the field, the bad value and what would
be valid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from data_pipeline.config import DataConfig, StageConfig
from data_pipeline.pipeline import is_prepared
from model.config import K3Config, k3_tiny
from model.errors import ConfigError
from parallel.config import MoonEPConfig, ParallelConfig
from parallel.topology import Topology

from .posttrain.config import MOPDConfig, RLConfig, RolloutConfig, validate_posttrain
from .startup_checks import check_betas, check_model_matches_data, check_no_secrets

__all__ = ["ConfigError", "MoonEPConfig", "ParallelConfig", "TrainConfig",
           "validate_train_config"]


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | muon (Muon for hidden matrices, AdamW for the rest)
    lr: float = 3e-3  # peak lr (Muon's, when name=muon)
    adamw_lr: float | None = None  # lr of the AdamW groups under name=muon (default: lr)
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95  # Muon
    nesterov: bool = True  # Muon
    ns_steps: int = 5  # Muon Newton-Schulz iterations
    # Muon steps its matrices in buckets of this many MiB of parameters (each bucket's updates
    # and exchange buffers exist only while it is stepped): the step's memory beyond the state
    muon_bucket_mb: int = 1024
    per_head: bool = True  # Muon: orthogonalise Q/K/V per head block
    qk_clip_tau: float = 100.0  # MuonClip threshold on MLA max logits (<= 0 disables)
    schedule: str = "cosine"  # cosine | wsd | constant
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    clip_grad_norm: float = 1.0  # <= 0 disables
    # none | cpu: the AdamW groups' state on the host, stepped by DeepSpeed's DeepSpeedCPUAdam
    offload: str = "none"


@dataclass
class PrecisionConfig:
    # auto (bf16 autocast on GPU, fp32 on CPU) | fp32 | bf16 | mxfp4_qat | fp64 (parameters and
    # compute in float64: the layout-equivalence tests, where fp32 round-off would hide bugs)
    name: str = "auto"
    qat_scale_mode: str = "floor"  # MX scale rounding: floor (OCP) | rceil (TE)
    # Transformer Engine for the LM's dense linears (CUDA only): "auto" uses it with the recipe
    # the GPU supports (Float8BlockScaling on 9.x, MXFP8BlockScaling on 10.x) where TE is
    # installed; "off" keeps them in bf16 (attention and latent projections stay high
    # precision in K3's own recipe).
    te: str = "off"


@dataclass
class LoggingConfig:
    log_every: int = 1
    wandb: bool = True
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "k3"
    wandb_entity: str | None = None
    plot: bool = True  # loss/throughput PNG at the end
    verbose: bool = False  # datatrove's and megatron's INFO logs while preparing data


@dataclass
class CheckpointConfig:
    every: int = 50  # steps; <= 0 only on signals and at the end
    keep_last: int = 3
    resume: bool = True  # continue from <run_dir>/checkpoints/latest when it exists
    save_at_end: bool = True


@dataclass
class EvalConfig:
    every: int = 50  # steps between validation-loss evaluations (and at the end); 0: never
    batches: int = 2  # global batches of the held-out split per evaluation


@dataclass
class SlurmConfig:
    """How `k3-submit` turns this training config into an sbatch job (one torchrun per node)."""

    job_name: str = "k3"
    nodes: int = 1
    gpus_per_node: int = 0  # 0: a CPU job
    procs_per_node: int | None = None  # ranks per node; default gpus_per_node, or 1 on CPU
    cpus_per_node: int = 2
    mem: str | None = None  # sbatch --mem, e.g. "0" (all) or "16G"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "01:00:00"
    constraint: str | None = None
    exclusive: bool = False
    output_dir: str = "${run_dir}/slurm"  # sbatch script, resolved config, logs
    extra_sbatch: list[str] = field(default_factory=list)  # e.g. ["--reservation=big"]
    env: dict[str, str] = field(default_factory=dict)
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    container_mounts: str | None = None
    requeue: bool = True
    signal_seconds: int = 120  # SIGUSR1 this long before the time limit: checkpoint + requeue
    max_restarts: int = 50  # stop requeueing after this many restarts
    shutdown_timeout_s: int = 300  # torchrun's grace period for the checkpoint on a signal

    def ranks_per_node(self) -> int:
        if self.procs_per_node is not None:
            return self.procs_per_node
        return self.gpus_per_node if self.gpus_per_node > 0 else 1


@dataclass
class DryRunConfig:
    """`dry_run.world_size=N dry_run.rank=R`: one optimizer step of rank R of an N-rank job on
    fake tensors and torch's fake process group (train/dry_run.py); 0: train for real."""

    world_size: int = 0
    rank: int = 0


@dataclass
class TrainConfig:
    model: K3Config = field(default_factory=k3_tiny)
    data: DataConfig = field(default_factory=DataConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    run_dir: str = "outputs/run"
    # The model's weights at the first start: a k3-train run, one of its checkpoints or a
    # k3-export directory (train/init_from.py); null: initialised from `seed`.
    init_from: str | None = None
    steps: int = 150
    # Passes over the stage's training data: when set, the run takes that many epochs' optimizer
    # steps (the data decides `steps`, the learning-rate schedule spans them).
    epochs: int | None = None
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    activation_checkpointing: bool = False
    compile: bool = False
    # torch.compile of only the element-wise kernels inside the model's autograd functions
    # (model/ops/fused.py), not of whole sublayers as `compile` does.
    fused_kernels: bool = False
    max_nonfinite_in_a_row: int = 5
    deterministic: bool = True
    # On-policy post-training (train/posttrain): rl | mopd, with `rollout`, `rl` and `mopd`;
    # none: training on `data`.
    posttrain: str = "none"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    mopd: MOPDConfig = field(default_factory=MOPDConfig)


def _fail(path: str, value, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: {valid}")


def _check_pipeline(cfg: TrainConfig, topo: Topology, micro_batches: int) -> None:
    """Enough micro-batches per data-parallel rank to fill the pipeline."""
    stages = _least_micro_batches(topo)
    if micro_batches < stages:
        _fail("stage.global_batch_size", cfg.stage.global_batch_size,
              f"must give at least {stages} micro-batches per data-parallel rank with "
              f"parallel.pipeline={topo.pp} and pipeline_schedule={topo.pipeline_schedule} "
              f"(global_batch_size / (micro_batch_size*data) = {micro_batches}): "
              + _micro_batch_hint(cfg.stage, topo.dp, stages))


def _least_micro_batches(topo: Topology) -> int:
    """Micro-batches a step needs per data-parallel rank: torch's schedules (1F1B, the V
    schedules) need one for every stage."""
    if topo.pp == 1:
        return 1
    return topo.pp * (topo.virtual_stages if topo.pipeline_schedule != "Interleaved1F1B" else 1)


def _micro_batch_hint(stage, dp: int, micro_batches: int) -> str:
    """What to change when the global batch does not split into at least `micro_batches`
    micro-batches per data-parallel rank: the largest micro-batch below the configured one
    that does, or else the global batch size that does."""
    rows = stage.global_batch_size // dp if stage.global_batch_size % dp == 0 else 0
    for size in range(min(stage.micro_batch_size, rows // micro_batches), 0, -1):
        if rows % size == 0:
            return f"set stage.micro_batch_size={size}"
    least = stage.micro_batch_size * dp * micro_batches
    return f"raise stage.global_batch_size to a multiple of {least}"


def validate_train_config(cfg: TrainConfig, world_size: int | None = None,
                          data: bool = True) -> TrainConfig:
    """Checks everything that can be checked before starting processes; raises ConfigError.
    `data=False`: not the data config and its files (a dry run reads no dataset)."""
    if world_size is None:
        world_size = (cfg.dry_run.world_size if cfg.dry_run.world_size > 0
                      else int(os.environ.get("WORLD_SIZE", "1")))
    cfg.model.validate("model")
    if data:
        cfg.data.validate("data")
        if not is_prepared(cfg.data):  # the run will read the raw sources first
            cfg.data.check_sources_exist("data")
    cfg.stage.validate("stage")
    if cfg.steps <= 0:
        _fail("steps", cfg.steps, "must be > 0")
    if cfg.epochs is not None and cfg.epochs <= 0:
        _fail("epochs", cfg.epochs, "must be > 0 or null (null: `steps` optimizer steps)")
    o = cfg.optim
    if o.name not in ("adamw", "muon"):
        _fail("optim.name", o.name, "must be one of ['adamw', 'muon']")
    if not o.lr > 0:
        _fail("optim.lr", o.lr, "must be > 0")
    if o.adamw_lr is not None and not o.adamw_lr > 0:
        _fail("optim.adamw_lr", o.adamw_lr, "must be > 0 or null")
    if o.weight_decay < 0:
        _fail("optim.weight_decay", o.weight_decay, "must be >= 0")
    if o.schedule not in ("cosine", "wsd", "constant"):
        _fail("optim.schedule", o.schedule, "must be one of ['constant', 'cosine', 'wsd']")
    if o.warmup_steps < 0:
        _fail("optim.warmup_steps", o.warmup_steps, "must be >= 0")
    if o.muon_bucket_mb < 1:
        _fail("optim.muon_bucket_mb", o.muon_bucket_mb, "must be >= 1 (MiB)")
    if not 0 <= o.min_lr_ratio <= 1:
        _fail("optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    check_betas(o.betas)
    if not all(0 <= b < 1 for b in o.betas):
        _fail("optim.betas", o.betas, "each must be in [0, 1)")
    if o.offload not in ("none", "cpu"):
        _fail("optim.offload", o.offload, "must be one of ['cpu', 'none']")
    if o.offload == "cpu" and (cfg.parallel.tensor > 1 or cfg.parallel.data_shard == "full"
                               or cfg.parallel.expert > 1 or cfg.parallel.pipeline > 1
                               or cfg.device == "cuda"):
        _fail("optim.offload", o.offload,
              "cpu needs plain host parameters: parallel.tensor=1, parallel.data_shard none or "
              "optimizer, parallel.expert=1, parallel.pipeline=1, device cpu (sharded DTensor "
              "and GPU parameters, expert and pipeline layouts are not offloaded yet)")
    topo = Topology.from_config(cfg.parallel, world_size, cfg.model)
    validate_posttrain(cfg.posttrain, cfg.rollout, cfg.rl, cfg.mopd, topo)
    # Context parallelism splits the rows; sequence parallelism and the tensor-parallel MoE
    # (whose experts are split over expert or expert tensor parallel ranks) split the tokens.
    pieces = 2 if topo.cp > 1 and topo.context_layout == "zigzag" else 1
    shards = pieces * topo.cp * topo.tp
    if cfg.stage.seq_len % shards:
        _fail("stage.seq_len", cfg.stage.seq_len,
              f"must be divisible by {shards}: {pieces} piece(s) on each of context={topo.cp} "
              f"ranks (parallel.context_layout={topo.context_layout}) x tensor={topo.tp} ranks "
              f"each hold an equal part of the sequence")
    # A dry run models the GPU job on the CPU (its exchange is a stand-in).
    if (topo.ep > 1 and cfg.parallel.moonep.transport == "symm_mem"
            and not cfg.dry_run.world_size):
        from parallel.moonep.transport import symm_mem_unavailable

        if (reason := symm_mem_unavailable()) is not None:
            _fail("parallel.moonep.transport", "symm_mem", f"{reason}: use collective")
    dp = topo.dp
    micro = cfg.stage.micro_batch_size * dp
    # Post-training's rows per step are the groups its rollouts finish: no global batch size.
    if cfg.posttrain == "none" and cfg.stage.global_batch_size % micro:
        _fail("stage.global_batch_size", cfg.stage.global_batch_size,
              f"must be a multiple of micro_batch_size*data_parallel = "
              f"{cfg.stage.micro_batch_size}*{dp} = {micro}: "
              + _micro_batch_hint(cfg.stage, dp, _least_micro_batches(topo)))
    if topo.pp > 1:
        _check_pipeline(cfg, topo, cfg.stage.global_batch_size // micro)
    if cfg.stage.loss_normalization == "sequence" and (topo.tp > 1 or topo.pp > 1
                                                       or topo.cp > 1):
        _fail("stage.loss_normalization", "sequence",
              "takes data- and expert-parallel layouts only for now (parallel.tensor, "
              "parallel.pipeline and parallel.context 1): their vocabulary-parallel loss, "
              "pipeline stages and sequence fragments do not carry per-token weights yet")
    if cfg.stage.seq_len > cfg.model.max_seq_len:
        _fail("stage.seq_len", cfg.stage.seq_len,
              f"must be <= model.max_seq_len={cfg.model.max_seq_len}")
    if cfg.precision.name not in ("auto", "fp32", "bf16", "mxfp4_qat", "fp64"):
        _fail("precision.name", cfg.precision.name,
              "must be one of ['auto', 'bf16', 'fp32', 'fp64', 'mxfp4_qat']")
    if cfg.precision.qat_scale_mode not in ("floor", "rceil"):
        _fail("precision.qat_scale_mode", cfg.precision.qat_scale_mode,
              "must be one of ['floor', 'rceil']")
    if cfg.precision.te not in ("off", "auto"):
        _fail("precision.te", cfg.precision.te, "must be one of ['auto', 'off']")
    if cfg.precision.name == "mxfp4_qat":
        for name in ("latent_dim", "expert_intermediate"):
            value = getattr(cfg.model.moe, name)
            if value % 32:
                _fail(f"model.moe.{name}", value,
                      "must be a multiple of 32 with precision=mxfp4_qat (MX blocks of 32 along "
                      "the experts' reduction dimensions)")
    if cfg.device not in ("auto", "cpu", "cuda"):
        _fail("device", cfg.device, "must be one of ['auto', 'cpu', 'cuda']")
    if cfg.logging.wandb_mode not in ("offline", "online", "disabled"):
        _fail("logging.wandb_mode", cfg.logging.wandb_mode,
              "must be one of ['disabled', 'offline', 'online']")
    if cfg.logging.log_every <= 0:
        _fail("logging.log_every", cfg.logging.log_every, "must be > 0")
    if cfg.checkpoint.keep_last <= 0:
        _fail("checkpoint.keep_last", cfg.checkpoint.keep_last, "must be > 0")
    if cfg.eval.every < 0:
        _fail("eval.every", cfg.eval.every, "must be >= 0 (0: no validation loss)")
    if cfg.eval.batches <= 0:
        _fail("eval.batches", cfg.eval.batches, "must be > 0")
    if cfg.eval.every > 0 and cfg.data.validation_fraction == 0:
        _fail("eval.every", cfg.eval.every, "must be 0 with data.validation_fraction=0 (there "
              "is no held-out split to evaluate on)")
    if cfg.max_nonfinite_in_a_row <= 0:
        _fail("max_nonfinite_in_a_row", cfg.max_nonfinite_in_a_row, "must be > 0")
    if cfg.dry_run.world_size < 0 or not 0 <= cfg.dry_run.rank < max(cfg.dry_run.world_size, 1):
        _fail("dry_run.rank", cfg.dry_run.rank,
              f"must be in [0, dry_run.world_size={cfg.dry_run.world_size}) (world_size 0: no "
              "dry run)")
    check_no_secrets(cfg)
    if data:
        check_model_matches_data(cfg)
    if cfg.init_from is not None:
        _check_init_from(cfg)
    return cfg


def _check_init_from(cfg: TrainConfig) -> None:
    from .init_from import check_same_model, resolve

    source = resolve(cfg.init_from)
    run_dir = Path(cfg.run_dir).resolve()
    if run_dir == source.path.resolve() or run_dir in source.path.resolve().parents:
        _fail("init_from", cfg.init_from, f"lies inside run_dir={cfg.run_dir!r}, whose own "
              f"checkpoints the run would resume from: give this run another run_dir")
    check_same_model(source, cfg.model)
