"""Activation checkpointing changes memory, not numbers: same loss, gradients and QB statistics."""

import pytest
import torch

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny
from model.k3 import K3Model
from tests.helpers.tolerances import assert_close_rms
from train.activation_checkpointing import apply_activation_checkpointing


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    (out.loss_sum / out.num_tokens).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = [m.balancer.local_statistics().clone() for m in model.moe_layers()]
    for m in model.moe_layers():
        m.balancer.update()
    return out.loss_sum.detach(), grads, stats


@pytest.mark.parametrize("forms", ["native", "torch"])
def test_checkpointed_model_matches_plain_model(forms, request):
    """With the native CPU kernels and with the torch forms (what a GPU runs): a recomputed
    layer's backward reads each saved tensor once, as checkpointing demands."""
    if forms == "torch":
        request.getfixturevalue("torch_forms")
    torch.manual_seed(0)
    cfg = k3_tiny()
    plain = K3Model(cfg)
    ckpt = K3Model(cfg)
    ckpt.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(ckpt) == cfg.num_layers
    tokens = torch.randint(5, cfg.vocab_size, (2, 64))
    batch = K3Batch(tokens, tokens.roll(-1, 1), cu_seqlens_from_lengths([[30, 34], [64]], 64))
    for _ in range(2):  # the second step routes with the QB bias of the first
        loss_a, grads_a, stats_a = _step(plain, batch)
        loss_b, grads_b, stats_b = _step(ckpt, batch)
        assert torch.equal(loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert_close_rms(grads_a[name], grads_b[name], 1e-6, name)
        for a, b in zip(stats_a, stats_b):  # recomputation did not count tokens twice
            assert torch.equal(a, b)
    assert set(plain.state_dict()) == set(ckpt.state_dict())


def test_compiled_sublayers_match_eager():
    """compile=true (torch.compile per sublayer; inductor on CPU): same loss and gradients."""
    from train.activation_checkpointing import compile_sublayers

    torch.manual_seed(0)
    cfg = k3_tiny()
    eager = K3Model(cfg)
    compiled = K3Model(cfg)
    compiled.load_state_dict(eager.state_dict())
    compile_sublayers(compiled)
    tokens = torch.randint(5, cfg.vocab_size, (2, 64))
    batch = K3Batch(tokens, tokens.roll(-1, 1), cu_seqlens_from_lengths([[30, 34], [64]], 64))
    loss_e, grads_e, _ = _step(eager, batch)
    loss_c, grads_c, _ = _step(compiled, batch)
    assert_close_rms(loss_e, loss_c, 1e-6, "loss")
    for name in grads_e:  # fused kernels reorder fp32 sums: equal up to rounding
        assert_close_rms(grads_e[name], grads_c[name], 1e-4, name)
