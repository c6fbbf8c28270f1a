"""Bytes a k3_tiny forward keeps for backward (saved-tensor hooks over distinct storages), with
and without activation checkpointing of whole decoder layers and with the chunked or the
full-logits loss, next to what `k3-plan` counts for the same shapes (meta-device trace).

    python -m benchmarks.saved_activations --seq-lens 256 1024 --rows 2
    python -m benchmarks.saved_activations --by-site --seq-lens 512 --rows 4 [--dtype fp32]

bf16 weights and activations (the plan's assumption), text only, k3_tiny. `--by-site` instead
breaks one forward's saved bytes down by the innermost function under model/ that saved each
storage (the first to save it counts it), here 4 rows of 512 in fp32: the demo's micro-batch.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny, replace
from model.k3 import K3Model
from train.activation_checkpointing import apply_activation_checkpointing
from train.plan import saved_after_forward
from train.saved_activations import measure_saved_bytes

MiB = 2**20
MODEL_DIR = Path(__file__).resolve().parent.parent / "model"


def _site() -> str:
    """model/<file>:<function> of the innermost frame under model/ (the caller of the hook)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(MODEL_DIR):
            return f"{path.relative_to(MODEL_DIR.parent)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside model/)"


def saved_by_site(cfg, rows: int, seq_len: int, dtype: torch.dtype) -> Counter:
    torch.manual_seed(0)
    model = K3Model(cfg).to(dtype)
    tokens = torch.randint(5, cfg.vocab_size, (rows, seq_len))
    cu = cu_seqlens_from_lengths([[seq_len]] * rows, seq_len)
    excluded = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    first_saver: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key not in excluded and key not in first_saver:
            first_saver[key] = _site(), t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(K3Batch(tokens, tokens.roll(-1, 1), cu))
    sites = Counter()
    for site, nbytes in first_saver.values():
        sites[site] += nbytes
    del out
    return sites


def print_by_site(cfg, rows: int, seq_len: int, dtype: torch.dtype) -> None:
    sites = saved_by_site(cfg, rows, seq_len, dtype)
    print(f"k3_tiny, text only, {rows} x {seq_len} tokens, {dtype}: saved for backward by site")
    print("| site | MiB |")
    print("|---|---|")
    for site, nbytes in sites.most_common():
        print(f"| {site} | {nbytes / MiB:.2f} |")
    print(f"| total | {sum(sites.values()) / MiB:.2f} |")


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
    parser.add_argument("--by-site", action="store_true")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="weights and activations of --by-site")
    args = parser.parse_args()
    chunked = replace(k3_tiny(), vision=None)
    if args.by_site:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        for seq_len in args.seq_lens:
            print_by_site(chunked, args.rows, seq_len, dtype)
        return
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
