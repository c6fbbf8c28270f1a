"""Decode time per token and cache bytes per sequence as the context grows, k3_tiny (six KDA
layers, two MLA) side by side with the same model made of MLA layers only, on the CPU.

    PYTHONPATH=. python -m benchmarks.decoding [--contexts 1024 4096 16384 65536] [--tokens 16]

Each context's cache is filled with random contents of the right shapes (states, convolution
tails, latents of every position, one document): a decode step's work depends on the positions
the cache holds, not on their values, and prefilling 64K positions through the CPU's torch forms
would take minutes. Per model and context the median time of --tokens single-token decode calls
of one row, and the cache's bytes (what `model.new_cache` allocates and the positions fill)
against the formula: per KDA layer the fp32 state H*K*V*4 and three convolution tails
(kernel-1)*H*K*4, flat in the context; per MLA layer (kv_lora_rank + qk_rope_head_dim)*4 bytes
per position (fp32 model; bf16 would halve it), and 8 bytes per position for the document ids.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from model.cache import KDACache
from model.config import k3_tiny, replace
from model.k3 import K3Model


def _filled_cache(model: K3Model, context: int, generator: torch.Generator):
    cache = model.new_cache(1)
    cache.reserve(context + 64)
    for layer in cache.layers.values():
        if isinstance(layer, KDACache):
            layer.state = torch.randn(layer.state.shape, generator=generator) * 0.1
            layer.conv_tails = [torch.randn(t.shape, generator=generator)
                                for t in layer.conv_tails]
        else:
            layer.latent[:, :context] = torch.randn(layer.latent[:, :context].shape,
                                                    generator=generator)
    cache.slot_documents[:, :context] = 0
    cache.tokens_seen.fill_(context)
    cache.slots = context
    return cache


def cache_bytes(cache) -> int:
    """Bytes of what the cache holds for its written positions."""
    total = cache.slots * cache.slot_documents.element_size() * cache.batch_size
    for layer in cache.layers.values():
        if isinstance(layer, KDACache):
            total += sum(t.numel() * t.element_size() for t in [layer.state, *layer.conv_tails])
        else:
            total += layer.latent[:, :cache.slots].numel() * layer.latent.element_size()
    return total


def formula_bytes(model: K3Model, context: int) -> int:
    cfg = model.cfg
    kda, mla = cfg.kda, cfg.mla
    width = kda.num_heads * kda.head_dim
    per_kda = 4 * (kda.num_heads * kda.head_dim ** 2 + 3 * (kda.conv_kernel - 1) * width)
    per_mla = 4 * (mla.kv_lora_rank + mla.qk_rope_head_dim) * context
    kinds = cfg.layer_types()
    return (sum(per_kda if k == "kda" else per_mla for k in kinds) + 8 * context)


def measure(model: K3Model, context: int, tokens: int) -> tuple[float, int]:
    """(median seconds of a single-token decode call after `context` positions, the cache's
    bytes then)."""
    generator = torch.Generator().manual_seed(context)
    cache = _filled_cache(model, context, generator)
    nbytes = cache_bytes(cache)
    times = []
    token = torch.tensor([[7]])
    for _ in range(tokens + 1):
        start = time.perf_counter()
        model.decode(token, cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = replace(k3_tiny(), vision=None, max_seq_len=max(args.contexts) + 4 * args.tokens)
    models = {"k3_tiny (6 KDA + 2 MLA)": K3Model(base, seed=0).eval(),
              "MLA only (8 MLA)": K3Model(replace(base, mla_every=1), seed=0).eval()}
    print(f"{'model':26s} {'context':>8s} {'ms/token':>9s} {'cache MiB':>10s} "
          f"{'formula MiB':>12s}")
    for name, model in models.items():
        for context in args.contexts:
            seconds, nbytes = measure(model, context, args.tokens)
            print(f"{name:26s} {context:8d} {seconds * 1e3:9.2f} {nbytes / 2**20:10.3f} "
                  f"{formula_bytes(model, context) / 2**20:12.3f}")


if __name__ == "__main__":
    main()
