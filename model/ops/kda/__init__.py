"""Kimi Delta Attention: the gated delta rule with a per-channel decay.

Per head, with state S [K, V], log decay g_t [K] (<= 0), beta_t a scalar:
    S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S_t^T (scale q_t)

`kda_recurrent` (naive.py) is the plain reference, a loop over time. `kda_chunk` is the training
form, its backend picked here: fla's Triton kernel on CUDA when fla-core is installed, a
registered CPU recurrence (model/ops/dispatch.py's "kda_recurrence"; model/ops/cpu registers its
C loops) where one is registered and takes the inputs, else the torch chunk form (chunk.py),
which has static shapes (also for packed documents) and is exact for any gate, bounded or not.
Layout (fla's): q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K], beta [B, T, H], states
[B, H, K, V], or [N, H, K, V] with `cu_seqlens` (then B == 1 and cu_seqlens [N + 1] must cover
0..T). Internals and states are fp32 (float64 for float64 inputs); o has the input dtype.
"""

from __future__ import annotations

import functools

import torch

from model.dtypes import no_autocast
from model.ops import dispatch

from .chunk import kda_chunk_torch
from .layout import SUB_TILE
from .naive import _check_inputs, kda_recurrent

__all__ = ["SAFE_LOWER_BOUND", "SUB_TILE", "kda_chunk", "kda_recurrent"]

SAFE_LOWER_BOUND = -5.0
_BACKENDS = ("auto", "torch", "fla")


def kda_chunk(
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
    backend: str = "auto",
    lower_bound: float | None = None,
    rows: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA. backend: "auto" (fla on CUDA when installed, the registered CPU
    recurrence where one is registered and takes the inputs, else torch), "torch" (the chunk form,
    chunk.py) or "fla". lower_bound (e.g. -5 for the K3 gate) promises g >= lower_bound; within
    the safe range [-5, 0) it selects fla's safe-gate kernel and the torch path's factorised
    sub-tiles (which clamp g at the bound). None, or a looser bound, takes the form that is exact
    for any gate (the Kimi Linear gate). rows (with cu_seqlens) promises that the packed sequence
    is `rows` rows of equal length each starting a document (K3Batch's layout): the torch path then
    carries the states of the rows side by side, a shorter sequential pass."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: must be one of {list(_BACKENDS)}")
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size={chunk_size} is invalid: must be a multiple of {SUB_TILE}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"lower_bound={lower_bound} is invalid: must be < 0 (a log decay) or None")
    scale = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if rows != 1 and (cu_seqlens is None or rows < 1 or q.shape[1] % rows):
        raise ValueError(f"rows={rows} is invalid: needs cu_seqlens and must divide the packed "
                         f"length {q.shape[1]}")
    safe_bound = _safe_bound(lower_bound)
    use_fla = backend == "fla" or (backend == "auto" and q.is_cuda)
    fla_chunk_kda = _fla_chunk_kda() if use_fla else None  # imported only where it may run
    if backend == "fla" and fla_chunk_kda is None:
        raise RuntimeError("backend='fla' needs fla-core (and triton) importable")
    if fla_chunk_kda is not None:
        return fla_chunk_kda(
            q, k, v, g, beta, scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            safe_gate=safe_bound is not None, lower_bound=safe_bound, chunk_size=chunk_size,
            # Builds the varlen chunk list on the device with a fixed shape (no host sync).
            use_graph=cu_seqlens is not None,
        )
    if backend == "auto":  # a registered CPU recurrence, where one takes these inputs
        out = dispatch.call("kda_recurrence", q, k, v, g, beta, scale, initial_state,
                            output_final_state, cu_seqlens, safe_bound)
        if out is not None:
            return out
    # An fp32 island whatever the autocast region around it: the state pass writes with out=,
    # which autocast does not cast, so its operands must not come out of autocast's matmuls.
    with no_autocast(q.device.type):
        return kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                               cu_seqlens, chunk_size, safe_bound, rows)


def _safe_bound(lower_bound: float | None) -> float | None:
    """The bound if it makes a 16-token sub-tile decay by at most exp(-80) (fla's safe range
    too), else None: a looser bound gives the factorised scores no fp32 headroom."""
    if lower_bound is None or lower_bound < SAFE_LOWER_BOUND:
        return None
    return lower_bound


@functools.cache
def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda
