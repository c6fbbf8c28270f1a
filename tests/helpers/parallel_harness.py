"""Runs k3_tiny training steps in one process or in a spawned gloo world, through the training
loop's own `build_parallel_model` and `train_step`, and records what the equivalence tests
compare: loss per step, every gradient before the first step and every parameter after the
last, all as full (logical) tensors."""

from __future__ import annotations

import json
import math
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from model.batch import K3Batch, cu_seqlens_from_lengths
from tests.helpers.tolerances import rel_rms
from tests.helpers.train_helpers import free_port
from train.config import ParallelConfig, TrainConfig
from train.optim.factory import set_lr

SEQ = 64
GLOBAL_ROWS = 4
STEPS = 3


def tiny_config(optim: str, precision: str = "fp32") -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim.name = optim
    cfg.optim.lr = 3e-3
    if optim == "muon":
        cfg.optim.qk_clip_tau = 1e-3  # every head clips: QK-Clip runs on every MLA layer
        # Several buckets a step (k3_tiny's matrices are a few MiB): a layout's exchanges pair
        # up bucket by bucket.
        cfg.optim.muon_bucket_mb = 1
    cfg.precision.name = precision
    cfg.device = "cpu"
    return cfg


DOCS = [[40, 24], [SEQ], [10, 30, 24], [SEQ]]  # document lengths of each row


def global_batch(step: int, start: int = 0, count: int = GLOBAL_ROWS,
                 per_document: bool = False) -> K3Batch:
    """Rows [start, start + count) of step's global batch: GLOBAL_ROWS rows of SEQ tokens with
    document boundaries, different every step. `per_document`: loss weights of 1 / each
    document's loss tokens (stage.loss_normalization=sequence)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(4, 2048, (GLOBAL_ROWS, SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    weights = None
    if per_document:
        weights = torch.zeros(GLOBAL_ROWS, SEQ)
        for row, lengths in enumerate(DOCS):
            for end, n in zip(torch.tensor(lengths).cumsum(0).tolist(), lengths):
                weights[row, end - n:end] = 1.0 / int((labels[row, end - n:end] != -100).sum())
        weights = weights[start:start + count]
    rows = slice(start, start + count)
    return K3Batch(tokens[rows], labels[rows], cu_seqlens_from_lengths(DOCS[rows], SEQ),
                   loss_weights=weights)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def logical(param: torch.Tensor, value: torch.Tensor, topology) -> torch.Tensor:
    """`value` (the parameter or its gradient) as the full logical tensor: DTensors gathered
    over their meshes, a rank's home experts over the expert-parallel ranks (a collective over
    them: call in the same order on every rank of the group)."""
    from parallel.expert_parallel import is_expert_parameter

    whole = full(value)
    if topology is None or topology.ep == 1 or not is_expert_parameter(param):
        return whole
    out = whole.new_empty(whole.shape[0] * topology.ep, *whole.shape[1:])
    dist.all_gather_into_tensor(out, whole.contiguous(), group=topology.group("ep"))
    return out


@dataclass
class Record:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)  # before clipping, every step
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # before the first step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # after the last step
    muon: list[str] = field(default_factory=list)  # parameters Muon updates
    # `states=True`: the checkpoint's logical state (`logical_state`) just after `resume`
    # loaded it and just before `save` wrote it.
    loaded_state: dict = field(default_factory=dict)
    saved_state: dict = field(default_factory=dict)


def logical_state(model, optimizers, sharded=None) -> dict:
    """What train.checkpoint saves and loads: the model's and optimizers' state under their
    logical (flattened, layout-free) names, tensors as full tensors, merged over the ranks
    (ZeRO-1 ranks own different optimizer entries, pipeline stages different parameters). Every
    rank returns the same dict; a name two ranks hold with different values raises. `sharded`:
    the layout's ParallelPlan.sharded_state (experts as their logical tensors), as the
    checkpointer takes it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from train.checkpoint import OPTIONS

    model_sd, optim_sd = get_state_dict(model, optimizers, options=OPTIONS)
    if sharded is not None:
        model_sd, optim_sd = sharded.wrap(model_sd, optim_sd)
    mine = {}
    for prefix, sd in (("model", model_sd), ("optim", optim_sd)):
        for key in sorted(sd):  # the same order on every rank: full() is a collective
            value = sd[key]
            mine[f"{prefix}/{key}"] = full(value) if isinstance(value, torch.Tensor) else value
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged: dict = {}
    for state in every:
        for key, value in state.items():
            if key in merged:
                held = merged[key]
                same = (torch.equal(held, value) if isinstance(value, torch.Tensor)
                        else held == value)
                assert same, f"ranks hold different values of {key}"
            else:
                merged[key] = value
    return merged


