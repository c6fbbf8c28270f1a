"""What a training step allocates and communicates, measured while it runs (the dry run's
probes): two TorchDispatchModes that see every operator of the step, fake tensors included.

`StepMemory`: the bytes of every live tensor storage on the device, counted as the CUDA caching
allocator would hand them out (rounded up to 512-byte blocks), and the peak. A storage counts
from the operator that made it until it is freed; `UntypedStorage.resize_` (FSDP2 frees and
re-allocates its unsharded parameters that way) is followed too. torch's
`torch.distributed._tools.mem_tracker.MemTracker` does this and more (module by module), at a
cost per operator that grows with the number of modules: minutes for one step of a large model,
where this costs a dictionary update.

`CollectiveBytes`: per kind of collective, the bytes of the buffer of every call (all_reduce's
and broadcast's tensor, all_gather's output, reduce_scatter's and all_to_all's input, send's and
recv's tensor), torch.distributed's and the functional collectives DTensor uses alike.
"""

from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

BLOCK = 512  # the CUDA caching allocator's smallest block and rounding


def allocator_bytes(nbytes: int) -> int:
    """`nbytes` as the CUDA caching allocator hands them out (whole blocks)."""
    return -(-nbytes // BLOCK) * BLOCK


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages under `t` (a wrapper subclass such as DTensor: its inner tensors')."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]  # tensors, and opaque objects (meshes)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


class StepMemory(TorchDispatchMode):
    """Live bytes and their peak. `track(tensors)` adds tensors made before the mode was
    entered (parameters, gradients, optimizer state); operators' outputs are added as they
    appear."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}  # storage (its StorageImpl address) -> bytes held
        self.current = 0
        self.peak = 0
        self._resize = None

    def restart_peak(self) -> int:
        """The peak so far; from here the peak starts again at the bytes live now."""
        peak, self.peak = self.peak, self.current
        return peak

    def track(self, tensors) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                for storage in _storages(t):
                    self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self.live:
            return
        self._set(key, storage.nbytes())
        weakref.finalize(storage, self._set, key, 0)

    def _set(self, key: int, nbytes: int) -> None:
        held = allocator_bytes(nbytes)
        self.current += held - self.live.get(key, 0)
        if nbytes:
            self.live[key] = held
        else:
            self.live.pop(key, None)
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        probe = self

        def resize_(storage, size):
            probe._resize(storage, size)
            if storage._cdata in probe.live or size:
                probe._set(storage._cdata, size)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


# Collective operators -> (kind, the argument whose buffer is counted: 0 the first argument,
# None the output). c10d's in-place operators take their output buffer first.
_COLLECTIVES = {
    "c10d::allreduce_": ("all_reduce", 0), "c10d::allreduce_coalesced_": ("all_reduce", 0),
    "c10d::_allgather_base_": ("all_gather", 0), "c10d::allgather_": ("all_gather", 0),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_": ("reduce_scatter", 1),
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::alltoall_base_": ("all_to_all", 1), "c10d::alltoall_": ("all_to_all", 1),
    "c10d::broadcast_": ("broadcast", 0), "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "_c10d_functional::all_reduce": ("all_reduce", 0),
    "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", None),
    "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", None),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional::all_to_all_single": ("all_to_all", 0),
    "_c10d_functional::broadcast": ("broadcast", 0),
    "_c10d_functional_autograd::all_gather_into_tensor": ("all_gather", None),
    "_c10d_functional_autograd::reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional_autograd::all_to_all_single": ("all_to_all", 0),
}


def _bytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value)
               if isinstance(t, torch.Tensor))


class CollectiveBytes(TorchDispatchMode):
    """`bytes[kind]` and `calls[kind]` of the collectives called inside."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        entry = _COLLECTIVES.get(func._schema.name)
        if entry is not None:
            kind, position = entry
            self.bytes[kind] += _bytes(out if position is None else args[position])
            self.calls[kind] += 1
        return out
