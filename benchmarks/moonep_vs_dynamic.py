"""MoonEP vs the dynamic all-to-all dispatch on 4 gloo ranks, one scaled-up k3_tiny-shaped MoE
layer (routed experts only), router imbalance maxvio in {0.2, 1, 5, 20}, side by side:
forward+backward time, peak memory, max/mean rows per rank, bytes received, host syncs and
dropped entries.

    python -m benchmarks.moonep_vs_dynamic [--tokens 1024 --experts 64 --top-k 8 --latent 256
                                            --intermediate 256 --reps 3]

Expert popularity is lognormal (as in MoonEP's own benchmark), its spread chosen so that the
popularity's max / mean - 1 equals the target maxvio; tokens then draw K distinct experts from
it, so the realised per-expert maxvio saturates at E / K - 1 (every token takes the hottest
expert), and both are printed. Time: the best over reps of the slowest rank (on a shared
machine the minimum is the least disturbed). Peak memory: the largest resident-set growth over
the pass, sampled every millisecond (glibc's mmap threshold is pinned so freed tensors leave
the resident set).
"""

from __future__ import annotations

import argparse
import datetime
import os
import threading
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # before torch allocates anything

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from model.moe import GroupedExperts  # noqa: E402
from parallel.moonep.dispatcher import MoonEPDispatcher  # noqa: E402
from parallel.moonep.dynamic import DynamicDispatcher  # noqa: E402
from parallel.moonep.traffic import moe_layer_traffic  # noqa: E402
from parallel.moonep.transport import CollectiveTransport  # noqa: E402

MAXVIO = (0.2, 1.0, 5.0, 20.0)
WORLD = 4
SYNCING = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
           torch.Tensor.__float__, torch.Tensor.__index__, torch.nonzero, torch.Tensor.nonzero,
           torch.masked_select, torch.Tensor.masked_select, torch.unique}


class HostSyncCounter(TorchFunctionMode):
    """Counts calls that read a tensor's value on the host (the dispatch-level recorder cannot
    see .tolist() on CPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.count += 1
        return func(*args, **(kwargs or {}))


class PeakRSS:
    """Largest resident-set growth while the context runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @property
    def growth(self) -> int:
        return self.peak - self.base


