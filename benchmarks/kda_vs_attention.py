"""CPU forward+backward time and peak memory of the KDA chunk form (K3's bounded gate, and the
exact form any gate takes), the KDA recurrence (the torch reference, and the native C loops that
kda_chunk's `auto` backend runs for fp32 on a CPU: kda_native) and the MLA attention core
(doc_causal_attention, sdpa backend) as the sequence grows, with the chunk form's FLOP rate
against the matmul peak.

    python -m benchmarks.kda_vs_attention --T 1024 4096 16384

Each measurement runs in its own subprocess, one thread. Peak memory is the growth of the
process's resident-set high-water mark (getrusage ru_maxrss) from just before the first forward
to the end of the first backward, after imports and inputs exist. That counts every byte the op
keeps resident at its worst moment: autograd's saved tensors, temporaries, allocator slack.
torch's CPU allocator returns large blocks to the OS, so this tracks real use; tracemalloc cannot
see torch's allocations and a parent-process RSS mixes measurements, hence one process each.
Time is the median of --repeats runs after that first (warm-up) run; kda_recurrent (a Python
loop over tokens, with nothing to warm up) is timed on that first run unless
--recurrent-repeats is set.

The machine is shared, and its load changes within minutes, so the two headline ratios are
measured side by side in one process. Speed-up over the recurrence: a separate worker runs
kda_chunk (a warm-up and --repeats timed runs), one kda_recurrent pass, kda_chunk again
(--repeats runs), all on inputs of the same shapes, and reports the recurrent time / the median
of the chunk runs around it. Share of the matmul peak:
around every timed run the worker times a 1024 x 1024 x 1024 fp32 matmul on its thread (best of
2 before and 2 after); each run's FLOP rate is divided by the mean of its two neighbouring peaks
and the median over the runs is shown, once in wall-clock time and once in the thread's CPU
time (both the op and the probe): on a loaded machine the wall clock also counts the time the
thread waits for a core, the CPU time only what it ran. The chunk form's FLOPs are counted
analytically (chunk_flops: every matmul and triangular solve it runs, forward and backward,
masked entries included; the scores of keys after a row tile, which it never computes, not) and
checked against torch's FlopCounterMode, which counts the matmuls but not the triangular solves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

METHODS = ("kda_chunk", "kda_chunk_exact", "kda_native", "kda_recurrent", "mla_attention")
K3_LOWER_BOUND = -5.0
CHUNK = 64


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
    inputs = kda_inputs(T, args)
    fn = kda_function(method)

    def step():
        o, _ = fn(**inputs, cu_seqlens=cu_seqlens, chunk_size=CHUNK)
        o.sum().backward()

    return step


def kda_inputs(T: int, args) -> dict:
    H, D = args.kda_heads, args.kda_dim
    q, k = (F.normalize(torch.randn(1, T, H, D), dim=-1).requires_grad_() for _ in range(2))
    v = torch.randn(1, T, H, D, requires_grad=True)
    g = (K3_LOWER_BOUND * torch.sigmoid(torch.randn(1, T, H, D))).requires_grad_()  # K3 gate
    beta = torch.rand(1, T, H, requires_grad=True)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def kda_function(method: str):
    import functools

    from model.ops.kda import kda_chunk, kda_recurrent

    if method == "kda_chunk":  # what the K3 layer runs: its gate's bound passed through
        return functools.partial(kda_chunk, lower_bound=K3_LOWER_BOUND, backend="torch")
    if method == "kda_chunk_exact":  # the form for unbounded gates (Kimi Linear's)
        return functools.partial(kda_chunk, backend="torch")
    if method == "kda_native":  # what the layer runs on a CPU in fp32
        from model.ops import cpu

        if not cpu.install():
            raise SystemExit("kda_native: the native kernels are unavailable (see the warning)")
        return functools.partial(kda_chunk, lower_bound=K3_LOWER_BOUND)
    return kda_recurrent


def chunk_flops(T: int, H: int, K: int, V: int, C: int = CHUNK, solves: bool = True) -> int:
    """FLOPs of kda_chunk's bounded form, forward + backward, B = 1, no states in or out
    (2 per multiply-add), as its matmuls and triangular solves run them, masked entries included.

    Per chunk and head, forward: scores, [2t, K] x [K, 16 (a + 1)] for row tile a of the
    n = C/16 (t = 16 rows of q and of k, each against the keys up to the end of the tile:
    4 C K e, with e = C (n + 1) / (2 n) keys per row on average); the unit-triangular inverse
    (a solve against I: C^3); U and W (2 C^2 V + 2 C^2 K); the state pass, W S and K^T Vn
    (4 C K V); the output, (Q exp(G)) S and Aqk Vn (2 C K V + 2 C^2 V). Backward: two matmuls
    for each of the state pass's and the output's (12 C K V + 4 C^2 V), then the custom
    backward: dweighted, dV and d(k exp(G)) (4 C^2 V + 4 C^2 K), dM (two C^3 matmuls: 4 C^3),
    dkeys and drows (8 C K e).
    """
    n = C // 16
    scores = 4 * C * K * C * (n + 1) // (2 * n)
    fwd = scores + 2 * C * C * K + 4 * C * C * V + 6 * C * K * V + (C ** 3 if solves else 0)
    bwd = 12 * C * K * V + 8 * C * C * V + 4 * C * C * K + 2 * scores + 4 * C ** 3
    return (fwd + bwd) * -(-T // C) * H


def counted_flops(T: int, args) -> int:
    """The bounded chunk form's fwd + bwd matmul FLOPs as torch's FlopCounterMode sees them."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = kda_inputs(T, args)
    counter = FlopCounterMode(display=False)
    with counter:
        o, _ = kda_function("kda_chunk")(**inputs, cu_seqlens=torch.tensor([0, T]),
                                         chunk_size=CHUNK)
        o.sum().backward()
    return counter.get_total_flops()


