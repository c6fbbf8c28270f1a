"""QK-Clip for gated MLA (MuonClip, SPEC 7), applied to the weights after the optimizer step.

A head whose max pre-softmax logit m exceeds tau gets gamma = tau / m. Its logit is
q_nope . k_nope + q_rope . k_rope (times the softmax scale); scaling q_nope and k_nope by
sqrt(gamma) and q_rope by gamma scales every logit of that head by gamma, so its max becomes tau.
The shared k_rope (one for all heads) and v are left alone. Other heads are untouched bit for bit
(their factor is exactly 1).

Head-parallel shards work as they are: pass the local heads' weights, logits and count; for
weights sharded otherwise (FSDP rows), `qk_clip_factors` gives the per-row factors to apply.
"""

from __future__ import annotations

import torch

from model.dtypes import upcast


def _head_factors(gamma: torch.Tensor, first_dim: int, first_power: float, rest_dim: int,
                  rest_power: float) -> torch.Tensor:
    """[H, first_dim + rest_dim] row factors: gamma**first_power then gamma**rest_power."""
    first = gamma.pow(first_power)[:, None].expand(-1, first_dim)
    rest = gamma.pow(rest_power)[:, None].expand(-1, rest_dim)
    return torch.cat([first, rest], dim=1)


@torch.no_grad()
def qk_clip_(
    q_b_weight: torch.Tensor,
    kv_b_weight: torch.Tensor,
    max_logits: torch.Tensor,
    tau: float,
    num_heads: int,
    qk_nope_dim: int,
    qk_rope_dim: int,
    v_dim: int,
) -> torch.Tensor:
    """Clip in place; returns the number of clipped heads as a 0-dim tensor (no host sync).

    q_b_weight [H*(nope+rope), q_lora], rows per head [q_nope | q_rope];
    kv_b_weight [H*(nope+v), kv_lora], rows per head [k_nope | v]; max_logits [H].
    """
    expected = {
        "q_b_weight": (q_b_weight.shape[0], num_heads * (qk_nope_dim + qk_rope_dim)),
        "kv_b_weight": (kv_b_weight.shape[0], num_heads * (qk_nope_dim + v_dim)),
        "max_logits": (max_logits.numel(), num_heads),
    }
    for name, (got, want) in expected.items():
        if got != want:
            raise ValueError(f"qk_clip_: {name} has {got} rows/entries, expected {want} for "
                             f"num_heads={num_heads}, nope={qk_nope_dim}, rope={qk_rope_dim}, "
                             f"v={v_dim}")
    q_factors, kv_factors, clipped = qk_clip_factors(max_logits, tau, qk_nope_dim, qk_rope_dim,
                                                     v_dim)
    q_b_weight.mul_(q_factors[:, None].to(q_b_weight.dtype))
    kv_b_weight.mul_(kv_factors[:, None].to(kv_b_weight.dtype))
    return clipped


def qk_clip_factors(max_logits: torch.Tensor, tau: float, qk_nope_dim: int, qk_rope_dim: int,
                    v_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row factors of QK-Clip for the heads of `max_logits` [H]: ([H*(nope+rope)] for q_b,
    [H*(nope+v)] for kv_b, number of clipped heads), fp32 (float64 for float64 logits), no host
    sync."""
    logits = upcast(max_logits.detach())
    exceeds = logits > tau
    # Heads at or below tau get exactly 1.0, so multiplying leaves their weights bit-identical.
    gamma = torch.where(exceeds, tau / logits, torch.ones_like(logits))
    q_factors = _head_factors(gamma, qk_nope_dim, 0.5, qk_rope_dim, 1.0)
    kv_factors = _head_factors(gamma, qk_nope_dim, 0.5, v_dim, 0.0)
    return q_factors.reshape(-1), kv_factors.reshape(-1), exceeds.sum()
