"""One padding id for the data pipeline and every model preset, so that the loader's padding never
counts in Quantile Balancing or the MoE load statistics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data_pipeline.tokenizer import IMAGE_ID, PAD_ID
from model.batch import K3Batch
from model.config import PRESETS, k3_small, k3_tiny
from model.k3 import K3Model


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_uses_the_data_pipelines_special_ids(name):
    cfg = PRESETS[name]()
    assert (cfg.pad_token_id, cfg.image_token_id) == (PAD_ID, IMAGE_ID)


def test_loader_padding_is_not_counted_by_quantile_balancing_on_k3_small():
    """k3_small's token ids, vocabulary and routing (48 experts, top-4) on k3_tiny's widths so
    that it runs on a CPU; row 1 ends in 24 positions of the loader's padding."""
    tiny, small = k3_tiny(), k3_small()
    cfg = dataclasses.replace(
        small, hidden_size=tiny.hidden_size, num_layers=2, dense_intermediate=128,
        kda=tiny.kda, mla=tiny.mla, vision=None,
        moe=dataclasses.replace(small.moe, latent_dim=32, expert_intermediate=64)).validate()
    torch.manual_seed(0)
    model = K3Model(cfg)
    b, t, pad = 2, 64, 24
    tokens = torch.randint(5, cfg.vocab_size, (b, t))
    tokens[1, -pad:] = PAD_ID  # what data_pipeline.loader writes after a row's documents
    labels = tokens.roll(-1, dims=1)
    labels[:, -1] = -100
    labels[1, -pad - 1:] = -100
    cu = torch.tensor([0, t, 2 * t - pad, 2 * t])
    model(K3Batch(tokens, labels, cu)).loss_sum.backward()
    (moe,) = model.moe_layers()
    moe.balancer.update()
    load = moe.balancer.load_stats()["tokens_per_expert"]
    assert int(load.sum()) == (b * t - pad) * small.moe.top_k
