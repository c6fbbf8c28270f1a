"""Context parallelism: every rank of a CP group holds one contiguous fragment of every row.

Rank f of F holds positions f*L .. (f+1)*L - 1 of each row (L = T / F); documents may start,
end or span several fragments. `shard_batch` cuts a batch into this rank's fragment; the local
cu_seqlens has a boundary at every fragment start, so the unchanged model treats a continued
document as a new one, and three seams the model names (filled by `apply_context_parallel`)
join the pieces again:

- ShortConv.halo: the previous fragment's last kernel-1 inputs are prepended (an autograd
  all-gather of every rank's tail), masked by document ids, so the conv restarts only at real
  document starts.
- KimiDeltaAttention.state_exchange (KCP): the fragment's state is
  affine in the state entering it, S_end = M S_in + S_ext. One pass of kda_chunk over the
  fragment with the values widened to [v | 0] and the first document started from [0 | I]
  gives both: its final state is [S_ext | M] (the value columns of the recurrence are
  independent, and the zero columns carry the identity through the transition product), and
  its output columns [o | P] hold the zero-start output and, per token, the map from the
  incoming state to the output (o_t += S_in^T P_t: the output is linear in S_in). One
  all-gather of [S_ext | M] (fp32); every rank runs the scan S_in_f = c_f (M_{f-1} S_in_{f-1}
  + S_ext_{f-1}) over all fragments, where c_f says whether fragment f starts inside a
  document; M is 0 when the last document started inside the fragment, so a boundary resets the
  chain. kda_chunk picks fla's kernel on CUDA and the torch chunk form elsewhere; both take
  per-document initial states and return per-document final states with gradients.
- GatedMLA.kv_exchange: the compressed latent (kv_lora + rope per token, far smaller than K and
  V) is all-gathered up to this fragment's end; each rank expands K and V itself and its queries
  attend document-causally at their offset (offset_doc_causal_attention).

The collectives are torch's functional all-gather with autograd: the backward reduce-scatters
the gradients to the ranks that produced the inputs. Every rank's graph uses the whole gathered
tensor (the scan runs over all fragments), so every rank joins each backward collective.
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
    fragment: int = 0
    num_fragments: int = 1

    def to(self, device) -> ContextShard:
        return ContextShard(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    @property
    def start(self) -> int:
        """The row position of this fragment's first token."""
        return self.fragment * self.tokens.shape[1]


def _to(value, device):
    return value.to(device) if hasattr(value, "to") else value


