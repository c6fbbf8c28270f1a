"""Long context on one process: forward+backward time and peak memory of KDA's torch chunk form
against the MLA attention core on the blockwise backend (and, up to --max-dense-T, the sdpa
backend with its dense [B, 1, T, T] document mask), as T grows.

    python -m benchmarks.long_context --T 4096 16384 65536
    python -m benchmarks.long_context --context-parallel 2 --T 16384

One CPU thread, B=1, one document of T tokens given as cu_seqlens (as packed training gives it),
K3's head dims with --heads heads for both (cost per head is the same for any head count).
Each measurement runs in its own subprocess (benchmarks/kda_vs_attention.py explains why):
peak memory is the growth of the resident-set high-water mark (getrusage ru_maxrss) over the
first forward + backward, after imports and inputs exist; that first run is also timed, in wall
seconds and in CPU seconds of the process (the machine is shared: CPU seconds vary less).

--context-parallel N: one KDA and one MLA layer at k3_tiny width (the model's own layers, q/k/v
convs, gates and projections included) over one document of T tokens, forward+backward on one
process (CP1) against N gloo ranks holding T/N tokens each (parallel/context_parallel.py: KCP
state scan and conv halo for KDA, latent all-gather for MLA), one thread per rank; time and
peak memory per rank, measured the same way.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.kda_vs_attention import growth_exponent
from benchmarks.kda_vs_attention import make_step as make_kda_step

METHODS = ("kda_chunk", "mla_blockwise", "mla_dense_mask")
ATTENTION_BACKENDS = {"mla_blockwise": "blockwise", "mla_dense_mask": "sdpa"}


def make_step(method: str, T: int, args):
    if method == "kda_chunk":
        return make_kda_step("kda_chunk", T, args)
    from model.ops.attention import doc_causal_attention

    cu_seqlens = torch.tensor([0, T])
    q, k = (torch.randn(1, T, args.heads, args.mla_qk_dim, requires_grad=True) for _ in range(2))
    v = torch.randn(1, T, args.heads, args.mla_v_dim, requires_grad=True)
    scale = args.mla_qk_dim ** -0.5
    backend = ATTENTION_BACKENDS[method]

    def step():
        o, max_logit = doc_causal_attention(q, k, v, cu_seqlens, scale, backend=backend,
                                            return_max_logit=True)  # QK-Clip on, as in training
        o.sum().backward()

    return step


def measure(method: str, T: int, args) -> dict:
    """Runs inside the worker subprocess."""
    torch.set_num_threads(1)
    step = make_step(method, T, args)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
    return {"time_s": wall, "cpu_s": cpu, "peak_mib": peak_kib / 1024}


def run_worker(method: str, T: int, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.long_context", *argv, "--worker", method, str(T)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def single_process(args, argv: list[str]) -> None:
    """KDA vs MLA side by side at each T, ratios to kda_chunk."""
    results = {}
    for T in args.T:
        for method in METHODS:
            if method == "mla_dense_mask" and T > args.max_dense_T:
                continue
            results[(method, T)] = run_worker(method, T, argv)
            print(f"  measured {method} T={T}: {results[(method, T)]}", file=sys.stderr,
                  flush=True)
    print(f"one thread, B=1, one document of T tokens as cu_seqlens, {args.heads} head(s) each. "
          f"KDA: K=V={args.kda_dim}, chunk 64 (torch). MLA core: Dqk={args.mla_qk_dim}, "
          f"Dv={args.mla_v_dim}, max logit on")
    header = (f"{'T':>7} {'method':<15} {'wall [s]':>9} {'CPU [s]':>8} {'peak [MiB]':>11} "
              f"{'cpu/kda':>8} {'mem/kda':>8}")
    print(header)
    print("-" * len(header))
    for T in args.T:
        base = results[("kda_chunk", T)]
        for method in METHODS:
            r = results.get((method, T))
            if r is None:
                print(f"{T:>7} {method:<15} skipped (T > --max-dense-T)")
                continue
            mem_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}x" if base["peak_mib"] > 0 else "-"
            print(f"{T:>7} {method:<15} {r['time_s']:>9.2f} {r['cpu_s']:>8.2f} "
                  f"{r['peak_mib']:>11.1f} {r['cpu_s'] / base['cpu_s']:>7.2f}x {mem_ratio:>8}")
    print("\ngrowth exponents over the measured T (slope of log y vs log T):")
    for method in METHODS:
        measured = [T for T in args.T if (method, T) in results]
        cpu = growth_exponent([(T, results[(method, T)]["cpu_s"]) for T in measured])
        mem = growth_exponent([(T, max(results[(method, T)]["peak_mib"], 1e-3))
                               for T in measured])
        shown = ("n/a (fewer than 2 points)" if cpu is None
                 else f"CPU time {cpu:.2f}, peak memory {mem:.2f}")
        print(f"  {method:<15} {shown}   (T measured: {measured})")


CP_LAYERS = ("kda", "mla")


def make_cp_step(layer_name: str, T: int, rank: int, size: int):
    """One layer's forward+backward on this rank's fragment of one T-token document."""
    from model.batch import K3Batch, segment_ids
    from model.config import k3_tiny
    from model.kda import KimiDeltaAttention
    from model.mla import GatedMLA
    from parallel.context_parallel import apply_context_parallel, shard_batch

    cfg = k3_tiny()
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg) if layer_name == "kda" else GatedMLA(cfg)
    layer.record_max_logit = True  # QK-Clip on, as in training (read by MLA only)
    x = torch.randn(1, T, cfg.hidden_size)
    tokens = torch.zeros(1, T, dtype=torch.long)
    shard = shard_batch(K3Batch(tokens, tokens, torch.tensor([0, T])), rank, size)
    if size > 1:
        apply_context_parallel(layer, dist.group.WORLD).bind(shard)
    x = x[:, shard.start:shard.start + T // size].clone().requires_grad_()
    segments = segment_ids(shard.cu_seqlens, x.shape[1]).view(1, -1)

    def step():
        layer(x, shard.cu_seqlens, segments).square().mean().backward()

    return step


def _measure_cp_rank(rank: int, size: int, layer_name: str, T: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    if size > 1:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/init", rank=rank,
                                world_size=size)
    step = make_cp_step(layer_name, T, rank, size)
    if size > 1:
        dist.barrier()
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"time_s": wall, "cpu_s": cpu, "peak_mib": peak_kib / 1024}))
    if size > 1:
        dist.barrier()
        dist.destroy_process_group()


def cp_worker(layer_name: str, T: int, size: int) -> list[dict]:
    """Runs inside the worker subprocess: `size` fresh rank processes (one for CP1 too, so
    both sides pay the same start-up), each measuring its own step."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_measure_cp_rank, args=(size, layer_name, T, out_dir), nprocs=size)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(size)]


