"""Kimi Delta Attention (SPEC section 2): the gated delta rule with a per-channel decay.

Per head, with state S [K, V], log decay g_t [K] (<= 0), beta_t a scalar:
    S' = Diag(exp(g_t)) S_{t-1};  S_t = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S_t^T (scale q_t)

`kda_recurrent` is the plain reference (a loop over time). `kda_chunk` is the chunkwise-parallel
training form: fla's Triton kernel on CUDA when fla-core is installed, the recurrence itself as
native C loops for fp32 CPU tensors (model/ops/native.py: a head's state stays in cache, which on a
CPU beats the chunk form), else the torch implementation below, which has static shapes (also for
packed documents) and is exact for any gate, bounded or not. Layout (fla's): q, k [B, T, H, K], v
[B, T, H, V], g [B, T, H, K], beta [B, T, H], states [B, H, K, V], or [N, H, K, V] with
`cu_seqlens` (then B == 1 and cu_seqlens [N + 1] must cover 0..T). Internals and states are fp32
(float64 for float64 inputs); o has the input dtype.

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

With a gate bounded below by lower_bound in [-5, 0) (K3's gate), a 16-token sub-tile decays by at
most exp(16 lower_bound) >= exp(-80), so every score factorises with the reference R_a = Gc at
row 7 of row tile a: x_i exp(Gc_i - R_a) (within exp(+-40)) times k_j exp(R_a - Gc_j) (at most
exp(40) up to the end of tile a, <= 1 before it, where it is floored at exp(-80): such a term
stays below exp(-45)). Each row tile is then one dense matmul against the keys up to its end
(the later ones are masked: neither their factors nor their scores are computed), no [t, t, K]
pairwise tensor. That form is one custom autograd function over blocks of chunks, state pass
included (each block's chunks are carried right after its intra-chunk work, and backward in
reverse block by block): it keeps its inputs, Akk, the WY inverse and what the state pass needs
(the state entering each chunk and Vn), and recomputes the factors in its backward. The exact
form's state pass is a custom autograd function too, with the same saved tensors.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from model.batch import segment_ids
from model.dtypes import compute_dtype, upcast
from model.ops import native
from model.ops.fast_exp import exp_
from model.ops.fused import fusable

SUB_TILE = 16
SAFE_LOWER_BOUND = -5.0
_TILE_REF = SUB_TILE // 2 - 1  # the reference row: exponents within [8, -7] * lower_bound
_EXP_FLOOR = -80.0
_BLOCK_ELEMENTS = 2 ** 18
_SMALL_CHUNK_ELEMENTS = 2 ** 14
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
    rows: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA. backend: "auto" (fla on CUDA when installed, the native recurrence
    for fp32 CPU tensors where the native kernels are available, else torch), "torch" (the chunk
    form below) or "fla". lower_bound (e.g. -5 for the K3 gate) promises g >= lower_bound; within
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
    if backend == "auto" and native.kda_usable(q, k, v, g, beta, initial_state):
        return _native_recurrence(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  cu_seqlens, safe_bound)
    # An fp32 island whatever the autocast region around it: the state pass writes with out=,
    # which autocast does not cast, so its operands must not come out of autocast's matmuls.
    with _no_autocast(q.device.type):
        return _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state,
                                cu_seqlens, chunk_size, safe_bound, rows)


def _native_recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       lower_bound):
    """The recurrence itself as C loops (model/ops/native.py kda_forward): on a CPU the state of
    a head (4 KiB at K = V = 32) stays in cache, where the chunk form's small matmuls and
    element-wise passes go through memory and torch's per-operator cost."""
    if cu_seqlens is None:  # each row one sequence
        bounds = torch.arange(q.shape[0] + 1) * q.shape[1]
    else:
        bounds = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    floor = -torch.inf if lower_bound is None else lower_bound  # the bounded form clamps too
    o, final = _NativeRecurrence.apply(q, k, v, g, beta, initial_state, bounds, scale, floor)
    return o, final if output_final_state else None


