"""The combinations k3-plan proposes for k3_full's layouts: pipeline with FSDP2, with expert
parallelism (plain, FSDP2 and ZeRO-1) and with context parallelism, expert parallelism with
ZeRO-1 and with HSDP (FSDP2 and ZeRO-1 replicas), expert x tensor x FSDP2 with activation
checkpointing, and expert tensor parallelism with expert x tensor parallelism and with ZeRO-1
(without expert parallelism under tensor parallelism the experts are split over the etp ranks
by default: every tensor-parallel layout of tests/distributed/test_parallel.py runs that).
On 4 gloo ranks each reproduces one process over 3 steps of the training loop's
own build and step (`build_parallel_model`, `train_step`: Muon with QK-Clip on every head, AdamW,
clipping, Quantile Balancing), in float64 within 1e-9: the loss and gradient norm of every step,
every gradient before the first step and every parameter after the third, as logical tensors
(DTensors gathered, home experts gathered over their ranks), each rank's own parameters (a
pipeline stage holds its layers only), the worst rank's figure. A checkpoint moves between two
of them: saved by PP2 x EP2 x FSDP2 after step 2, resumed by EP2 x ZeRO-1, whose third step
gives the one-process run's loss and parameters, and whose loaded state is the saved one, bit
for bit; the same from EP2 x ETP2 x TP2 to ETP2 x ZeRO-1 (the experts' strided gate/up rows
saved as contiguous ones).

Measured (float64, worst rank and tensor): losses 1.2e-16, gradients 7e-15, parameters 2e-13."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel.topology import Topology
from tests.helpers.parallel_harness import (
    compare,
    layout,
    run_steps,
    spawn,
    state_mismatches,
    tiny_config,
    worst_over_ranks,
)
from tests.helpers.tolerances import rel_rms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TOL = 1e-9  # float64: the layouts differ from one process in the order of their sums only
LAYOUTS = {
    "pp2_fsdp2": dict(pipeline=2, data=2, data_shard="full"),
    "pp2_ep2": dict(pipeline=2, data=2, expert=2),
    "pp2_ep2_fsdp2": dict(pipeline=2, data=2, expert=2, data_shard="full"),
    "pp2_ep2_zero1": dict(pipeline=2, data=2, expert=2, data_shard="optimizer"),
    "pp2_cp2": dict(pipeline=2, context=2),
    "ep2_zero1": dict(data=4, expert=2, data_shard="optimizer"),
    # HSDP: replicas of FSDP2 (ZeRO-1) shard groups, the experts' among the expert-data ranks
    "ep2_hsdp2": dict(data=4, data_replicate=2, expert=2, data_shard="full"),
    "ep2_hsdp2_zero1": dict(data=4, data_replicate=2, expert=2, data_shard="optimizer"),
    # Checkpointed layers recompute the MoE in backward: FSDP2 hands the experts their gathered
    # weights there too.
    "ep2_tp2_fsdp2_checkpointed": dict(data=2, expert=2, tensor=2, data_shard="full",
                                       activation_checkpointing=True),
    # Each expert's intermediate rows over 2 ranks, its experts over 2 others; without TP.
    "ep2_etp2_tp2": dict(tensor=2, expert=2, expert_tensor=2),
    "etp2_zero1": dict(data=4, expert_tensor=2, data_shard="optimizer"),
}
# Saved after step 2 by the first, resumed by the second.
MOVES = {"move": ("pp2_ep2_fsdp2", "ep2_zero1"), "move_etp": ("ep2_etp2_tp2", "etp2_zero1")}
FIGURES = {"loss", "grad_norm", "grad", "muon_param", "adamw_param"}


def _run(name: str, world: int, **kwargs):
    parallel = dict(LAYOUTS[name])
    cfg = tiny_config("muon", "fp64")
    cfg.activation_checkpointing = parallel.pop("activation_checkpointing", False)
    cfg = layout(cfg, **parallel)
    topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
    try:
        # A pipeline schedule needs a micro-batch per stage (the same sums, regrouped).
        return run_steps(cfg, topology, micro_batches=topology.pp, **kwargs), topology.pp > 1
    finally:
        topology.destroy()


def _world(rank: int, world: int, ref_path: str, root: str) -> dict:
    ref = torch.load(ref_path, weights_only=False)
    errors = {}
    for name in LAYOUTS:
        got, stage = _run(name, world)
        errors[name] = compare(ref, got, stage)
    for move, (saver, loader) in MOVES.items():
        saved, _ = _run(saver, world, steps=2, save=Path(root) / move, states=True)
        resumed, _ = _run(loader, world, resume=Path(root) / move, states=True)
        errors[move] = {  # its step 3 against the one-process run's
            "loss": abs(ref.losses[2] - resumed.losses[0]) / abs(ref.losses[2]),
            "params": max(rel_rms(ref.params[n], p) for n, p in resumed.params.items()),
            "state_mismatches": float(len(state_mismatches(saved.saved_state,
                                                           resumed.loaded_state)))}
    dist.barrier()
    return worst_over_ranks(errors)


def test_combined_layouts_match_one_process(tmp_path):
    ref_path = tmp_path / "ref.pt"
    torch.save(run_steps(tiny_config("muon", "fp64"), None), ref_path)
    errors = spawn(_world, 4, tmp_path / "world", str(ref_path), str(tmp_path / "ckpt"))
    for name, e in errors.items():  # shown with pytest -s
        print(name, {k: (f"{v:.1e}" if isinstance(v, float) else v) for k, v in e.items()})
    assert sorted(errors) == sorted([*LAYOUTS, *MOVES])
    bad = {}
    for name, e in errors.items():
        figures = {k for k in e if not k.startswith("worst_")}
        expected = {"loss", "params", "state_mismatches"} if name in MOVES else FIGURES
        assert figures == expected, (name, sorted(figures))
        if not all(e[k] <= TOL for k in figures):  # `not <=`: a NaN is beyond too
            bad[name] = e
    assert not bad, f"beyond {TOL}: {bad}"