def shard_batch(batch: K3Batch, fragment: int, num_fragments: int) -> ContextShard:
    """This rank's fragment (positions fragment*L .. (fragment+1)*L - 1 of every row). Labels are
    already shifted, so each fragment's last label is the next fragment's first token."""
    B, T = batch.tokens.shape
    if T % num_fragments:
        raise ValueError(f"sequence length {T} must be divisible by parallel.context="
                         f"{num_fragments} (each rank holds an equal fragment of every row)")
    L = T // num_fragments
    start = fragment * L
    cu = batch.cu_seqlens
    # Global boundary b*T + t -> local b*L + clamp(t - start, 0, L): the same N + 1 entries
    # (documents outside the fragment become empty), static shapes.
    local_cu = (cu // T) * L + (cu % T - start).clamp(0, L)
    rows = slice(start, start + L)
    return ContextShard(batch.tokens[:, rows], batch.labels[:, rows], local_cu,
                        _fragment_vision(batch.vision, T, start, L),
                        row_segments=segment_ids(cu, B * T).view(B, T), fragment=fragment,
                        num_fragments=num_fragments)


def _fragment_vision(vision: VisionInput | None, T: int, start: int, L: int):
    """Every rank encodes all of the batch's images (their gradients sum over the CP ranks
    like any replicated parameter's) and keeps the output tokens whose placeholders lie in its
    fragment. Runs on the loader's CPU batch before the forward: its host sync is not on the
    model's hot path."""
    if vision is None:
        return None
    rows = vision.output_rows
    if rows is None:
        rows = torch.arange(vision.token_positions.shape[0])
    row, pos = vision.token_positions // T, vision.token_positions % T
    inside = ((pos >= start) & (pos < start + L)).nonzero().squeeze(1)
    local = row * L + pos - start
    return VisionInput(vision.patches, vision.grid_thw, local[inside], rows[inside])


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

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.row_segments: torch.Tensor | None = None

    def bind(self, shard: ContextShard) -> None:
        if not isinstance(shard, ContextShard):
            raise TypeError(f"a context-parallel model takes this rank's fragment of the batch "
                            f"(parallel.context_parallel.shard_batch), got {type(shard).__name__}")
        if (shard.fragment, shard.num_fragments) != (self.rank, self.size):
            raise ValueError(f"the batch is fragment {shard.fragment} of {shard.num_fragments}, "
                             f"but this rank is {self.rank} of {self.size} in its CP group")
        self.row_segments = shard.row_segments

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[...] -> [F, ...]: every rank's x, with gradients returned by reduce-scatter."""
        out = funcol.all_gather_single_autograd(x.contiguous(), gather_dim=0, group=self.group)
        return out.view(self.size, *x.shape)

    def _segments(self, tokens: int) -> torch.Tensor:
        """The bound rows' document ids, checked against the fragment's `tokens` (B*L)."""
        if self.row_segments is None:
            raise RuntimeError("no context-parallel batch bound: call bind(shard) first")
        if self.row_segments.numel() != tokens * self.size:
            raise ValueError(f"a fragment of {tokens} tokens does not match the bound rows "
                             f"{list(self.row_segments.shape)} over {self.size} ranks")
        return self.row_segments

    def conv_halo(self, x: torch.Tensor, segments, width: int):
        """ShortConv.halo: (the `width` inputs before the fragment + x, their document ids)."""
        del segments  # the rows' ids also number the inputs before the fragment
        B, L, _ = x.shape
        if L < width:
            raise ValueError(f"fragment length {L} is shorter than the conv halo ({width}): "
                             f"lower parallel.context or raise the sequence length")
        row_segments = self._segments(B * L)
        before = self.gather(x[:, L - width:])[(self.rank - 1) % self.size]
        start = self.rank * L
        if self.rank == 0:  # nothing before the rows; the last rank's tail is masked out
            ids_before = row_segments.new_full((B, width), -1)
        else:
            ids_before = row_segments[:, start - width:start]
        ids = torch.cat([ids_before, row_segments[:, start:start + L]], dim=1)
        return torch.cat([before, x], dim=1), ids

    def kda_exchange(self, kda, q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
        """KimiDeltaAttention.state_exchange: KCP (module docstring)."""
        return self.kda_with_states(kda, q, k, v, g, beta, cu_seqlens)[0]

    def kda_with_states(self, kda, q, k, v, g, beta, cu_seqlens):
        """(o, the state entering each row's first document [B, H, K, V])."""
        row_segments = self._segments(q.shape[1])
        rows = row_segments.shape[0]
        o, state_map, summary = fragment_summary(kda, q, k, v, g, beta, cu_seqlens, rows)
        continues = fragment_continues(row_segments, self.size)
        incoming = incoming_states(self.gather(summary), continues)[self.rank]
        return add_incoming_state(o, state_map, incoming), incoming

    def mla_exchange(self, latent: torch.Tensor):
        """GatedMLA.kv_exchange: the latents of all fragments up to this one's end (causal: the
        later ones are never attended) and the offset attention over them."""
        B, L, C = latent.shape
        row_segments = self._segments(B * L)
        start = self.rank * L
        keys = self.gather(latent)[: self.rank + 1].transpose(0, 1).reshape(B, start + L, C)
        attend = functools.partial(_fragment_attention, q_segments=row_segments[:, start:start + L],
                                   k_segments=row_segments[:, :start + L], q_offset=start)
        return keys, attend


def _fragment_attention(q, k, v, cu_seqlens, scale, backend, return_max_logit, *, q_segments,
                        k_segments, q_offset):
    """doc_causal_attention's signature over gathered keys: the rows' document ids replace the
    fragment's cu_seqlens; the dense reference stays available for tests, every other backend
    runs blockwise (linear memory)."""
    del cu_seqlens
    return offset_doc_causal_attention(q, k, v, q_segments, k_segments, q_offset, scale,
                                       "reference" if backend == "reference" else "blockwise",
                                       return_max_logit)


def apply_context_parallel(model: nn.Module, cp) -> ContextParallel | None:
    """Fills the model's context-parallel seams (KDA state exchange, conv halo, MLA latent
    gather) for the CP group `cp` (a ProcessGroup, or a Topology's "cp" group). A K3Model then
    takes ContextShards (shard_batch); a single layer needs `bind(shard)` before its forward.
    Returns None (model unchanged) for a group of one rank."""
    group = cp.group("cp") if hasattr(cp, "group") else cp
    if dist.get_world_size(group) == 1:
        return None
    context = ContextParallel(group)
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

