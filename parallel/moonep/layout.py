"""Slot layout per rank: E/R home-expert groups, then E/R copy groups, each padded to
the alignment, in one buffer of S*K + 2*(E/R)*(alignment - 1) rows whatever the routing.

Entry order is fixed so that every rank derives the same slots: the entries of expert e are
numbered by source rank, then token, then top-k position (a prefix sum over source ranks), and
that sequence is cut into the ranks computing e in ascending rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.moonep.plan import MoonEPPlan


@dataclass
class SlotLayout:
    group_counts: torch.Tensor  # [R, 2G] int64 entries per group (G = E/R home, then G copies)
    group_ends: torch.Tensor  # [R, 2G] int64 padded end offsets; the last is num_slots
    num_slots: int

    @property
    def group_starts(self) -> torch.Tensor:
        return torch.cat([torch.zeros_like(self.group_ends[:, :1]), self.group_ends[:, :-1]], 1)


def num_slots(num_entries: int, experts_per_rank: int, alignment: int) -> int:
    """Static buffer rows per rank for S*K = num_entries."""
    return num_entries + 2 * experts_per_rank * (alignment - 1)


def copy_group_of(plan: MoonEPPlan) -> torch.Tensor:
    """[E, R] int64: the copy group (0..G-1) of expert e on rank d, -1 if e is not copied there."""
    num_experts, num_ranks = plan.alloc.shape
    per_rank = plan.experts_per_rank
    device = plan.alloc.device
    out = torch.full((num_experts + 1, num_ranks), -1, dtype=torch.long, device=device)
    # Unused slots (-1) write into the extra row num_experts, dropped below.
    rows = torch.where(plan.copied_experts >= 0, plan.copied_experts,
                       torch.full_like(plan.copied_experts, num_experts))
    groups = torch.arange(per_rank, device=device).expand(num_ranks, per_rank)
    ranks = torch.arange(num_ranks, device=device)[:, None].expand(num_ranks, per_rank)
    out[rows, ranks] = groups
    return out[:num_experts]


def slot_layout(plan: MoonEPPlan, num_entries: int) -> SlotLayout:
    """Group sizes and padded offsets of every rank's buffer (device tensors)."""
    num_experts, num_ranks = plan.alloc.shape
    per_rank = plan.experts_per_rank
    device = plan.alloc.device
    rank_ids = torch.arange(num_ranks, device=device)
    home_counts = plan.alloc.view(num_ranks, per_rank, num_ranks)[rank_ids, :, rank_ids]
    safe = plan.copied_experts.clamp(min=0)
    copy_counts = plan.alloc[safe, rank_ids[:, None]] * (plan.copied_experts >= 0)
    counts = torch.cat([home_counts, copy_counts], dim=1)
    align = plan.alignment
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(1)
    total = num_slots(num_entries, per_rank, align)
    ends[:, -1] = total  # the last group absorbs the unused tail: every row is in a group
    return SlotLayout(counts, ends, total)


def _exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.cumsum(dim) - x


def entry_slots(plan: MoonEPPlan, layout: SlotLayout, experts_of_entries: torch.Tensor,
                tokens_per_expert: torch.Tensor,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts_of_entries [S*K] (source rank `rank`'s topk_idx, flattened row-major),
    tokens_per_expert [R, E] (every rank's counts, as planned) -> (destination rank, buffer row
    on that rank), both [S*K] int64. Only this rank's entries are sorted: the entries of other
    ranks enter through their counts."""
    num_ranks, num_experts = tokens_per_expert.shape
    num_entries = experts_of_entries.shape[0]
    per_rank = plan.experts_per_rank
    device = experts_of_entries.device
    expert = experts_of_entries.long()
    counts = tokens_per_expert.long()
    # Rank of each entry among its expert's entries on its source rank (stable sort by expert).
    order = torch.argsort(expert, stable=True)
    run_start = _exclusive_cumsum(counts[rank], 0).index_select(0, expert.index_select(0, order))
    rank_in_source = torch.empty_like(order).scatter_(
        0, order, torch.arange(num_entries, device=device) - run_start)
    # ... then among all its expert's entries, source ranks in ascending order.
    global_index = _exclusive_cumsum(counts, 0)[rank].index_select(0, expert) + rank_in_source

    # Destination: the first rank whose cut of the expert's sequence ends past the entry. One
    # searchsorted over every expert's cut ends, each row offset past the previous one's.
    cut_ends = plan.alloc.cumsum(1)  # [E, R]
    row_offset = num_ranks * num_entries + 1  # above any entry count
    offsets = torch.arange(num_experts, device=device)[:, None] * row_offset
    position = torch.searchsorted((cut_ends + offsets).view(-1),
                                  expert * row_offset + global_index, right=True)
    dest = position - expert * num_ranks
    index_in_rank = global_index - (cut_ends - plan.alloc)[expert, dest]
    home = expert // per_rank
    is_home = home == dest
    copy_group = copy_group_of(plan)[expert, dest]
    group = torch.where(is_home, expert - home * per_rank, per_rank + copy_group)
    start = layout.group_starts[dest, group]
    return dest, start + index_in_rank
