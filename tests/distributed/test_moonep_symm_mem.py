"""The symm_mem MoonEP transport (NVSHMEM all_to_all_vdev, device-side split sizes) on CUDA.

The real exchange between expert-parallel ranks needs one GPU per rank: NCCL refuses two ranks
on one device ("Duplicate GPU detected"), torch's CUDA symmetric memory refuses allocations of
two ranks on one device at rendezvous, and NVSHMEM runs several PEs on one GPU only under CUDA
MPS. What each test covers:

- `test_symm_mem_index_arithmetic_at_ep2_on_one_device`: EP=2 simulated on one device, its two
  ranks two threads of one process (torch's threaded process group), CUDA tensors: the symm_mem
  transport's index and offset arithmetic (who sends which token and expert copy to whom, the
  packing of the send buffers, where each received row lands) with its exchange replaced by a
  host-split all_to_all (what all_to_all_vdev does on the device), against the collective
  transport on the same routings and both against the single-rank LocalDispatcher: output,
  input, routing weight and expert gradients. Runs on CPU too, which checks the harness here.
- `test_nvshmem_exchange_on_one_gpu`: the real NVSHMEM exchange on one PE (one GPU): exactly the
  rows sent come back, the rest of the buffer zeroed even when a reused symmetric buffer still
  holds an earlier exchange's rows, an exchange of no rows, multi-dimensional rows (split sizes
  in elements); then the whole MoonEP layer over NCCL + NVSHMEM at EP1 against the collective
  transport (a smoke test: with one PE every exchange is to itself).
- `test_symm_mem_transport_matches_collective_across_gpus`: two GPUs or more, EP = min(GPUs, 4)
  over NCCL + NVSHMEM against the collective transport, the exchange crossing devices.

All skip without CUDA (and without NVSHMEM where it is needed), except the CPU form of the
first; the index arithmetic also runs on every CPU run through
tests/distributed/test_moonep_layer.py (gloo)."""

import multiprocessing
import threading
import traceback

import pytest
import torch
import torch.distributed as dist

from model.moe import LocalDispatcher
from parallel.moonep.dispatcher import MoonEPDispatcher
from parallel.moonep.transport import (
    CollectiveTransport,
    NvshmemExchange,
    SymmMemTransport,
    symm_mem_unavailable,
)
from tests.distributed.test_moonep_layer import (
    EXPERTS,
    LATENT,
    TOKENS,
    TOP_K,
    full_experts,
    home_experts,
    inputs,
    routings,
    run_moe,
)
from tests.helpers.moonep_helpers import host_split_exchange, run_world
from tests.helpers.tolerances import assert_close_rms

needs_symm_mem = pytest.mark.skipif(symm_mem_unavailable() is not None,
                                    reason=str(symm_mem_unavailable()))
# fp32: the same rows through the same expert GEMMs, only sums in another order (as
# test_moonep_layer.py's TOL; its cases measure below 1e-7).
TOL = 1e-6
WHAT = ("output", "x grad", "weight grad", "w1 grad", "w2 grad")


# ---- EP=2 simulated on one device: two threads, torch's threaded process group ----

