"""The native CPU kernels: C loops (native_kernels.c) for fp32 CPU training, a path to test and to
demo on; nothing here is loaded where the model trains on GPUs.

`install()` builds the library with the system C compiler (build.py: cached per user, so the
next processes only load it), sets its ctypes signatures (bindings.py) and registers each kernel
under its op's name with model/ops/dispatch.py, whose ops then take it where it applies and their
torch forms elsewhere (other dtypes or devices, tensor subclasses such as DTensor, tracing by
torch.compile). The model never installs them: k3-train does at start-up, the benchmarks that
measure them do, and the test suite does once per session. `K3_NATIVE_KERNELS=0` keeps them out.
"""

from __future__ import annotations

import contextlib
import os

from model.ops import dispatch

from . import attention, bindings, kda

# Op name -> kernel: each takes its op's torch-form arguments and declines (None, or False for
# the in-place loss passes) where it does not apply.
KERNELS = {
    "situ_glu_forward": bindings.situ_glu_forward,
    "situ_glu_backward": bindings.situ_glu_backward,
    "conv_silu_forward": bindings.conv_silu_forward,
    "conv_silu_backward": bindings.conv_silu_backward,
    "rms_norm_forward": bindings.rms_norm_forward,
    "rms_norm_backward": bindings.rms_norm_backward,
    "depth_mix_forward": bindings.depth_mix_forward,
    "depth_mix_backward": bindings.depth_mix_backward,
    "kda_inputs": kda.kda_inputs,
    "kda_recurrence": kda.kda_recurrence,
    "log_sum_exp_rows": bindings.log_sum_exp_rows,
    "softmax_grad_rows_": bindings.softmax_grad_rows_,
    "attention_forward": attention.attention_forward,
    "attention_backward": attention.attention_backward,
}


def install() -> tuple[str, ...]:
    """Registers every kernel (building the library on the first call) and returns their names;
    none with K3_NATIVE_KERNELS=0, and none after one warning where the library cannot be built
    or loaded (no compiler, say)."""
    if os.environ.get("K3_NATIVE_KERNELS", "1") == "0" or not available():
        return ()
    for name, kernel in KERNELS.items():
        dispatch.register(name, kernel)
    return tuple(sorted(KERNELS))


def uninstall() -> None:
    for name in KERNELS:
        dispatch.unregister(name)


def available() -> bool:
    """Whether the library builds and loads on this machine (building it on the first call)."""
    return bindings.library() is not None


def kernels_in_use() -> tuple[str, ...]:
    """The installed kernels that run now: none before install(), while dispatch's kernels are
    turned off, or without the library."""
    names = tuple(name for name in dispatch.registered() if name in KERNELS)
    return names if names and available() else ()


@contextlib.contextmanager
def native_kernels(enabled: bool):
    """The native kernels on (installed first) or off (every op's torch form) inside the block."""
    if enabled:
        install()
    with dispatch.kernels_enabled(enabled):
        yield
