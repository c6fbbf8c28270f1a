"""Records every aten op a region runs, to prove a hot path has static shapes and no host sync.

DESIGN.md section 2: run the layer forward and backward under a TorchDispatchMode; (a) no op that
syncs with the host or has a data-dependent output size appears; (b) the recorded op sequence and
output shapes are identical for two inputs that differ only in their data (balanced vs skewed
routing, two document layouts with the same number of documents).

The recorder also keeps the peak of the bytes held by the storages the region's ops create and
that are still referenced (activations, autograd's saved tensors, gradients, communication
buffers): deterministic on any device, so two routings' peak memory can be compared exactly.
A collective's tensors are also referenced by the backend's work object, which gloo's worker
thread releases after the wait has already returned, at a moment the main thread cannot see;
so the recorder hands each collective private copies of its inputs and counts its result from
the wait on, as a copy the program alone holds (what it counts is what the program holds).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

# Ops that read a device value on the host or whose output size depends on the data.
SYNCING_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.nonzero_static",  # static, but listed so that a use is a conscious choice
    "aten.masked_select",
    "aten.unique",
    "aten._unique",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.item",
}


# Functional-collective ops that take the collective's pending result (keyed by its storage in
# the work registry): they get the tensor itself, never a copy.
_HANDLE_OPS = {"wait_tensor", "_wrap_tensor_autograd"}


def _shapes(out) -> tuple:
    leaves, _ = tree_flatten(out)
    return tuple(tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in leaves)


def _bool_index(func, args) -> bool:
    if func.__name__.split(".")[0] not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


def _unbounded_repeat_interleave(func, kwargs) -> bool:
    return func.__name__.startswith("repeat_interleave") and kwargs.get("output_size") is None


def _storages(tree) -> dict[int, tuple[StorageWeakRef, int]]:
    """{storage id: (weak reference, bytes)} of the tensors in a pytree."""
    found = {}
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            ref = StorageWeakRef(storage)
            found[ref.cdata] = (ref, storage.nbytes())
    return found


class OpRecorder(TorchDispatchMode):
    """Records (op name, output shapes) for every aten op executed inside the context, and the
    peak bytes of live storages created inside it (`peak_bytes`)."""

    def __init__(self):
        super().__init__()
        self.trace: list[tuple[str, tuple]] = []
        self.violations: list[str] = []
        self.peak_bytes = 0
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.collectives: list[tuple[str, int]] = []  # (op, output bytes) of each collective

    def _account(self, args, kwargs, out) -> None:
        """After each op: forget freed storages, add the op's new ones (not views of or writes
        into its inputs, which were counted where they were made or predate the region)."""
        self._live = {key: v for key, v in self._live.items() if not v[0].expired()}
        inputs = _storages((args, kwargs))
        for key, value in _storages(out).items():
            if key not in inputs:
                self._live.setdefault(key, value)
        self.peak_bytes = max(self.peak_bytes, sum(n for _, n in self._live.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"aten.{func.__name__.split('.')[0]}"
        if (name in SYNCING_OPS or _bool_index(func, args)
                or _unbounded_repeat_interleave(func, kwargs)):
            self.violations.append(str(func))
        op = func.__name__.split(".")[0]
        collective = func.namespace == "_c10d_functional"
        if collective and op not in _HANDLE_OPS:
            args, kwargs = tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
        out = func(*args, **kwargs)
        self.trace.append((str(func), _shapes(out)))
        if not collective:
            self._account(args, kwargs, out)
        elif op == "wait_tensor":
            out = out.clone()
            self._account((), {}, out)
        if collective and isinstance(out, torch.Tensor):
            self.collectives.append((op, out.nbytes))
        return out


def record(fn, *args, **kwargs) -> OpRecorder:
    """Runs fn(*args, **kwargs) (which should include the backward) under an OpRecorder."""
    rec = OpRecorder()
    with rec:
        fn(*args, **kwargs)
    return rec


def assert_static(rec_a: OpRecorder, rec_b: OpRecorder) -> None:
    """Both runs free of syncing ops and with identical op/shape traces."""
    assert not rec_a.violations, f"syncing or data-dependent ops: {sorted(set(rec_a.violations))}"
    assert not rec_b.violations, f"syncing or data-dependent ops: {sorted(set(rec_b.violations))}"
    assert len(rec_a.trace) == len(rec_b.trace), (
        f"op count differs with the data: {len(rec_a.trace)} vs {len(rec_b.trace)}")
    for i, (a, b) in enumerate(zip(rec_a.trace, rec_b.trace)):
        assert a == b, f"op {i} differs with the data: {a} vs {b}"