def _simulated_ep(device_name: str, world: int) -> None:
    """Runs in a fresh (spawned) process: the threaded process group replaces torch.distributed's
    world for as long as it is installed."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    device = torch.device(device_name)
    x, w = inputs(world)
    topks = routings(world)
    names = ("collective", "symm_mem")
    # GroupedExperts' init draws from the global RNG, which the threads would share: every
    # rank's experts are made here, before the threads start.
    experts = {(rank, name, routing): home_experts(world, rank) for rank in range(world)
               for name in names for routing in topks}
    results, errors = {}, []

    def rank_body(rank: int, store) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            group = dist.group.WORLD
            transports = {"collective": CollectiveTransport(group),
                          "symm_mem": SymmMemTransport(group, host_split_exchange(group))}
            for name, transport in transports.items():
                for routing, topk in topks.items():
                    dispatcher = MoonEPDispatcher(EXPERTS, transport, alignment=4)
                    mine = experts[rank, name, routing].to(device)
                    mine.group_weights = dispatcher.group_weights
                    out, x_grad, w_grad, _ = run_moe(
                        dispatcher, mine, x[rank].to(device), topk[rank].to(device),
                        w[rank].to(device), rank * TOKENS)
                    assert out.device.type == device.type
                    results[rank, name, routing] = [t.cpu() for t in (
                        out, x_grad, w_grad, mine.w1.grad, mine.w2.grad)]
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            mtpg.ProcessLocalGroup.exception_handle(exc)  # wakes the rank waiting in a collective
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    try:
        store = dist.HashStore()
        threads = [threading.Thread(target=rank_body, args=(r, store)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise AssertionError("\n".join(errors))
    per_rank = EXPERTS // world
    for routing, topk in topks.items():
        ref_experts = full_experts()  # all R*S tokens on one rank
        ref = run_moe(LocalDispatcher(EXPERTS), ref_experts, x.view(-1, LATENT),
                      topk.reshape(-1, TOP_K), w.view(-1, TOP_K))
        for rank in range(world):
            rows, home = slice(rank * TOKENS, (rank + 1) * TOKENS), \
                slice(rank * per_rank, (rank + 1) * per_rank)
            expected = [ref[0][rows], ref[1][rows], ref[2][rows], ref_experts.w1.grad[home],
                        ref_experts.w2.grad[home]]
            for what, want, coll, symm in zip(WHAT, expected, results[rank, "collective", routing],
                                              results[rank, "symm_mem", routing]):
                where = f"{what} ({routing}, rank {rank}, {device_name})"
                assert_close_rms(want, coll, TOL, f"collective {where}")
                assert_close_rms(want, symm, TOL, f"symm_mem {where}")
                assert_close_rms(coll, symm, TOL, f"symm_mem against collective {where}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_symm_mem_index_arithmetic_at_ep2_on_one_device(device):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.apply(_simulated_ep, (device, 2))


# ---- the real NVSHMEM exchange on one GPU (one PE) ----

def _exchange_on_one_pe(rank: int, world: int) -> None:
    device = torch.device("cuda", rank)
    exchange = NvshmemExchange(dist.group.WORLD)
    gen = torch.Generator(device=device).manual_seed(0)
    first, second = (torch.randn(12, 3, 5, generator=gen, device=device) for _ in range(2))
    # 7 of 12 rows of 15 elements into a 10-row buffer: the split is in elements on the device.
    out = exchange(first, torch.tensor([7], device=device), 10)
    assert out.shape == (10, 3, 5) and out.dtype == first.dtype
    assert torch.equal(out[:7], first[:7]) and not out[7:].any()
    # The same shapes again reuse the symmetric buffers, which still hold rows 3..6 of `first`:
    # only the 3 rows sent now come back, the rest zero; the first result is its own tensor.
    again = exchange(second, torch.tensor([3], device=device), 10)
    assert torch.equal(again[:3], second[:3]) and not again[3:].any()
    assert torch.equal(out[:7], first[:7])
    nothing = exchange(second, torch.tensor([0], device=device), 10)
    assert not nothing.any()
    # Another dtype, other buffers.
    half = first.bfloat16()
    got = exchange(half, torch.tensor([12], device=device), 12)
    assert got.dtype == torch.bfloat16 and torch.equal(got, half)
    _same_as_collective(rank, world)  # the whole layer, EP1


@needs_symm_mem
@pytest.mark.timeout(300)
def test_nvshmem_exchange_on_one_gpu():
    run_world(1, _exchange_on_one_pe, backend="nccl")


# ---- two GPUs or more: the exchange across devices ----

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
        for what, ref, got in zip(WHAT, results["collective", routing],
                                  results["symm_mem", routing]):
            assert_close_rms(ref, got, TOL, f"{what} ({routing}, rank {rank})")


@pytest.mark.timeout(300)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="expert parallelism across devices needs two GPUs or more (NCCL and "
                           "symmetric memory take one rank per GPU)")
@needs_symm_mem
def test_symm_mem_transport_matches_collective_across_gpus():
    world = min(torch.cuda.device_count(), 4)
    run_world(world, _same_as_collective, backend="nccl")
