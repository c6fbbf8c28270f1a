"""The index arithmetic both MoonEP transports share (parallel/moonep/exchange.py) against plain
Python loops, on random and extreme sends (one process)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.moonep.exchange import (
    block_rows,
    pack_index,
    receive_rows,
    tokens_received,
    tokens_sent,
)

shapes = st.tuples(st.integers(1, 5), st.integers(1, 9), st.integers(0, 2**16))


def random_sent(peers: int, items: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    density = [0.0, 1.0, 0.5][seed % 3]  # nothing, everything, half
    return (torch.rand(peers, items, generator=gen) < density).long()


def block_order(sent: torch.Tensor) -> list[tuple[int, int]]:
    """(peer, item) of every sent item, blocks by peer, items ascending: the buffer layout."""
    return [(p, i) for p in range(sent.shape[0]) for i in range(sent.shape[1]) if sent[p, i]]


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_pack_and_receive_rows_follow_the_block_layout(shape):
    peers, items, seed = shape
    sent = random_sent(peers, items, seed)
    order = block_order(sent)
    source_row = torch.arange(peers * items).view(peers, items) * 7 + 3  # any labels
    capacity = peers * items
    packed = pack_index(sent, source_row, capacity, empty_row=-5).tolist()
    assert packed == [int(source_row[p, i]) for p, i in order] + [-5] * (capacity - len(order))
    rows = block_rows(sent)
    for row, (p, i) in enumerate(order):
        assert rows[p, i] == row
    peer = torch.arange(peers).repeat_interleave(items, output_size=peers * items)
    item = torch.arange(items).repeat(peers)
    got = receive_rows(sent, peer, item, sent.view(-1) > 0, empty_row=99).tolist()
    want = [order.index((p, i)) if sent[p, i] else 99 for p in range(peers) for i in range(items)]
    assert got == want


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 3), st.integers(0, 2**16))
def test_tokens_travel_once_to_each_rank_holding_an_entry(ranks, tokens, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    entry_dest = torch.randint(0, ranks, (ranks, tokens, top_k), generator=gen)
    if seed % 2:  # every entry of every rank on rank 0
        entry_dest.zero_()
    for rank in range(ranks):
        # What rank computes: the global token of each entry sent to it (a token may repeat).
        token_of_entry = (torch.arange(ranks * tokens)[:, None]
                          .expand(-1, top_k)[entry_dest.view(-1, top_k) == rank])
        sent = tokens_sent(entry_dest[rank], ranks)
        received = tokens_received(token_of_entry, ranks, tokens)
        for d in range(ranks):
            for i in range(tokens):
                assert sent[d, i] == int(d in entry_dest[rank, i].tolist())
                assert received[d, i] == int(rank in entry_dest[d, i].tolist())


def test_route_indices_widen_only_past_int32():
    """The routing exchange's indices are int32 while every index fits, int64 beyond."""
    from parallel.moonep.transport import index_dtype

    assert index_dtype(2**31) == torch.int32  # indices 0 .. 2**31 - 1
    assert index_dtype(2**31 + 1) == torch.int64
    assert torch.tensor(2**31 - 1).to(index_dtype(2**31)).item() == 2**31 - 1
