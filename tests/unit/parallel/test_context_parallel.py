"""Context parallelism in one process: the batch sharder, the KDA state math of KCP (fragments
composed by the scan against kda_recurrent over whole rows) and k3-train's check of the context
size. tests/distributed/test_context_parallel.py runs the layers and the model in gloo worlds."""

from __future__ import annotations

import functools

import pytest
import torch

from model.batch import VisionInput, segment_ids
from model.ops.kda import kda_chunk, kda_recurrent
from parallel.context_parallel import (
    add_incoming_state,
    fragment_continues,
    fragment_summary,
    incoming_states,
    shard_batch,
)
from tests.helpers.context_parallel_helpers import (
    STATE_TOL,
    T,
    kda_inputs,
    make_batch,
    recurrent_states_entering,
)
from tests.helpers.tolerances import assert_close_rms

# ---- the sharder ----

def test_shard_batch_cuts_every_row_and_rebases_the_documents():
    batch = make_batch()
    shards = [shard_batch(batch, f, 4) for f in range(4)]
    assert torch.equal(torch.cat([s.tokens for s in shards], 1), batch.tokens)
    assert torch.equal(torch.cat([s.labels for s in shards], 1), batch.labels)
    # Each fragment's documents are the whole rows' documents cut at the fragment's edges.
    global_seg = segment_ids(batch.cu_seqlens, 2 * T).view(2, T)
    for s in shards:
        local = segment_ids(s.cu_seqlens, 2 * 32).view(2, 32)
        cut = global_seg[:, s.start:s.start + 32]
        assert torch.equal(local[:, 1:] != local[:, :-1], cut[:, 1:] != cut[:, :-1])
        assert s.cu_seqlens.shape == batch.cu_seqlens.shape  # static: N + 1 boundaries
        assert torch.equal(s.row_segments, global_seg)
    continues = fragment_continues(global_seg, 4)
    # row 0 starts documents at 64 and 96; row 1's document 31..97 continues into 32 and 64.
    assert continues.tolist() == [[False, False], [True, True], [False, True], [False, True]]