class _NativeRecurrence(torch.autograd.Function):
    """kda_recurrent (with g clamped at `floor`) forward and backward in native C loops; it
    keeps its inputs and the state at every native.KDA_SEGMENT-th token of each sequence, and
    the backward recomputes the states in between."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, bounds, scale, floor):
        inputs = [x.contiguous() for x in (q, k, v, g, beta)]
        initial = None if initial_state is None else initial_state.contiguous()
        o, final, checkpoints = native.kda_forward(*inputs, initial, bounds, scale, floor)
        ctx.save_for_backward(*inputs, checkpoints, bounds)
        ctx.scale, ctx.floor = scale, floor
        ctx.set_materialize_grads(False)  # an unused final state needs no zero gradient
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        *inputs, checkpoints, bounds = ctx.saved_tensors
        grads = native.kda_backward(*inputs, checkpoints, bounds, ctx.scale, ctx.floor, do,
                                    dfinal, ctx.needs_input_grad[5])
        return *grads, None, None, None


def _no_autocast(device_type: str):
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


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


@dataclass
class _ChunkLayout:
    """Where each token goes in a buffer of whole chunks, and where each document starts.

    token_index [T]: position of each token in the padded buffer of num_chunks * C tokens (None:
    token t at position t). For packed documents also, per chunk, whether it starts a document
    and which one, and per document its last chunk (clamped to 0) and whether it has any token.
    """

    token_index: torch.Tensor | None
    num_chunks: int
    chunk_doc: torch.Tensor | None = None
    chunk_starts_doc: torch.Tensor | None = None
    doc_last_chunk: torch.Tensor | None = None
    doc_nonempty: torch.Tensor | None = None


def _rows_layout(T: int, chunk: int) -> _ChunkLayout:
    return _ChunkLayout(None, -(-T // chunk))


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
    """[B, T, H, ...] -> [B, H, num_chunks, C, ...] fp32 or wider, zeros where no token lands:
    a view of x, or of its padded or cast copy (token-major). No chunk-major copy of the whole
    input: the bounded form copies one block of chunks at a time (it stays in cache), and a
    32 MiB buffer at T = 16K would be fresh memory, page-faulted in on every step."""
    B, T, H, *rest = x.shape
    padded_T = layout.num_chunks * chunk
    if layout.token_index is not None:
        x = x.new_zeros(B, padded_T, H, *rest).index_copy(1, layout.token_index, x)
    elif T < padded_T:
        x = torch.cat([x, x.new_zeros(B, padded_T - T, H, *rest)], dim=1)
    x = x.to(compute_dtype(x.dtype)).unflatten(1, (layout.num_chunks, chunk))
    return x.permute(0, 3, 1, 2, *range(4, x.dim()))


def _from_chunks(x: torch.Tensor, layout: _ChunkLayout, T: int) -> torch.Tensor:
    """[B, H, num_chunks, C, V] -> [B, T, H, V] (a view for rows: the state pass stores its
    output token-major)."""
    x = x.permute(0, 2, 3, 1, 4).flatten(1, 2)
    return x[:, :T] if layout.token_index is None else x.index_select(1, layout.token_index)


def _kda_chunk_torch(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     chunk, lower_bound, rows):
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


@dataclass
class _SegmentMasks:
    """Documents sharing chunks ([rows, 1, NC, C, *] bool, like the chunks [B, H, NC, C, *]):
    `same` pairs of one document, `continues` tokens whose document began before the chunk
    (they see the carried state), `in_last` tokens of the chunk's last document (they make the
    state carried on)."""

    same: torch.Tensor
    continues: torch.Tensor
    in_last: torch.Tensor


def _segment_masks(cu_seqlens: torch.Tensor, T: int, chunk: int, rows: int) -> _SegmentMasks:
    """The masks of the T packed tokens, split into `rows` rows of whole chunks (or one row)."""
    num_chunks = -(-T // chunk)
    seg = segment_ids(cu_seqlens.long(), T)
    # Padding after T (k = beta = 0: no effect on the state) counts as the last document.
    seg = torch.cat([seg, seg[-1:].expand(num_chunks * chunk - T)]).view(num_chunks, chunk)
    before = torch.cat([seg.new_full((1,), -1), seg[:-1, -1]])  # document before each chunk
    masks = (seg.unsqueeze(-1) == seg.unsqueeze(-2), (seg == before.unsqueeze(-1)).unsqueeze(-1),
             (seg == seg[:, -1:]).unsqueeze(-1))
    return _SegmentMasks(*(m.view(rows, 1, num_chunks // rows, *m.shape[1:]) for m in masks))


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


class _BoundedIntraChunk(torch.autograd.Function):
    """The chunk form for a gate with a safe lower bound (q not yet scaled): the intra-chunk
    work, where the decayed scores are one dense matmul per row tile of two factors (see the
    module docstring), then the state pass. It keeps its inputs, Akk, the WY inverse and what
    the state pass's backward needs, and recomputes the factors in its backward. The
    intra-chunk work runs over blocks of about _BLOCK_ELEMENTS elements per [.., C, K] tensor
    (all chunks of a block at once), so that temporaries stay in cache and in the allocator's
    reused memory, and the state pass carries each block's chunks right after it. The backward
    runs the state pass's backward block by block in reverse and each block's intra-chunk
    backward right after it: U and the gradients of the intra-chunk results (U, W, ...) exist
    for one block at a time, not as buffers of the whole sequence (32 MiB each at T = 16K with
    4 heads: fresh memory, page-faulted in on every step)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, inits, starts, scale, lower_bound,
                masks: _SegmentMasks | None):
        inputs = (q, k, v, g, beta)
        NC = q.shape[2]
        carry = _CarryForward(state, inits, starts, NC, q.shape[3])
        kept = None  # what the backward needs: all but U, stored chunk-major
        for block, block_masks in _blocks(q.shape, masks):
            Aqk, U, *rest = _bounded_forward(*(_chunk_major(x[:, :, block]) for x in inputs),
                                             scale, lower_bound, block_masks)
            parts = (Aqk, *rest)  # W, q exp(G), exp(G_last - G) k, exp(G_last), Akk, inverse
            if kept is None:
                kept = [_from_chunk_major(x.new_empty(NC, *x.shape[1:])) for x in parts]
            for result, part in zip(kept, parts):
                result[:, :, block] = _from_chunk_major(part)
            # The state pass over the block's chunks while its results are in cache.
            carry.run(range(block.start, block.stop),
                      *(_from_chunk_major(x) for x in (Aqk, U, *rest[:4])))
        o, out_states, carry_saved = carry.results()
        Aqk, W, q_decayed, k_to_end, chunk_decay, Akk, inverse = kept
        ctx.save_for_backward(*inputs, Akk, inverse, Aqk, W, q_decayed, k_to_end, chunk_decay,
                              *carry_saved, starts)
        ctx.scale, ctx.lower_bound, ctx.masks = scale, lower_bound, masks
        ctx.inits_shape = None if inits is None else inits.shape
        return o, out_states

    @staticmethod
    def backward(ctx, do, dout_states):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each tensor once
        inputs, (Akk, inverse), carried = saved[:5], saved[5:7], saved[7:]
        Aqk, W, q_decayed, k_to_end, chunk_decay, _, new_values, _ = carried
        carry = _CarryBackward(*carried, do, dout_states,
                               ctx.inits_shape if ctx.needs_input_grad[6] else None)
        # Token-major like the inputs: the backward of _to_chunks is then a view, not a copy.
        grads = [torch.empty_like(x) for x in inputs]
        for block, block_masks in reversed(list(_blocks(inputs[0].shape, ctx.masks))):
            n = block.stop - block.start
            # The gradients of Aqk, U, W, q exp(G), exp(G_last - G) k and exp(G_last) for the
            # block, chunk-major [n, B, H, ...].
            local = [x.new_empty(n, *x.shape[:2], *x.shape[3:])
                     for x in (Aqk, new_values, W, q_decayed, k_to_end, chunk_decay)]
            carry.run(range(block.start, block.stop), [_from_chunk_major(x) for x in local])
            parts = _bounded_backward(*(_chunk_major(x[:, :, block])
                                        for x in (*inputs, Akk, inverse)),
                                      *local, ctx.scale, ctx.lower_bound, block_masks)
            for grad, part in zip(grads, parts):
                grad[:, :, block] = _from_chunk_major(part)
        return *grads, carry.initial_state_grad(), carry.dinits, None, None, None, None


