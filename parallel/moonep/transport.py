"""How MoonEP moves data between expert-parallel ranks: one small interface, two transports.

Every call has shapes fixed by (S, K, E, R) alone, never by the routing, so no rank needs to
know on the host how much it will receive.

- `CollectiveTransport` (portable: gloo, NCCL; the reference and the CPU/CI path): tokens by an
  all-gather of the latent rows and a local selection, results by a local scatter-add and a
  reduce-scatter, copied weights by an all-gather of the home experts and a local selection
  (its backward reduce-scatters the copies' fp32 gradients back to their owners).
A CUDA symmetric-memory transport (each rank reading only the rows and the one home rank's
expert weights it needs from peer buffers at device-side offsets) would implement the same
`Transport`; it is not written yet.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


class Transport(Protocol):
    group: dist.ProcessGroup
    rank: int
    size: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n, ...] -> [R * n, ...], rank-major, differentiable (small metadata)."""

    def dispatch(self, x: torch.Tensor, token_of_slot: torch.Tensor) -> torch.Tensor:
        """x [S, L] this rank's tokens; token_of_slot [N] global token r * S + i of each buffer
        row (R * S: an empty row) -> buffer [N, L]. Differentiable in x."""

    def combine(self, rows: torch.Tensor, token_of_slot: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        """rows [N, L] (weighted expert outputs) -> [S = num_tokens, L]: for each of this
        rank's tokens the sum over all ranks of the rows whose token it is. Differentiable."""

    def fetch_copies(self, home: torch.Tensor, copied_experts: torch.Tensor) -> torch.Tensor:
        """home [G, ...] this rank's experts' weights; copied_experts [G] global expert ids
        (-1 unused) -> [G, ...] copies in fp32 or wider (zeros where unused). Backward returns
        each copy's gradient, in that dtype, to its owner, summed in a fixed order, added to the
        home gradient."""


class CollectiveTransport:
    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.all_gather_single_autograd(x, 0, self.group))

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        return funcol.wait_tensor(funcol.reduce_scatter_single_autograd(x, "sum", 0, self.group))

    def dispatch(self, x: torch.Tensor, token_of_slot: torch.Tensor) -> torch.Tensor:
        every_token = torch.cat([self.all_gather(x), x.new_zeros(1, x.shape[-1])])
        return every_token.index_select(0, token_of_slot)

    def combine(self, rows: torch.Tensor, token_of_slot: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
        num_global = self.size * num_tokens
        per_token = rows.new_zeros(num_global + 1, rows.shape[-1]).index_add(0, token_of_slot, rows)
        return self.reduce_scatter(per_token[:num_global])

    def fetch_copies(self, home: torch.Tensor, copied_experts: torch.Tensor) -> torch.Tensor:
        every_expert = self.all_gather(home.to(torch.promote_types(home.dtype, torch.float32)))
        used = (copied_experts >= 0).view(-1, *([1] * (home.dim() - 1)))
        return every_expert.index_select(0, copied_experts.clamp(min=0)) * used