def test_shard_batch_keeps_the_vision_tokens_of_its_fragment():
    batch = make_batch()
    positions = torch.tensor([5, 30, 31, 32, 33, 130, 200, 255])  # flattened over 2 x 128
    batch.vision = VisionInput(torch.zeros(1, 1), torch.ones(1, 3, dtype=torch.long), positions)
    seen = []
    for f in range(4):
        s = shard_batch(batch, f, 4)
        local = s.vision.token_positions
        back = (local // 32) * T + local % 32 + s.start  # local flattened -> global flattened
        assert torch.equal(back, positions[s.vision.output_rows])
        seen += s.vision.output_rows.tolist()
    assert sorted(seen) == list(range(len(positions)))


def test_zigzag_pieces_balance_the_causal_work_and_keep_every_token():
    """Under zig-zag CP4 every row is cut into 8 pieces of 16 and rank f holds pieces f and 7-f
    as its rows b and 2 + b: together the ranks hold every token and label once, each piece's
    documents are the rows' cut at its edges, the vision tokens land in the rows of their
    pieces, and every rank's queries attend to as many keys (the pieces' ends: (f+1) + (8-f)
    pieces), where contiguous fragments give the last rank 4x the first's."""
    batch = make_batch()
    positions = torch.tensor([5, 30, 31, 32, 33, 130, 200, 255])  # flattened over 2 x 128
    batch.vision = VisionInput(torch.zeros(1, 1), torch.ones(1, 3, dtype=torch.long), positions)
    global_seg = segment_ids(batch.cu_seqlens, 2 * T).view(2, T)
    tokens, seen, work = torch.full_like(batch.tokens, -1), [], []
    for f in range(4):
        s = shard_batch(batch, f, 4, zigzag=True)
        assert s.pieces == (f, 7 - f) and s.tokens.shape == (4, 16)
        local = segment_ids(s.cu_seqlens, 4 * 16).view(4, 16)
        for half, piece in enumerate(s.pieces):
            cols = slice(piece * 16, (piece + 1) * 16)
            rows = slice(2 * half, 2 * half + 2)
            tokens[:, cols] = s.tokens[rows]
            assert torch.equal(s.labels[rows], batch.labels[:, cols])
            cut = global_seg[:, cols]
            assert torch.equal(local[rows, 1:] != local[rows, :-1], cut[:, 1:] != cut[:, :-1])
        row, pos = s.vision.token_positions // 16, s.vision.token_positions % 16
        piece = torch.tensor(s.pieces)[row // 2]
        assert torch.equal((row % 2) * T + piece * 16 + pos, positions[s.vision.output_rows])
        seen += s.vision.output_rows.tolist()
        work.append(sum(p + 1 for p in s.pieces))
    assert torch.equal(tokens, batch.tokens)
    assert sorted(seen) == list(range(len(positions)))
    assert work == [9, 9, 9, 9]
    contiguous = [shard_batch(batch, f, 4).start // 32 + 1 for f in range(4)]
    assert contiguous == [1, 2, 3, 4]


def test_shard_batch_rejects_what_it_cannot_split():
    with pytest.raises(ValueError, match="parallel.context=3"):
        shard_batch(make_batch(), 0, 3)
    with pytest.raises(ValueError, match="divisible by 6: parallel.context=3 ranks each hold 2"):
        shard_batch(make_batch(), 0, 3, zigzag=True)


def test_k3_train_validates_the_context_size():
    from model.config import ConfigError
    from train.config import ParallelConfig, TrainConfig, validate_train_config

    cfg = TrainConfig(parallel=ParallelConfig(context=2))
    assert validate_train_config(cfg, 2) is cfg
    cfg.stage.seq_len = 126  # 2 zig-zag pieces on each of 2 ranks
    with pytest.raises(ConfigError, match=r"stage.seq_len=126 is invalid: must be divisible by 4: "
                                          r"2 piece\(s\) on each of context=2 ranks"):
        validate_train_config(cfg, 2)
    cfg.parallel.context_layout = "contiguous"
    assert validate_train_config(cfg, 2) is cfg
    cfg.stage.seq_len = 127
    with pytest.raises(ConfigError, match="stage.seq_len=127 is invalid: must be divisible by 2"):
        validate_train_config(cfg, 2)


# ---- KCP state math in one process ----

@pytest.mark.parametrize("gate, bound", [("lower_bound", -5.0), ("kimi_linear", None)])
@pytest.mark.parametrize("F", [2, 4])
def test_fragments_composed_by_the_scan_equal_the_recurrence(gate, bound, F):
    inputs = kda_inputs(gate=gate)
    batch = make_batch()
    flat = [x.reshape(1, 2 * T, *x.shape[2:]) for x in inputs]
    o_ref, _ = kda_recurrent(*flat, cu_seqlens=batch.cu_seqlens)
    do = torch.randn_like(o_ref)
    ref_grads = torch.autograd.grad((o_ref * do).sum(), inputs)

    kda = functools.partial(kda_chunk, chunk_size=16, backend="torch", lower_bound=bound)
    L = T // F
    shards = [shard_batch(batch, f, F) for f in range(F)]
    parts = []
    for s in shards:
        local = [x[:, s.start:s.start + L].reshape(1, 2 * L, *x.shape[2:]) for x in inputs]
        parts.append(fragment_summary(kda, *local, s.cu_seqlens, rows=2))
    incoming = incoming_states(torch.stack([p[2] for p in parts]),
                               fragment_continues(shards[0].row_segments, F))
    assert_close_rms(recurrent_states_entering(inputs, batch.cu_seqlens, F)[1:], incoming[1:],
                     STATE_TOL, "incoming states")
    assert incoming[0].abs().max() == 0
    o = torch.cat([add_incoming_state(o0, p, s_in).view(2, L, *o0.shape[2:])
                   for (o0, p, _), s_in in zip(parts, incoming)], dim=1)
    o = o.reshape(o_ref.shape)
    assert_close_rms(o_ref, o, STATE_TOL, "o")
    grads = torch.autograd.grad((o * do).sum(), inputs)
    for name, ref, got in zip(("dq", "dk", "dv", "dg", "dbeta"), ref_grads, grads):
        assert_close_rms(ref, got, 0.008 if name in "dq dk dv" else 0.02, name)


# ---- one spawned world of 4 ranks ----
