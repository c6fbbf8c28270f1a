"""The MoonEP planner: which rank computes how many entries of which expert.

Every EP rank routes S tokens to K experts each, so it holds S*K (token, expert) entries and
should compute exactly S*K entries. Expert e is homed on rank e // (E/R); a home rank whose
experts drew more than S*K entries (overloaded) exports whole runs of one expert's entries to
underloaded ranks, which compute them on copies of that expert (at most E/R copy slots per rank).

Two phases, both greedy with static trip counts so that the device version runs the same
kernels for any routing:
1. Rank fills (at most R-1): the most loaded rank h gives the least loaded rank d exactly d's
   deficit, after which d is full. A filled rank is never touched again, so each receiver's
   imported entries come from one home rank. (h may give more than its excess and become a
   receiver itself later; it never gives more than it holds.)
2. Expert-wise migration, per home rank: the largest outstanding quota is served from the local
   expert with the most remaining entries, min(quota, remaining) at a time; each round empties a
   quota or an expert, so (R-1) + E/R rounds always suffice. What remains stays home.
Ties go to the lowest index (torch.argmax / argmin and `index` below agree), so every rank
computes the same plan from the same all-gathered counts.

`plan_moonep` is the device version, `plan_reference` the plain Python one it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoonEPPlan:
    alloc: torch.Tensor  # [E, R] int64: entries of expert e computed on rank d
    copied_experts: torch.Tensor  # [R, E // R] int64: copy slots, ascending, -1 where unused
    source_rank: torch.Tensor  # [R] int64: home rank a rank imports from, -1 if none
    top_k: int
    alignment: int

    @property
    def experts_per_rank(self) -> int:
        return self.alloc.shape[0] // self.alloc.shape[1]


def check_plan_inputs(num_experts: int, num_ranks: int, top_k: int, alignment: int) -> None:
    """Shape-level validation (host ints only, no tensor values)."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel "
                         f"size {num_ranks}: choose parallel.expert dividing the expert count")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} is invalid: must be in [1, {num_experts}]")
    if alignment < 1:
        raise ValueError(f"alignment={alignment} is invalid: must be >= 1")


def plan_moonep(tokens_per_expert: torch.Tensor, top_k: int, alignment: int = 1) -> MoonEPPlan:
    """tokens_per_expert int64 [R, E] (every row sums to S*K) -> the plan, on its device."""
    num_ranks, num_experts = tokens_per_expert.shape
    check_plan_inputs(num_experts, num_ranks, top_k, alignment)
    per_rank = num_experts // num_ranks
    device = tokens_per_expert.device
    counts = tokens_per_expert.long()
    per_expert = counts.sum(0)  # [E] entries of each expert over all ranks
    capacity = counts[0].sum()  # S*K
    rank_ids = torch.arange(num_ranks, device=device)

    # Phase 1: rank fills. quota[h, d] = entries home rank h hands to rank d.
    level = per_expert.view(num_ranks, per_rank).sum(1)
    quota = torch.zeros(num_ranks, num_ranks, dtype=torch.long, device=device)
    for _ in range(num_ranks - 1):
        # One-hot arithmetic, not tensor indexing: a 0-d index tensor is read on the host.
        is_giver = rank_ids == level.argmax()
        is_taker = rank_ids == level.argmin()
        amount = capacity - (level * is_taker).sum()
        level = level - amount * is_giver + amount * is_taker
        quota += amount * (is_giver[:, None] & is_taker[None, :])

    # Phase 2: per home rank (all at once), largest quota from the fullest local expert.
    remaining = per_expert.view(num_ranks, per_rank).clone()
    moved = torch.zeros(num_ranks, per_rank, num_ranks, dtype=torch.long, device=device)
    local_ids = torch.arange(per_rank, device=device)
    for _ in range(num_ranks - 1 + per_rank):
        taker = quota.argmax(1, keepdim=True)  # [R, 1]
        expert = remaining.argmax(1, keepdim=True)  # [R, 1]
        amount = torch.minimum(quota.gather(1, taker), remaining.gather(1, expert))  # [R, 1]
        quota = quota - amount * (rank_ids == taker)
        remaining = remaining - amount * (local_ids == expert)
        moved += (amount[:, :, None] * (local_ids[None, :, None] == expert[:, :, None])
                  * (rank_ids[None, None, :] == taker[:, :, None]))
    alloc = moved.view(num_experts, num_ranks)
    home = torch.arange(num_experts, device=device) // per_rank
    alloc = alloc + remaining.view(num_experts, 1) * (home[:, None] == rank_ids[None, :])

    # Copy slots: the experts a rank computes but does not own, ascending (one home rank each).
    imported = (alloc > 0) & (home[:, None] != rank_ids[None, :])  # [E, R]
    expert_ids = torch.arange(num_experts, device=device)
    key = torch.where(imported.T, expert_ids, expert_ids + num_experts)  # [R, E]
    first = key.sort(dim=1).values[:, :per_rank]
    copied = torch.where(first < num_experts, first, torch.full_like(first, -1))
    source = torch.where(copied[:, 0] >= 0, copied[:, 0].clamp(min=0) // per_rank,
                         torch.full_like(copied[:, 0], -1))
    return MoonEPPlan(alloc, copied, source, top_k, alignment)


def _first_argmax(values: list[int]) -> int:
    return values.index(max(values))


def plan_reference(tokens_per_expert: list[list[int]], top_k: int,
                   alignment: int = 1) -> dict[str, list]:
    """The same plan in plain Python: {"alloc": [E][R], "copied_experts": [R][E/R],
    "source_rank": [R]}."""
    num_ranks, num_experts = len(tokens_per_expert), len(tokens_per_expert[0])
    check_plan_inputs(num_experts, num_ranks, top_k, alignment)
    per_rank = num_experts // num_ranks
    per_expert = [sum(row[e] for row in tokens_per_expert) for e in range(num_experts)]
    capacity = sum(tokens_per_expert[0])
    level = [sum(per_expert[h * per_rank:(h + 1) * per_rank]) for h in range(num_ranks)]
    quota = [[0] * num_ranks for _ in range(num_ranks)]
    for _ in range(num_ranks - 1):
        giver = _first_argmax(level)
        taker = level.index(min(level))
        amount = capacity - level[taker]
        level[giver] -= amount
        level[taker] += amount
        quota[giver][taker] += amount

    alloc = [[0] * num_ranks for _ in range(num_experts)]
    for h in range(num_ranks):
        remaining = per_expert[h * per_rank:(h + 1) * per_rank]
        while max(quota[h]) > 0:
            taker = _first_argmax(quota[h])
            local = _first_argmax(remaining)
            amount = min(quota[h][taker], remaining[local])
            if amount == 0:
                raise AssertionError(f"home rank {h} owes more entries than it holds")
            quota[h][taker] -= amount
            remaining[local] -= amount
            alloc[h * per_rank + local][taker] += amount
        for local, left in enumerate(remaining):
            alloc[h * per_rank + local][h] += left

    copied, source = [], []
    for d in range(num_ranks):
        mine = [e for e in range(num_experts) if alloc[e][d] > 0 and e // per_rank != d]
        copied.append(mine + [-1] * (per_rank - len(mine)))
        source.append(mine[0] // per_rank if mine else -1)
    return {"alloc": alloc, "copied_experts": copied, "source_rank": source}
