"""Context parallelism: every rank of a CP group holds pieces of every row.

`contiguous`: rank f of F holds piece f of F, positions f*L .. (f+1)*L - 1 of each row
(L = T / F). `zigzag` (parallel.context_layout, the default): rows are cut into 2F pieces and
rank f holds pieces f and 2F-1-f as two rows of its local batch (pieces of row b: local rows b
and B + b), so every rank has one early and one late piece and does the same causal-attention
work (contiguous, the last rank attends to every key, the first to its own only: about twice
the mean). Documents may start, end or span several pieces. `shard_batch` cuts a batch into
this rank's pieces; the local cu_seqlens has a boundary at every piece start, so the unchanged
model treats a continued document as a new one, and three seams the model names (filled by
`apply_context_parallel`) join the pieces again:

- ShortConv.halo: the previous piece's last kernel-1 inputs are prepended (an autograd
  all-gather of every rank's tails), masked by document ids, so the conv restarts only at real
  document starts.
- KimiDeltaAttention.state_exchange (KCP): a piece's state is affine in the state entering it,
  S_end = M S_in + S_ext. One pass of kda_chunk over the pieces with the values widened to
  [v | 0] and each piece's first document started from [0 | I] gives both: its final state is
  [S_ext | M] (the value columns of the recurrence are independent, and the zero columns carry
  the identity through the transition product), and its output columns [o | P] hold the
  zero-start output and, per token, the map from the incoming state to the output
  (o_t += S_in^T P_t: the output is linear in S_in). One all-gather of [S_ext | M] (fp32);
  every rank runs the scan S_in_f = c_f (M_{f-1} S_in_{f-1} + S_ext_{f-1}) over all pieces in
  row order, where c_f says whether piece f starts inside a document; M is 0 when the last
  document started inside the piece, so a boundary resets the chain. kda_chunk picks fla's
  kernel on CUDA and the torch chunk form elsewhere; both take per-document initial states and
  return per-document final states with gradients.
- GatedMLA.kv_exchange: the compressed latent (kv_lora + rope per token, far smaller than K and
  V) is all-gathered up to this rank's last piece; each rank expands K and V itself and each of
  its pieces' queries attend document-causally at their offset (offset_doc_causal_attention)
  to the keys up to the piece's end.

The collectives are torch's functional all-gather with autograd: the backward reduce-scatters
the gradients to the ranks that produced the inputs. Every rank's graph uses the whole gathered
tensor (the scan runs over all pieces), so every rank joins each backward collective.
Parameters are replicated over the CP ranks: their gradients are summed over dp x cp, and the
loss is normalised by the loss tokens of dp x cp (parallel/apply.py does both).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from model.batch import K3Batch, VisionInput, segment_ids
from model.dtypes import upcast
from model.k3 import K3Model
from model.kda import KimiDeltaAttention
from model.mla import GatedMLA
from model.ops.attention import offset_doc_causal_attention
from model.short_conv import ShortConv


@dataclass
class ContextShard(K3Batch):
    """One rank's fragment of a batch: tokens, labels [B, L] and cu_seqlens over B*L (a boundary
    at each fragment start), plus the document ids of the whole rows, which the exchanges need
    to tell a continued document from a new one."""

    row_segments: torch.Tensor | None = None  # [B, T] document ids of the whole rows
    fragment: int = 0  # this rank in its CP group
    num_fragments: int = 1  # the CP ranks
    zigzag: bool = False

    def to(self, device) -> ContextShard:
        return ContextShard(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    @property
    def pieces(self) -> tuple[int, ...]:
        """The pieces of every row this rank holds, in its local row order."""
        return held_pieces(self.fragment, self.num_fragments, self.zigzag)

    @property
    def start(self) -> int:
        """The row position of this rank's first piece's first token."""
        return self.pieces[0] * self.tokens.shape[1]


def held_pieces(rank: int, size: int, zigzag: bool) -> tuple[int, ...]:
    """The pieces of every row CP rank `rank` of `size` holds, in its local row order: piece
    `rank` of `size`, or under zig-zag pieces rank and 2*size-1-rank of 2*size."""
    return (rank, 2 * size - 1 - rank) if zigzag else (rank,)


def _to(value, device):
    return value.to(device) if hasattr(value, "to") else value


def shard_batch(batch: K3Batch, fragment: int, num_fragments: int,
                zigzag: bool = False) -> ContextShard:
    """CP rank `fragment` of `num_fragments`'s pieces of every row (held_pieces), as rows of
    L = T / pieces tokens: [B, L], or [2B, L] under zig-zag (the early pieces' rows, then the
    late ones'). Labels are already shifted, so each piece's last label is the next piece's
    first token."""
    B, T = batch.tokens.shape
    pieces = held_pieces(fragment, num_fragments, zigzag)
    num_pieces = num_fragments * len(pieces)
    if T % num_pieces:
        raise ValueError(f"sequence length {T} must be divisible by {num_pieces}: "
                         f"parallel.context={num_fragments} ranks each hold {len(pieces)} equal "
                         f"piece(s) of every row")
    L = T // num_pieces
    cu = batch.cu_seqlens
    # Global boundary b*T + t -> local (h*B + b)*L + clamp(t - start_h, 0, L) for the piece of
    # local half h: N + 1 entries a piece (documents outside it become empty), static shapes.
    local_cu = torch.cat([(h * B + cu // T) * L + (cu % T - p * L).clamp(0, L)
                          for h, p in enumerate(pieces)])
    cut = [slice(p * L, (p + 1) * L) for p in pieces]
    return ContextShard(torch.cat([batch.tokens[:, c] for c in cut]),
                        torch.cat([batch.labels[:, c] for c in cut]), local_cu,
                        _piece_vision(batch.vision, B, T, pieces, L),
                        row_segments=segment_ids(cu, B * T).view(B, T), fragment=fragment,
                        num_fragments=num_fragments, zigzag=zigzag)


def _piece_vision(vision: VisionInput | None, B: int, T: int, pieces: tuple[int, ...], L: int):
    """Every rank encodes all of the batch's images (their gradients sum over the CP ranks
    like any replicated parameter's) and keeps the output tokens whose placeholders lie in its
    pieces. Runs on the loader's CPU batch before the forward: its host sync is not on the
    model's hot path."""
    if vision is None:
        return None
    rows = vision.output_rows
    if rows is None:
        rows = torch.arange(vision.token_positions.shape[0])
    row, pos = vision.token_positions // T, vision.token_positions % T
    local, kept = [], []
    for half, piece in enumerate(pieces):
        start = piece * L
        inside = ((pos >= start) & (pos < start + L)).nonzero().squeeze(1)
        local.append(((half * B + row) * L + pos - start)[inside])
        kept.append(rows[inside])
    return VisionInput(vision.patches, vision.grid_thw, torch.cat(local), torch.cat(kept))


def fragment_continues(row_segments: torch.Tensor, num_fragments: int) -> torch.Tensor:
    """[F, B] bool: whether fragment f of row b starts inside a document begun before it."""
    B, T = row_segments.shape
    L = T // num_fragments
    firsts, lasts = row_segments[:, ::L], row_segments[:, L - 1::L]
    continues = torch.zeros(num_fragments, B, dtype=torch.bool, device=row_segments.device)
    continues[1:] = (firsts[:, 1:] == lasts[:, :-1]).T
    return continues


# --- KCP: the KDA state across fragments -----------------------------------------------------

def fragment_summary(kda, q, k, v, g, beta, cu_seqlens, rows: int):
    """One `kda` pass over a packed fragment of `rows` rows (q [1, rows*L, H, K], cu_seqlens
    with a boundary at each row start). Returns the zero-start output [1, rows*L, H, V], the
    incoming-state map P [1, rows*L, H, K] (o_t = o_t(0) + S_in^T P_t; zero outside each row's
    first document) and [S_ext | M] [rows, H, K, V + K] of each row's last document (fp32)."""
    _, total, H, K = q.shape
    V = v.shape[-1]
    L = total // rows
    ends = cu_seqlens[1:]
    row_starts = torch.arange(rows, device=q.device) * L
    first = torch.searchsorted(ends, row_starts, right=True)  # document of each row's first token
    last = torch.searchsorted(ends, row_starts + L - 1, right=True)
    identity = torch.eye(K, device=q.device).expand(rows, H, K, K)
    start_states = torch.cat([identity.new_zeros(rows, H, K, V), identity], dim=-1)
    initial = start_states.new_zeros(cu_seqlens.shape[0] - 1, H, K, V + K)
    initial = initial.index_copy(0, first, start_states)
    widened = torch.cat([v, v.new_zeros(1, total, H, K)], dim=-1)
    o, final = kda(q, k, widened, g, beta, initial_state=initial, output_final_state=True,
                   cu_seqlens=cu_seqlens)
    return o[..., :V], o[..., V:], final.index_select(0, last)


def incoming_states(summaries: torch.Tensor, continues: torch.Tensor) -> torch.Tensor:
    """The scan over fragments in order: summaries [F, R, H, K, V + K] ([S_ext | M] of each
    fragment's last document), continues [F, R]. Returns the state entering each fragment's
    first document, [F, R, H, K, V] fp32 (or wider): S_in_0 = 0, S_in_f = c_f (M_{f-1} S_in_{f-1} +
    S_ext_{f-1})."""
    K = summaries.shape[-2]
    V = summaries.shape[-1] - K
    state = summaries.new_zeros(*summaries.shape[1:-1], V)
    states = []
    for summary, carries in zip(upcast(summaries).unbind(0), continues.unbind(0)):
        state = torch.where(carries.view(-1, 1, 1, 1), state, 0.0)
        states.append(state)
        s_ext, transition = summary.split([V, K], dim=-1)
        state = transition @ state + s_ext
    return torch.stack(states)


def add_incoming_state(o: torch.Tensor, state_map: torch.Tensor,
                       incoming: torch.Tensor) -> torch.Tensor:
    """o [1, R*L, H, V] + S_in^T P per token, with incoming [R, H, K, V] per row."""
    rows = incoming.shape[0]
    P = state_map.unflatten(1, (rows, -1))[0]  # [R, L, H, K]
    correction = torch.einsum("rlhk,rhkv->rlhv", upcast(P), incoming)
    return o + correction.reshape(o.shape).to(o.dtype)


# --- the seams -------------------------------------------------------------------------------

class ContextParallel:
    """The exchanges of one CP group, with the document ids of the micro-batch being run (set
    by `bind`; K3Model's forward pre-hook binds each ContextShard it is given). Activation
    checkpointing recomputes a layer in the backward of the same micro-batch, so the ids stay
    valid for it as long as one micro-batch's backward follows its forward."""

    def __init__(self, group, zigzag: bool = False):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.zigzag = zigzag
        self.pieces = held_pieces(self.rank, self.size, zigzag)
        self.num_pieces = self.size * len(self.pieces)
        self.row_segments: torch.Tensor | None = None

    def bind(self, shard: ContextShard) -> None:
        if not isinstance(shard, ContextShard):
            raise TypeError(f"a context-parallel model takes this rank's pieces of the batch "
                            f"(parallel.context_parallel.shard_batch), got {type(shard).__name__}")
        if (shard.fragment, shard.num_fragments, shard.zigzag) != (self.rank, self.size,
                                                                   self.zigzag):
            raise ValueError(f"the batch is rank {shard.fragment}'s of {shard.num_fragments} "
                             f"(zigzag={shard.zigzag}), but this rank is {self.rank} of "
                             f"{self.size} in its CP group (zigzag={self.zigzag})")
        self.row_segments = shard.row_segments

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] -> [F, ...]: every rank's x, with gradients returned by reduce-scatter."""
        out = funcol.all_gather_single_autograd(x.contiguous(), gather_dim=0, group=self.group)
        return out.view(self.size, *x.shape)

    def gather_pieces(self, x: torch.Tensor) -> torch.Tensor:
        """x [halves * B, ...] (this rank's rows, by local half) -> [pieces, B, ...]: every
        piece's rows in row order."""
        every = self.gather(x)
        if not self.zigzag:
            return every
        # Pieces 0..F-1 are the ranks' early halves in rank order, F..2F-1 their late halves
        # in reverse rank order.
        early, late = every.unflatten(1, (2, -1)).unbind(1)
        return torch.cat([early, late.flip(0)])

    def _segments(self, tokens: int) -> torch.Tensor:
        """The bound rows' document ids, checked against this rank's `tokens` (halves*B*L)."""
        if self.row_segments is None:
            raise RuntimeError("no context-parallel batch bound: call bind(shard) first")
        if self.row_segments.numel() != tokens * self.size:
            raise ValueError(f"{tokens} tokens on this rank do not match the bound rows "
                             f"{list(self.row_segments.shape)} over {self.size} ranks")
        return self.row_segments

    def _own(self, row_segments: torch.Tensor, L: int) -> torch.Tensor:
        """This rank's pieces' document ids [halves * B, L]."""
        return torch.cat([row_segments[:, p * L:(p + 1) * L] for p in self.pieces])

    def conv_halo(self, x: torch.Tensor, segments, width: int):
        """ShortConv.halo: (the `width` inputs before each piece + x, their document ids)."""
        del segments  # the rows' ids also number the inputs before the pieces
        rows, L, _ = x.shape
        if L < width:
            raise ValueError(f"piece length {L} is shorter than the conv halo ({width}): "
                             f"lower parallel.context or raise the sequence length")
        row_segments = self._segments(rows * L)
        B = row_segments.shape[0]
        tails = self.gather_pieces(x[:, L - width:])
        # Nothing is before piece 0: the last piece's tail stands in, masked out by its ids
        # (every rank's graph uses the gathered tails, so every rank joins their backward).
        before = torch.cat([tails[p - 1] for p in self.pieces])
        ids_before = torch.cat([row_segments[:, p * L - width:p * L] if p > 0
                                else row_segments.new_full((B, width), -1) for p in self.pieces])
        ids = torch.cat([ids_before, self._own(row_segments, L)], dim=1)
        return torch.cat([before, x], dim=1), ids

    def kda_exchange(self, kda, q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
        """KimiDeltaAttention.state_exchange: KCP (module docstring)."""
        return self.kda_with_states(kda, q, k, v, g, beta, cu_seqlens)[0]

    def kda_with_states(self, kda, q, k, v, g, beta, cu_seqlens):
        """(o, the state entering each local row's first document [halves * B, H, K, V])."""
        row_segments = self._segments(q.shape[1])
        rows = row_segments.shape[0] * len(self.pieces)
        o, state_map, summary = fragment_summary(kda, q, k, v, g, beta, cu_seqlens, rows)
        continues = fragment_continues(row_segments, self.num_pieces)
        incoming = incoming_states(self.gather_pieces(summary), continues)
        mine = torch.cat([incoming[p] for p in self.pieces])
        return add_incoming_state(o, state_map, mine), mine

    def mla_exchange(self, latent: torch.Tensor):
        """GatedMLA.kv_exchange: the latents of every piece up to this rank's last (causal: the
        later ones are never attended), one set [B, ...] for the rows of all its pieces, and the
        offset attention of each of its pieces over them (a piece's keys are the first of
        those)."""
        rows, L, C = latent.shape
        row_segments = self._segments(rows * L)
        B, last = row_segments.shape[0], max(self.pieces)
        keys = self.gather_pieces(latent)[:last + 1].transpose(0, 1).reshape(B, (last + 1) * L, C)
        attend = functools.partial(_pieces_attention, row_segments=row_segments,
                                   pieces=self.pieces, length=L)
        return keys, attend  # [B, ...]: each piece's queries take the keys of their rows


def _pieces_attention(q, k, v, cu_seqlens, scale, backend, return_max_logit, *, row_segments,
                      pieces, length):
    """doc_causal_attention's signature over gathered keys [B, ...] (one set for the rows of
    every piece), piece by piece (a local half of the query rows each, attending to the keys up
    to its end): the rows' document ids replace the pieces' cu_seqlens; the dense reference
    stays available for tests, every other backend runs blockwise (linear memory)."""
    del cu_seqlens
    B = row_segments.shape[0]
    outs, max_logits = [], []
    for half, piece in enumerate(pieces):
        rows, start, end = slice(half * B, (half + 1) * B), piece * length, (piece + 1) * length
        out = offset_doc_causal_attention(
            q[rows], k[:, :end], v[:, :end], row_segments[:, start:end],
            row_segments[:, :end], start, scale,
            "reference" if backend == "reference" else "blockwise", return_max_logit)
        if return_max_logit:
            out, max_logit = out
            max_logits.append(max_logit)
        outs.append(out)
    out = torch.cat(outs)
    return (out, torch.stack(max_logits).amax(0)) if return_max_logit else out


def apply_context_parallel(model: nn.Module, cp, zigzag: bool | None = None
                           ) -> ContextParallel | None:
    """Fills the model's context-parallel seams (KDA state exchange, conv halo, MLA latent
    gather) for the CP group `cp` (a ProcessGroup, or a Topology, whose "cp" group and
    context_layout are taken). A K3Model then takes ContextShards (shard_batch); a single layer
    needs `bind(shard)` before its forward. `zigzag`: the pieces' layout (None: the Topology's,
    contiguous for a group). Returns None (model unchanged) for a group of one rank."""
    group = cp.group("cp") if hasattr(cp, "group") else cp
    if zigzag is None:
        zigzag = getattr(cp, "context_layout", "contiguous") == "zigzag"
    if dist.get_world_size(group) == 1:
        return None
    context = ContextParallel(group, zigzag)
    for module in model.modules():
        if isinstance(module, ShortConv):
            module.halo = context.conv_halo
        elif isinstance(module, KimiDeltaAttention):
            module.state_exchange = context.kda_exchange
        elif isinstance(module, GatedMLA):
            module.kv_exchange = context.mla_exchange
    if isinstance(model, K3Model):
        model.register_forward_pre_hook(lambda _, args: context.bind(args[0]))
    return context

