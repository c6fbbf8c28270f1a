"""Fine-tuning under the layouts. `init_from` (train/init_from.py): two data-parallel ranks
train k3_tiny for 2 steps (float64) with per-document loss averaging
(stage.loss_normalization=sequence: the same losses, first gradients and parameters as one
process, within 1e-9) and checkpoint; a tensor-parallel x expert-tensor-parallel run with
sequence parallelism on the same 2 ranks and one process each start from that checkpoint: the
first loss on the next batch is the same in both (it comes before any update, so it sees
exactly the weights and Quantile Balancing biases that were loaded; measured equal to the last
bit), and the one-process model holds exactly the saved parameters. One process that starts
from the checkpoint's k3-export holds exactly the export's weights (its experts in MXFP4, so
not the checkpoint's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from parallel.topology import Topology
from tests.helpers.parallel_harness import (
    GLOBAL_ROWS,
    SEQ,
    compare,
    global_batch,
    layout,
    run_steps,
    spawn,
    tiny_config,
)
from train.checkpoint import Checkpointer
from train.export import export_checkpoint, load_exported
from train.init_from import load_initial_weights, resolve
from train.loop import build_parallel_model, train_step

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOL = 1e-9  # float64: other orders of sums only (measured below 1e-15)
SAVED_STEPS = 2


def _config(**parallel):
    cfg = layout(tiny_config("adamw", "fp64"), **parallel)
    cfg.stage.seq_len, cfg.stage.micro_batch_size = SEQ, GLOBAL_ROWS
    cfg.stage.global_batch_size = GLOBAL_ROWS
    return cfg


def _started(cfg, topology, source: str, rank: int = 0, world: int = 1):
    """(the model's state as loaded, the loss of the batch after the saved steps) of a run
    that starts from `source`. Each rank takes the whole batch (tensor-parallel ranks share
    their rows)."""
    model, precision, parallel, optimizers = build_parallel_model(cfg, topology,
                                                                  torch.device("cpu"))
    checkpointer = Checkpointer(Path(source), 1, rank, world, parallel.sharded_state)
    load_initial_weights(resolve(source), model, checkpointer)
    loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    result = train_step(model, optimizers, [global_batch(SAVED_STEPS)], torch.device("cpu"),
                        precision, parallel, cfg.optim)
    return loaded, float(result.loss)


def _per_document(cfg):
    cfg.stage.loss_normalization = "sequence"
    return cfg


def _world(rank: int, world: int, run_dir: str) -> dict:
    cfg = _per_document(_config(data=2))
    topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
    saved = run_steps(cfg, topology, SAVED_STEPS, save=Path(run_dir) / "checkpoints")
    topology.destroy()
    if rank == 0:
        torch.save(saved, Path(run_dir) / "saved_run.pt")
    checkpoint = Checkpointer(Path(run_dir) / "checkpoints", 1).latest()
    cfg = _config(tensor=2, sequence_parallel=True)
    topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
    _, tp = _started(cfg, topology, str(checkpoint), rank, world)
    topology.destroy()
    return {"tp2": tp, "checkpoint": str(checkpoint)}


def test_init_from_a_dp2_checkpoint_into_tp2_and_one_process(tmp_path):
    run_dir = tmp_path / "pretrain"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(
        OmegaConf.to_yaml(OmegaConf.structured(_config())))
    got = spawn(_world, 2, tmp_path / "world", str(run_dir))
    # The saving run (per-document loss averaging on 2 data-parallel ranks) is the one-process
    # run's: losses, first gradients, parameters after its steps.
    saved = torch.load(run_dir / "saved_run.pt", weights_only=False)
    errors = compare(run_steps(_per_document(_config()), None, SAVED_STEPS), saved)
    assert all(e <= TOL for k, e in errors.items() if not k.startswith("worst_")), errors
    loaded, one = _started(_config(), None, got["checkpoint"])
    assert [k for k, v in saved.params.items() if not torch.equal(loaded[k], v)] == []
    assert abs(got["tp2"] - one) <= TOL * one, (got["tp2"], one)
    # An export (experts in MXFP4) loads exactly its own weights, biases included.
    export = export_checkpoint(run_dir, tmp_path / "export", dtype="fp32")
    started, _ = _started(_config(), None, str(export))
    exported = load_exported(export).state_dict()
    loaded = {k: v.float() for k, v in started.items()}
    assert sorted(loaded) == sorted(exported)
    differ = [k for k in exported if not torch.equal(loaded[k], exported[k])]
    assert not differ, differ