def matmul_peak_gflops(n: int = 1024, tries: int = 5) -> tuple[float, float]:
    """The best n^3 fp32 matmul rate over `tries`, in wall-clock and in thread CPU time."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = best_cpu = math.inf
    for _ in range(tries):
        start, start_cpu = time.perf_counter(), time.thread_time()
        a @ b
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.thread_time() - start_cpu)
    return 2 * n ** 3 / best / 1e9, 2 * n ** 3 / best_cpu / 1e9


def timed_runs(step, repeats: int) -> list[tuple[float, float, float, float]]:
    """(seconds, mean matmul peak just before and after, CPU seconds, the same in CPU time) for
    each of `repeats` runs."""
    runs = []
    peak_before = matmul_peak_gflops(tries=2)
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        seconds, cpu_seconds = time.perf_counter() - start, time.thread_time() - start_cpu
        peak_after = matmul_peak_gflops(tries=2)
        wall_peak, cpu_peak = ((x + y) / 2 for x, y in zip(peak_before, peak_after))
        runs.append((seconds, wall_peak, cpu_seconds, cpu_peak))
        peak_before = peak_after
    return runs


def measure(method: str, T: int, args) -> dict:
    """Runs inside the worker subprocess."""
    torch.set_num_threads(args.threads)
    step = make_step(method, T, args)
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    step()
    first_s = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb
    repeats = args.recurrent_repeats if method == "kda_recurrent" else args.repeats
    runs = timed_runs(step, repeats)
    result = {"time_s": statistics.median(r[0] for r in runs) if runs else first_s,
              "timed_runs": max(len(runs), 1), "peak_mib": peak_kb / 1024, "runs": runs}
    return result


def measure_speedup(T: int, args) -> dict:
    """Runs inside its own worker: kda_chunk runs around one kda_recurrent pass."""
    torch.set_num_threads(args.threads)
    chunk_step = make_step("kda_chunk", T, args)
    recurrent_step = make_step("kda_recurrent", T, args)
    chunk_step()
    chunk_s = [r[0] for r in timed_runs(chunk_step, args.repeats)]
    start = time.perf_counter()
    recurrent_step()
    recurrent_s = time.perf_counter() - start
    chunk_s += [r[0] for r in timed_runs(chunk_step, args.repeats)]
    return {"recurrent_s": recurrent_s, "chunk_s": statistics.median(chunk_s)}


def run_worker(method: str, T: int, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.kda_vs_attention", *argv,
           "--worker", method, str(T)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def growth_exponent(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of log(y) against log(T)."""
    if len(points) < 2:
        return None
    xs = [math.log(T) for T, _ in points]
    ys = [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            / sum((x - mx) ** 2 for x in xs))


