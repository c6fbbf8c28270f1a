"""The fused elementwise autograd functions against their plain references at the demo's
sizes (one micro-batch of 4 x 512 tokens, k3_tiny widths, fp32; a depth mix of three sources,
as in k3_tiny's second block): forward + backward time in the thread's CPU time (one thread;
less sensitive to other processes on the machine than wall time) and the bytes saved for
backward besides the inputs, measured side by side in one run. The "compiled" column is the
same function with its kernels compiled (`fused_kernels=true`, model/ops/fused.py; compiled
before the timed runs), which also times the bounded-gate KDA chunk form at the demo's layer
shape.

    python -m benchmarks.fused_ops [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model.activations import situ_glu_halves, situ_glu_reference
from model.attnres import depth_mix, depth_mix_reference
from model.norms import rms_norm, rms_norm_reference
from model.ops import fused as fused_kernels
from model.ops.kda import kda_chunk
from model.short_conv import doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference
from train.saved_activations import SavedBytes

ROWS, SEQ = 4, 512


def _cases() -> dict:
    """name -> (inputs needing gradients, other arguments, fused, reference)."""
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor([300, SEQ - 300]))
    gate_up = torch.randn(ROWS * SEQ, 2 * 128)
    return {
        "situ_glu [2048, 128]": ((gate_up,), (), situ_glu_halves,
                                 lambda gu: situ_glu_reference(*gu.chunk(2, -1))),
        "rms_norm [4, 512, 64]": ((torch.randn(ROWS, SEQ, 64), torch.rand(64) + 0.5), (1e-5,),
                                  rms_norm, rms_norm_reference),
        "short conv + silu [4, 512, 64], K 4": (
            (torch.randn(ROWS, SEQ, 64), torch.randn(64, 4)), (segments.expand(ROWS, SEQ),),
            doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference),
        "depth mix, 3 sources [4, 512, 64]": (
            (*(torch.randn(ROWS, SEQ, 64) * s for s in (1, 3, 10)), torch.randn(64),
             torch.rand(64) + 0.5), (),
            lambda *x: depth_mix(x[:3], *x[3:], 1e-5),
            lambda *x: depth_mix_reference(x[:3], *x[3:], 1e-5)),
        "kda_chunk [2048 tokens, 2 x 32], C 32": (
            _kda_inputs(), (), _kda_layer_call, None),
    }


def _kda_inputs():
    q, k = (torch.nn.functional.normalize(torch.randn(1, ROWS * SEQ, 2, 32), dim=-1)
            for _ in range(2))
    g = -5 * torch.sigmoid(2 * torch.randn(1, ROWS * SEQ, 2, 32))
    return q, k, torch.randn(1, ROWS * SEQ, 2, 32), g, torch.rand(1, ROWS * SEQ, 2)


def _kda_layer_call(q, k, v, g, beta):
    """As the layer calls it: each row starts a document, the first row holds two."""
    cu_seqlens = torch.tensor([0, 300, *range(SEQ, ROWS * SEQ + 1, SEQ)])
    return kda_chunk(q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_size=32,
                     lower_bound=-5.0, rows=ROWS, backend="torch")[0]


def _step(fn, leaves, args, compiled: bool = False) -> tuple[float, int]:
    """CPU seconds of one forward + backward, and the bytes it saved besides its inputs."""
    leaves = [t.clone().requires_grad_() for t in leaves]
    grad = torch.ones(())
    fused_kernels.enable_fused_kernels(compiled)
    start = time.thread_time()
    with SavedBytes(leaves) as saved:
        out = fn(*leaves, *args)
    out.backward(grad.expand_as(out))
    seconds = time.thread_time() - start
    fused_kernels.enable_fused_kernels(False)
    return seconds, saved.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'op':<38} {'fused [ms]':>10} {'plain [ms]':>10} {'time ratio':>10} "
          f"{'saved besides the inputs: fused':>32} {'plain':>10} {'compiled [ms]':>14} "
          f"{'/ fused':>8}")
    for name, (leaves, extra, fused, reference) in _cases().items():
        variants = {"fused": (fused, False), "compiled": (fused, True)}
        if reference is not None:
            variants["plain"] = (reference, False)
        _step(fused, leaves, extra, compiled=True)  # compiles the kernels: not timed
        times = {key: [] for key in variants}
        saved = {}
        for _ in range(args.repeats):  # alternated, so all see the same machine
            for key, (fn, compiled) in variants.items():
                seconds, saved[key] = _step(fn, leaves, extra, compiled)
                times[key].append(seconds)
        ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        plain = (f"{ms['plain']:>10.3f} {ms['fused'] / ms['plain']:>9.2f}x "
                 f"{saved['fused'] / 2**20:>28.2f} MiB {saved['plain'] / 2**20:>6.2f} MiB"
                 if reference is not None else f"{'-':>10} {'-':>10} {'-':>32} {'-':>10}")
        print(f"{name:<38} {ms['fused']:>10.3f} {plain} {ms['compiled']:>14.3f} "
              f"{ms['compiled'] / ms['fused']:>7.2f}x")


if __name__ == "__main__":
    main()
