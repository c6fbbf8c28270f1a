"""The blockwise attention backend's forward as C loops: per query only the keys of its document
(the torch tiles compute whole tiles and mask them), on fp32 CPU rows of up to NATIVE_MAX_KEYS
keys; longer rows take the tiles, whose matmuls reuse the cache better. Its backward is
bindings.attention_backward as it stands."""

from __future__ import annotations

from . import bindings

NATIVE_MAX_KEYS = 4096


def attention_forward(q, k, v, q_segments, k_segments, scale: float, causal: bool,
                      q_offset: int):
    """bindings.attention_forward for rows of up to NATIVE_MAX_KEYS keys, else None."""
    if k.shape[-2] > NATIVE_MAX_KEYS:
        return None
    return bindings.attention_forward(q, k, v, q_segments, k_segments, scale, causal, q_offset)
