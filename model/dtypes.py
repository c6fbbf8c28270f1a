"""The dtype of the model's high-precision islands (norms, gates, attention and KDA internals,
AttnRes mixes, router, expert combine, loss): fp32 for fp32 and lower-precision tensors, the
tensor's own dtype when it is wider. A float64 model (the `fp64` precision of the equivalence
tests) so computes in float64 everywhere, and differently ordered sums of two layouts differ by
float64 round-off, not by fp32 round-off amplified through training."""

import contextlib

import torch


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The widest of `dtypes` and fp32."""
    out = torch.float32
    for dtype in dtypes:
        out = torch.promote_types(out, dtype)
    return out


def no_autocast(device_type: str):
    """A region where autocast does not cast (an fp32 island inside a bf16 autocast region);
    nothing on devices without autocast (meta)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes in on `device_type` here; None outside autocast."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (x itself when it already is)."""
    return x.to(compute_dtype(x.dtype))
