"""Long context on one process: forward+backward time and peak memory of KDA's torch chunk form
against the MLA attention core on the blockwise backend (and, up to --max-dense-T, the sdpa
backend with its dense [B, 1, T, T] document mask), as T grows.

    python -m benchmarks.long_context --T 4096 16384 65536

One CPU thread, B=1, one document of T tokens given as cu_seqlens (as packed training gives it),
K3's head dims with --heads heads for both (cost per head is the same for any head count).
Each measurement runs in its own subprocess (benchmarks/kda_vs_attention.py explains why):
peak memory is the growth of the resident-set high-water mark (getrusage ru_maxrss) over the
first forward + backward, after imports and inputs exist; that first run is also timed, in wall
seconds and in CPU seconds of the process (the machine is shared: CPU seconds vary less).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--max-dense-T", type=int, default=16384,
                   help="skip the dense-mask attention above this T (its mask is T^2 bytes)")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--kda-dim", type=int, default=128, help="d_k = d_v (K3: 128)")
    p.add_argument("--mla-qk-dim", type=int, default=192, help="K3: 128 nope + 64 rope")
    p.add_argument("--mla-v-dim", type=int, default=128)
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "T"), help=argparse.SUPPRESS)
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
    single_process(args, argv)


if __name__ == "__main__":
    main()
