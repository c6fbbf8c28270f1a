"""The fused elementwise autograd functions against their plain references at the demo's
sizes (one micro-batch of 4 x 512 tokens, k3_tiny widths, fp32): forward + backward time in the
thread's CPU time (one thread; less sensitive to other processes on the machine than wall
time) and the bytes saved for backward besides the inputs, measured side by side in one run.

    python -m benchmarks.fused_ops [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model.activations import situ_glu, situ_glu_reference
from model.norms import rms_norm, rms_norm_reference
from model.short_conv import doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference
from train.saved_activations import SavedBytes

ROWS, SEQ = 4, 512


def _cases() -> dict:
    """name -> (inputs needing gradients, other arguments, fused, reference)."""
    segments = torch.repeat_interleave(torch.arange(2), torch.tensor([300, SEQ - 300]))
    gate_up = torch.randn(ROWS * SEQ, 2 * 128)
    return {
        "situ_glu [2048, 128]": ((gate_up,), (), lambda gu: situ_glu(*gu.chunk(2, -1)),
                                 lambda gu: situ_glu_reference(*gu.chunk(2, -1))),
        "rms_norm [4, 512, 64]": ((torch.randn(ROWS, SEQ, 64), torch.rand(64) + 0.5), (1e-5,),
                                  rms_norm, rms_norm_reference),
        "short conv + silu [4, 512, 64], K 4": (
            (torch.randn(ROWS, SEQ, 64), torch.randn(64, 4)), (segments.expand(ROWS, SEQ),),
            doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference),
    }


def _step(fn, leaves, args) -> tuple[float, int]:
    """CPU seconds of one forward + backward, and the bytes it saved besides its inputs."""
    leaves = [t.clone().requires_grad_() for t in leaves]
    grad = torch.ones(())
    start = time.thread_time()
    with SavedBytes(leaves) as saved:
        out = fn(*leaves, *args)
    out.backward(grad.expand_as(out))
    return time.thread_time() - start, saved.bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'op':<38} {'fused [ms]':>10} {'plain [ms]':>10} {'time ratio':>10} "
          f"{'saved besides the inputs: fused':>32} {'plain':>10}")
    for name, (leaves, extra, fused, reference) in _cases().items():
        times = {"fused": [], "plain": []}
        saved = {}
        for _ in range(args.repeats):  # alternated, so both see the same machine
            for key, fn in (("fused", fused), ("plain", reference)):
                seconds, saved[key] = _step(fn, leaves, extra)
                times[key].append(seconds)
        ms = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        print(f"{name:<38} {ms['fused']:>10.3f} {ms['plain']:>10.3f} "
              f"{ms['fused'] / ms['plain']:>9.2f}x {saved['fused'] / 2**20:>28.2f} MiB "
              f"{saved['plain'] / 2**20:>6.2f} MiB")


if __name__ == "__main__":
    main()
