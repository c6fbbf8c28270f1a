"""MoonEP's two transports per rank as the expert-parallel world grows: one k3_full MoE layer
(S = 8192 tokens per rank, K = 16 of E = 896 experts, latent L = 3584, expert width 3072, bf16
tokens and weights), forward and backward of dispatch, the copies' weights and combine, on
torch's fake process group and fake tensors at R = 2..64 (rank 0; every rank's shapes are the
same). Side by side per transport, for the tokens (routing, dispatch and combine): the bytes
handed to collectives and the peak memory the exchange adds, each over S*K*L*2 (the bytes of
the layer's S*K dispatched rows), and the largest buffer handed to one collective in latent
rows; for the copied experts' weights: the bytes handed over the rank's home weights' bytes.

    PYTHONPATH=. python -m benchmarks.moonep_scaling [--ranks 2 4 8 16 32 64]

O(S*K) per rank means the symm_mem token columns stay flat as R grows; the collective
transport's token all-gather and reduce-scatter grow as R*S. The expert GEMM is left out (an
identity on the dispatched rows; the copies are fetched and their gradient returned on their
own): the transports are measured, not the GEMM.
"""

from __future__ import annotations

import argparse

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from benchmarks.fake_world import WORLD_SIZES, fake_process_group
from parallel.moonep.dispatcher import MoonEPDispatcher
from parallel.moonep.transport import CollectiveTransport, SymmMemTransport
from train.step_probes import CollectiveBytes, StepMemory

TOKENS, TOP_K, EXPERTS, LATENT, INTER = 8192, 16, 896, 3584, 3072
TRANSPORTS = {"collective": CollectiveTransport, "symm_mem": SymmMemTransport}


class LargestBuffer(CollectiveBytes):
    """CollectiveBytes, and the most latent rows handed to one collective."""

    def __init__(self):
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.bytes.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        handed = sum(self.bytes.values()) - before
        if handed:
            self.rows = max(self.rows, handed // (LATENT * 2))
        return out


def measure(ranks: int, transport: str) -> tuple[int, int, int, int]:
    """(bytes handed to collectives, peak bytes above the inputs, largest buffer in rows) of the
    tokens' forward and backward on rank 0, and the bytes handed for the copies."""
    with fake_process_group(ranks) as group, FakeTensorMode():
        dispatcher = MoonEPDispatcher(EXPERTS, TRANSPORTS[transport](group), alignment=8)
        home = EXPERTS // ranks
        w1 = torch.empty(home, 2 * INTER, LATENT, dtype=torch.bfloat16, requires_grad=True)
        w2 = torch.empty(home, LATENT, INTER, dtype=torch.bfloat16, requires_grad=True)
        x = torch.empty(TOKENS, LATENT, dtype=torch.bfloat16, requires_grad=True)
        topk = torch.empty(TOKENS, TOP_K, dtype=torch.long)
        weight = torch.empty(TOKENS, TOP_K, requires_grad=True)
        memory, counter, copies = StepMemory(), LargestBuffer(), CollectiveBytes()
        memory.track([w1, w2, x, topk, weight])
        base = memory.current
        with memory, counter:
            d = dispatcher.dispatch(x, topk, weight)
            dispatcher.combine(d.buffer, d).sum().backward()
        with copies:
            g1, g2 = dispatcher.group_weights(w1, w2, torch.bfloat16)
            (g1.sum() + g2.sum()).backward()
    return (sum(counter.bytes.values()), memory.peak - base, counter.rows,
            sum(copies.bytes.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=WORLD_SIZES)
    args = parser.parse_args()
    rows = TOKENS * TOP_K * LATENT * 2
    print(f"one MoE layer, S={TOKENS} K={TOP_K} E={EXPERTS} L={LATENT}: S*K*L*2 = "
          f"{rows / 2**20:.0f} MiB")
    print(f"{'':>3} " + " ".join(f"{name:-^40}" for name in TRANSPORTS))
    print(f"{'R':>3} " + " ".join(f"{'tokens bytes':>13} {'peak':>6} {'rows':>8} {'copies':>9}"
                                  for _ in TRANSPORTS))
    for ranks in args.ranks:
        home = EXPERTS // ranks * 3 * LATENT * INTER * 2
        cells = []
        for name in TRANSPORTS:
            sent, peak, largest, copied = measure(ranks, name)
            cells.append(f"{sent / rows:>13.2f} {peak / rows:>6.2f} {largest:>8} "
                         f"{copied / home:>9.2f}")
        print(f"{ranks:>3} " + " ".join(cells))


if __name__ == "__main__":
    main()
