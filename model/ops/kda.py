"""Kimi Delta Attention (SPEC section 2): the gated delta rule with a per-channel decay.

Per head, with state S [K, V], log decay g_t [K] (<= 0), beta_t a scalar:
    S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S_t^T (scale q_t)

`kda_recurrent` is the plain reference (a loop over time). `kda_chunk` is the chunkwise-parallel
training form: fla's Triton kernel on CUDA when fla-core is installed, else the torch
implementation below, which has static shapes (also for packed documents) and is exact for any
gate, bounded or not. Layout (fla's): q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K],
beta [B, T, H], states [B, H, K, V], or [N, H, K, V] with `cu_seqlens` (then B == 1 and
cu_seqlens [N + 1] must cover 0..T). Internals are fp32; o has the input dtype, states are fp32.

Chunk form (derived from the recurrence; C tokens per chunk, S the state entering the chunk,
Gc the inclusive cumsum of g inside the chunk):
    Akk[i, j] = k_i . (exp(Gc_i - Gc_j) k_j) for j < i
    Aqk[i, j] = q_i . (exp(Gc_i - Gc_j) k_j) for j <= i
    (I + Diag(beta) Akk) [U | W] = [beta V | beta exp(Gc) K]      (unit lower triangular)
    Vn = U - W S;   O = (Q exp(Gc)) S + Aqk Vn
    S <- Diag(exp(Gc_last)) S + (exp(Gc_last - Gc) K)^T Vn
Vn are the delta rule's effective values beta_t (v_t - S'^T k_t). exp(-Gc) is never formed, so an
unbounded gate cannot overflow: Akk and Aqk are built from 16-token sub-tiles, where diagonal
tiles use the pairwise difference Gc_i - Gc_j and off-diagonal tiles factorise at the start of
the row tile, both factors <= 1. Terms that underflow to 0 are below fp32 resolution anyway.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from model.batch import segment_ids

SUB_TILE = 16
_BACKENDS = ("auto", "torch", "fla")


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA. backend: "auto" (fla on CUDA when installed, else torch),
    "torch" or "fla". lower_bound (e.g. -5 for the K3 gate) promises g >= lower_bound and lets
    fla use its faster safe-gate kernel; the torch path is exact for any gate and ignores it."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid: must be one of {list(_BACKENDS)}")
    if chunk_size <= 0 or chunk_size % SUB_TILE:
        raise ValueError(f"chunk_size={chunk_size} is invalid: must be a multiple of {SUB_TILE}")
    scale = _check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    use_fla = backend == "fla" or (backend == "auto" and q.is_cuda)
    fla_chunk_kda = _fla_chunk_kda() if use_fla else None  # imported only where it may run
    if backend == "fla" and fla_chunk_kda is None:
        raise RuntimeError("backend='fla' needs fla-core (and triton) importable")
    if fla_chunk_kda is not None:
        return fla_chunk_kda(
            q, k, v, g, beta, scale=scale,
            initial_state=None if initial_state is None else initial_state.float(),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens,
            safe_gate=lower_bound is not None, lower_bound=lower_bound, chunk_size=chunk_size,
            # Builds the varlen chunk list on the device with a fixed shape (no host sync).
            use_graph=cu_seqlens is not None,
        )
    return _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                            cu_seqlens, chunk_size)


@functools.cache
def _fla_chunk_kda():
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


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
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    B, _, H, K = q.shape
    if initial_state is None:
        state = q.new_zeros(B, H, K, v.shape[-1])
    else:
        state = initial_state.float()
    outputs = []
    # unbind, not x[:, t]: the backward of T slices would build T full-size zero gradients.
    for q_t, k_t, v_t, g_t, beta_t in zip(*(x.unbind(1) for x in (q, k, v, g, beta))):
        state = state * g_t.exp().unsqueeze(-1)
        error = v_t - torch.einsum("bhk,bhkv->bhv", k_t, state)
        state = state + beta_t[:, :, None, None] * k_t.unsqueeze(-1) * error.unsqueeze(-2)
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_t * scale, state))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)
    return o, state


@dataclass
class _ChunkLayout:
    """Where each token goes in a buffer of whole chunks, and where each document starts.

    token_index [T]: position of each token in the padded buffer of num_chunks * C tokens.
    For packed documents also, per chunk, whether it starts a document and which one, and per
    document its last chunk (clamped to 0) and whether it has any token.
    """

    token_index: torch.Tensor
    num_chunks: int
    chunk_doc: torch.Tensor | None = None
    chunk_starts_doc: torch.Tensor | None = None
    doc_last_chunk: torch.Tensor | None = None
    doc_nonempty: torch.Tensor | None = None


def _rows_layout(T: int, chunk: int, device) -> _ChunkLayout:
    return _ChunkLayout(torch.arange(T, device=device), -(-T // chunk))


def _docs_layout(cu_seqlens: torch.Tensor, T: int, chunk: int) -> _ChunkLayout:
    """Each document starts on a chunk boundary. With N documents the chunks needed,
    sum ceil(len_n / C) < T / C + N, fit in ceil(T / C) + N - 1: a static count."""
    device = cu_seqlens.device
    cu_seqlens = cu_seqlens.long()
    N = cu_seqlens.shape[0] - 1
    num_chunks = -(-T // chunk) + N - 1
    doc_chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + chunk - 1) // chunk
    chunk_end = doc_chunks.cumsum(0)
    chunk_start = chunk_end - doc_chunks
    doc = segment_ids(cu_seqlens, T)
    token_index = chunk_start[doc] * chunk + torch.arange(T, device=device) - cu_seqlens[doc]
    chunk_ids = torch.arange(num_chunks, device=device)
    # A document without tokens owns no chunk: searchsorted(right) skips it.
    chunk_doc = torch.searchsorted(chunk_end, chunk_ids, right=True).clamp(max=N - 1)
    return _ChunkLayout(
        token_index=token_index,
        num_chunks=num_chunks,
        chunk_doc=chunk_doc,
        chunk_starts_doc=chunk_ids == chunk_start[chunk_doc],
        doc_last_chunk=(chunk_end - 1).clamp(min=0),
        doc_nonempty=doc_chunks > 0,
    )


def _to_chunks(x: torch.Tensor, layout: _ChunkLayout, chunk: int) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, num_chunks, C, ...] fp32, zeros where no token lands."""
    B, _, H, *rest = x.shape
    padded = x.new_zeros(B, layout.num_chunks * chunk, H, *rest, dtype=torch.float32)
    padded = padded.index_copy(1, layout.token_index, x.float())
    padded = padded.unflatten(1, (layout.num_chunks, chunk))
    return padded.movedim(3, 1)


