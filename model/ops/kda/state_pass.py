"""The chunk form's state pass, the only sequential part: the state carried from chunk to chunk
(_CarryForward) and its hand-written backward in reverse chunk order (_CarryBackward), and the
exact form's autograd function over them (_StatePass). The bounded form (bounded.py) runs the
same two over blocks of chunks inside its own autograd function."""

from __future__ import annotations

import contextlib

import torch

_SMALL_CHUNK_ELEMENTS = 2 ** 14


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


def _chunk_major(x):
    """[B, H, n, ...] -> [n, B, H, ...] contiguous (a view where x is stored chunk-major)."""
    return x.permute(2, 0, 1, *range(3, x.dim())).contiguous()


def _from_chunk_major(x):
    """[n, B, H, ...] -> [B, H, n, ...] (a view)."""
    return x.permute(1, 2, 0, *range(3, x.dim()))


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
    saves, so the loop runs on one."""
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
