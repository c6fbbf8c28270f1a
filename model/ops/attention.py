"""Causal softmax attention restricted to documents (SPEC section 3: the MLA core).

Layout: q, k [B, T, H, Dqk], v [B, T, H, Dv] (Dv may differ from Dqk). `cu_seqlens` [N + 1]
marks document boundaries over the flattened B*T tokens (model/batch.py); a token attends to the
earlier tokens of its own document only. The output is fp32 (SPEC 3 keeps the attention output in
fp32), computed from fp32 inputs. With `return_max_logit` the per-head maximum pre-softmax logit
over the batch comes back too (detached, a device tensor: no sync), for QK-Clip.

Backends: "reference" (explicit scores, mask and softmax) and "sdpa"
(F.scaled_dot_product_attention with a boolean mask; "auto" picks it). Shapes never depend on
where documents end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.batch import segment_ids

_BACKENDS = ("auto", "sdpa", "reference")
# Query rows per block when the sdpa path computes the max logit: bounds the temporary scores.
MAX_LOGIT_BLOCK = 1024


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
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: must be one of {list(_BACKENDS)}")
    B, T, H, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != (B, T, H):
        raise ValueError(f"q, k must be [B, T, H, Dqk] and v [B, T, H, Dv]: "
                         f"{q.shape}, {k.shape}, {v.shape}")
    qh, kh, vh = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    need_mask = backend == "reference" or return_max_logit or cu_seqlens is not None
    allowed = doc_causal_mask(cu_seqlens, B, T, q.device) if need_mask else None
    if backend == "reference":
        o, max_logit = _reference(qh, kh, vh, allowed, scale)
    else:
        o = _sdpa(qh, kh, vh, None if cu_seqlens is None else allowed, scale)
        max_logit = _blockwise_max_logit(qh, kh, allowed, scale) if return_max_logit else None
    o = o.transpose(1, 2)
    return (o, max_logit) if return_max_logit else o


def doc_causal_mask(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """[B, 1, T, T] bool, True where query i may attend key j: same document and j <= i."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if cu_seqlens is None:
        return causal.expand(B, 1, T, T)
    doc = segment_ids(cu_seqlens, B * T).view(B, 1, T)
    return (doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal


def _reference(q, k, v, allowed, scale):
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    max_logit = scores.detach().amax(dim=(0, 2, 3))
    return torch.softmax(scores, dim=-1) @ v, max_logit


def _sdpa(q, k, v, mask, scale):
    """sdpa; without a mask (one document per row) is_causal lets it skip masked blocks."""
    dqk, dv = q.shape[-1], v.shape[-1]
    if q.device.type == "cpu" and dqk != dv:
        # The CPU flash kernel needs equal head dims, else sdpa falls back to the math path with
        # O(T^2) memory. Zero columns change neither q.k nor (after slicing) the output.
        width = max(dqk, dv)
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                       scale=scale)
    return o[..., :dv]


@torch.no_grad()
def _blockwise_max_logit(q, k, allowed, scale):
    """Per-head max of the allowed logits, one block of query rows at a time; keys after a
    block's last row are causally masked, so they are skipped (about half of one Q K^T)."""
    T = q.shape[-2]
    block_maxima = []
    for start in range(0, T, MAX_LOGIT_BLOCK):
        end = min(start + MAX_LOGIT_BLOCK, T)
        scores = (q[..., start:end, :] @ k[..., :end, :].transpose(-1, -2)) * scale
        scores = scores.masked_fill(~allowed[..., start:end, :end], float("-inf"))
        block_maxima.append(scores.amax(dim=(0, 2, 3)))
    return torch.stack(block_maxima).amax(dim=0)