def _from_chunks(x: torch.Tensor, layout: _ChunkLayout) -> torch.Tensor:
    """[B, H, num_chunks, C, V] -> [B, T, H, V]."""
    return x.flatten(2, 3).index_select(2, layout.token_index).transpose(1, 2)


def _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     chunk):
    T = q.shape[1]
    masks = None
    if cu_seqlens is None:
        layout = _rows_layout(T, chunk, q.device)
    elif initial_state is None and not output_final_state:
        # Training's case: no per-document states in or out, so documents may share a chunk and
        # are kept apart by masks; no padding per document.
        layout = _rows_layout(T, chunk, q.device)
        masks = _segment_masks(cu_seqlens, T, chunk)
    else:
        layout = _docs_layout(cu_seqlens, T, chunk)
    qc, kc, vc, gc = (_to_chunks(x, layout, chunk) for x in (q, k, v, g))
    qc = qc * scale  # in fp32, after the cast
    bc = _to_chunks(beta.unsqueeze(-1), layout, chunk)
    prepared = _intra_chunk(qc, kc, vc, gc, bc, masks)
    o, chunk_end_states = _state_pass(*prepared, initial_state, layout)
    o = _from_chunks(o, layout).to(q.dtype)
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, chunk_end_states[-1]
    return o, _doc_final_states(chunk_end_states, initial_state, layout)


