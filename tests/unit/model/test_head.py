"""The LM head's chunked linear + cross entropy equals the full-logits loss and its gradients."""

import pytest
import torch
import torch.nn.functional as F

from model.batch import K3Batch, cu_seqlens_from_lengths
from model.config import k3_tiny, replace
from model.head import (
    IGNORE_INDEX,
    _log_sum_exp_,
    chunked_linear_cross_entropy,
    full_logits_loss,
)
from model.k3 import K3Model
from tests.helpers.tolerances import assert_close_rms


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])  # one row, uneven tail, exact, one chunk
def test_chunked_loss_and_gradients_equal_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 64, 24, 300
    hidden = torch.randn(2, n // 2, d, generator=g, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, n // 2), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -3:] = IGNORE_INDEX

    ref = full_logits_loss(F.linear(hidden, weight), labels)
    ref_grads = torch.autograd.grad(ref * 0.37, (hidden, weight))
    loss = chunked_linear_cross_entropy(hidden, weight, labels, chunk)
    grads = torch.autograd.grad(loss * 0.37, (hidden, weight))

    assert loss.dtype == torch.float32
    assert_close_rms(ref, loss, 1e-6, "loss")
    assert_close_rms(ref_grads[0], grads[0], 1e-6, "hidden gradient")
    assert_close_rms(ref_grads[1], grads[1], 1e-6, "weight gradient")
    assert torch.all(grads[0][0, :5] == 0)  # ignored tokens get no gradient


@pytest.mark.parametrize("chunk", [7, 1000])
def test_weighted_tokens_chunked_and_full_equal_the_weighted_sum(chunk):
    """Per-token loss weights (per-conversation averaging): both paths give sum_t w_t CE_t
    and its gradients, float64."""
    g = torch.Generator().manual_seed(1)
    n, d, vocab = 40, 16, 200
    hidden = torch.randn(2, n // 2, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (2, n // 2), generator=g)
    labels[0, :4] = IGNORE_INDEX
    weights = torch.rand(2, n // 2, generator=g, dtype=torch.float64)
    per_token = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none")
    ref = (per_token * weights.reshape(-1)).sum()
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    for loss in (full_logits_loss(F.linear(hidden, weight), labels, weights),
                 chunked_linear_cross_entropy(hidden, weight, labels, chunk, weights)):
        grads = torch.autograd.grad(loss, (hidden, weight))
        assert_close_rms(ref, loss, 1e-12, "weighted loss")
        assert_close_rms(ref_grads[0], grads[0], 1e-12, "hidden gradient")
        assert_close_rms(ref_grads[1], grads[1], 1e-12, "weight gradient")


def test_per_document_weights_average_each_documents_mean_loss():
    """K3Batch.loss_weights of 1 / (a document's loss tokens): the model's loss over its loss
    units is the mean over documents of each document's mean token loss."""
    torch.manual_seed(0)
    model = K3Model(replace(k3_tiny(), vision=None)).double()
    tokens = torch.randint(5, 2048, (2, 32))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    labels[0, 9] = labels[0, 30:] = IGNORE_INDEX  # each document's last position: no target
    docs = [(0, 0, 10), (0, 10, 32), (1, 0, 32)]  # (row, start, stop)
    weights = torch.zeros(2, 32, dtype=torch.float64)
    for row, start, stop in docs:
        weights[row, start:stop] = 1.0 / int((labels[row, start:stop] != IGNORE_INDEX).sum())
    batch = K3Batch(tokens, labels, cu_seqlens_from_lengths([[10, 22], [32]], 32),
                    loss_weights=weights)
    out = model(batch, return_logits=True)
    per_token = F.cross_entropy(out.logits.flatten(0, 1), labels.reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="none").view(2, 32)
    means = [per_token[r, a:b][labels[r, a:b] != IGNORE_INDEX].mean() for r, a, b in docs]
    assert float(out.num_tokens) == pytest.approx(3.0)
    assert_close_rms(torch.stack(means).mean(), out.loss_sum / out.num_tokens, 1e-12, "loss")


def test_chunked_loss_of_only_ignored_tokens_is_zero():
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    labels = torch.full((6,), IGNORE_INDEX)
    loss = chunked_linear_cross_entropy(hidden, weight, labels, 4)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.all(hidden.grad == 0) and torch.all(weight.grad == 0)


def test_in_place_log_sum_exp_matches_logsumexp():
    """The chunked loss's in-place log-sum-exp (one logits buffer, no temporaries, exp as exp2)
    against torch.logsumexp in float64: within one epsilon of the result in fp32 and float64
    (torch.logsumexp's own fp32 error on these rows is 7.4e-7 of values about 20), and the same
    infinities for rows with an infinite maximum and all -inf rows."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g, dtype=torch.float64) * 7
    logits[1, 5] = torch.inf
    logits[2] = -torch.inf
    logits[3, :4] = -torch.inf
    for dtype in (torch.float32, torch.float64):
        x = logits.to(dtype)
        out = torch.empty(6, dtype=dtype)
        _log_sum_exp_(x.clone(), out=out)
        ref = torch.logsumexp(x.double(), -1)
        finite = ref.isfinite()
        assert finite.sum() == 4 and torch.equal(out[~finite].double(), ref[~finite]), dtype
        error = (out[finite].double() - ref[finite]).abs()
        assert torch.all(error <= torch.finfo(dtype).eps * ref[finite].abs()), (dtype, error)


def test_chunked_loss_of_low_precision_inputs_widens_their_logits():
    """bf16 hidden and weight (autocast's matmul dtype): the logits are computed in bf16 and
    widened to fp32, as F.linear(...).float() is, and the gradients come back in bf16."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(50, 16, generator=g) * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (40,), generator=g)
    ref = full_logits_loss(F.linear(hidden, weight), labels)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    loss = chunked_linear_cross_entropy(hidden, weight, labels, 16)
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert loss.dtype == torch.float32
    assert_close_rms(ref, loss, 1e-6, "loss")
    for ref_grad, grad in zip(ref_grads, grads):
        assert grad.dtype == torch.bfloat16
        # bf16 rounding of a different summation order: 0 and 2.6e-3 measured.
        assert_close_rms(ref_grad.float(), grad.float(), 1e-2, "bf16 gradient")


def test_model_loss_and_gradients_chunked_equal_full_logits():
    """k3_tiny, packed documents and ignored labels: loss_chunk_tokens=24 against 0 (full)."""
    torch.manual_seed(0)
    full = K3Model(replace(k3_tiny(), loss_chunk_tokens=0))
    chunked = K3Model(replace(k3_tiny(), loss_chunk_tokens=24))
    chunked.load_state_dict(full.state_dict())
    tokens = torch.randint(5, 2048, (2, 64))
    labels = tokens.roll(-1, 1)
    labels[:, -1] = IGNORE_INDEX
    batch = K3Batch(tokens, labels, cu_seqlens_from_lengths([[30, 34], [64]], 64))
    outputs = {}
    for name, model in (("full", full), ("chunked", chunked)):
        out = model(batch)
        (out.loss_sum / out.num_tokens).backward()
        outputs[name] = out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert_close_rms(outputs["full"][0], outputs["chunked"][0], 1e-6, "loss")
    for name, grad in outputs["full"][1].items():
        if grad is None:  # the vision tower (no images here)
            assert outputs["chunked"][1][name] is None, name
            continue
        # The head's gradients are the Function's own outputs: 1e-6. Below it, its input
        # gradient (equal to 1e-7, fp32 rounding of a different summation order) passes
        # through 8 layers whose small, cancelling parameter gradients (A_h, AttnRes queries)
        # amplify that rounding to ~1e-6 relative.
        tol = 1e-6 if name.startswith("head.") else 1e-5
        assert_close_rms(grad, outputs["chunked"][1][name], tol, name)
    # return_logits still gives the logits, with the same loss.
    out = chunked(batch, return_logits=True)
    assert out.logits.shape == (2, 64, 2048) and out.logits.dtype == torch.float32
    assert_close_rms(outputs["full"][0], out.loss_sum.detach(), 1e-6, "loss with logits")


@pytest.mark.timeout(120)
def test_full_logits_path_takes_vocab_sharded_dtensor_logits_under_loss_parallel():
    """The seam vocabulary-parallel cross entropy uses: head.output colwise (logits sharded on
    the vocabulary dim, kept as DTensors), chunk_tokens = 0, loss under loss_parallel. One gloo
    rank: the DTensor dispatch path itself, against the chunked loss of a plain model."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    from tests.helpers.train_helpers import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = replace(k3_tiny(), vision=None)
        plain = K3Model(cfg)
        sharded = K3Model(cfg)
        sharded.load_state_dict(plain.state_dict())
        parallelize_module(sharded.head, init_device_mesh("cpu", (1,)), {
            "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        sharded.head.chunk_tokens = 0
        tokens = torch.randint(5, cfg.vocab_size, (2, 64))
        batch = K3Batch(tokens, tokens.roll(-1, 1), cu_seqlens_from_lengths([[30, 34], [64]], 64))
        ref = plain(batch).loss_sum
        ref.backward()
        with loss_parallel():
            loss = sharded(batch).loss_sum
            loss.backward()
        assert_close_rms(ref, loss.full_tensor(), 1e-6, "loss")
        assert_close_rms(plain.head.output.weight.grad,
                         sharded.head.output.weight.grad.full_tensor(), 1e-6, "head gradient")
        dist.barrier()
    finally:
        dist.destroy_process_group()
