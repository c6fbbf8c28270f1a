"""The dispatcher seam: moves (token, expert) entries into per-expert slot groups and back.

The MoE layer only calls `dispatch` and `combine`; expert parallelism replaces
`LatentMoE.dispatcher` with an object that has the same two methods and moves the slots across
ranks (MoonEP). Contract:

- `dispatch(x, topk_idx, topk_weight) -> Dispatched`: `buffer` [N, L] holds one row per slot,
  grouped by expert in the order of the expert GEMM's groups; `group_ends` [G] int32 is the end
  offset of each group (the grouped GEMM's `offs`), with group_ends[-1] == N so that no buffer
  row is left outside a group. Empty slots are zero rows. N and G never depend on the routing.
- `combine(expert_out [N, L], dispatched) -> [S, L]`: sum_j topk_weight[i, j] * expert output
  of entry (i, j), differentiable in `expert_out` and `topk_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Dispatched:
    buffer: torch.Tensor  # [N, L] expert inputs, grouped by expert
    group_ends: torch.Tensor  # [G] int32 cumulative end offset of each expert group
    slot_of_entry: torch.Tensor  # [S * k] int64 buffer row of entry (i, j), row-major
    topk_weight: torch.Tensor  # [S, k] routing weights, applied in combine


def combine_dtype(out_dtype: torch.dtype, weight_dtype: torch.dtype) -> torch.dtype:
    """Weighted sums of expert outputs run in fp32, or wider for a wider model dtype."""
    return torch.promote_types(torch.promote_types(out_dtype, weight_dtype), torch.float32)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) - x


class LocalDispatcher:
    """Single-rank dispatch: a stable sort of the S*k entries by expert into a fixed buffer of
    S*k + E*(slot_alignment - 1) rows, each expert's group padded to a multiple of
    slot_alignment. Group sizes come from an index_add on device: no host sync."""

    def __init__(self, num_experts: int, slot_alignment: int = 1):
        self.num_experts = num_experts
        self.slot_alignment = slot_alignment

    def num_slots(self, num_entries: int) -> int:
        return num_entries + self.num_experts * (self.slot_alignment - 1)

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weight: torch.Tensor) -> Dispatched:
        num_tokens, k = topk_idx.shape
        expert_of_entry = topk_idx.reshape(-1)
        num_entries = expert_of_entry.numel()
        device = x.device
        tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long, device=device)
        tokens_per_expert.index_add_(0, expert_of_entry, torch.ones_like(expert_of_entry))
        align = self.slot_alignment
        group_sizes = (tokens_per_expert + align - 1) // align * align
        group_starts = _exclusive_cumsum(group_sizes)
        group_ends = group_starts + group_sizes
        num_slots = self.num_slots(num_entries)
        # The last group absorbs the unused tail so that every row belongs to some group.
        group_ends[-1] = num_slots

        # Entries sorted by expert; an entry's rank inside its expert's run becomes its slot.
        order = torch.argsort(expert_of_entry, stable=True)
        sorted_expert = expert_of_entry[order]
        rank_in_group = (torch.arange(num_entries, device=device)
                         - _exclusive_cumsum(tokens_per_expert)[sorted_expert])
        slot_of_entry = torch.empty_like(order)
        slot_of_entry[order] = group_starts[sorted_expert] + rank_in_group

        # Each token's row k times, in entry order: an expand, whose backward sums over k (an
        # index by token would scatter-add in backward, which is slower on CPU).
        entries = x.unsqueeze(1).expand(num_tokens, k, x.shape[-1]).reshape(num_entries, -1)
        buffer = x.new_zeros(num_slots, x.shape[-1]).index_copy(0, slot_of_entry, entries)
        return Dispatched(buffer, group_ends.to(torch.int32), slot_of_entry, topk_weight)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        weight = dispatched.topk_weight
        num_tokens, k = weight.shape
        per_entry = expert_out.index_select(0, dispatched.slot_of_entry)
        per_entry = per_entry.view(num_tokens, k, -1).to(combine_dtype(expert_out.dtype,
                                                                       weight.dtype))
        return (per_entry * weight[..., None]).sum(dim=1).to(expert_out.dtype)
