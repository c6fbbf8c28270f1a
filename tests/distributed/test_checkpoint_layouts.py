"""Checkpoints move between layouts: saved by 4 FSDP2 ranks after step 2, resumed by 4 ZeRO-1
ranks, by 2x2 HSDP ZeRO-1 ranks (whose checkpoint after step 4, optimizer state held once per
replica, 4 ZeRO-1 ranks resume), by 2 pipeline x 2 ZeRO-1 ranks, by 2 data-parallel ranks
(another DP size), by 2 tensor-parallel ranks and by 2 pipeline ranks, whose checkpoints after
step 4 one process resumes, and a 2-rank data-parallel checkpoint resumed by 2 pipeline ranks.

Each resume is checked three ways, in float64 (`precision=fp64`, Muon + AdamW, QK-Clip on every
head, Quantile Balancing): the state it loaded equals the state that was saved, bit for bit,
under the checkpoint's logical names (every parameter, QB bias, Muon momentum, Adam moment and
step counter, and every param-group setting); the 2 steps it takes after the resume give the
losses of the run that never moved; and every parameter after those 2 steps is that run's.
The first loss after a resume comes before that step's update, so it cannot see the optimizer
state at all; the second loss and the parameters after the updates do. The run that never
moved is one process; the layouts differ from it only in the order of their float64 sums
(measured: losses within 2.3e-16, parameters within 1.7e-13 relative RMS), so 1e-9 sees any
state the checkpoint dropped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from parallel.topology import Topology
from tests.helpers.parallel_harness import (
    layout,
    run_steps,
    spawn,
    state_mismatches,
    tiny_config,
)
from tests.helpers.tolerances import rel_rms

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TOL = 1e-9  # float64: the layouts' other order of sums (module docstring)
STEPS = 6
STATE_FILE = "logical_state.pt"  # next to a checkpoint: what it was saved from


def _config(**parallel):
    return layout(tiny_config("muon", "fp64"), **parallel)


def _save_params(params: dict, root: Path, name: str, rank: int) -> None:
    # Every rank's own: a pipeline stage holds only its layers.
    torch.save(params, root / f"{name}.params.rank{rank}.pt")


def _world(rank: int, world: int, plan: list, root: str) -> dict:
    """plan: (name, parallel fields, steps, resume root, save root) run one after another.
    Returns per run the losses and, for a resumed run, the names whose loaded state is not the
    saved one; every rank's parameters after the run go to files under `root`."""
    out = {}
    for name, parallel, steps, resume, save in plan:
        cfg = _config(**parallel)
        topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
        # A pipeline schedule needs a micro-batch per stage: 2 (the same sums, regrouped).
        record = run_steps(cfg, topology, steps, topology.pp, resume=resume, save=save,
                           states=True)
        topology.destroy()
        _save_params(record.params, Path(root), name, rank)
        result = {"losses": record.losses}
        if rank == 0:
            if save is not None:
                torch.save(record.saved_state, Path(save) / STATE_FILE)
            if resume is not None:
                saved = torch.load(Path(resume) / STATE_FILE, weights_only=False)
                result["state_mismatches"] = state_mismatches(saved, record.loaded_state)
        out[name] = result
        dist.barrier()
    return out


def _params_of(root: Path, name: str, ranks: int) -> list[dict]:
    return [torch.load(root / f"{name}.params.rank{r}.pt") for r in range(ranks)]


