"""CPU forward+backward time and peak memory of the KDA chunk form, the KDA recurrence and the
MLA attention core (doc_causal_attention, sdpa backend) as the sequence grows.

    python -m benchmarks.kda_vs_attention --T 1024 4096 16384 --max-recurrent-T 4096

Each measurement runs in its own subprocess. Peak memory is the growth of the process's
resident-set high-water mark (getrusage ru_maxrss) from just before the first forward to the end
of the first backward, after imports and inputs exist. That counts every byte the op keeps
resident at its worst moment: autograd's saved tensors, temporaries, allocator slack. torch's CPU
allocator returns large blocks to the OS, so this tracks real use; tracemalloc cannot see torch's
allocations and a parent-process RSS mixes measurements, hence one process each.
Time is the median of --repeats runs after that first (warm-up) run.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

METHODS = ("kda_chunk", "kda_recurrent", "mla_attention")


def make_step(method: str, T: int, args):
    """Inputs as the layers feed them (one document covering T, passed as cu_seqlens as in
    packed training) and a closure running forward and backward."""
    cu_seqlens = torch.tensor([0, T])
    if method == "mla_attention":
        from model.ops.attention import doc_causal_attention

        H = args.mla_heads
        q, k = (torch.randn(1, T, H, args.mla_qk_dim, requires_grad=True) for _ in range(2))
        v = torch.randn(1, T, H, args.mla_v_dim, requires_grad=True)
        scale = args.mla_qk_dim ** -0.5

        def step():
            doc_causal_attention(q, k, v, cu_seqlens, scale, backend="sdpa").sum().backward()

        return step
    from model.ops.kda import kda_chunk, kda_recurrent

    fn = kda_chunk if method == "kda_chunk" else kda_recurrent
    H, D = args.kda_heads, args.kda_dim
    q, k = (F.normalize(torch.randn(1, T, H, D), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, H, D, requires_grad=True)
    g = (-5 * torch.sigmoid(torch.randn(1, T, H, D))).requires_grad_()  # the K3 gate
    beta = torch.rand(1, T, H, requires_grad=True)

    def step():
        o, _ = fn(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        o.sum().backward()

    return step


def measure(method: str, T: int, args) -> dict:
    """Runs inside the worker subprocess."""
    torch.set_num_threads(args.threads)
    step = make_step(method, T, args)
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"time_s": statistics.median(times), "peak_mib": peak_kb / 1024}


def run_worker(method: str, T: int, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.kda_vs_attention", *argv,
           "--worker", method, str(T)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(time) against log(T)."""
    if len(points) < 2:
        return None
    xs = [math.log(T) for T, _ in points]
    ys = [math.log(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def print_table(results: dict, args) -> None:
    print(f"threads={args.threads}  repeats={args.repeats}  "
          f"KDA: H={args.kda_heads} K=V={args.kda_dim} chunk=64 (torch path)  "
          f"MLA core: H={args.mla_heads} Dqk={args.mla_qk_dim} Dv={args.mla_v_dim} (sdpa)")
    print("forward+backward, B=1, one document of T tokens given as cu_seqlens")
    header = f"{'T':>7} {'method':<15} {'time [s]':>10} {'peak [MiB]':>11} " \
             f"{'t/kda_chunk':>12} {'mem/kda_chunk':>14}"
    print(header)
    print("-" * len(header))
    for T in args.T:
        base = results[("kda_chunk", T)]  # kda_chunk is never skipped
        for method in METHODS:
            r = results.get((method, T))
            if r is None:
                print(f"{T:>7} {method:<15} {'skipped (> --max-recurrent-T)':>35}")
                continue
            t_ratio = f"{r['time_s'] / base['time_s']:.2f}x"
            m_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}x" if base["peak_mib"] > 0 else "-"
            print(f"{T:>7} {method:<15} {r['time_s']:>10.3f} {r['peak_mib']:>11.1f} "
                  f"{t_ratio:>12} {m_ratio:>14}")
    print("\ngrowth exponent (slope of log time vs log T over the measured T):")
    for method in METHODS:
        points = [(T, results[(method, T)]["time_s"]) for T in args.T if (method, T) in results]
        slope = growth_exponent(points)
        shown = "n/a (fewer than 2 points)" if slope is None else f"{slope:.2f}"
        print(f"  {method:<15} {shown}   (T measured: {[T for T, _ in points]})")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--max-recurrent-T", type=int, default=16384,
                   help="skip kda_recurrent above this T (a Python loop over tokens)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--kda-heads", type=int, default=4)
    p.add_argument("--kda-dim", type=int, default=128, help="d_k = d_v (K3: 128)")
    p.add_argument("--mla-heads", type=int, default=4)
    p.add_argument("--mla-qk-dim", type=int, default=192, help="K3: 128 nope + 64 rope")
    p.add_argument("--mla-v-dim", type=int, default=128)
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        method, T = args.worker
        print(json.dumps(measure(method, int(T), args)))
        return
    results = {}
    for T in args.T:
        for method in METHODS:
            if method == "kda_recurrent" and T > args.max_recurrent_T:
                continue
            results[(method, T)] = run_worker(method, T, argv)
            print(f"  measured {method} T={T}: {results[(method, T)]}", file=sys.stderr,
                  flush=True)
    print_table(results, args)


if __name__ == "__main__":
    main()
