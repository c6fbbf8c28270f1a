"""How MoonEP moves data between expert-parallel ranks: one small interface, two transports.

Every call has shapes fixed by (S, K, E, R) alone, never by the routing, so no rank needs to
know on the host how much it will receive. Each rank computes the destination and slot of its
own S*K entries (layout.entry_slots); `route` tells every rank which entries fill its slots.
Where each row goes is computed by the shared functions of exchange.py, so the two transports
differ only in what they move.

- `CollectiveTransport` (portable: gloo, NCCL; the reference and the CPU/CI path): routes by an
  all-gather of every entry's destination and slot (int32) and routing weight, tokens by an
  all-gather of the latent rows and a local selection, results by a local scatter-add and a
  reduce-scatter, copied weights by two equal-split all-to-alls of 1/R of every expert each
  (piece j of every home expert to rank j, then from each rank j piece j of the experts each
  rank copies): about 2 (E/R) experts received per rank instead of an all-gather's E, shapes
  still fixed. The weights travel in the GEMM's dtype (bf16 under autocast: the values the
  GEMM would cast them to); the backward returns the copies' gradients to the owners the same
  way in fp32 (or wider), summed there.
- `SymmMemTransport` (CUDA with NVSHMEM, torch symmetric memory): O(S*K) per rank whatever R:
  each entry's token id, slot and routing weight to the rank computing it, each token once to
  each rank holding one of its entries, results back the same way, all with
  `symm_mem.all_to_all_vdev`, whose split sizes are device tensors (no host sync), into static
  buffers of the worst-case size. Copied weights take the collective relay's two steps, moving
  only the pieces of experts some rank copies: sent directly, a home rank's static send buffer
  would have to hold every rank's copy of its experts (up to E experts: each rank imports from
  one home rank, possibly the same), the relay's hold 2 E/R.
  Written against the collective transport's tests; not yet run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from parallel.moonep.exchange import (
    pack_index,
    receive_rows,
    token_rows,
    tokens_received,
    tokens_sent,
)

# exchange(x [C_in, ...], rows_to_each_peer [R] int64, rows_out) -> [rows_out, ...]: the rows
# each source sends this rank, block by block in source order, then zeros.
Exchange = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Routes:
    """Which entries fill this rank's N buffer rows, and which tokens travel where."""
    token_of_slot: torch.Tensor  # [N] int64 global token r * S + i of each row (R * S: empty)
    slot_weight: torch.Tensor  # [N] routing weight of each row's entry (0: empty)
    sent: torch.Tensor  # [R, S] int64 0/1: this rank's token i travels to rank d
    received: torch.Tensor  # [R, S] int64 0/1: source r's token i travels here
    top_k: int


