"""k3-plan's activation count (modules traced on the meta device) against the bytes a real
forward saves for backward (saved-tensor hooks), with and without activation checkpointing."""

import pytest
import torch

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny, replace
from model.k3 import K3Model
from train.activation_checkpointing import apply_activation_checkpointing
from train.plan import saved_after_forward
from train.saved_activations import SavedBytes, measure_saved_bytes


def _batch(cfg, rows, seq_len):
    tokens = torch.randint(5, cfg.vocab_size, (rows, seq_len))
    lengths = [[seq_len // 3, seq_len - seq_len // 3]] + [[seq_len]] * (rows - 1)
    return K3Batch(tokens, tokens.roll(-1, 1), cu_seqlens_from_lengths(lengths, seq_len))


@pytest.mark.parametrize("seq_len", [256, 1024])
def test_plan_counts_what_the_forward_saves(seq_len):
    torch.manual_seed(0)
    cfg = replace(k3_tiny(), vision=None)
    batch = _batch(cfg, 2, seq_len)
    measured = {}
    for checkpointing in (False, True):
        model = K3Model(cfg).to(torch.bfloat16)  # the plan counts bf16 activations
        if checkpointing:
            apply_activation_checkpointing(model)
        measured[checkpointing] = measure_saved_bytes(model, batch)
        planned, _ = saved_after_forward(cfg, seq_len, 2, cfg.num_layers, checkpointing)
        ratio = planned / measured[checkpointing]
        assert 0.9 <= ratio <= 1.1, (checkpointing, planned, measured[checkpointing])
    # Whole layers, depth mixes included, are recomputed: checkpointing keeps under 1/20.
    assert measured[True] * 20 < measured[False], measured


def test_saved_bytes_count_each_storage_once_and_skip_parameters():
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with SavedBytes([weight]) as saved:
        y = x @ weight  # saves x and weight (a parameter: not counted)
        (y * y).sum()  # saves y twice: one storage
    assert saved.bytes == x.nbytes + y.nbytes
