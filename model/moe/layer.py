"""Stable LatentMoE (Eq. 11 of the K3 report): routed experts in a narrower latent space plus shared
experts at full width."""

from __future__ import annotations

import torch
from torch import nn

from model.config import K3Config
from model.mlp import SiTUGLUMLP
from model.moe.balancing import QuantileBalancer
from model.moe.dispatch import LocalDispatcher
from model.moe.experts import GroupedExperts
from model.moe.router import SigmoidRouter
from model.norms import RMSNorm


class LatentMoE(nn.Module):
    """y = Shared(x) + W_up RMSNorm(sum_{j in T} p_j E_j(W_down x)).

    The router and the shared experts see the full-width x; the routed experts see the latent
    z = W_down x. `self.dispatcher` is the expert-parallel seam (see model/moe/dispatch.py);
    `self.balancer` (None with balancer "none") owns the router bias and its statistics.
    """

    def __init__(self, cfg: K3Config):
        super().__init__()
        moe = cfg.moe
        dim, latent, std = cfg.hidden_size, moe.latent_dim, cfg.init_std
        self.router = SigmoidRouter(dim, moe.num_experts, moe.top_k, moe.router_scale, std)
        self.balancer = (QuantileBalancer(moe.num_experts, moe.top_k, moe.qb_estimator,
                                          moe.qb_bins)
                         if moe.balancer == "quantile" else None)
        self.latent_down = nn.Linear(dim, latent, bias=False)
        self.experts = GroupedExperts(moe.num_experts, latent, moe.expert_intermediate,
                                      cfg.situ_beta_gate, cfg.situ_beta_up, std, moe.dispatch)
        self.latent_norm = RMSNorm(latent, cfg.norm_eps)
        self.latent_up = nn.Linear(latent, dim, bias=False)
        for linear in (self.latent_down, self.latent_up):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        self.shared = (SiTUGLUMLP(dim, moe.num_shared_experts * moe.expert_intermediate,
                                  cfg.situ_beta_gate, cfg.situ_beta_up, std)
                       if moe.num_shared_experts > 0 else None)
        self.dispatcher = LocalDispatcher(moe.num_experts, moe.slot_alignment)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., d] (flattened to S tokens), token_mask [...] non-zero for tokens that count
        in Quantile Balancing (padding: 0). Returns [..., d]."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        bias = None if self.balancer is None else self.balancer.bias
        routing = self.router(x, bias)
        if self.balancer is not None:
            self.balancer.accumulate(routing, token_mask)
        dispatched = self.dispatcher.dispatch(self.latent_down(x), routing.topk_idx,
                                              routing.topk_weight)
        expert_out = self.experts(dispatched.buffer, dispatched.group_ends)
        latent = self.dispatcher.combine(expert_out, dispatched)
        y = self.latent_up(self.latent_norm(latent))
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)
