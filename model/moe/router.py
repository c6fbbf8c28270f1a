"""Sigmoid router with a selection-only bias (Eq. 13 of the K3 report)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.dtypes import no_autocast
from model.init import Normal, Rule, reset_


@dataclass
class Routing:
    """The router's decision for S tokens over E experts, top-k."""

    topk_idx: torch.Tensor  # [S, k] int64, experts in order of decreasing biased score
    # [S, k] fp32 (or wider), s_T / sum(s_T) * router_scale; carries the gradient
    topk_weight: torch.Tensor
    scores: torch.Tensor  # [S, E] fp32 (or wider) sigmoid scores, unbiased
    cutoff: torch.Tensor  # [S] fp32, the (k+1)-th largest biased score (Quantile Balancing)


def route(scores: torch.Tensor, bias: torch.Tensor | None, top_k: int,
          router_scale: float = 1.0) -> Routing:
    """Selects top-k of scores + bias; the bias moves the selection, never the weights.

    Top-(k+1) is taken so that the (k+1)-th biased value, the score a token's weakest selected
    expert had to beat, comes out as the token's cutoff.
    """
    biased = scores if bias is None else scores + bias.detach().to(scores.dtype)
    top_values, top_idx = biased.detach().topk(top_k + 1, dim=-1)
    topk_idx = top_idx[:, :top_k]
    selected = scores.gather(1, topk_idx)
    topk_weight = selected / selected.sum(dim=-1, keepdim=True) * router_scale
    return Routing(topk_idx, topk_weight, scores.detach(), top_values[:, top_k])


class SigmoidRouter(nn.Module):
    """s = sigmoid(W_r x) in fp32 (fp64 in a float64 model) on the full-width hidden state;
    weight [E, d]."""

    def __init__(self, dim: int, num_experts: int, top_k: int, router_scale: float = 1.0,
                 init_std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.router_scale = router_scale
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_(self)

    def init_rules(self) -> dict[str, Rule]:
        return {"weight": Normal(self.init_std)}

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> Routing:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or wider for fp64 models
        # fp32 under bf16 autocast too: a near-tie decided in bf16 routes a token elsewhere.
        with no_autocast(x.device.type):
            scores = torch.sigmoid(F.linear(x.to(dtype), self.weight.to(dtype)))
        return route(scores, bias, self.top_k, self.router_scale)
