"""MoonEP dispatcher: fills the MoE layer's dispatcher seam (model/moe/dispatch.py) across the
expert-parallel ranks, in the latent space, with shapes fixed by (S, K, E, R) alone.

Per micro-batch and layer: one all-gather of every rank's tokens-per-expert and routing (int64),
the same plan on every rank (plan.py), this rank's S*K slots (layout.py), the tokens moved in
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
from parallel.moonep.transport import Transport


@dataclass
class MoonEPDispatched(Dispatched):
    token_of_slot: torch.Tensor  # [N] int64 global token r * S + i of each row (R * S: empty)
    slot_weight: torch.Tensor  # [N] routing weight of each row's entry (0: empty)
    entry_dest: torch.Tensor  # [R, S, K] int64 destination rank of every rank's entries
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
        num_entries = num_tokens * top_k
        ranks, rank = self.transport.size, self.transport.rank
        expert_of_entry = topk_idx.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        counts.index_add_(0, expert_of_entry, torch.ones_like(expert_of_entry))
        # One fixed-size all-gather carries every rank's counts and routing.
        meta = self.transport.all_gather(torch.cat([counts, expert_of_entry]))
        meta = meta.view(ranks, self.num_experts + num_entries)
        plan = plan_moonep(meta[:, :self.num_experts], top_k, self.alignment)
        layout = slot_layout(plan, num_entries)
        dest, slot = entry_slots(plan, layout, meta[:, self.num_experts:])

        # This rank's rows: entry ids scattered to their slots; other ranks' entries go to
        # distinct dump positions past the buffer, so every index is written once.
        all_entries = ranks * num_entries
        entry_ids = torch.arange(all_entries, device=x.device)
        target = torch.where(dest.view(-1) == rank, slot.view(-1), layout.num_slots + entry_ids)
        entry_of_slot = torch.full((layout.num_slots + all_entries,), all_entries,
                                   dtype=torch.long, device=x.device)
        entry_of_slot = entry_of_slot.scatter(0, target, entry_ids)[:layout.num_slots]
        token_of_slot = entry_of_slot // top_k  # the empty marker maps to R * S as well
        weights = torch.cat([self.transport.all_gather(topk_weight).view(-1),
                             topk_weight.new_zeros(1)])
        self._copied_experts = plan.copied_experts
        entry_dest = dest.view(ranks, num_tokens, top_k)
        return MoonEPDispatched(
            buffer=self.transport.dispatch(x, token_of_slot, entry_dest),
            group_ends=layout.group_ends[rank].to(torch.int32),
            slot_of_entry=slot[rank], topk_weight=topk_weight, token_of_slot=token_of_slot,
            slot_weight=weights.index_select(0, entry_of_slot), entry_dest=entry_dest, plan=plan)

    def combine(self, expert_out: torch.Tensor, dispatched: MoonEPDispatched) -> torch.Tensor:
        weight = dispatched.slot_weight
        rows = expert_out.to(combine_dtype(expert_out.dtype, weight.dtype)) * weight[:, None]
        out = self.transport.combine(rows, dispatched.token_of_slot, dispatched.entry_dest)
        return out.to(expert_out.dtype)

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
