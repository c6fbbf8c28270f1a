"""The torch chunk form of KDA (derived from the recurrence; C tokens per chunk, S the state
entering the chunk, Gc the inclusive cumsum of g inside the chunk):
    Akk[i, j] = k_i . (exp(Gc_i - Gc_j) k_j) for j < i
    Aqk[i, j] = q_i . (exp(Gc_i - Gc_j) k_j) for j <= i
    (I + Diag(beta) Akk) [U | W] = [beta V | beta exp(Gc) K]      (unit lower triangular)
    Vn = U - W S;   O = (Q exp(Gc)) S + Aqk Vn
    S <- Diag(exp(Gc_last)) S + (exp(Gc_last - Gc) K)^T Vn
Vn are the delta rule's effective values beta_t (v_t - S'^T k_t). Static shapes, also for packed
documents. Two intra-chunk forms: the one exact for any gate (here), where exp(-Gc) is never
formed, so an unbounded gate cannot overflow: Akk and Aqk are built from 16-token sub-tiles,
where diagonal tiles use the pairwise difference Gc_i - Gc_j and off-diagonal tiles factorise at
the start of the row tile, both factors <= 1 (terms that underflow to 0 are below fp32
resolution anyway); and the factorised one for a gate with a safe lower bound (bounded.py). The
state pass and its hand-written backward are in state_pass.py.
"""

from __future__ import annotations

import torch

from .bounded import _BoundedIntraChunk
from .layout import (
    SUB_TILE,
    _carried_in,
    _doc_final_states,
    _docs_layout,
    _from_chunks,
    _rows_layout,
    _segment_masks,
    _SegmentMasks,
    _to_chunks,
)
from .state_pass import _StatePass


def kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    chunk, lower_bound, rows):
    """kda_chunk's torch form on checked inputs: the bounded form for a safe lower_bound, the
    exact one for None."""
    T = q.shape[1]
    masks = None
    packed_shape = None
    if cu_seqlens is None:
        layout = _rows_layout(T, chunk)
    elif initial_state is None and not output_final_state:
        # Training's case: no per-document states in or out, so documents may share a chunk and
        # are kept apart by masks; no padding per document. Rows that each start a document and
        # split into whole chunks are independent: a batch (every row's state starts at zero).
        if (T // rows) % chunk:
            rows = 1
        packed_shape = q.shape[:2]
        q, k, v, g, beta = (x.reshape(rows, T // rows, *x.shape[2:]) for x in (q, k, v, g, beta))
        masks = _segment_masks(cu_seqlens, T, chunk, rows)
        T //= rows
        layout = _rows_layout(T, chunk)
    else:
        layout = _docs_layout(cu_seqlens, T, chunk)
    qc, kc, vc, gc = (_to_chunks(x, layout, chunk) for x in (q, k, v, g))
    bc = _to_chunks(beta.unsqueeze(-1), layout, chunk)
    carried_in = _carried_in(qc, vc, initial_state, layout)
    if lower_bound is None:  # contiguous: elementwise results would keep a view's strides
        qc, kc, vc, gc, bc = (x.contiguous() for x in (qc, kc, vc, gc, bc))
        prepared = _intra_chunk(qc * scale, kc, vc, gc, bc, masks)  # scale in fp32, after the cast
        o, chunk_end_states = _StatePass.apply(*prepared, *carried_in)
    else:
        o, chunk_end_states = _BoundedIntraChunk.apply(qc, kc, vc, gc, bc, *carried_in, scale,
                                                      lower_bound, masks)
    o = _from_chunks(o, layout, T).to(q.dtype)
    if packed_shape is not None:
        o = o.reshape(*packed_shape, *o.shape[2:])
    if not output_final_state:
        return o, None
    if cu_seqlens is None:
        return o, chunk_end_states
    return o, _doc_final_states(chunk_end_states, initial_state, layout)


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
        chunk_decay = torch.where(masks.continues[..., -1:, :], chunk_decay, 0.0)
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