class Transport(Protocol):
    group: dist.ProcessGroup
    rank: int
    size: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [R * n, ...], rank-major, differentiable (small metadata)."""

    def route(self, dest: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
              num_slots: int) -> Routes:
        """dest, slot [S, K] int64 the destination rank and buffer row of this rank's entries,
        weight [S, K] their routing weights (differentiable) -> this rank's Routes."""

    def dispatch(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        """x [S, L] this rank's tokens -> buffer [N, L]. Differentiable in x."""

    def combine(self, rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        """rows [N, L] (weighted expert outputs) -> [S, L]: for each of this rank's tokens the
        sum over all ranks of the rows whose token it is. Differentiable."""

    def fetch_copies(self, home: torch.Tensor, copied_experts: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """home [G, ...] this rank's experts' weights; copied_experts [R, G] every rank's copy
        slots' global expert ids (-1 unused) -> [G, ...] this rank's copies in fp32 or wider
        (zeros where unused), their values rounded to and moved in `dtype` (default home's).
        Backward returns each copy's gradient, in fp32 or wider, to its owner, summed, added to
        the home gradient."""


def copy_piece(numel: int, ranks: int) -> int:
    """Elements of one expert weight each rank relays in the collective copy exchange."""
    return -(-numel // ranks)


def index_dtype(bound: int) -> torch.dtype:
    """The narrowest exact integer type for indices below `bound` (a host int of the shapes)."""
    return torch.int32 if bound <= 2**31 else torch.int64


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])


def _copy_dtype(home: torch.Tensor) -> torch.dtype:
    return torch.promote_types(home.dtype, torch.float32)


class CollectiveTransport:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_single_autograd(x, 0, self.group))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.reduce_scatter_single_autograd(x, "sum", 0, self.group))

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """[R * n, ...] -> [R * n, ...]: block d to rank d, block j from rank j (equal splits).
        Not differentiable: its transpose is itself (see `_Moved`)."""
        return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None,
                                                           self.group))

    def _everything(self, per_rank: int, device: torch.device) -> torch.Tensor:
        """The all-gather's `sent`: every rank's every item reaches every rank."""
        return torch.ones(self.size, per_rank, dtype=torch.long, device=device)

    def route(self, dest: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
              num_slots: int) -> Routes:
        num_tokens, top_k = dest.shape
        all_entries = self.size * num_tokens * top_k
        # Every entry's (destination, row) as one integer: int32 while R * N rows fit.
        code = (dest * num_slots + slot).view(-1).to(index_dtype(self.size * num_slots))
        where = self.all_gather(code).long()
        weights = torch.cat([self.all_gather(weight.reshape(-1)), weight.new_zeros(1)])
        # This rank's rows: entry ids scattered to their slots; other ranks' entries go to
        # distinct dump positions past the buffer, so every index is written once.
        entry_ids = torch.arange(all_entries, device=dest.device)
        mine = where // num_slots == self.rank
        target = torch.where(mine, where % num_slots, num_slots + entry_ids)
        entry_of_slot = torch.full((num_slots + all_entries,), all_entries, dtype=torch.long,
                                   device=dest.device).scatter(0, target, entry_ids)[:num_slots]
        everything = self._everything(num_tokens, dest.device)
        return Routes(token_of_slot=entry_of_slot // top_k,  # the empty marker maps to R * S
                      slot_weight=weights.index_select(0, entry_of_slot),
                      sent=everything, received=everything, top_k=top_k)

    def dispatch(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        rows = token_rows(routes.token_of_slot, routes.received, routes.received.numel())
        return _with_zero_row(self.all_gather(x)).index_select(0, rows)

    def combine(self, rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        num_global = routes.received.numel()
        per_token = rows.new_zeros(num_global + 1, rows.shape[-1]).index_add(
            0, token_rows(routes.token_of_slot, routes.received, num_global), rows)
        return self.reduce_scatter(per_token[:num_global])

    def fetch_copies(self, home: torch.Tensor, copied_experts: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        per_rank, ranks = home.shape[0], self.size
        flat = home.to(_copy_dtype(home)).reshape(per_rank, -1)
        relay = (self.all_to_all, self.all_to_all, dtype or home.dtype)
        numel = flat.shape[1]
        piece = copy_piece(numel, ranks)
        # 1: piece j of each of this rank's experts to rank j -> piece `rank` of every expert.
        pieces = F.pad(flat, (0, piece * ranks - numel)).view(per_rank, ranks, piece)
        every_piece = _Moved.apply(pieces.transpose(0, 1).reshape(ranks * per_rank, piece),
                                   *relay)
        # 2: to each rank d this rank's piece of each expert d copies (unused slots send
        # expert 0, zeroed below) -> piece j of this rank's copies from each rank j.
        everything = self._everything(per_rank, home.device)
        rows = receive_rows(everything, copied_experts // per_rank, copied_experts % per_rank,
                            copied_experts >= 0, 0)
        got = _Moved.apply(every_piece.index_select(0, rows.reshape(-1)), *relay)
        copies = got.view(ranks, per_rank, piece).transpose(0, 1).reshape(per_rank, -1)
        used = (copied_experts[self.rank] >= 0)[:, None]
        return (copies[:, :numel] * used).reshape(home.shape)


class _Moved(torch.autograd.Function):
    """x rounded to `dtype` and moved by `forward` (copied weights travel in the GEMM's dtype
    though kept wide for the sums of their gradients), the result in x's dtype; the gradient
    moved back by `backward` (the transpose of `forward`) in x's own dtype, unrounded."""

    @staticmethod
    def forward(ctx, x, forward, backward, dtype):
        ctx.backward_move = backward
        return forward(x.to(dtype)).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_move(grad.contiguous()), None, None, None


def _exchanged(x: torch.Tensor, send_splits: torch.Tensor, recv_splits: torch.Tensor,
               rows_out: int, exchange: Exchange, dtype: torch.dtype | None = None):
    """exchange() forward (in `dtype`, default x's); backward sends the gradients back along
    the same rows."""
    rows_in = x.shape[0]
    return _Moved.apply(x, lambda t: exchange(t, send_splits, rows_out),
                        lambda g: exchange(g, recv_splits, rows_in), dtype or x.dtype)


def symm_mem_unavailable() -> str | None:
    """Why the symm_mem transport cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "needs CUDA (torch symmetric memory); torch.cuda.is_available() is False"
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        return ("needs NVSHMEM for all_to_all_vdev; "
                "torch.distributed._symmetric_memory.is_nvshmem_available() is False")
    return None


class NvshmemExchange:
    """`Exchange` over symm_mem.all_to_all_vdev: static symmetric buffers per shape (made, and
    rendezvoused, on first use in the same order on every rank), split sizes on the device."""

    def __init__(self, group: dist.ProcessGroup):
        import torch.distributed._symmetric_memory as symm_mem

        self.symm_mem = symm_mem
        self.group_name = group.group_name
        self.size = dist.get_world_size(group)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None:
            if self.symm_mem.get_backend(device) != "NVSHMEM":
                self.symm_mem.set_backend("NVSHMEM")
            buffer = self.symm_mem.empty(shape, dtype=dtype, device=device)
            self.symm_mem.rendezvous(buffer, self.group_name)
            self._buffers[key] = buffer
        return buffer

    def __call__(self, x: torch.Tensor, send_splits: torch.Tensor,
                 rows_out: int) -> torch.Tensor:
        width = x[0].numel()
        key = (x.shape[0], rows_out, width, x.dtype)
        source = self._buffer(("in", *key), (x.numel(),), x.dtype, x.device)
        target = self._buffer(("out", *key), (rows_out * width,), x.dtype, x.device)
        splits = self._buffer(("splits", *key), (self.size,), torch.long, x.device)
        offsets = self._buffer(("offsets", *key), (2, self.size), torch.long, x.device)
        source.copy_(x.reshape(-1))
        splits.copy_(send_splits * width)  # 1-D buffers: splits in elements
        torch.ops.symm_mem.all_to_all_vdev(source, target, splits, offsets, self.group_name)
        received = offsets[0].sum() // width
        out = target.view(rows_out, width)
        # A fresh tensor, its tail (rows no source sent) zeroed: the buffers are reused.
        live = torch.arange(rows_out, device=x.device)[:, None] < received
        return torch.where(live, out, 0).view(rows_out, *x.shape[1:])


class FakeGroupExchange:
    """`Exchange` on torch's fake process group (dry runs): hands the static send buffer to
    one all-to-all, as all_to_all_vdev is handed it, and returns the static receive buffer
    (the fake group moves no data; split sizes that keep every row here give the shapes)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def __call__(self, x: torch.Tensor, send_splits: torch.Tensor,
                 rows_out: int) -> torch.Tensor:
        def here(rows: int) -> list[int]:
            return [rows if peer == self.rank else 0 for peer in range(self.size)]

        return funcol.wait_tensor(funcol.all_to_all_single(
            x.contiguous(), here(rows_out), here(x.shape[0]), self.group))


def symm_mem_exchange(group: dist.ProcessGroup) -> Exchange:
    """NVSHMEM's all_to_all_vdev, or on the fake process group its stand-in."""
    if dist.get_backend(group) == "fake":
        return FakeGroupExchange(group)
    return NvshmemExchange(group)


class SymmMemTransport(CollectiveTransport):
    """Routes, tokens and results by `exchange` (NVSHMEM's all_to_all_vdev by default, its
    stand-in on the fake process group; tests pass an equivalent over gloo); the plan's counts
    stay an all-gather."""

    def __init__(self, group: dist.ProcessGroup, exchange: Exchange | None = None):
        super().__init__(group)
        self.exchange = exchange if exchange is not None else symm_mem_exchange(group)

    def route(self, dest: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
              num_slots: int) -> Routes:
        # Each entry to the rank computing it: its global token and row there (int32), and its
        # routing weight. Every rank computes exactly S*K entries, so every received row is one.
        num_tokens, top_k = dest.shape
        entries = num_tokens * top_k
        order = torch.argsort(dest.view(-1), stable=True)  # this rank's entries only
        send_splits = torch.zeros(self.size, dtype=torch.long, device=dest.device).index_add_(
            0, dest.view(-1), torch.ones_like(order))
        token = self.rank * num_tokens + torch.arange(entries, device=dest.device) // top_k
        meta = torch.stack([token, slot.view(-1)], 1).index_select(0, order).to(
            index_dtype(max(self.size * num_tokens, num_slots)))
        got = self.exchange(meta, send_splits, entries).long()
        recv_splits = torch.zeros_like(send_splits).index_add_(
            0, got[:, 0] // num_tokens, torch.ones_like(order))
        weights = _exchanged(weight.reshape(-1).index_select(0, order), send_splits,
                             recv_splits, entries, self.exchange)
        entry_of_slot = torch.full((num_slots,), entries, dtype=torch.long,
                                   device=dest.device).scatter(0, got[:, 1], torch.arange(
                                       entries, device=dest.device))
        empty = torch.tensor([self.size * num_tokens], device=dest.device)
        return Routes(token_of_slot=torch.cat([got[:, 0], empty]).index_select(0, entry_of_slot),
                      slot_weight=_with_zero_row(weights).index_select(0, entry_of_slot),
                      sent=tokens_sent(dest, self.size),
                      received=tokens_received(got[:, 0], self.size, num_tokens),
                      top_k=top_k)

    @staticmethod
    def _capacity(routes: Routes) -> int:
        """Rows of either token buffer: a rank sends a token to at most min(K, R) ranks and
        receives at most its S*K entries' tokens, at most S from each of the R ranks; the
        worst case whatever the routing (the symmetric buffers are allocated once)."""
        return routes.sent.shape[1] * min(routes.top_k, routes.sent.shape[0])

    def dispatch(self, x: torch.Tensor, routes: Routes) -> torch.Tensor:
        sent, received, rows = routes.sent, routes.received, self._capacity(routes)
        local = torch.arange(x.shape[0], device=x.device).expand_as(sent)
        packed = _with_zero_row(x).index_select(0, pack_index(sent, local, rows, x.shape[0]))
        got = _exchanged(packed, sent.sum(1), received.sum(1), rows, self.exchange)
        return _with_zero_row(got).index_select(0, token_rows(routes.token_of_slot, received,
                                                              rows))

    def combine(self, rows: torch.Tensor, routes: Routes) -> torch.Tensor:
        sent, received, capacity = routes.sent, routes.received, self._capacity(routes)
        num_tokens = sent.shape[1]
        per_row = rows.new_zeros(capacity + 1, rows.shape[-1]).index_add(
            0, token_rows(routes.token_of_slot, received, capacity), rows)[:capacity]
        back = _exchanged(per_row, received.sum(1), sent.sum(1), capacity, self.exchange)
        local = torch.arange(num_tokens, device=rows.device).expand_as(sent)
        return rows.new_zeros(num_tokens + 1, rows.shape[-1]).index_add(
            0, pack_index(sent, local, capacity, num_tokens), back)[:num_tokens]

    def fetch_copies(self, home: torch.Tensor, copied_experts: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
        """The collective relay's two steps, moving only the pieces of experts some rank copies
        (static buffers of the relay's size; the bytes follow the plan)."""
        per_rank, ranks = home.shape[0], self.size
        flat = home.to(_copy_dtype(home)).reshape(per_rank, -1)
        numel = flat.shape[1]
        piece = copy_piece(numel, ranks)
        device, moved_dtype = home.device, dtype or home.dtype
        capacity = ranks * per_rank
        # copied[h, g]: 1 where home rank h's expert g is in some rank's copy slots.
        slots = copied_experts.reshape(-1)
        copied = torch.zeros(ranks * per_rank + 1, dtype=torch.long, device=device).index_fill(
            0, torch.where(slots >= 0, slots, ranks * per_rank), 1)[:-1].view(ranks, per_rank)
        # 1: piece j of each copied home expert to rank j -> from each home h, piece `rank` of
        # its copied experts, in expert order.
        pieces = F.pad(flat, (0, piece * ranks - numel)).view(per_rank * ranks, piece)
        sent = copied[self.rank].expand(ranks, -1)
        expert_piece = (torch.arange(per_rank, device=device) * ranks
                        + torch.arange(ranks, device=device)[:, None])  # row of (j, g)
        packed = _with_zero_row(pieces).index_select(
            0, pack_index(sent, expert_piece, capacity, per_rank * ranks))
        relayed = _exchanged(packed, sent.sum(1), copied.sum(1), capacity, self.exchange,
                             moved_dtype)
        # 2: to each rank d the pieces (`rank`) of the experts in d's used slots -> from each
        # rank j, piece j of this rank's copies, in slot order.
        used = (copied_experts >= 0).long()
        source = receive_rows(copied, copied_experts.clamp(min=0) // per_rank,
                              copied_experts.clamp(min=0) % per_rank, used > 0, capacity)
        packed = _with_zero_row(relayed).index_select(
            0, pack_index(used, source, capacity, capacity))
        mine = used[self.rank].expand(ranks, -1)
        got = _exchanged(packed, used.sum(1), mine.sum(1), capacity, self.exchange,
                         moved_dtype)
        rows = receive_rows(mine, torch.arange(ranks, device=device).expand(per_rank, -1),
                            torch.arange(per_rank, device=device)[:, None].expand(-1, ranks),
                            mine.T > 0, capacity)  # [G, R]: slot s's piece j
        copies = _with_zero_row(got).index_select(0, rows.reshape(-1)).view(per_rank, -1)
        return copies[:, :numel].reshape(home.shape)
