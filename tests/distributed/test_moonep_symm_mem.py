"""The symm_mem transport (NVSHMEM all_to_all_vdev, device-side split sizes) against the
collective transport on CUDA ranks over NCCL: the same MoonEP layer outputs, input, routing
weight and expert gradients for every forced routing. Skipped without CUDA + NVSHMEM; its index
arithmetic runs on every CPU run through tests/test_moonep_layer.py (gloo exchange)."""

import pytest
import torch
import torch.distributed as dist

from parallel.moonep.dispatcher import MoonEPDispatcher
from parallel.moonep.transport import CollectiveTransport, SymmMemTransport, symm_mem_unavailable
from tests.distributed.test_moonep_layer import EXPERTS, home_experts, inputs, routings, run_moe
from tests.helpers.moonep_helpers import run_world
from tests.helpers.tolerances import assert_close_rms

pytestmark = pytest.mark.skipif(symm_mem_unavailable() is not None,
                                reason=str(symm_mem_unavailable()))


def _same_as_collective(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    x, w = (t.to(device) for t in inputs(world))
    group = dist.group.WORLD
    results = {}
    for name, transport in (("collective", CollectiveTransport(group)),
                            ("symm_mem", SymmMemTransport(group))):
        for routing, topk in routings(world).items():
            dispatcher = MoonEPDispatcher(EXPERTS, transport, alignment=4)
            experts = home_experts(world, rank, dispatcher).to(device)
            out, x_grad, w_grad, _ = run_moe(dispatcher, experts, x[rank], topk[rank].to(device),
                                             w[rank], rank * x.shape[1])
            results[name, routing] = (out, x_grad, w_grad, experts.w1.grad, experts.w2.grad)
    for routing in routings(world):
        for what, ref, got in zip(("output", "x grad", "weight grad", "w1 grad", "w2 grad"),
                                  results["collective", routing], results["symm_mem", routing]):
            assert_close_rms(ref, got, 1e-6, f"{what} ({routing}, rank {rank})")


@pytest.mark.timeout(300)
def test_symm_mem_transport_matches_collective_on_cuda():
    world = min(torch.cuda.device_count(), 4)
    run_world(world, _same_as_collective, backend="nccl")
