"""Router, dispatcher, grouped experts and the LatentMoE layer (SPEC 5) against plain loops."""

import copy
import warnings

import pytest
import torch

from model.activations import situ_glu
from model.config import K3Config, MoEConfig, k3_tiny, replace
from model.moe import LatentMoE, LocalDispatcher, SigmoidRouter, route
from model.norms import rms_norm
from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms, rel_rms

TOKENS, DIM, EXPERTS, TOP_K = 64, 32, 8, 2


def small_config(**moe_changes) -> K3Config:
    moe = dict(num_experts=EXPERTS, top_k=TOP_K, num_shared_experts=1, latent_dim=16,
               expert_intermediate=24, router_scale=1.5)
    moe.update(moe_changes)
    return replace(k3_tiny(), hidden_size=DIM, init_std=0.2, moe=MoEConfig(**moe))


def make_layer(**moe_changes) -> LatentMoE:
    torch.manual_seed(0)
    layer = LatentMoE(small_config(**moe_changes))
    layer.balancer.bias.copy_(torch.randn(EXPERTS) * 0.3)  # the bias must steer selection
    return layer


# ---- router -----------------------------------------------------------------------------------

def test_bias_changes_the_selection_but_not_the_weights():
    router = SigmoidRouter(DIM, EXPERTS, TOP_K, router_scale=2.5, init_std=0.2)
    x = torch.randn(TOKENS, DIM)
    plain = router(x)
    bias = torch.zeros(EXPERTS)
    bias[-1] = 10.0  # every token now takes the last expert
    biased = router(x, bias)
    assert not torch.equal(plain.topk_idx, biased.topk_idx)
    assert (biased.topk_idx[:, 0] == EXPERTS - 1).all()
    assert torch.equal(plain.scores, biased.scores)
    for routing in (plain, biased):
        chosen = routing.scores.gather(1, routing.topk_idx)
        assert_close_rms(chosen / chosen.sum(-1, keepdim=True) * 2.5, routing.topk_weight, 1e-6)
        assert torch.allclose(routing.topk_weight.sum(-1), torch.full((TOKENS,), 2.5))
    # Cutoff: the (k+1)-th largest biased score, just below the weakest selected one.
    ranked = (plain.scores + bias).sort(dim=-1, descending=True).values
    assert torch.equal(biased.cutoff, ranked[:, TOP_K])
    assert (biased.cutoff <= (plain.scores + bias).gather(1, biased.topk_idx).min(-1).values).all()


