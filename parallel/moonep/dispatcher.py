"""MoonEP dispatcher: fills the MoE layer's dispatcher seam (model/moe/dispatch.py) across the
expert-parallel ranks, in the latent space, with shapes fixed by (S, K, E, R) alone.

Per micro-batch and layer: one all-gather of every rank's tokens-per-expert (int32 [E]), the
same plan on every rank (plan.py), the destination and row of this rank's S*K entries
(layout.py), which entries fill each rank's rows (transport.route), the tokens moved in
(transport.dispatch), the grouped GEMM over E/R home + E/R copy groups, and the weighted results
moved back (transport.combine). The copies' weights come from `group_weights`, which the
experts module calls before its GEMM (GroupedExperts.group_weights seam).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.moe.dispatch import Dispatched, combine_dtype
from parallel.moonep.layout import entry_slots, slot_layout
from parallel.moonep.plan import MoonEPPlan, plan_moonep
from parallel.moonep.transport import Routes, Transport


@dataclass
class MoonEPDispatched(Dispatched):
    routes: Routes
    plan: MoonEPPlan


class MoonEPDispatcher:
    def __init__(self, num_experts: int, transport: Transport, alignment: int = 1):
        if num_experts % transport.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                             f"size {transport.size}")
        self.num_experts = num_experts
        self.transport = transport
        self.alignment = alignment
        self.experts_per_rank = num_experts // transport.size
        # This micro-batch's copy slots of every rank [R, G]: set by dispatch, read by
        # group_weights.
        self._copied_experts: torch.Tensor | None = None

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weight: torch.Tensor) -> MoonEPDispatched:
        num_tokens, top_k = topk_idx.shape
        ranks, rank = self.transport.size, self.transport.rank
        expert_of_entry = topk_idx.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.index_add_(0, expert_of_entry, torch.ones_like(expert_of_entry, dtype=torch.int32))
        # The plan needs every rank's counts only (S*K <= 2^31 entries per rank: int32).
        every_count = self.transport.all_gather(counts).view(ranks, self.num_experts)
        plan = plan_moonep(every_count, top_k, self.alignment)
        layout = slot_layout(plan, num_tokens * top_k)
        dest, slot = entry_slots(plan, layout, expert_of_entry, every_count, rank)
        routes = self.transport.route(dest.view(num_tokens, top_k),
                                      slot.view(num_tokens, top_k), topk_weight,
                                      layout.num_slots)
        self._copied_experts = plan.copied_experts
        return MoonEPDispatched(
            buffer=self.transport.dispatch(x, routes),
            group_ends=layout.group_ends[rank].to(torch.int32),
            slot_of_entry=slot, topk_weight=topk_weight, routes=routes, plan=plan)

    def combine(self, expert_out: torch.Tensor, dispatched: MoonEPDispatched) -> torch.Tensor:
        weight = dispatched.routes.slot_weight
        # Promoted by the multiply (exactly as a cast first), without a cast copy of the rows.
        rows = expert_out * weight[:, None].to(combine_dtype(expert_out.dtype, weight.dtype))
        return self.transport.combine(rows, dispatched.routes).to(expert_out.dtype)

    def group_weights(self, w1: torch.Tensor, w2: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Home experts' (w1, w2) [G, ...] -> the 2G groups' weights: home, then this
        micro-batch's copies (moved in the GEMM's `dtype`, which they are cast to anyway; their
        gradients return in fp32), in the home dtype."""
        if self._copied_experts is None:
            raise RuntimeError("MoonEP: the experts ran before dispatch planned the copy slots")
        copied = self._copied_experts
        fetched = [self.transport.fetch_copies(w, copied, dtype).to(w.dtype) for w in (w1, w2)]
        return torch.cat([w1, fetched[0]]), torch.cat([w2, fetched[1]])