def _blocks(shape, masks):
    """Blocks of whole chunks of a [B, H, NC, C, K] tensor, about _BLOCK_ELEMENTS elements each,
    with their masks, chunk-major ([n, B, 1, C, ...])."""
    B, H, NC, C, K = shape
    step = max(1, _BLOCK_ELEMENTS // (B * H * C * K))
    for start in range(0, NC, step):
        block = slice(start, min(start + step, NC))
        block_masks = None if masks is None else _SegmentMasks(
            *(_chunk_major(m[:, :, block]) for m in (masks.same, masks.continues,
                                                     masks.in_last)))
        yield block, block_masks


def _chunk_major(x):
    """[B, H, n, ...] -> [n, B, H, ...] contiguous (a view where x is stored chunk-major)."""
    return x.permute(2, 0, 1, *range(3, x.dim())).contiguous()


def _from_chunk_major(x):
    """[n, B, H, ...] -> [B, H, n, ...] (a view)."""
    return x.permute(1, 2, 0, *range(3, x.dim()))


@fusable
def _bounded_forward(q, k, v, g, beta, scale, lower_bound, masks):
    """Returns Aqk, U, W, q exp(Gc), exp(Gc_last - Gc) k, exp(Gc_last), Akk and the inverse."""
    G = g.clamp(min=lower_bound).cumsum_(-2)
    _, rows, refs = _tile_factors(q, k, G)
    # Keys after row tile a are masked out of its scores: they stay 0, never computed.
    Aqk = q.new_zeros(*q.shape[:-1], q.shape[-2])
    Akk = torch.zeros_like(Aqk)
    for tile, (rows_tile, key_decay) in enumerate(zip(rows.unbind(-3), _key_factors(G, refs))):
        end = key_decay.shape[-2]
        scores = rows_tile @ key_decay.mul_(k[..., :end, :]).mT  # [.., 2t, end]
        tile_rows = slice(tile * SUB_TILE, end)
        Aqk[..., tile_rows, :end] = scores[..., :SUB_TILE, :]
        Akk[..., tile_rows, :end] = scores[..., SUB_TILE:, :]
    del rows, scores, key_decay
    lower, strictly_lower = _score_masks(q.shape[-2], masks, q.device)
    Aqk.mul_(scale).masked_fill_(~lower, 0.0)
    Akk.masked_fill_(~strictly_lower, 0.0)
    # (I + Diag(beta) Akk)^-1, unit lower triangular; U and W are then plain matmuls.
    inverse = _unit_lower_inverse(beta * Akk)
    weighted = inverse * beta.mT  # = inverse @ Diag(beta)
    U = weighted @ v
    G_exp = _decay(G.clone())
    W = weighted @ (k * G_exp)
    q_decayed = G_exp.mul_(q).mul_(scale)
    G_last = G[..., -1:, :]
    k_to_end = _decay(G_last - G).mul_(k)
    chunk_decay = _decay(G_last.clone())
    if masks is not None:
        W.mul_(masks.continues)
        q_decayed.mul_(masks.continues)
        k_to_end.mul_(masks.in_last)
        chunk_decay.mul_(masks.continues[..., -1:, :])
    return Aqk, U, W, q_decayed, k_to_end, chunk_decay, Akk, inverse


@fusable
def _bounded_backward(q, k, v, g, beta, Akk, inverse, dAqk, dU, dW, dq_decayed, dk_to_end,
                      dchunk_decay, scale, lower_bound, masks):
    """Gradients of q, k, v, g and beta from those of _bounded_forward's first six outputs."""
    if masks is not None:  # a masked output passes no gradient
        dW = dW * masks.continues
        dq_decayed = dq_decayed * masks.continues
        dk_to_end = dk_to_end * masks.in_last
        dchunk_decay = dchunk_decay * masks.continues[..., -1:, :]
    G = g.clamp(min=lower_bound).cumsum_(-2)
    G_exp = _decay(G.clone())
    G_last = G[..., -1:, :]
    # U = weighted V, W = weighted (k exp(G)), weighted = inverse Diag(beta).
    weighted = inverse * beta.mT
    k_decayed = k * G_exp
    dweighted = torch.matmul(dU, v.mT).add_(dW @ k_decayed.mT)
    dv = weighted.mT @ dU
    dk_decayed = weighted.mT @ dW
    del weighted
    dbeta = (dweighted * inverse).sum(-2).unsqueeze(-1)
    # inverse = M^-1 with M = I + Diag(beta) Akk: dL/dM = -inverse^T dL/dinverse inverse^T.
    dM = inverse.mT @ dweighted.mul_(beta.mT) @ inverse.mT
    dbeta -= (dM * Akk).sum(-1, keepdim=True)
    lower, strictly_lower = _score_masks(q.shape[-2], masks, q.device)
    dAkk = dM.mul_(-beta).masked_fill_(~strictly_lower, 0.0)
    dAqk = (dAqk * scale).masked_fill_(~lower, 0.0)
    del dM, dweighted
    # scores = rows @ keys^T per row tile, with the references held constant: the scores
    # depend on Gc only through differences, so that gradient is exact.
    row, rows, refs = _tile_factors(q, k, G)
    dk_keys = torch.zeros_like(k)
    drows = torch.empty_like(rows)  # [.., n, 2t, K]
    for tile, (rows_tile, key_decay) in enumerate(zip(rows.unbind(-3), _key_factors(G, refs))):
        end = key_decay.shape[-2]
        tile_rows = slice(tile * SUB_TILE, end)
        dscores = torch.cat([dAqk[..., tile_rows, :end], dAkk[..., tile_rows, :end]], dim=-2)
        dk_keys[..., :end, :].addcmul_(dscores.mT @ rows_tile, key_decay)
        drows[..., tile, :, :] = dscores @ key_decay.mul_(k[..., :end, :])
    del dAqk, dAkk, dscores, key_decay
    drows, rows = drows.unflatten(-2, (2, SUB_TILE)), rows.unflatten(-2, (2, SUB_TILE))
    dG = _from_tiles((drows * rows).sum(-3)).addcmul_(dk_keys, k, value=-1)
    dq = _from_tiles(drows[..., 0, :, :] * row)
    dk = _from_tiles(drows[..., 1, :, :] * row).add_(dk_keys)
    del drows, rows, row, dk_keys
    # q_decayed = scale q exp(G), k exp(G) in W, k_to_end = k exp(G_last - G), exp(G_last).
    dq.addcmul_(dq_decayed, G_exp, value=scale)
    dk.addcmul_(dk_decayed, G_exp)
    dG.addcmul_(dk_decayed, k_decayed)
    dG.addcmul_(dq_decayed, G_exp.mul_(q), value=scale)
    to_end = _decay(G_last - G)
    dk.addcmul_(dk_to_end, to_end)
    dto_end = dk_to_end.mul_(to_end).mul_(k)  # d(G_last - G)
    dG.sub_(dto_end)
    dG[..., -1:, :] += dto_end.sum(-2, keepdim=True) + dchunk_decay * _decay(G_last.clone())
    # G = cumsum(clamp(g)): reverse cumsum, and no gradient where the clamp held.
    dg = dG.flip(-2).cumsum_(-2).flip(-2).masked_fill_(g < lower_bound, 0.0)
    return dq, dk, dv, dg, dbeta


def _tile_factors(q, k, G):
    """The scores' row factors, with R_a = Gc at row _TILE_REF of row tile a: row =
    exp(Gc_i - R_a) for i in tile a ([.., n, t, K], within exp(-8, 7 * |lower_bound|)); rows
    [.., n, 2t, K], q then k times row; and the references R [.., n, 1, K]."""
    Gt = _to_tiles(G)
    refs = Gt[..., _TILE_REF:_TILE_REF + 1, :]
    row = exp_(Gt - refs)
    rows = torch.stack((_to_tiles(q), _to_tiles(k)), dim=-3).mul_(row.unsqueeze(-3))
    return row, rows.flatten(-3, -2), refs


def _key_factors(G, refs):
    """Per row tile a, the key factors exp(R_a - Gc_j) [.., 16 (a + 1), K] for the keys up to
    the end of tile a (the later ones are masked out of its scores, so none is computed): at
    most exp(8 |lower_bound|), floored at exp(-80) before the tile (the row factor is at most
    exp(35), so a floored term stays below exp(-45))."""
    for tile, ref in enumerate(refs.unbind(-3)):
        yield _decay(ref - G[..., :(tile + 1) * SUB_TILE, :])


def _to_tiles(x):
    """[.., C, X] -> [.., C / 16, 16, X]."""
    return x.unflatten(-2, (x.shape[-2] // SUB_TILE, SUB_TILE))


def _from_tiles(x):
    """[.., n, 16, X] -> [.., 16 n, X] (a copy if x is a strided slice)."""
    return x.reshape(*x.shape[:-3], -1, x.shape[-1])


def _decay(exponent):
    """exp, in place, of a log decay floored at -80: the result stays a normal fp32 (below
    about -87 it is subnormal, which takes exp2 1.7x and torch's exp 10x longer on CPU), and
    what it scales there is below 1e-35 of its size anyway."""
    return exp_(exponent.clamp_(min=_EXP_FLOOR))


def _score_masks(C, masks, device):
    """Where Aqk (j <= i) and Akk (j < i) may be nonzero: within one document."""
    lower = torch.ones(C, C, dtype=torch.bool, device=device).tril()
    strictly_lower = lower.tril(-1)
    if masks is not None:
        lower, strictly_lower = lower & masks.same, strictly_lower & masks.same
    return lower, strictly_lower


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower triangular A [.., C, C]."""
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device).expand_as(A)
    return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)


def _carried_in(qc, vc, initial_state, layout):
    """What the state pass starts from: the state entering the first chunk [B, H, K, V], and for
    packed documents the initial state of each chunk's document (None: zeros) and whether each
    chunk starts one."""
    B, H, _, _, K = qc.shape
    state = qc.new_zeros(B, H, K, vc.shape[-1])
    starts = inits = None
    if layout.chunk_doc is None:
        if initial_state is not None:
            state = upcast(initial_state)
    else:  # a chunk that starts a document loads that document's initial state
        starts = layout.chunk_starts_doc
        if initial_state is not None:
            inits = upcast(initial_state).index_select(0, layout.chunk_doc).unsqueeze(1)
    return state, inits, starts


class _StatePass(torch.autograd.Function):
    """The state pass (_carry_forward) after the exact form's intra-chunk work; its backward
    runs the loop in reverse from the saved S_c and Vn_c (_CarryBackward)."""

    @staticmethod
    def forward(ctx, Aqk, U, W, q_decayed, k_to_end, chunk_decay, state, inits, starts):
        carry = _CarryForward(state, inits, starts, *U.shape[2:4])
        carry.run(range(U.shape[2]), Aqk, U, W, q_decayed, k_to_end, chunk_decay)
        o, out_states, saved = carry.results()
        ctx.save_for_backward(Aqk, W, q_decayed, k_to_end, chunk_decay, *saved, starts)
        ctx.inits_shape = None if inits is None else inits.shape
        return o, out_states

    @staticmethod
    def backward(ctx, do, dout_states):
        saved = ctx.saved_tensors  # once: activation checkpointing unpacks each tensor once
        Aqk, W, q_decayed, k_to_end, chunk_decay, _, new_values, _ = saved
        carry = _CarryBackward(*saved, do, dout_states,
                               ctx.inits_shape if ctx.needs_input_grad[7] else None)
        grads = [_from_chunk_major(x.new_empty(x.shape[2], *x.shape[:2], *x.shape[3:]))
                 for x in (Aqk, new_values, W, q_decayed, k_to_end, chunk_decay)]
        carry.run(range(new_values.shape[2]), grads)
        return *grads, carry.initial_state_grad(), carry.dinits, None


class _CarryForward:
    """Carries the state across chunks (the only sequential part): `run` over consecutive
    ranges of chunks in order, each given that range's Aqk, U, W, q exp(G), exp(G_last - G) k
    and exp(G_last) [B, H, n, ...]. Per chunk c: S_c (the state entering it; a chunk that starts
    a document loads inits[c], zeros without inits), Vn_c = U_c - W_c S_c and
    S_{c+1} = Diag(decay_c) S_c + K_end,c^T Vn_c in the loop, then for the whole range at once
    O_c = (Q exp(G))_c S_c + Aqk_c Vn_c (two batched matmuls: at narrow heads each small matmul
    costs more in dispatch than in arithmetic, so the loop keeps only what depends on the carried
    state). Everything writes into preallocated buffers (no per-chunk autograd graph;
    chunk-major inputs make each chunk's slice contiguous)."""

    def __init__(self, state, inits, starts, num_chunks, chunk):
        B, H, K, V = state.shape
        self.inits, self.starts = inits, starts
        # states[c] enters chunk c (chunk-major, like the inputs); states[NC] leaves the last.
        self.states = state.new_empty(num_chunks + 1, B, H, K, V)
        self.states[0] = state
        self.new_values = _from_chunk_major(state.new_empty(num_chunks, B, H, chunk, V))
        # o [B, H, NC, C, V] stored token-major, so that _from_chunks is a view, and not itself
        # a view (autograd refuses in-place ops on views of a custom function's outputs).
        self.o = torch.empty_strided(
            (B, H, num_chunks, chunk, V), (num_chunks * chunk * H * V, V, chunk * H * V, H * V, 1),
            dtype=state.dtype, device=state.device)
        self.end_states = (state.new_empty(num_chunks, B, H, K, V) if starts is not None
                           else self.states[1:])
        # Each chunk's [B * H, ...] views, made once (per-chunk indexing costs more than the
        # chunk's small matmuls at narrow heads).
        self.state_views = self.states.flatten(1, 2).unbind(0)
        self.end_views = self.end_states.flatten(1, 2).unbind(0)
        self.value_views = _per_chunk(self.new_values)

    def run(self, chunks: range, Aqk, U, W, q_decayed, k_to_end, chunk_decay):
        starts = self.starts
        per_chunk = zip(chunks, *(_per_chunk(x) for x in (U, W, k_to_end, chunk_decay)))
        with _threads_for(self.value_views[0]):
            for c, U_c, W_c, k_end_c, decay_c in per_chunk:
                S, end = self.state_views[c], self.end_views[c]
                if starts is not None:  # the state carried in: end_states[c - 1], or the given
                    carried = self.end_views[c - 1] if c else S
                    loaded = S.new_zeros(()) if self.inits is None else self.inits[c].flatten(0, 1)
                    torch.where(starts[c], loaded, carried, out=S)
                vn = torch.baddbmm(U_c, W_c, S, alpha=-1, out=self.value_views[c])
                _accumulate_bmm(torch.mul(decay_c.mT, S, out=end), k_end_c.mT, vn)
        block = slice(chunks.start, chunks.stop)
        o = torch.bmm(_chunk_batch(q_decayed), self.states[block].flatten(0, 2))
        _accumulate_bmm(o, _chunk_batch(Aqk), _chunk_batch(self.new_values[:, :, block]))
        B, H = self.o.shape[:2]
        self.o[:, :, block] = _from_chunk_major(o.view(len(chunks), B, H, *o.shape[1:]))

    def results(self):
        """o [B, H, NC, C, V], the state after each chunk [B, H, NC, K, V] for packed documents
        or after the last [B, H, K, V] for rows, and what the backward needs: the states
        entering the chunks and Vn."""
        NC = self.new_values.shape[2]
        if self.starts is None:
            out_states = self.states[NC].clone()
        else:
            out_states = self.end_states.permute(1, 2, 0, 3, 4)
        return self.o, out_states, (self.states[:NC], self.new_values)


class _CarryBackward:
    """The state pass's backward in reverse chunk order: `run` over any descending sequence of
    ranges of chunks, each writing the gradients of its chunks' Aqk, U, W, q exp(G),
    exp(G_last - G) k and exp(G_last) into chunk-major buffers [B, H, n, ...] for that range.
    Only the carried gradient dstate (of the state after the chunk being processed,
    [B * H, K, V]) is sequential: per chunk dVn += K_end dstate and
    dstate <- Diag(decay) dstate + (Q exp(G))^T dO - W^T dVn. What does not depend on it
    (dAqk, dq exp(G), Aqk^T dO, (Q exp(G))^T dO) is computed for the range before the loop and
    what only reads it (dK_end, ddecay, dW) after, from the dstate of every chunk kept in a
    buffer (with packed documents also the initial states' gradients, dinits)."""

    def __init__(self, Aqk, W, q_decayed, k_to_end, chunk_decay, start_states, new_values,
                 starts, do, dout_states, inits_shape):
        self.start_states, self.starts = start_states, starts
        self.dinits = None if inits_shape is None else start_states.new_zeros(inits_shape)
        if starts is None:
            self.dstate = dout_states.flatten(0, 1).clone()
        else:
            self.dstate = torch.zeros_like(dout_states[:, :, 0]).flatten(0, 1)
            self.dout_views = _per_chunk(dout_states)
        # [NC, B * H, ...] contiguous: views of the chunk-major tensors, a copy of do (token-major
        # like o) and of the exact form's inputs. start_states is [NC, B, H, K, V] already.
        self.saved = [_chunk_rows(x).contiguous() for x in (new_values, do, Aqk, k_to_end,
                                                            chunk_decay, q_decayed, W)]
        self.saved.append(start_states.flatten(1, 2))

    def run(self, chunks: range, grads):
        """grads: the range's gradient buffers, chunk-major."""
        starts, block = self.starts, slice(chunks.start, chunks.stop)
        vn, do, Aqk, k_end, decay, q, W, S = (x[block] for x in self.saved)
        dAqk, dU, dW, dq, dk_end, ddecay = (_chunk_rows(x) for x in grads)
        torch.bmm(_flat(do), _flat(vn).mT, out=_flat(dAqk))
        torch.bmm(_flat(do), _flat(S).mT, out=_flat(dq))
        torch.bmm(_flat(Aqk).mT, _flat(do), out=_flat(dU))  # dVn, before the carried part
        # dstates[i + 1]: the gradient of the state after the range's chunk i; dstates[i]
        # starts as (Q exp(G))_i^T dO_i and becomes the gradient of the state entering it.
        dstates = self.dstate.new_empty(len(chunks) + 1, *self.dstate.shape)
        torch.bmm(_flat(q).mT, _flat(do), out=_flat(dstates[:-1]))
        dstates[-1] = self.dstate
        with _threads_for(self.dstate):
            for i, c in reversed(list(enumerate(chunks))):
                dstate, carried = dstates[i + 1], dstates[i]
                if starts is not None:
                    dstate += self.dout_views[c]
                dvn = _accumulate_bmm(dU[i], k_end[i], dstate)
                carried.addcmul_(dstate, decay[i].mT)
                _accumulate_bmm(carried, W[i].mT, dvn, alpha=-1)
                if starts is not None:  # a loaded initial state cuts the carried one off
                    if self.dinits is not None:
                        self.dinits[c] = torch.where(starts[c], carried, 0.0).view_as(
                            self.dinits[c])
                    carried.masked_fill_(starts[c], 0.0)
        after = _flat(dstates[1:])
        torch.bmm(_flat(vn), after.mT, out=_flat(dk_end))
        torch.sum(after * _flat(S), -1, keepdim=True, out=_flat(ddecay).mT)
        torch.bmm(_flat(dU), _flat(S).mT, out=_flat(dW)).neg_()
        self.dstate = dstates[0]

    def initial_state_grad(self):
        return self.dstate.view_as(self.start_states[0])


def _flat(x):
    """[n, B * H, ...] -> [n * B * H, ...]: one batch of a range's chunks."""
    return x.flatten(0, 1)


def _accumulate_bmm(out, a, b, alpha=1):
    """out += alpha a @ b in place (baddbmm's out= form: torch's FlopCounterMode counts it,
    not baddbmm_)."""
    return torch.baddbmm(out, a, b, alpha=alpha, out=out)


def _chunk_rows(x):
    """x [B, H, n, ...] -> [n, B * H, ...] (a view; contiguous for chunk-major x)."""
    return x.permute(2, 0, 1, *range(3, x.dim())).flatten(1, 2)


def _per_chunk(x):
    """The chunks of x [B, H, n, ...] as n views [B * H, ...] (contiguous for chunk-major x)."""
    return _chunk_rows(x).unbind(0)


def _chunk_batch(x):
    """x [B, H, n, ...] -> [n * B * H, ...], one batch for a matmul over all its chunks (a view
    for chunk-major x, else one copy)."""
    return _chunk_rows(x).flatten(0, 1)


def _threads_for(work: torch.Tensor):
    """The state pass's per-chunk matmuls are as small as `work` ([B * H, C, V] or [B * H, K,
    V]): below _SMALL_CHUNK_ELEMENTS elements a second intra-op thread costs more to wake than it
    saves (a [2, 32, 32] bmm: 5 us on one thread, 9 us on two), so the loop runs on one."""
    if work.device.type != "cpu" or work.numel() > _SMALL_CHUNK_ELEMENTS:
        return contextlib.nullcontext()
    return _one_intra_op_thread()


@contextlib.contextmanager
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _doc_final_states(chunk_end_states, initial_state, layout):
    """The state after each document's last chunk ([N, H, K, V]); a document without tokens
    keeps its initial state."""
    final = chunk_end_states.index_select(2, layout.doc_last_chunk)[0].transpose(0, 1)
    if initial_state is None:
        before = final.new_zeros(())
    else:
        before = upcast(initial_state)
    return torch.where(layout.doc_nonempty.view(-1, 1, 1, 1), final, before)
