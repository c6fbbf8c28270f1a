"""The chunk form for a gate bounded below by lower_bound in [-5, 0) (K3's gate).

A 16-token sub-tile then decays by at most exp(16 lower_bound) >= exp(-80), so every score
factorises with the reference R_a = Gc at row 7 of row tile a: x_i exp(Gc_i - R_a) (within
exp(+-40)) times k_j exp(R_a - Gc_j) (at most exp(40) up to the end of tile a, <= 1 before it,
where it is floored at exp(-80): such a term stays below exp(-45)). Each row tile is then one
dense matmul against the keys up to its end (the later ones are masked: neither their factors
nor their scores are computed), no [t, t, K] pairwise tensor. The form is one custom autograd
function over blocks of chunks, state pass included (each block's chunks are carried right after
its intra-chunk work, and backward in reverse block by block): it keeps its inputs, Akk, the WY
inverse and what the state pass needs (the state entering each chunk and Vn), and recomputes the
factors in its backward.
"""

from __future__ import annotations

import torch

from model.ops.fast_exp import exp_
from model.ops.fused import fusable

from .layout import SUB_TILE, _SegmentMasks
from .state_pass import _CarryBackward, _CarryForward, _chunk_major, _from_chunk_major

_TILE_REF = SUB_TILE // 2 - 1  # the reference row: exponents within [8, -7] * lower_bound
_EXP_FLOOR = -80.0
_BLOCK_ELEMENTS = 2 ** 18


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
    about -87 it is subnormal, which exp2 and torch's exp compute slowly on CPU), and what it
    scales there is below 1e-35 of its size anyway."""
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
