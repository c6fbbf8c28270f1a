"""What the context-parallel tests share (tests/unit/parallel/test_context_parallel.py in one
process, tests/distributed/test_context_parallel.py in gloo worlds): the rows and their
documents, batches and KDA inputs over them, the recurrence's states at fragment starts, and
the tolerances."""

from __future__ import annotations

import torch

from model.batch import K3Batch, cu_seqlens_from_lengths, segment_ids
from model.head import IGNORE_INDEX
from model.kda import kda_gate
from model.ops.kda import kda_recurrent

T = 128
# Documents that start exactly on a fragment edge (64, 96), end just after one (67) or just
# before one (31: the conv halo crosses a boundary), and one that spans whole fragments
# (31..97 covers fragments 1 and 2 of CP4).
ROWS = [[64, 3, 29, 32], [31, 66, 31]]
STATE_TOL = 5e-3  # KDA states and outputs against the recurrence (fla's convention)
EXACT_TOL = 1e-9  # a float64 parallel layout against one process on the same chunk form


def make_batch(rows=ROWS, seq_len=T, seed=0, vocab=2048) -> K3Batch:
    """Random tokens; labels are the next token of the same document (-100 at each end)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, vocab, (len(rows), seq_len), generator=gen)
    cu = cu_seqlens_from_lengths(rows, seq_len)
    seg = segment_ids(cu, tokens.numel()).view_as(tokens)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    same = seg[:, 1:] == seg[:, :-1]
    labels[:, :-1] = torch.where(same, tokens[:, 1:], IGNORE_INDEX)
    return K3Batch(tokens, labels, cu)


def kda_inputs(B=2, H=2, K=16, V=24, gate="lower_bound", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    # The gate near its slow end: states carry across fragments with a visible size.
    g = kda_gate(torch.randn(B, T, H, K, generator=gen) - 4, torch.zeros(H), gate, -5.0)
    beta = torch.rand(B, T, H, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def recurrent_states_entering(inputs, cu, F):
    """[F, B, H, K, V]: the recurrence's state of each row's document at each fragment start."""
    B = inputs[0].shape[0]
    L = T // F
    seg = segment_ids(cu, B * T).view(B, T)
    states = []
    for f in range(F):
        per_row = []
        for b in range(B):
            begin = int((seg[b] == seg[b, f * L]).nonzero()[0]) if f else f * L
            pieces = [x.detach()[b:b + 1, begin:f * L] for x in inputs]
            if f == 0 or pieces[0].shape[1] == 0:
                per_row.append(torch.zeros(inputs[0].shape[2], inputs[0].shape[3],
                                           inputs[2].shape[3]))
            else:
                per_row.append(kda_recurrent(*pieces, output_final_state=True)[1][0])
        states.append(torch.stack(per_row))
    return torch.stack(states)