def state_mismatches(saved: dict, loaded: dict) -> list[str]:
    """The names whose loaded value is not the saved one, bit for bit (and the names only one
    side has)."""
    bad = sorted(f"{key} (missing when loaded)" for key in saved.keys() - loaded.keys())
    bad += sorted(f"{key} (not saved)" for key in loaded.keys() - saved.keys())
    for key in sorted(saved.keys() & loaded.keys()):
        a, b = saved[key], loaded[key]
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            bad.append(key)
        elif isinstance(a, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                bad.append(key)
        elif a != b:
            bad.append(key)
    return bad


def run_steps(cfg: TrainConfig, topology, steps: int = STEPS, micro_batches: int = 1,
              resume: Path | None = None, save: Path | None = None,
              tensors: bool = True, states: bool = False) -> Record:
    """Optimizer steps up to `steps` on this rank's share of each global batch, in
    `micro_batches` accumulated micro-batches (the single-process reference of a data-parallel
    layout takes the ranks' shares one after the other: the same sums, in the same order where
    it can). `resume`: start from the latest checkpoint under that root; `save`: checkpoint
    the last step under that root. `tensors=False` records the losses only (gathering every
    gradient and parameter is a collective per tensor). `states=True` records the
    checkpoint's logical state after loading `resume` and before saving `save`."""
    from train.checkpoint import Checkpointer
    from train.loop import build_parallel_model, train_step

    dp = 1 if topology is None else topology.dp
    dp_rank = 0 if topology is None else topology.rank_in("dp")
    per_rank = GLOBAL_ROWS // dp
    per_micro = per_rank // micro_batches
    # The stage's batch shape is this one (a pipeline schedule is built for it).
    cfg.stage.seq_len, cfg.stage.micro_batch_size = SEQ, per_micro
    cfg.stage.global_batch_size = GLOBAL_ROWS
    torch.manual_seed(cfg.seed)
    model, precision, parallel, optimizers = build_parallel_model(cfg, topology,
                                                                  torch.device("cpu"))
    set_lr(optimizers, cfg.optim.lr)
    record = Record()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    start = 0
    if resume is not None:
        ckpt = Checkpointer(resume, keep_last=3, rank=rank, world_size=world,
                            sharded=parallel.sharded_state)
        start = ckpt.load(ckpt.latest(), model, optimizers, lambda state: None)
        if states:
            record.loaded_state = logical_state(model, optimizers, parallel.sharded_state)

    def keep_grads(m):
        record.grads = {n: logical(p, p.grad, topology) for n, p in m.named_parameters()}

    for step in range(start, steps):
        per_document = cfg.stage.loss_normalization == "sequence"
        batches = [global_batch(step, dp_rank * per_rank + m * per_micro, per_micro,
                                per_document) for m in range(micro_batches)]
        result = train_step(model, optimizers, batches, torch.device("cpu"), precision, parallel,
                            cfg.optim, on_gradients=keep_grads if tensors and step == 0 else None)
        assert result.finite
        record.losses.append(float(result.loss))
        record.grad_norms.append(float(result.grad_norm))
    if save is not None:
        if states:
            record.saved_state = logical_state(model, optimizers, parallel.sharded_state)
        Checkpointer(save, keep_last=3, rank=rank, world_size=world,
                     sharded=parallel.sharded_state).save(
            steps, model, optimizers, {"loader": {"optimizer_step": steps}})
    if not tensors:
        return record
    record.params = {n: logical(p, p, topology) for n, p in model.named_parameters()}
    record.muon = sorted(n for n, p in model.named_parameters()
                         if any(type(o).__name__ == "Muon" and p in o.state for o in optimizers))
    return record


def _nan_first(error: float) -> tuple[bool, float]:
    """A sort key under which NaN is the worst error (max() would keep whichever came first)."""
    return math.isnan(error), error


def _worst(ref: dict, got: dict, names) -> tuple[float, str]:
    errors = {n: rel_rms(ref[n], got[n]) for n in names}
    name = max(errors, key=lambda n: _nan_first(errors[n]))
    return errors[name], name


def compare(ref: Record, got: Record, stage: bool = False) -> dict[str, float | str]:
    """Worst relative errors: losses and gradient norms of every step, gradients before the
    first step, Muon's and AdamW's parameters after the last step (with the worst tensors'
    names). `stage`: `got` holds one pipeline stage's parameters, a part of `ref`'s."""
    if stage:
        assert got.grads.keys() == got.params.keys() and got.params.keys() < ref.params.keys()
    else:
        assert ref.grads.keys() == got.grads.keys() and ref.params.keys() == got.params.keys()
    out: dict[str, float | str] = {
        key: max((abs(a - b) / abs(a) for a, b in zip(getattr(ref, field_name),
                                                      getattr(got, field_name), strict=True)),
                 key=_nan_first)
        for key, field_name in (("loss", "losses"), ("grad_norm", "grad_norms"))}
    held = got.params.keys()
    adamw = [n for n in held if n not in ref.muon]
    for key, (a, b, names) in {"grad": (ref.grads, got.grads, list(held)),
                               "muon_param": (ref.params, got.params,
                                              [n for n in ref.muon if n in held]),
                               "adamw_param": (ref.params, got.params, adamw)}.items():
        if names:
            out[key], out[f"worst_{key}"] = _worst(a, b, names)
    return out


def worst_over_ranks(errors: dict[str, dict]) -> dict[str, dict]:
    """Every rank's `compare` results (layout -> figures) merged: per figure the worst rank's
    value, and its tensor's name (a collective over the world; one process: as they are)."""
    if not dist.is_initialized():
        return errors
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, errors)
    merged: dict[str, dict] = {}
    for name in errors:
        out: dict = {}
        for rank_errors in every:
            for key, value in rank_errors[name].items():
                if key.startswith("worst_"):
                    continue
                if key not in out or _nan_first(value) > _nan_first(out[key]):
                    out[key] = value
                    if f"worst_{key}" in rank_errors[name]:
                        out[f"worst_{key}"] = rank_errors[name][f"worst_{key}"]
        merged[name] = out
    return merged


def parallel_config(**fields) -> ParallelConfig:
    """A ParallelConfig from keyword fields; `moonep_<name>` fields set the MoonEP config."""
    from train.config import MoonEPConfig

    moonep = {k.removeprefix("moonep_"): fields.pop(k) for k in list(fields)
              if k.startswith("moonep_")}
    return ParallelConfig(moonep=MoonEPConfig(**moonep), **fields)


def layout(cfg: TrainConfig, **parallel) -> TrainConfig:
    cfg.parallel = ParallelConfig(**parallel)
    return cfg


def _worker(rank: int, world: int, port: int, fn, out: str, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    except Exception:
        Path(f"{out}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def spawn(fn, world: int, tmp_path: Path, *args):
    """Runs fn(rank, world, *args) on `world` gloo ranks; returns rank 0's JSON result."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.json"
    try:
        mp.spawn(_worker, args=(world, free_port(), fn, str(out), args), nprocs=world)
    except Exception as err:
        logs = "\n".join(p.read_text() for p in sorted(tmp_path.glob("result.json.rank*.err")))
        raise AssertionError(f"spawned world failed: {err}\n{logs[-6000:]}") from None
    return json.loads(out.read_text())
