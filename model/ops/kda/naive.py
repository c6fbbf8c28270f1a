"""The KDA recurrence token by token (and document by document): the reference that every other
form is held to, and the input checks that kda_chunk shares with it."""

from __future__ import annotations

import torch

from model.dtypes import upcast


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference: the recurrence token by token (and document by document). chunk_size is
    accepted for a common signature and ignored."""
    del chunk_size
    scale = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if cu_seqlens is None:
        o, state = _recurrence(q, k, v, g, beta, scale, initial_state)
        return o.to(q.dtype), state if output_final_state else None
    outputs, states = [], []
    bounds = cu_seqlens.tolist()
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, state = _recurrence(*(x[:, start:end] for x in (q, k, v, g, beta)), scale, h0)
        outputs.append(o)
        states.append(state)
    o = torch.cat(outputs, dim=1).to(q.dtype)
    return o, torch.cat(states) if output_final_state else None


def _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> float:
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share [B, T, H, K]: {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H]: {v.shape}, {beta.shape}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"with cu_seqlens the batch must be flattened to B=1, got B={B}")
    if initial_state is not None:
        n = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if initial_state.shape != (n, H, K, V):
            raise ValueError(
                f"initial_state must be {[n, H, K, V]}, got {list(initial_state.shape)}")
    return K ** -0.5 if scale is None else scale


def _recurrence(q, k, v, g, beta, scale, initial_state):
    """One independent sequence per batch row, fp32, token by token."""
    q, k, v, g, beta = (upcast(x) for x in (q, k, v, g, beta))
    B, _, H, K = q.shape
    if initial_state is None:
        state = q.new_zeros(B, H, K, v.shape[-1])
    else:
        state = upcast(initial_state)
    outputs = []
    # unbind, not x[:, t]: the backward of T slices would build T full-size zero gradients.
    for q_t, k_t, v_t, g_t, beta_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta))):
        state = state * g_t.exp().unsqueeze(-1)
        error = v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + beta_t[:, :, None, None] * k_t.unsqueeze(-1) * error.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, state
