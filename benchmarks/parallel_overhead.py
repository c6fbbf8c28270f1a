"""Cost of each data-parallel layout on 4 gloo ranks (k3_tiny, AdamW): step time, bytes every
collective moves per step (counted by wrapping torch.distributed's collectives, next to
`k3-plan`'s analytic figure, train.plan.data_parallel_bytes, for the same layout), peak RSS per
rank, all against one process.

    PYTHONPATH=. python benchmarks/parallel_overhead.py

The loss-token count, gradient norms and max logits add a few hundred bytes to all_reduce.
Tensor-parallel traffic goes through DTensor's functional collectives, which this wrapper does
not see, so TP layouts are not in this table.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.k3 import K3Model  # noqa: E402
from parallel.topology import Topology  # noqa: E402
from tests.helpers.parallel_harness import global_batch, layout, spawn, tiny_config  # noqa: E402
from train.plan import data_parallel_bytes  # noqa: E402

# collective -> (the argument whose size is counted: the full, unsharded side; k3-plan's name)
WRAPPED = {"all_reduce": ("tensor", "all_reduce"), "broadcast": ("tensor", "broadcast"),
           "all_gather_single": ("output_tensor", "all_gather"),
           "reduce_scatter_single": ("input", "reduce_scatter")}
LAYOUTS = {"none": dict(data_shard="none"), "optimizer": dict(data_shard="optimizer"),
           "full": dict(data_shard="full"),
           "hsdp_2x2": dict(data_replicate=2, data_shard="full"),
           "hsdp_2x2_optimizer": dict(data_replicate=2, data_shard="optimizer")}
STEPS = 4


def _count(counts: dict) -> None:
    """Wraps torch.distributed's collectives (FSDP2 calls the *_single ones): bytes per
    collective, integer payloads (Quantile Balancing's counts) apart."""
    import inspect

    for name, (arg, label) in WRAPPED.items():
        inner = getattr(dist, name)
        signature = inspect.signature(inner)

        def wrapper(*args, _inner=inner, _label=label, _arg=arg, _sig=signature, **kwargs):
            tensor = _sig.bind(*args, **kwargs).arguments[_arg]
            key = (f"QB counts ({str(tensor.dtype).removeprefix('torch.')})"
                   if not tensor.is_floating_point() else _label)
            counts[key] += tensor.numel() * tensor.element_size()
            return _inner(*args, **kwargs)

        setattr(dist, name, wrapper)


def _run(cfg, topology, counts) -> dict:
    from train.loop import build_parallel_model, train_step
    from train.optim.factory import set_lr

    torch.manual_seed(cfg.seed)
    model, precision, parallel, optimizers = build_parallel_model(cfg, topology,
                                                                  torch.device("cpu"))
    set_lr(optimizers, cfg.optim.lr)
    n = sum(p.numel() for p in model.parameters())
    analytic = {}
    if topology is not None:  # k3-plan's figure, from the model built on the meta device
        with torch.device("meta"):
            analytic = data_parallel_bytes(K3Model(cfg.model), topology)
    dp = 1 if topology is None else topology.dp
    rank = 0 if topology is None else topology.rank_in("dp")
    times = []
    for step in range(STEPS):
        counts.clear()
        start = time.perf_counter()
        train_step(model, optimizers, [global_batch(step, rank * 4 // dp, 4 // dp)],
                   torch.device("cpu"), precision, parallel, cfg.optim)
        times.append(time.perf_counter() - start)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"step_s": sum(times[1:]) / (STEPS - 1), "bytes": dict(counts), "params": n,
            "analytic": analytic, "peak_rss_mb": peak_mb}


def _world(rank: int, world: int, layouts: dict) -> dict:
    counts: dict = defaultdict(int)
    _count(counts)
    out = {}
    for name, fields in layouts.items():
        cfg = layout(tiny_config("adamw"), data=world, **fields)
        topology = Topology.from_config(cfg.parallel, world, cfg.model).initialize("cpu")
        result = _run(cfg, topology, counts)
        gathered = [None] * world
        dist.all_gather_object(gathered, result["peak_rss_mb"])
        result["peak_rss_mb"] = max(gathered)
        out[name] = result
        topology.destroy()
    return out


def main() -> None:
    torch.set_num_threads(1)
    one = _run(tiny_config("adamw"), None, defaultdict(int))
    with tempfile.TemporaryDirectory() as tmp:
        four = spawn(_world, 4, Path(tmp), LAYOUTS)
    print(f"one process: step {one['step_s']:.3f} s, peak RSS {one['peak_rss_mb']:.0f} MB, "
          f"{one['params']:,} parameters")
    print(f"{'layout':<19} {'step s':>7} {'x 1 proc':>8} {'RSS MB':>7} {'collective':<18} "
          f"{'counted MB':>10} {'k3-plan MB':>10} {'ratio':>6}")
    for mode, r in four.items():
        expected = r["analytic"]
        for name in sorted(set(r["bytes"]) | set(expected)):
            got, want = r["bytes"].get(name, 0), expected.get(name)
            ratio = f"{got / want:.3f}" if want else "-"
            print(f"{mode:<19} {r['step_s']:>7.3f} {r['step_s'] / one['step_s']:>8.2f} "
                  f"{r['peak_rss_mb']:>7.0f} {name:<18} {got / 1e6:>10.3f} "
                  f"{(want or 0) / 1e6:>10.3f} {ratio:>6}")


if __name__ == "__main__":
    main()