def test_router_runs_in_fp32_and_passes_gradient_through_the_weights_only():
    router = SigmoidRouter(DIM, EXPERTS, TOP_K, init_std=0.2)
    x = torch.randn(TOKENS, DIM, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(EXPERTS, requires_grad=True)
    routing = router(x, bias)
    assert routing.scores.dtype == torch.float32 and routing.topk_weight.dtype == torch.float32
    (routing.topk_weight * torch.randn(TOKENS, TOP_K)).sum().backward()
    assert router.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0
    assert bias.grad is None


# ---- dispatcher -------------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", [1, 4])
def test_dispatch_groups_slots_by_expert_and_combine_inverts_it(alignment):
    dispatcher = LocalDispatcher(EXPERTS, alignment)
    x = torch.randn(TOKENS, 16)
    scores = torch.rand(TOKENS, EXPERTS)
    routing = route(scores, None, TOP_K)
    out = dispatcher.dispatch(x, routing.topk_idx, routing.topk_weight)
    num_slots = TOKENS * TOP_K + EXPERTS * (alignment - 1)
    assert out.buffer.shape == (num_slots, 16) and out.group_ends.dtype == torch.int32
    ends = out.group_ends.long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
    counts = torch.bincount(routing.topk_idx.reshape(-1), minlength=EXPERTS)
    assert ends[-1] == num_slots
    assert ((starts % alignment) == 0).all() and (ends - starts >= counts).all()
    for expert in range(EXPERTS):
        tokens = (routing.topk_idx == expert).any(-1).nonzero().squeeze(-1)  # ascending: stable
        group = out.buffer[starts[expert]:ends[expert]]
        assert torch.equal(group[:len(tokens)], x[tokens])
        assert (group[len(tokens):] == 0).all()  # alignment padding
    # An identity "expert": the weights of each token sum to router_scale = 1.
    assert_close_rms(x, dispatcher.combine(out.buffer, out), 1e-6, "combine(dispatch(x))")


# ---- the layer against a per-token loop -------------------------------------------------------

def naive_latent_moe(layer: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """For each token, for each selected expert, run that expert's MLP; no dispatch."""
    experts, router = layer.experts, layer.router
    scores = torch.sigmoid(x.float() @ router.weight.float().T)
    selected = (scores + layer.balancer.bias).topk(router.top_k, dim=-1).indices
    latent = x @ layer.latent_down.weight.T
    mixed = []
    for token in range(x.shape[0]):
        chosen = scores[token, selected[token]]
        weights = chosen / chosen.sum() * router.router_scale
        total = torch.zeros(latent.shape[1])
        for weight, expert in zip(weights, selected[token]):
            gate, up = (experts.w1[expert] @ latent[token]).chunk(2)
            total = total + weight * (experts.w2[expert] @ situ_glu(gate, up))
        mixed.append(total)
    normed = rms_norm(torch.stack(mixed), layer.latent_norm.weight, layer.latent_norm.eps)
    return normed @ layer.latent_up.weight.T + layer.shared(x)


def forward_backward(layer, fn, x, grad_out):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("alignment", [1, 4])
def test_dispatched_layer_equals_per_token_loop(alignment):
    layer = make_layer(slot_alignment=alignment)
    loop_layer = copy.deepcopy(layer)
    loop_layer.experts.backend = "loop"
    x, grad_out = torch.randn(TOKENS, DIM), torch.randn(TOKENS, DIM)
    reference = forward_backward(layer, lambda t: naive_latent_moe(layer, t), x, grad_out)
    for candidate in (layer, loop_layer):
        y, x_grad, grads = forward_backward(candidate, candidate, x, grad_out)
        name = candidate.experts.backend
        assert_close_rms(reference[0], y, 1e-5, f"{name}: output")
        assert_close_rms(reference[1], x_grad, 1e-5, f"{name}: input gradient")
        assert set(grads) == set(reference[2])
        for param, grad in grads.items():
            assert grad.abs().sum() > 0, f"{name}: {param} gets no gradient"
            assert_close_rms(reference[2][param], grad, 1e-5, f"{name}: grad of {param}")


def test_bf16_autocast_runs_the_grouped_gemm():
    layer = make_layer()
    x = torch.randn(TOKENS, DIM)
    reference = naive_latent_moe(layer, x).detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop fallback warns
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
    assert y.dtype == torch.bfloat16
    assert_close_rms(reference, y, 2e-2, "bf16 autocast")  # bf16 operands: 8-bit mantissa


def test_unaligned_rows_fall_back_to_the_loop():
    layer = LatentMoE(small_config(latent_dim=18))  # 72-byte rows: grouped_mm refuses them
    x = torch.randn(TOKENS, DIM)
    with pytest.warns(UserWarning, match="per-expert loop"):
        y = layer(x)
    assert_close_rms(naive_latent_moe(layer, x), y, 1e-5, "loop fallback")


def test_fake_quant_seams_apply_to_both_backends():
    def bf16_round(t):
        return t.to(torch.bfloat16).float()

    layer = make_layer()
    x = torch.randn(TOKENS, DIM)
    plain = layer(x).detach()
    layer.experts.weight_fake_quant = bf16_round
    layer.experts.input_fake_quant = bf16_round
    quantised = layer(x).detach()
    loop_layer = copy.deepcopy(layer)
    loop_layer.experts.backend = "loop"
    assert rel_rms(plain, quantised) > 1e-5  # the seams changed the GEMM operands
    assert_close_rms(quantised, loop_layer(x), 1e-6, "fake-quantised grouped vs loop")


def test_layer_shapes_options_and_init():
    layer = LatentMoE(small_config(num_shared_experts=0, balancer="none"))
    assert layer.shared is None and layer.balancer is None
    x = torch.randn(2, 8, DIM)
    assert layer(x).shape == (2, 8, DIM)
    assert list(layer.buffers()) == []
    assert layer.experts.w1.shape == (EXPERTS, 48, 16)
    assert layer.experts.w2.shape == (EXPERTS, 16, 24)
    assert layer.experts.w1.std().item() == pytest.approx(0.2, rel=0.1)
    assert layer.router.weight.std().item() == pytest.approx(0.2, rel=0.2)


def test_layer_feeds_the_balancer_in_training_only_and_skips_padding():
    layer = make_layer()
    start_bias = layer.balancer.bias.clone()
    x = torch.randn(TOKENS, DIM)
    mask = torch.arange(TOKENS) < TOKENS - 8
    layer.eval()
    layer(x, mask)
    layer.balancer.update()
    assert torch.equal(layer.balancer.bias, start_bias)
    layer.train()
    layer(x, mask)
    layer.balancer.update()
    assert not torch.equal(layer.balancer.bias, start_bias)
    assert layer.balancer.load_stats()["tokens_per_expert"].sum() == (TOKENS - 8) * TOP_K


# ---- static shapes ----------------------------------------------------------------------------

@pytest.mark.parametrize("alignment", [1, 4])
def test_forward_backward_static_for_balanced_and_collapsed_routing(alignment):
    def run(bias):
        layer = make_layer(slot_alignment=alignment)
        layer.balancer.bias.copy_(bias)
        x = torch.randn(TOKENS, DIM, requires_grad=True)
        grad_out = torch.randn(TOKENS, DIM)
        rec = record(lambda: layer(x, torch.ones(TOKENS)).backward(grad_out))
        layer.balancer.update()
        return rec, layer.balancer.last_load

    balanced, balanced_load = run(torch.zeros(EXPERTS))
    collapsed_bias = torch.zeros(EXPERTS)
    collapsed_bias[:TOP_K] = 10.0  # every token picks experts 0 and 1
    collapsed, collapsed_load = run(collapsed_bias)
    assert (balanced_load > 0).all()
    assert collapsed_load[:TOP_K].tolist() == [TOKENS] * TOP_K
    assert collapsed_load[TOP_K:].sum() == 0
    assert any("grouped_mm" in op for op, _ in balanced.trace)  # the hot path, not the loop
    assert_static(balanced, collapsed)
