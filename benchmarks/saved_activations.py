"""Bytes a k3_tiny forward keeps for backward (saved-tensor hooks over distinct storages), with
and without activation checkpointing of whole decoder layers and with the chunked or the
full-logits loss, next to what `k3-plan` counts for the same shapes (meta-device trace).

    python -m benchmarks.saved_activations --seq-lens 256 1024 --rows 2

bf16 weights and activations (the plan's assumption), text only, k3_tiny.
"""

from __future__ import annotations

import argparse

import torch

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny, replace
from model.k3 import K3Model
from train.activation_checkpointing import apply_activation_checkpointing
from train.plan import saved_after_forward
from train.saved_activations import measure_saved_bytes

MiB = 2**20


def measure(cfg, rows: int, seq_len: int, checkpointing: bool) -> int:
    torch.manual_seed(0)
    model = K3Model(cfg).to(torch.bfloat16)
    if checkpointing:
        apply_activation_checkpointing(model)
    tokens = torch.randint(5, cfg.vocab_size, (rows, seq_len))
    cu = cu_seqlens_from_lengths([[seq_len]] * rows, seq_len)
    return measure_saved_bytes(model, K3Batch(tokens, tokens.roll(-1, 1), cu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args()
    chunked = replace(k3_tiny(), vision=None)
    full_logits = replace(chunked, loss_chunk_tokens=0)
    print("| seq_len | loss | AC | measured MiB | k3-plan MiB | plan / measured | "
          "AC saves |")
    print("|---|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        for name, cfg in (("chunked", chunked), ("full logits", full_logits)):
            without = None
            for checkpointing in (False, True):
                measured = measure(cfg, args.rows, seq_len, checkpointing)
                planned, _ = saved_after_forward(cfg, seq_len, args.rows, cfg.num_layers,
                                                 checkpointing)
                without = measured if not checkpointing else without
                saves = f"{without / measured:.1f}x" if checkpointing else ""
                print(f"| {seq_len} | {name} | {'on' if checkpointing else 'off'} | "
                      f"{measured / MiB:.2f} | {planned / MiB:.2f} | {planned / measured:.3f} | "
                      f"{saves} |")


if __name__ == "__main__":
    main()