def context_parallel(args, argv: list[str]) -> None:
    """CP1 vs CP-N per layer at each T: the slowest rank's time, each rank's peak memory."""
    size = args.context_parallel
    rows = []
    for T in args.T:
        for layer_name in CP_LAYERS:
            per_size = {}
            for n in (1, size):
                cmd = [sys.executable, "-m", "benchmarks.long_context", *argv,
                       "--cp-worker", layer_name, str(T), str(n)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                per_size[n] = json.loads(out.strip().splitlines()[-1])
                print(f"  measured {layer_name} T={T} CP{n}: {per_size[n]}", file=sys.stderr,
                      flush=True)
            rows.append((T, layer_name, per_size))
    print(f"k3_tiny layers, one document of T tokens, forward+backward, one thread per rank; "
          f"CP{size}: {size} gloo ranks of T/{size} tokens. Wall and CPU seconds: the slowest "
          f"rank; memory: the largest rank")
    header = (f"{'T':>7} {'layer':<5} {'CP':>3} {'wall [s]':>9} {'CPU [s]':>8} "
              f"{'peak/rank [MiB]':>16} {'wall vs CP1':>12} {'CPU vs CP1':>11} "
              f"{'mem vs CP1':>11}")
    print(header)
    print("-" * len(header))
    for T, layer_name, per_size in rows:
        base = per_size[1][0]
        for n in (1, size):
            wall = max(r["time_s"] for r in per_size[n])
            cpu = max(r["cpu_s"] for r in per_size[n])
            peak = max(r["peak_mib"] for r in per_size[n])
            print(f"{T:>7} {layer_name:<5} {n:>3} {wall:>9.2f} {cpu:>8.2f} {peak:>16.1f} "
                  f"{wall / base['time_s']:>11.2f}x {cpu / base['cpu_s']:>10.2f}x "
                  f"{peak / base['peak_mib']:>10.2f}x")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--max-dense-T", type=int, default=16384,
                   help="skip the dense-mask attention above this T (its mask is T^2 bytes)")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--kda-dim", type=int, default=128, help="d_k = d_v (K3: 128)")
    p.add_argument("--mla-qk-dim", type=int, default=192, help="K3: 128 nope + 64 rope")
    p.add_argument("--mla-v-dim", type=int, default=128)
    p.add_argument("--context-parallel", type=int, default=0, metavar="N",
                   help="compare the KDA and MLA layers on N gloo ranks with one process")
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    p.add_argument("--cp-worker", nargs=3, metavar=("LAYER", "T", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.kda_heads = args.heads  # the names benchmarks.kda_vs_attention.make_step reads
    return args


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        method, T = args.worker
        print(json.dumps(measure(method, int(T), args)))
        return
    if args.cp_worker:
        layer_name, T, size = args.cp_worker
        print(json.dumps(cp_worker(layer_name, int(T), int(size))))
        return
    if args.context_parallel > 1:
        context_parallel(args, argv)
        return
    single_process(args, argv)


if __name__ == "__main__":
    main()