def print_table(results: dict, args) -> None:
    H, D = args.kda_heads, args.kda_dim
    print(f"threads={args.threads}  repeats={args.repeats} (kda_recurrent: "
          f"{args.recurrent_repeats or 'its first run'})  KDA: H={H} K=V={D} chunk={CHUNK} "
          f"(kda_chunk, kda_native: lower_bound={K3_LOWER_BOUND})  "
          f"MLA core: H={args.mla_heads} Dqk={args.mla_qk_dim} Dv={args.mla_v_dim} (sdpa)")
    print("forward+backward, B=1, one document of T tokens given as cu_seqlens")
    header = (f"{'T':>7} {'method':<16} {'time [s]':>9} {'peak [MiB]':>11} {'t/kda_chunk':>12} "
              f"{'mem/kda_chunk':>14} {'GFLOP/s':>8} {'mm peak':>8} {'of peak':>8} {'(CPU t)':>8}")
    print(header)
    print("-" * len(header))
    for T in args.T:
        base = results[("kda_chunk", T)]  # kda_chunk is never skipped
        for method in METHODS:
            r = results.get((method, T))
            if r is None:
                if method in args.methods:
                    print(f"{T:>7} {method:<16} {'skipped (> --max-recurrent-T)':>35}")
                continue
            t_ratio = f"{r['time_s'] / base['time_s']:.2f}x"
            m_ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}x" if base["peak_mib"] > 0 else "-"
            rate = share = cpu_share = "-"
            peak = f"{statistics.median(run[1] for run in r['runs']):.1f}" if r["runs"] else "-"
            if method == "kda_chunk":
                flops = chunk_flops(T, H, D, D)
                rate = f"{flops / r['time_s'] / 1e9:.1f}"
                runs = r["runs"]  # (wall s, wall peak, CPU s, CPU peak) of each timed run
                share, cpu_share = (
                    f"{statistics.median(flops / run[i] / 1e9 / run[i + 1] for run in runs):.0%}"
                    for i in (0, 2))
            print(f"{T:>7} {method:<16} {r['time_s']:>9.3f} {r['peak_mib']:>11.1f} "
                  f"{t_ratio:>12} {m_ratio:>14} {rate:>8} {peak:>8} {share:>8} {cpu_share:>8}")
    print("\nkda_chunk speed-up over kda_recurrent, side by side in one worker (one recurrent "
          "pass / the median of the kda_chunk runs before and after it):")
    for T in args.T:
        if ("speedup", T) in results:
            r = results[("speedup", T)]
            print(f"  T={T:>6}: {r['recurrent_s'] / r['chunk_s']:.1f}x  "
                  f"({r['recurrent_s']:.2f} s / {r['chunk_s']:.3f} s)")
    print("\ngrowth exponents (slope of log y vs log T over the measured T):")
    for method in (m for m in METHODS if m in args.methods):
        measured = [T for T in args.T if (method, T) in results]
        for what in ("time_s", "peak_mib"):
            points = [(T, results[(method, T)][what]) for T in measured
                      if results[(method, T)][what] > 0]
            slope = growth_exponent(points)
            shown = "n/a (fewer than 2 points)" if slope is None else f"{slope:.2f}"
            print(f"  {method:<16} {what.split('_')[0]:<5} {shown}   (T measured: {measured})")


def print_flop_check(args) -> None:
    T = 4 * CHUNK
    H, D = args.kda_heads, args.kda_dim
    counted = counted_flops(T, args)
    analytic = chunk_flops(T, H, D, D, solves=False)
    print(f"\nFLOP count check at T={T}: chunk_flops without its triangular solves {analytic:,} "
          f"vs FlopCounterMode {counted:,} (ratio {counted / analytic:.3f}); with the solves "
          f"chunk_flops = {chunk_flops(T, H, D, D):,}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--max-recurrent-T", type=int, default=16384,
                   help="skip kda_recurrent above this T (a Python loop over tokens)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--recurrent-repeats", type=int, default=0,
                   help="timed runs of kda_recurrent after its first (0: time the first)")
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
        if method == "speedup":
            print(json.dumps(measure_speedup(int(T), args)))
        else:
            print(json.dumps(measure(method, int(T), args)))
        return
    if "kda_chunk" not in args.methods:
        raise SystemExit("--methods must include kda_chunk (every ratio is against it)")
    print(f"load average before: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    results = {}
    for T in args.T:
        for method in (m for m in METHODS if m in args.methods):
            if method == "kda_recurrent" and T > args.max_recurrent_T:
                continue
            results[(method, T)] = run_worker(method, T, argv)
            print(f"  measured {method} T={T}: {results[(method, T)]}", file=sys.stderr,
                  flush=True)
        if "kda_recurrent" in args.methods and T <= args.max_recurrent_T:
            results[("speedup", T)] = run_worker("speedup", T, argv)
            print(f"  measured speedup T={T}: {results[('speedup', T)]}", file=sys.stderr,
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    print_table(results, args)
    torch.set_num_threads(args.threads)
    print_flop_check(args)


if __name__ == "__main__":
    main()
