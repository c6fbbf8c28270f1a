"""The blockwise attention backend's forward and backward as C loops: per query only the keys of
its document (the torch tiles compute whole tiles and mask them), on CPU rows of up to
NATIVE_MAX_KEYS keys; longer rows take the tiles, whose matmuls reuse the cache better. The
loops compute in fp32: half-precision inputs (bf16 autocast on a CPU) go in as fp32 copies, at
most NATIVE_MAX_KEYS keys' worth, and their gradients come back in the inputs' dtypes."""

from __future__ import annotations

import torch

from . import bindings

NATIVE_MAX_KEYS = 4096


def _fp32(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.float() if x.dtype in (torch.bfloat16, torch.float16) else x for x in tensors)


def attention_forward(q, k, v, q_segments, k_segments, scale: float, causal: bool,
                      q_offset: int):
    """bindings.attention_forward for CPU rows of up to NATIVE_MAX_KEYS keys, else None."""
    if k.shape[-2] > NATIVE_MAX_KEYS or q.device.type != "cpu":
        return None
    return bindings.attention_forward(*_fp32(q, k, v), q_segments, k_segments, scale, causal,
                                      q_offset)


def attention_backward(q, k, v, q_segments, k_segments, o, lse, grad_o, scale: float,
                       causal: bool, q_offset: int):
    """bindings.attention_backward, the gradients in the dtypes of q, k and v; None where it
    does not apply."""
    if q.device.type != "cpu":
        return None
    grads = bindings.attention_backward(*_fp32(q, k, v), q_segments, k_segments, o, lse, grad_o,
                                        scale, causal, q_offset)
    return None if grads is None else tuple(g.to(x.dtype) for g, x in zip(grads, (q, k, v),
                                                                           strict=True))