def popularity(experts: int, maxvio: float) -> torch.Tensor:
    """Lognormal expert popularity with max / mean - 1 == maxvio (bisection on its spread)."""
    z = torch.randn(experts, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    low, high = 0.0, 20.0
    for _ in range(100):
        sigma = (low + high) / 2
        p = (sigma * z).exp()
        low, high = (sigma, high) if p.max() / p.mean() - 1 < maxvio else (low, sigma)
    return p / p.sum()


def routing(p: torch.Tensor, tokens: int, top_k: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.multinomial(p.float().expand(tokens, -1), top_k, generator=gen)


def realised_maxvio(topk: torch.Tensor, experts: int) -> float:
    load = torch.bincount(topk.reshape(-1), minlength=experts).double()
    dist.all_reduce(load)
    return float(load.max() / load.mean() - 1)


def pass_once(dispatcher, experts, x, topk, weight):
    x = x.clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(True)
    d = dispatcher.dispatch(x, topk, weight)
    out = dispatcher.combine(experts(d.buffer, d.group_ends), d)
    out.square().sum().backward()
    return d


def rows_computed(d, dispatch: str, world_tokens: int) -> int:
    if dispatch == "moonep":
        return int((d.routes.token_of_slot < world_tokens).sum())
    return d.buffer.shape[0]


def bytes_received(d, dispatch: str, args, rank: int) -> int:
    """Bytes this rank receives over the pass (forward and backward)."""
    if dispatch == "moonep":  # static: the formula k3-plan prints, fp32 activations
        return moe_layer_traffic(args.tokens, args.top_k, args.experts, WORLD, args.latent,
                                 args.intermediate, "moonep", activation_bytes=4)["total"]
    # Rows in from other ranks (dispatch) and back from them (combine), each again in backward.
    others_in = sum(d.recv_splits) - d.recv_splits[rank]
    others_out = sum(d.send_splits) - d.send_splits[rank]
    return 2 * (others_in + others_out) * args.latent * 4 + (WORLD - 1) * 8


def _worker(rank: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    group = dist.group.WORLD
    per_rank = args.experts // WORLD
    torch.manual_seed(0)
    full = GroupedExperts(args.experts, args.latent, args.intermediate)
    setups = {}
    for dispatch in ("moonep", "dynamic"):
        experts = GroupedExperts(per_rank, args.latent, args.intermediate)
        with torch.no_grad():
            experts.w1.copy_(full.w1[rank * per_rank:(rank + 1) * per_rank])
            experts.w2.copy_(full.w2[rank * per_rank:(rank + 1) * per_rank])
        if dispatch == "moonep":
            dispatcher = MoonEPDispatcher(args.experts, CollectiveTransport(group))
            experts.group_weights = dispatcher.group_weights
        else:
            dispatcher = DynamicDispatcher(args.experts, group)
        setups[dispatch] = (dispatcher, experts)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.latent, generator=gen)
    weight = torch.rand(args.tokens, args.top_k, generator=gen)
    world_tokens = WORLD * args.tokens
    for maxvio in MAXVIO:
        topk = routing(popularity(args.experts, maxvio), args.tokens, args.top_k, rank)
        realised = realised_maxvio(topk, args.experts)
        for dispatch, (dispatcher, experts) in setups.items():
            pass_once(dispatcher, experts, x, topk, weight)  # warm-up
            times, peaks = [], []
            for _ in range(args.reps):
                experts.zero_grad(set_to_none=True)
                dist.barrier()
                with PeakRSS() as mem:
                    start = time.perf_counter()
                    d = pass_once(dispatcher, experts, x, topk, weight)
                    elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(float(elapsed))
                peaks.append(mem.growth)
            with HostSyncCounter() as syncs:
                pass_once(dispatcher, experts, x, topk, weight)
            stats = torch.tensor([rows_computed(d, dispatch, world_tokens), max(peaks),
                                  d.buffer.shape[0], syncs.count,
                                  bytes_received(d, dispatch, args, rank)], dtype=torch.float64)
            gathered = [torch.zeros_like(stats) for _ in range(WORLD)]
            dist.all_gather(gathered, stats)
            if rank == 0:
                table = torch.stack(gathered)
                results.put({
                    "maxvio": maxvio, "realised": realised, "dispatch": dispatch,
                    "time_s": min(times),
                    "peak_mib": float(table[:, 1].max()) / 2**20,
                    "rows_max": int(table[:, 0].max()), "rows_mean": float(table[:, 0].mean()),
                    "buffer_rows_max": int(table[:, 2].max()),
                    "dropped": WORLD * args.tokens * args.top_k - int(table[:, 0].sum()),
                    "host_syncs": int(table[:, 3].max()),
                    "received_mib": float(table[:, 4].max()) / 2**20,
                })
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="S, tokens per rank")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--latent", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from tests.helpers.train_helpers import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(free_port(), args, results), nprocs=WORLD,
                       start_method="spawn")
    rows = []
    while not results.empty():
        rows.append(results.get())
    print(f"{WORLD} gloo ranks, S={args.tokens} tokens per rank, E={args.experts}, "
          f"K={args.top_k}, latent {args.latent}, expert width {args.intermediate}, fp32, "
          f"best of {args.reps}")
    header = (f"{'maxvio':>6} {'real':>5} {'dispatch':>8} {'time s':>7} {'peak MiB':>8} "
              f"{'rows max/mean':>13} {'buffer':>7} {'recv MiB':>8} {'syncs':>5} {'drop':>4}")
    print(header)
    by_key = {(r["maxvio"], r["dispatch"]): r for r in rows}
    for r in rows:
        print(f"{r['maxvio']:>6} {r['realised']:>5.2f} {r['dispatch']:>8} {r['time_s']:>7.3f} "
              f"{r['peak_mib']:>8.1f} {r['rows_max'] / r['rows_mean']:>13.2f} "
              f"{r['buffer_rows_max']:>7} {r['received_mib']:>8.1f} {r['host_syncs']:>5} "
              f"{r['dropped']:>4}")
    for dispatch in ("moonep", "dynamic"):
        lo, hi = by_key[(MAXVIO[0], dispatch)], by_key[(MAXVIO[-1], dispatch)]
        print(f"{dispatch}: time maxvio {MAXVIO[-1]} / {MAXVIO[0]} = "
              f"{hi['time_s'] / lo['time_s']:.2f}, peak memory ratio "
              f"{hi['peak_mib'] / max(lo['peak_mib'], 1e-9):.2f}, max rows ratio "
              f"{hi['rows_max'] / lo['rows_max']:.2f}")
    for maxvio in MAXVIO:
        m, d = by_key[(maxvio, "moonep")], by_key[(maxvio, "dynamic")]
        print(f"maxvio {maxvio}: moonep / dynamic time {m['time_s'] / d['time_s']:.2f}")


if __name__ == "__main__":
    main()
