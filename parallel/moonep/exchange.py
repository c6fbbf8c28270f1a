"""Where every row sits in MoonEP's exchanges: the index and offset arithmetic that both
transports share (transport.py), computed on device with shapes fixed by (S, K, E, R).

An exchange moves items (latent token rows, expert weights) from each source rank to each
destination rank. `sent` [R, n] (int, 0/1) says which of n items go to (or come from) each
peer. A buffer holds the sent items block by block, peers in rank order, items in item order:
`block_rows(sent)` is each item's row there. The collective transport sends every item to
every rank (its token all-gather and its relay of every expert's pieces: `sent` all ones, rows =
global ids); the symmetric-memory transport sends a token once to each rank holding one of its
entries.
"""

from __future__ import annotations

import torch


def block_rows(sent: torch.Tensor) -> torch.Tensor:
    """[R, n] 0/1 -> [R, n] int64: row of item (peer, i) in the block-by-block buffer (rows of
    items not sent are meaningless: mask them with `sent`)."""
    return sent.reshape(-1).long().cumsum(0).view(sent.shape) - 1


def pack_index(sent: torch.Tensor, source_row: torch.Tensor, capacity: int,
               empty_row: int) -> torch.Tensor:
    """sent [R, n] 0/1 what this rank sends each destination; source_row [R, n] the local row
    holding item (d, i) -> [capacity] int64 local row of each row of the send buffer; rows past
    the sent items read empty_row (a zero row the caller appends)."""
    peers, items = sent.shape
    flat = torch.arange(peers * items, device=sent.device)
    # Unsent items go to distinct dump positions past the buffer, so every index is written once.
    target = torch.where(sent.reshape(-1) > 0, block_rows(sent).reshape(-1), capacity + flat)
    order = torch.full((capacity + peers * items,), peers * items, dtype=torch.long,
                       device=sent.device).scatter(0, target, flat)[:capacity]
    table = torch.cat([source_row.reshape(-1).long(), source_row.new_full((1,), empty_row)])
    return table.index_select(0, order)


def receive_rows(received: torch.Tensor, peer: torch.Tensor, item: torch.Tensor,
                 valid: torch.Tensor, empty_row: int) -> torch.Tensor:
    """received [R, n] 0/1 the items each source sends this rank; per wanted row its (peer,
    item) and whether it is wanted at all -> its row in the receive buffer, or empty_row (the
    caller's zero row past the buffer) where not valid."""
    peers, items = received.shape
    rows = block_rows(received)[peer.clamp(0, peers - 1), item.clamp(0, items - 1)]
    return torch.where(valid, rows, empty_row)


def tokens_sent(dest: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """dest [S, K] destination rank of this rank's entries -> [R, S] int64: 1 where this
    rank's token i has at least one entry on rank d (it travels once to each such rank)."""
    hit = torch.zeros(dest.shape[0], num_ranks, dtype=torch.long, device=dest.device)
    return hit.scatter(1, dest.long(), 1).T


def tokens_received(token_of_entry: torch.Tensor, num_ranks: int,
                    num_tokens: int) -> torch.Tensor:
    """token_of_entry [n] global token r * S + i of each entry this rank computes -> [R, S]
    int64: 1 where source r's token i has an entry here."""
    hit = torch.zeros(num_ranks * num_tokens, dtype=torch.long, device=token_of_entry.device)
    return hit.scatter(0, token_of_entry.long(), 1).view(num_ranks, num_tokens)


def token_rows(token_of_slot: torch.Tensor, received: torch.Tensor,
               empty_row: int) -> torch.Tensor:
    """token_of_slot [N] global token r * S + i of each buffer row (R * S: empty); received
    [R, S] -> [N] row of each slot's token in the receive buffer (empty_row for empty slots)."""
    num_tokens = received.shape[1]
    return receive_rows(received, token_of_slot // num_tokens, token_of_slot % num_tokens,
                        token_of_slot < received.numel(), empty_row)