def test_resume_at_other_layouts_continues_the_same_run(tmp_path):
    # The run that never moved: parameters after steps 2, 4 and 6 (the steps are the same in
    # every run: constant lr, the same batches).
    straight = {steps: run_steps(_config(), None, steps) for steps in (2, 4, STEPS)}
    losses = straight[STEPS].losses
    assert straight[2].losses == losses[:2] and straight[4].losses == losses[:4]
    fsdp, tp, dp, pp, hsdp = (tmp_path / name
                              for name in ("fsdp4", "tp2", "dp2", "pp2", "hsdp_zero1"))
    zero1 = dict(data=4, data_shard="optimizer")
    # name: (spawned world, parallel fields, last step, resumed from, saved to)
    runs = {
        "fsdp4": (4, dict(data=4, data_shard="full"), 2, None, fsdp),
        "zero4 from fsdp4": (4, zero1, 4, fsdp, None),
        "hsdp_zero1 from fsdp4": (4, dict(zero1, data_replicate=2), 4, fsdp, hsdp),
        "zero4 from hsdp_zero1": (4, zero1, STEPS, hsdp, None),
        "pp2 x zero2 from fsdp4": (4, dict(pipeline=2, data=2, data_shard="optimizer"), 4,
                                   fsdp, None),
        "tp2 from fsdp4": (2, dict(tensor=2), 4, fsdp, tp),
        "dp2 from fsdp4": (2, dict(data=2), 4, fsdp, dp),
        "pp2 from fsdp4": (2, dict(pipeline=2), 4, fsdp, pp),
        "pp2 from dp2": (2, dict(pipeline=2), STEPS, dp, None),
    }
    params_root = tmp_path / "params"
    params_root.mkdir()
    got = {}
    for world in (4, 2):
        plan = [(name, parallel, steps, resume, save)
                for name, (w, parallel, steps, resume, save) in runs.items() if w == world]
        got.update(spawn(_world, world, tmp_path / f"w{world}", plan, str(params_root)))
    params = {name: _params_of(params_root, name, runs[name][0]) for name in runs}
    for name, resume in (("1 process from tp2", tp), ("1 process from pp2", pp)):
        record = run_steps(_config(), None, STEPS, resume=resume, states=True)
        saved = torch.load(resume / STATE_FILE, weights_only=False)
        got[name] = {"losses": record.losses,
                     "state_mismatches": state_mismatches(saved, record.loaded_state)}
        params[name] = [record.params]
        runs[name] = (1, {}, STEPS, resume, None)

    # Every run's every problem collected, then reported together.
    problems: list[str] = []
    worst_loss, worst_param = 0.0, 0.0
    for name, (_, _, steps, resume, _) in runs.items():
        first = 0 if resume is None else steps - 2  # every resumed run takes 2 steps
        result = got[name]
        if resume is not None and result["state_mismatches"]:  # bit for bit, every name
            mismatched = result["state_mismatches"]
            problems.append(f"{name}: {len(mismatched)} loaded state entries differ from the "
                            f"saved ones, e.g. {mismatched[:4]}")
        expected = losses[first:steps]
        assert len(result["losses"]) == len(expected), (name, result["losses"])
        for step, (a, b) in enumerate(zip(result["losses"], expected), first + 1):
            err = abs(a - b) / abs(b)
            worst_loss = max(worst_loss, err)
            if not err <= TOL:  # `not <=`: a NaN is beyond too
                problems.append(f"{name}: loss of step {step} {a!r} != {b!r} ({err:.1e})")
        reference = straight[steps].params
        held, beyond = set(), {}
        for rank_params in params[name]:
            for pname, value in rank_params.items():
                assert value.shape == reference[pname].shape, (name, pname, value.shape)
                err = rel_rms(reference[pname], value)
                worst_param = max(worst_param, err)
                if not err <= TOL:
                    beyond[pname] = max(err, beyond.get(pname, 0.0))
            held |= rank_params.keys()
        assert held == reference.keys(), (name, sorted(reference.keys() - held))
        if beyond:
            top = sorted(beyond.items(), key=lambda item: -item[1])[:3]
            problems.append(f"{name}: {len(beyond)} parameters after step {steps} beyond {TOL}, "
                            "worst " + ", ".join(f"{n} {e:.1e}" for n, e in top))
    print(f"worst relative error against the run that never moved: loss {worst_loss:.1e}, "
          f"parameters {worst_param:.1e}")
    assert not problems, "\n".join(problems)
