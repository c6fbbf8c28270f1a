"""Checkpoints move between layouts: saved by 4 FSDP2 ranks, resumed by 4 ZeRO-1 ranks, by 2x2
HSDP ZeRO-1 ranks (whose checkpoint, optimizer state held once per replica, 4 ZeRO-1 ranks
resume), by 2 pipeline x 2 ZeRO-1 ranks, by 2 data-parallel ranks (another DP size), by 2
tensor-parallel ranks and by 2 pipeline ranks, whose checkpoints one process resumes, and a
2-rank data-parallel checkpoint resumed by 2 pipeline ranks; every resumed step's loss equals the
run that never moved (Muon + AdamW state, QK-Clip, Quantile Balancing buffers all carried)."""

from __future__ import annotations

import pytest

from parallel.topology import Topology
from tests.helpers.parallel_harness import layout, run_steps, spawn, tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-5
STEPS = 4


def _world(rank: int, world: int, plan: list) -> dict:
    """plan: (name, parallel fields, steps, resume root, save root) run one after another."""
    losses = {}
    for name, parallel, steps, resume, save in plan:
        cfg = layout(tiny_config("muon"), **parallel)
        topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
        # A pipeline schedule needs a micro-batch per stage: 2 (the same sums, regrouped).
        micro_batches = topology.pp
        losses[name] = run_steps(cfg, topology, steps, micro_batches, resume=resume,
                                 save=save, tensors=False).losses
        topology.destroy()
    return losses


def test_resume_at_other_layouts_continues_the_same_losses(tmp_path):
    straight = run_steps(tiny_config("muon"), None, STEPS, tensors=False).losses
    fsdp, tp, dp, pp, hsdp = (tmp_path / name
                              for name in ("fsdp4", "tp2", "dp2", "pp2", "hsdp_zero1"))
    zero1 = dict(data=4, data_shard="optimizer")
    four = spawn(_world, 4, tmp_path / "w4", [
        ("fsdp4", dict(data=4, data_shard="full"), 2, None, fsdp),
        ("zero4", zero1, 3, fsdp, None),
        ("hsdp_zero1", dict(zero1, data_replicate=2), 3, fsdp, hsdp),
        ("zero4 from hsdp_zero1", zero1, 4, hsdp, None),
        ("pp2zero2", dict(pipeline=2, data=2, data_shard="optimizer"), 3, fsdp, None)])
    two = spawn(_world, 2, tmp_path / "w2", [
        ("tp2", dict(tensor=2), 3, fsdp, tp),
        ("dp2", dict(data=2), 3, fsdp, dp),
        ("pp2", dict(pipeline=2), 3, fsdp, pp),
        ("pp2 from dp2", dict(pipeline=2), STEPS, dp, None)])
    one = run_steps(tiny_config("muon"), None, STEPS, resume=tp, tensors=False).losses
    one_from_pp = run_steps(tiny_config("muon"), None, STEPS, resume=pp, tensors=False).losses
    got = {"fsdp4 steps 1-2": (four["fsdp4"], straight[:2]),
           "zero4 step 3 from fsdp4": (four["zero4"], straight[2:3]),
           "pp2 x zero2 step 3 from fsdp4": (four["pp2zero2"], straight[2:3]),
           "hsdp_zero1 step 3 from fsdp4": (four["hsdp_zero1"], straight[2:3]),
           "zero4 step 4 from hsdp_zero1": (four["zero4 from hsdp_zero1"], straight[3:4]),
           "tp2 step 3 from fsdp4": (two["tp2"], straight[2:3]),
           "dp2 step 3 from fsdp4": (two["dp2"], straight[2:3]),
           "pp2 step 3 from fsdp4": (two["pp2"], straight[2:3]),
           "pp2 step 4 from dp2": (two["pp2 from dp2"], straight[3:4]),
           "1 process step 4 from tp2": (one, straight[3:4]),
           "1 process step 4 from pp2": (one_from_pp, straight[3:4])}
    for what, (losses, expected) in got.items():
        assert len(losses) == len(expected), what
        for a, b in zip(losses, expected):
            assert abs(a - b) <= TOL * abs(b), (what, a, b)