@dataclass
class _SegmentMasks:
    """Documents sharing chunks ([NC, C, *] bool): `same` pairs of one document, `continues`
    tokens whose document began before the chunk (they see the carried state), `in_last`
    tokens of the chunk's last document (they make the state carried on)."""

    same: torch.Tensor
    continues: torch.Tensor
    in_last: torch.Tensor


def _segment_masks(cu_seqlens: torch.Tensor, T: int, chunk: int) -> _SegmentMasks:
    num_chunks = -(-T // chunk)
    seg = segment_ids(cu_seqlens.long(), T)
    # Padding after T (k = beta = 0: no effect on the state) counts as the last document.
    seg = torch.cat([seg, seg[-1:].expand(num_chunks * chunk - T)]).view(num_chunks, chunk)
    before = torch.cat([seg.new_full((1,), -1), seg[:-1, -1]])  # document before each chunk
    return _SegmentMasks(same=(seg.unsqueeze(-1) == seg.unsqueeze(-2)),
                         continues=(seg == before.unsqueeze(-1)).unsqueeze(-1),
                         in_last=(seg == seg[:, -1:]).unsqueeze(-1))


def _intra_chunk(q, k, v, g, beta, masks: _SegmentMasks | None = None):
    """Everything that does not depend on the carried state, batched over all chunks.
    Inputs [B, H, NC, C, *] (beta [.., C, 1]). Returns Aqk [.., C, C], U [.., C, V],
    W [.., C, K], Q exp(Gc), exp(Gc_last - Gc) K and exp(Gc_last) [.., K]. With `masks`, pairs
    across documents, the carried state of documents that start inside a chunk, and the writes
    of documents that end inside it are zeroed."""
    C = q.shape[-2]
    G = g.cumsum(-2)
    Aqk, Akk = _decayed_scores(q, k, G)
    strictly_lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    if masks is not None:
        Aqk = torch.where(masks.same, Aqk, 0.0)
        strictly_lower = strictly_lower & masks.same
    Akk = torch.where(strictly_lower, Akk, 0.0)
    # I + Diag(beta) Akk is unit lower triangular; unitriangular=True never reads its diagonal.
    V = v.shape[-1]
    rhs = torch.cat([beta * v, beta * G.exp() * k], dim=-1)
    UW = torch.linalg.solve_triangular(beta * Akk, rhs, upper=False, unitriangular=True)
    G_last = G[..., -1:, :]
    U, W = UW[..., :V], UW[..., V:]
    q_decayed, k_to_end, chunk_decay = q * G.exp(), k * (G_last - G).exp(), G_last.exp()
    if masks is not None:
        W = torch.where(masks.continues, W, 0.0)
        q_decayed = torch.where(masks.continues, q_decayed, 0.0)
        k_to_end = torch.where(masks.in_last, k_to_end, 0.0)
        chunk_decay = torch.where(masks.continues[:, -1:], chunk_decay, 0.0)
    return Aqk, U, W, q_decayed, k_to_end, chunk_decay


def _decayed_scores(q, k, G):
    """Scores x_i . (exp(G_i - G_j) k_j) for j <= i and 0 above the diagonal, for x = q and
    x = k, [.., C, C], built from sub-tiles so that no exponent is positive."""
    C, K = q.shape[-2:]
    n = C // SUB_TILE
    qt, kt, Gt = (x.unflatten(-2, (n, SUB_TILE)) for x in (q, k, G))  # [.., n, t, K]
    lower = torch.ones(SUB_TILE, SUB_TILE, dtype=torch.bool, device=q.device).tril()
    # Diagonal tiles: the pairwise decay [.., n, t(i), t(j), K], 0 where j > i. torch.where
    # (not clamp) keeps only a small mask for the backward.
    pair_exponent = Gt.unsqueeze(-2) - Gt.unsqueeze(-3)
    pair_decay = torch.where(lower.unsqueeze(-1), pair_exponent, -torch.inf).exp()
    k_pair = pair_decay * kt.unsqueeze(-3)
    qk_diag = (k_pair @ qt.unsqueeze(-1)).squeeze(-1)  # [.., n, t(i), t(j)]
    kk_diag = (k_pair @ kt.unsqueeze(-1)).squeeze(-1)
    # Off-diagonal tiles: factorise at G_ref = G just before row tile a (0 for the first tile):
    # x_i exp(G_i - G_ref) times k_j exp(G_ref - G_j), both <= 1 for j before tile a.
    G_ref = torch.cat([torch.zeros_like(Gt[..., :1, -1, :]), Gt[..., :-1, -1, :]], dim=-2)
    row_decay = (Gt - G_ref.unsqueeze(-2)).exp()  # [.., n, t, K]
    tile = torch.arange(C, device=q.device) // SUB_TILE
    before_tile = (tile < torch.arange(n, device=q.device).unsqueeze(-1)).unsqueeze(-1)
    k_before = k.unsqueeze(-3) * torch.where(
        before_tile, G_ref.unsqueeze(-2) - G.unsqueeze(-3), -torch.inf).exp()  # [.., n, C, K]
    qk_off = (qt * row_decay) @ k_before.mT  # [.., n, t, C]
    kk_off = (kt * row_decay) @ k_before.mT
    same_tile = tile.unsqueeze(-1) == tile
    eye = torch.eye(n, dtype=q.dtype, device=q.device)

    def assemble(diag, off):
        # Block-diagonal [.., n, t, n, t] from the diagonal tiles, the rest from `off`.
        diag = (diag.unsqueeze(-2) * eye.view(n, 1, n, 1)).flatten(-4, -3).flatten(-2, -1)
        return torch.where(same_tile, diag, off.flatten(-3, -2))

    return assemble(qk_diag, qk_off), assemble(kk_diag, kk_off)


def _state_pass(Aqk, U, W, q_decayed, k_to_end, chunk_decay, initial_state, layout):
    """Carries the state across chunks (the only sequential part). Returns the output chunks
    [B, H, NC, C, V] and the state after each chunk [NC, B, H, K, V]."""
    B, H, _, _, K = W.shape
    state = U.new_zeros(B, H, K, U.shape[-1])
    starts = inits = itertools.repeat(None)
    if layout.chunk_doc is None:
        if initial_state is not None:
            state = initial_state.float()
    else:  # a chunk that starts a document loads that document's initial state
        starts = layout.chunk_starts_doc.unbind(0)
        if initial_state is None:
            inits = itertools.repeat(state.new_zeros(()))
        else:
            inits = initial_state.float().index_select(0, layout.chunk_doc).unsqueeze(1).unbind(0)
    start_states, new_values, end_states = [], [], []
    # unbind, not x[:, :, c]: the backward of NC slices would build NC full-size zero gradients.
    per_chunk = (x.unbind(2) for x in (U, W, chunk_decay, k_to_end))
    for u, w, decay, k_end, start, init in zip(*per_chunk, starts, inits):
        if start is not None:
            state = torch.where(start, init, state)
        start_states.append(state)
        vn = u - w @ state
        new_values.append(vn)
        state = decay.mT * state + k_end.mT @ vn
        end_states.append(state)
    start_states = torch.stack(start_states, dim=2)
    new_values = torch.stack(new_values, dim=2)
    o = q_decayed @ start_states + Aqk @ new_values
    return o, torch.stack(end_states)


def _doc_final_states(chunk_end_states, initial_state, layout):
    """The state after each document's last chunk ([N, H, K, V]); a document without tokens
    keeps its initial state."""
    final = chunk_end_states.index_select(0, layout.doc_last_chunk).squeeze(1)
    if initial_state is None:
        before = final.new_zeros(())
    else:
        before = initial_state.float()
    return torch.where(layout.doc_nonempty.view(-1, 1, 1, 1), final, before)
