"""Named kernels that may stand in for the torch forms of the model's fused ops.

An op asks `call(name, *args)` first and runs its torch form when that returns None: when no
kernel of that name is registered, when kernels are turned off (`kernels_enabled(False)`), or
when the kernel declines the inputs (another dtype or device, a tensor subclass, tracing): it
returns None then (False for a kernel that writes into its arguments). Kernels register from
outside the model (model/ops/cpu's `install()`), so by default every op runs its torch form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

_kernels: dict[str, Callable] = {}
_enabled = True


def register(name: str, kernel: Callable) -> None:
    _kernels[name] = kernel


def unregister(name: str) -> None:
    _kernels.pop(name, None)


def call(name: str, *args):
    """The kernel's result on args; None where none runs."""
    kernel = _kernels.get(name) if _enabled else None
    return None if kernel is None else kernel(*args)


def registered() -> tuple[str, ...]:
    """The names of the kernels that run now (none while they are turned off)."""
    return tuple(sorted(_kernels)) if _enabled else ()


@contextlib.contextmanager
def only(kernels: dict[str, Callable]):
    """Exactly `kernels` run inside the block (empty: every op's torch form), whatever is
    registered."""
    global _kernels, _enabled
    before = _kernels, _enabled
    _kernels, _enabled = dict(kernels), True
    try:
        yield
    finally:
        _kernels, _enabled = before


@contextlib.contextmanager
def kernels_enabled(enabled: bool):
    """The registered kernels on or off inside the block (off: every op's torch form)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before
