"""Plain data parallelism: gradients summed across data-parallel ranks after backward.

The loss of every micro-batch is already divided by the global number of loss tokens, so a sum
(not a mean) of the ranks' gradients gives exactly the single-process gradient of the same
global batch. Gradients are flattened into buckets so each all-reduce moves one large buffer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def fill_missing_gradients(model: nn.Module) -> None:
    """Zero gradients for parameters a step did not reach (e.g. the vision encoder on a text-only
    batch): every parameter then takes part in the all-reduce and gets an optimizer update (and
    optimizer state) every step, on one rank or many."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def allreduce_gradients(model: nn.Module, group=None, bucket_bytes: int = 64 << 20,
                        params: list[torch.Tensor] | None = None) -> None:
    """Sums gradients over the group (of `params`, default every trainable parameter of the
    model); call fill_missing_gradients first."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= bucket_bytes:
            _reduce_bucket(bucket, group)
            bucket, size = [], 0
    if bucket:
        _reduce_bucket(bucket, group)


def _reduce_bucket(grads: list[torch.Tensor], group) -> None:
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
