"""Softmax attention restricted to documents (the MLA core; MoonViT's
per-image attention).

Layout: q, k [B, T, H, Dqk], v [B, T, H, Dv] (Dv may differ from Dqk). `cu_seqlens` [N + 1]
marks document boundaries over the flattened B*T tokens (model/batch.py: no document crosses a
row); a token attends to the tokens of its own document only, and with `causal` to the earlier
ones. The output is fp32 (K3 keeps the attention output in fp32). With `return_max_logit`
the per-head maximum pre-softmax logit over the allowed positions of the batch comes back too
(detached, a device tensor: no sync), for QK-Clip.

Backends ("auto" picks the first that applies):
- "varlen": flash attention over cu_seqlens (torch.nn.attention.varlen), CUDA, fp16/bf16 inputs.
- "sdpa": F.scaled_dot_product_attention. Without cu_seqlens its fused kernel needs no mask and
  its memory is linear in T; with cu_seqlens it takes a dense [B, 1, T, T] mask (quadratic, only
  for short rows), so "auto" picks it only when cu_seqlens is None.
- "segments": segment lengths known on the host (`seqlens`; MoonViT's images and video chunks,
  whose layout is built on the host anyway): the segments of each distinct length are gathered
  into one batch for F.scaled_dot_product_attention, so no tile of another segment is computed.
  Its shapes depend on the lengths: not for the language model's static-shape hot path.
- "blockwise": torch on any device, fp32, memory linear in T forward and backward (below).
- "reference": explicit scores, dense mask and softmax; the plain version the tests compare to.
Shapes never depend on where documents end, except with "segments".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from model.batch import segment_ids
from model.dtypes import upcast
from model.ops import dispatch
from model.ops.fast_exp import exp_

_BACKENDS = ("auto", "varlen", "sdpa", "segments", "blockwise", "reference")
# Blockwise tile: at most BLOCK_Q query rows against BLOCK_K keys, a [B, H, bq, bk] fp32 score
# tile at a time. Large enough that the Python loop costs little next to the tile's matmuls,
# small enough that the tile's few temporaries stay in a core's cache: both halved while a tile
# holds more than TILE_ELEMENTS scores (1 MiB), down to 64 queries (at the CPU demo's 4 rows x 2
# heads that is 128 x 256 tiles).
BLOCK_Q = 256
BLOCK_K = 512
TILE_ELEMENTS = 2 ** 18


def doc_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, H, Dv] fp32 (and max_logit [H] when return_max_logit)."""
    return segment_attention(q, k, v, cu_seqlens, scale, causal=True, backend=backend,
                             return_max_logit=return_max_logit)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    scale: float,
    causal: bool,
    backend: str = "auto",
    return_max_logit: bool = False,
    seqlens: Sequence[int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """doc_causal_attention with causality as a flag: causal=False attends to the whole segment
    (MoonViT's images and video chunks); cu_seqlens None is one segment per row. `seqlens`, the
    segments' lengths in order (host ints, what cu_seqlens holds), enables the "segments"
    backend, which "auto" then picks where varlen cannot run."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: must be one of {list(_BACKENDS)}")
    B, T, H, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k must be [B, T, H, Dqk] and v [B, T, H, Dv]: "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if backend == "auto":
        backend = ("varlen" if _varlen_usable(q) else "segments" if seqlens is not None else
                   "sdpa" if cu_seqlens is None else "blockwise")
    segments = None if cu_seqlens is None else segment_ids(cu_seqlens, B * T).view(B, T)
    max_logit = None
    if backend == "varlen":
        if not _varlen_usable(q):
            raise ValueError(f"backend='varlen' needs CUDA fp16/bf16 inputs, got {q.dtype} on "
                             f"{q.device}: use backend='blockwise'")
        o = _varlen(q, k, v, cu_seqlens, scale, causal)
    elif backend == "segments":
        if seqlens is None:
            raise ValueError("backend='segments' needs seqlens, the segment lengths")
        o = _grouped_segments(q, k, v, seqlens, scale, causal)
    elif backend == "blockwise":  # in the inputs' dtype: each tile is upcast where it is used
        o, max_logit = _BlockwiseAttention.apply(*(x.transpose(1, 2) for x in (q, k, v)),
                                                 *_row_segments(segments), scale, causal, 0)
        o = o.transpose(1, 2)
    else:
        qh, kh, vh = (upcast(x).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
        if backend == "reference":
            allowed = dense_mask(segments, B, T, causal, q.device)
            o, max_logit = _reference(qh, kh, vh, allowed, scale)
        else:
            mask = None if segments is None else dense_mask(segments, B, T, causal, q.device)
            o = _sdpa(qh, kh, vh, mask, causal, scale)
        o = o.transpose(1, 2)
    if not return_max_logit:
        return o
    if max_logit is None:
        max_logit = _blockwise_max_logit(q.transpose(1, 2), k.transpose(1, 2),
                                         _row_segments(segments), scale, causal, 0)
    return o, max_logit


def offset_doc_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_segments: torch.Tensor,
    k_segments: torch.Tensor,
    q_offset: int,
    scale: float,
    backend: str = "blockwise",
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Document-causal attention of queries that are key positions q_offset .. q_offset + Tq - 1
    (a context-parallel rank's fragment against the keys gathered up to its end): q [B, Tq, H,
    Dqk], k [B, Tk, H, Dqk], v [B, Tk, H, Dv], document ids q_segments [B, Tq] and k_segments
    [B, Tk] (one numbering for both; a decode cache's padding slots, id -1, sit between a
    row's documents: the native CPU kernel takes non-decreasing ids only and leaves the others to
    the tiles). Query i attends key j when their ids match and j <= q_offset + i. backend:
    "blockwise" or "reference" (dense mask).
    Returns o [B, Tq, H, Dv] fp32 (and max_logit [H])."""
    if backend not in ("blockwise", "reference"):
        raise ValueError(f"backend={backend!r} is invalid: must be 'blockwise' or 'reference'")
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    if (k.shape[0], k.shape[2:]) != (B, q.shape[2:]) or v.shape[:3] != (B, Tk, H):
        raise ValueError(f"q must be [B, Tq, H, Dqk], k [B, Tk, H, Dqk] and v [B, Tk, H, Dv]: "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q_segments.shape != (B, Tq) or k_segments.shape != (B, Tk):
        raise ValueError(f"q_segments must be [B, Tq] and k_segments [B, Tk]: "
                         f"{list(q_segments.shape)}, {list(k_segments.shape)}")
    if not 0 <= q_offset <= Tk - Tq:
        raise ValueError(f"q_offset={q_offset} is invalid: the queries must lie within the "
                         f"{Tk} keys")
    if backend == "reference":
        allowed = (q_segments[:, None, :, None] == k_segments[:, None, None, :]) & torch.ones(
            Tq, Tk, dtype=torch.bool, device=q.device).tril(q_offset)
        o, max_logit = _reference(*(upcast(x).transpose(1, 2) for x in (q, k, v)), allowed,
                                  scale)
    else:  # the gathered keys stay in their dtype (an fp32 copy of a long row's K and V is
        # the largest tensor of a context-parallel layer): each tile is upcast where used
        o, max_logit = _BlockwiseAttention.apply(*(x.transpose(1, 2) for x in (q, k, v)),
                                                 *_row_segments(q_segments, k_segments),
                                                 scale, True, q_offset)
    o = o.transpose(1, 2)
    return (o, max_logit) if return_max_logit else o


def dense_mask(segments: torch.Tensor | None, B: int, T: int, causal: bool,
               device) -> torch.Tensor:
    """[B, 1, T, T] bool, True where query i may attend key j: same segment (and j <= i)."""
    allowed = torch.ones(T, T, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed.tril()
    if segments is None:
        return allowed.expand(B, 1, T, T)
    return (segments[:, None, :, None] == segments[:, None, None, :]) & allowed


def _reference(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    max_logit = scores.detach().amax(dim=(0, 2, 3))
    return torch.softmax(scores, dim=-1) @ v, max_logit


def _pad_head_dims(q, k, v):
    """q, k, v with one head dim (the larger): flash kernels need it. Zero columns change
    neither q.k nor, after slicing back to Dv, the output."""
    width = max(q.shape[-1], v.shape[-1])
    return (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))


def _sdpa(q, k, v, mask, causal, scale):
    dv = v.shape[-1]
    if q.device.type == "cpu" and q.shape[-1] != dv:
        # The CPU flash kernel needs equal head dims, else sdpa falls back to the math path with
        # O(T^2) memory.
        q, k, v = _pad_head_dims(q, k, v)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                       is_causal=causal and mask is None, scale=scale)
    return o[..., :dv]


def _grouped_segments(q, k, v, seqlens: Sequence[int], scale, causal):
    """One sdpa call per distinct segment length over the flattened B*T tokens: the segments of
    that length gathered into a batch [n, H, L, D], the outputs put back in token order."""
    B, T, H, _ = q.shape
    if any(n < 0 for n in seqlens) or sum(seqlens) != B * T:
        raise ValueError(f"seqlens must be non-negative lengths summing to B*T={B * T}: "
                         f"got {len(seqlens)} summing to {sum(seqlens)}")
    flat = [upcast(x).reshape(B * T, H, x.shape[-1]) for x in (q, k, v)]
    starts_by_length: dict[int, list[int]] = {}
    for start, n in zip(itertools.accumulate(seqlens, initial=0), seqlens):
        if n:
            starts_by_length.setdefault(n, []).append(start)
    outputs, order = [], []
    for n, starts in starts_by_length.items():
        index = (torch.tensor(starts).unsqueeze(-1) + torch.arange(n)).flatten()
        qg, kg, vg = (x[index.to(x.device)].unflatten(0, (len(starts), n)).transpose(1, 2)
                      for x in flat)
        outputs.append(_sdpa(qg, kg, vg, None, causal, scale).transpose(1, 2).flatten(0, 1))
        order.append(index)
    # The groups together hold every token once: the inverse permutation restores token order.
    inverse = torch.cat(order).argsort().to(q.device)
    return torch.cat(outputs)[inverse].view(B, T, H, v.shape[-1])


def _varlen_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _varlen(q, k, v, cu_seqlens, scale, causal):
    """Flash attention over the flattened B*T tokens; it skips other documents' key blocks in
    the kernel. No document crosses a row, so T bounds every document length: max_q and max_k
    are known without reading cu_seqlens on the host. Inputs stay in their half dtype (what the
    kernel takes); the output is upcast to fp32."""
    from torch.nn.attention.varlen import varlen_attn

    B, T, H, _ = q.shape
    dv = v.shape[-1]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, B * T + 1, T, device=q.device)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    q, k, v = (x.reshape(B * T, H, x.shape[-1]) for x in _pad_head_dims(q, k, v))
    o = varlen_attn(q, k, v, cu, cu, T, T, scale=scale,
                    window_size=(-1, 0) if causal else (-1, -1))
    return o[..., :dv].float().view(B, T, H, dv)


# --- blockwise -------------------------------------------------------------------------------
# Which tiles are formed depends on shapes only (Python ints, no host sync): rows are the batch
# dimension, so a tile never pairs two rows, and with `causal` a query block visits the key
# blocks from its diagonal back to the row start, so tiles above the diagonal are never formed.
# Tiles that fall wholly in other documents are computed and masked to -inf: skipping them
# would need document bounds on the host (a sync) or data-dependent shapes. The waste is at most
# the difference between T^2/2 and the sum of the documents' L^2/2; the varlen kernel on CUDA
# skips such tiles inside the kernel instead.

def _row_segments(segments: torch.Tensor | None,
                  k_segments: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    """(query, key) segment ids counted from each row's first key, as fp32 (what the tiles'
    masks use): a row holds at most T segments, so they are exact while T <= 2^24. Without
    k_segments the keys are the queries."""
    if segments is None:
        return None, None
    keys = segments if k_segments is None else k_segments
    if keys.shape[1] > 2**24:
        raise ValueError(f"T={keys.shape[1]} tokens per row exceeds the blockwise backend's "
                         f"limit of 2^24")
    base = keys[:, :1]
    return (segments - base).float(), (keys - base).float()


def _tile_shape(batch_heads: int) -> tuple[int, int]:
    """(query rows, keys) of a tile for B x H = batch_heads."""
    rows, keys = BLOCK_Q, BLOCK_K
    while batch_heads * rows * keys > TILE_ELEMENTS and rows > 64:
        rows, keys = rows // 2, keys // 2
    return rows, keys


def _query_blocks(T: int, rows: int) -> list[tuple[int, int]]:
    return [(start, min(start + rows, T)) for start in range(0, T, rows)]


def _key_blocks(q_end: int, T: int, causal: bool, keys: int) -> list[tuple[int, int]]:
    """Key ranges a query block ending at q_end visits, nearest first: with `causal` the first
    one holds the diagonal, so each row's running maximum is finite from the first tile on."""
    end = q_end if causal else T
    return [(max(stop - keys, 0), stop) for stop in range(end, 0, -keys)]


def _forbidden_bias(x: torch.Tensor) -> torch.Tensor:
    """In place: 0 where x == 0, -inf where x >= 1 (x >= 0). Float arithmetic (1 * 1e38 * -1e38
    overflows to -inf) instead of a boolean compare and masked_fill, which cost more on CPU."""
    return x.mul_(1e38).mul_(-1e38)


def _masked_scores(q_tile, k, q_segments, k_segments, q_start, k_start, k_end, causal,
                   q_offset):
    """Scores of an (already scaled) query tile [B, H, bq, D] against keys k_start:k_end,
    -inf where the key is in another segment or (causal) after the query. `q_segments` [B, Tq]
    and `k_segments` [B, Tk] are fp32 segment ids (_row_segments: exact while T <= 2^24);
    query row i is key position q_offset + i."""
    scores = q_tile @ upcast(k[:, :, k_start:k_end]).transpose(-1, -2)
    q_end = q_start + q_tile.shape[-2]
    bias = None
    if q_segments is not None:
        bias = _forbidden_bias((q_segments[:, None, q_start:q_end, None]
                                - k_segments[:, None, None, k_start:k_end]).abs_())
    first, last = q_offset + q_start, q_offset + q_end
    if causal and k_end > first:  # only the tiles holding the diagonal have keys after queries
        # fp32 like the segment ids (exact positions; a float64 1e38 * -1e38 is not -inf)
        rows = torch.arange(first, last, device=scores.device, dtype=torch.float32)
        cols = torch.arange(k_start, k_end, device=scores.device, dtype=torch.float32)
        after = _forbidden_bias((cols - rows[:, None]).clamp_(min=0))
        bias = after if bias is None else bias.add_(after)
    return scores if bias is None else scores.add_(bias)


class _BlockwiseAttention(torch.autograd.Function):
    """Online softmax over key tiles (flash attention); saves o and the per-row logsumexp only,
    and the backward recomputes each tile's probabilities from them (flash attention 2).
    Returns (o [B, H, T, Dv], max_logit [H]): the running row maxima are exact maxima of the
    allowed logits, so QK-Clip's statistic comes for free. The forward runs a registered kernel
    (model/ops/dispatch.py) where one takes the inputs, and then the backward asks for one too;
    else the torch tiles below."""

    @staticmethod
    def forward(ctx, q, k, v, q_segments, k_segments, scale, causal, q_offset):
        q, k, v = (x.contiguous() for x in (q, k, v))
        ctx.scale, ctx.causal, ctx.q_offset = scale, causal, q_offset
        computed = dispatch.call("attention_forward", q, k, v, q_segments, k_segments, scale,
                                 causal, q_offset)
        ctx.kernel = computed is not None
        if ctx.kernel:
            o, lse, row_max = computed
            return _BlockwiseAttention._results(ctx, q, k, v, q_segments, k_segments, o, lse,
                                                row_max)
        B, H, T, _ = q.shape
        Tk = k.shape[-2]
        q_scaled = upcast(q) * scale
        o = q_scaled.new_empty(B, H, T, v.shape[-1])
        lse = q_scaled.new_empty(B, H, T)
        row_max = q_scaled.new_empty(B, H, T)
        rows, keys = _tile_shape(B * H)
        for q_start, q_end in _query_blocks(T, rows):
            q_tile = q_scaled[:, :, q_start:q_end]
            m = q.new_full((B, H, q_end - q_start), float("-inf"))
            denom = q.new_zeros(B, H, q_end - q_start)
            acc = q.new_zeros(B, H, q_end - q_start, v.shape[-1])
            for k_start, k_end in _key_blocks(q_offset + q_end, Tk, causal, keys):
                scores = _masked_scores(q_tile, k, q_segments, k_segments, q_start, k_start,
                                        k_end, causal, q_offset)
                m_new = torch.maximum(m, scores.amax(dim=-1))
                # A row with no allowed key yet (non-causal: its segment lies elsewhere) keeps
                # m = -inf; shifting by 0 there gives exp(-inf) = 0 instead of NaN.
                shift = m_new.masked_fill(m_new == float("-inf"), 0.0)
                p = exp_(scores.sub_(shift.unsqueeze(-1)))  # in place: one tile buffer
                rescale = torch.exp(m - shift)
                denom = denom * rescale + p.sum(dim=-1)
                acc = acc * rescale.unsqueeze(-1) + p @ upcast(v[:, :, k_start:k_end])
                m = m_new
            o[:, :, q_start:q_end] = acc / denom.unsqueeze(-1)
            lse[:, :, q_start:q_end] = m + denom.log()
            row_max[:, :, q_start:q_end] = m
        return _BlockwiseAttention._results(ctx, q, k, v, q_segments, k_segments, o, lse,
                                            row_max)

    @staticmethod
    def _results(ctx, q, k, v, q_segments, k_segments, o, lse, row_max):
        ctx.save_for_backward(q, k, v, q_segments, k_segments, o, lse)
        max_logit = row_max.amax(dim=(0, 2))
        ctx.mark_non_differentiable(max_logit)
        return o, max_logit

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_o, _grad_max_logit):
        q, k, v, q_segments, k_segments, o, lse = ctx.saved_tensors
        scale, causal, q_offset = ctx.scale, ctx.causal, ctx.q_offset
        grads = ctx.kernel and dispatch.call(
            "attention_backward", q, k, v, q_segments, k_segments, o, lse, grad_o, scale,
            causal, q_offset)
        if grads:  # None where no kernel takes the inputs
            return *grads, None, None, None, None, None
        T, Tk = q.shape[-2], k.shape[-2]
        q_scaled = upcast(q) * scale
        grad_o = grad_o.contiguous()
        delta = (grad_o * o).sum(dim=-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
        dq, dk, dv = (torch.zeros_like(x, dtype=o.dtype) for x in (q, k, v))
        rows, key_count = _tile_shape(q.shape[0] * q.shape[1])
        for q_start, q_end in _query_blocks(T, rows):
            q_tile = q_scaled[:, :, q_start:q_end]
            do_tile = grad_o[:, :, q_start:q_end]
            lse_tile = lse[:, :, q_start:q_end].unsqueeze(-1)
            delta_tile = delta[:, :, q_start:q_end]
            dq_tile = dq[:, :, q_start:q_end]
            for k_start, k_end in _key_blocks(q_offset + q_end, Tk, causal, key_count):
                keys = slice(k_start, k_end)
                scores = _masked_scores(q_tile, k, q_segments, k_segments, q_start, k_start,
                                        k_end, causal, q_offset)
                p = exp_(scores.sub_(lse_tile))
                dv[:, :, keys].add_(p.transpose(-1, -2) @ do_tile)
                ds = (do_tile @ upcast(v[:, :, keys]).transpose(-1, -2)).sub_(delta_tile).mul_(p)
                dq_tile.add_(ds @ upcast(k[:, :, keys]))
                dk[:, :, keys].add_(ds.transpose(-1, -2) @ q_tile)
        return ((dq * scale).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None)


@torch.no_grad()
def _blockwise_max_logit(q, k, segments, scale, causal, q_offset):
    """Per-head max of the allowed logits over the same tiles, for the backends that do not
    report it (one extra Q K^T, no dense mask). segments: _row_segments' pair."""
    q, k = upcast(q), upcast(k)
    T, Tk = q.shape[-2], k.shape[-2]
    rows, keys = _tile_shape(q.shape[0] * q.shape[1])
    maxima = [
        _masked_scores(q[:, :, q_start:q_end] * scale, k, *segments, q_start, k_start, k_end,
                       causal, q_offset).amax(dim=(0, 2, 3))
        for q_start, q_end in _query_blocks(T, rows)
        for k_start, k_end in _key_blocks(q_offset + q_end, Tk, causal, keys)
    ]
    return torch.stack(maxima).amax(dim=0)
