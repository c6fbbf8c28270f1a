"""The dynamic expert-parallel baseline (`parallel.expert_dispatch=dynamic`), for comparison
only: entries sorted by destination rank and moved with `all_to_all_single`, whose split sizes
are read on the host, as Megatron's alltoall dispatcher and torchtitan's default do. Every
expert is computed on its home rank, so a rank's buffer is as large as its experts' load
(up to S*K*R rows) and its shape changes with the routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from model.moe.dispatch import Dispatched, combine_dtype


@dataclass
class DynamicDispatched(Dispatched):
    order: torch.Tensor  # [S * K] this rank's entries sorted by destination rank
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: torch.Tensor  # received rows sorted by local expert


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x, out_splits, in_splits, group))


class DynamicDispatcher:
    def __init__(self, num_experts: int, group: dist.ProcessGroup):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.num_ranks

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                 topk_weight: torch.Tensor) -> DynamicDispatched:
        num_tokens, top_k = topk_idx.shape
        expert_of_entry = topk_idx.reshape(-1)
        dest = expert_of_entry // self.experts_per_rank
        order = torch.argsort(dest, stable=True)
        send_counts = torch.bincount(dest, minlength=self.num_ranks)
        recv_counts = _all_to_all(send_counts, [1] * self.num_ranks, [1] * self.num_ranks,
                                  self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()  # host sync
        rows = x.index_select(0, order // top_k)
        received = _all_to_all(rows, recv_splits, send_splits, self.group)
        experts = _all_to_all(expert_of_entry[order], recv_splits, send_splits, self.group)
        local_expert = experts - self.rank * self.experts_per_rank
        recv_order = torch.argsort(local_expert, stable=True)
        group_ends = torch.bincount(local_expert, minlength=self.experts_per_rank).cumsum(0)
        slot_of_entry = torch.empty_like(order)
        slot_of_entry[order] = torch.arange(order.numel(), device=x.device)
        return DynamicDispatched(received.index_select(0, recv_order), group_ends.to(torch.int32),
                                 slot_of_entry, topk_weight, order, send_splits, recv_splits,
                                 recv_order)

    def combine(self, expert_out: torch.Tensor, dispatched: DynamicDispatched) -> torch.Tensor:
        unsorted = torch.empty_like(expert_out).index_copy(0, dispatched.recv_order, expert_out)
        returned = _all_to_all(unsorted, dispatched.send_splits, dispatched.recv_splits,
                               self.group)
        weight = dispatched.topk_weight
        num_tokens, k = weight.shape
        per_entry = returned.index_select(0, dispatched.slot_of_entry).view(num_tokens, k, -1)
        per_entry = per_entry.to(combine_dtype(expert_out.dtype, weight.dtype))
        return (per_entry * weight[..., None]).sum(1).to(expert_out.dtype)
