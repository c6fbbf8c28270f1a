"""`precision=fp64`: the float64 mode the layout-equivalence tests run in
(tests/distributed/test_parallel.py, the whole-model context-parallel case). Its point is that
differently ordered sums differ by float64 round-off only, so no op of a training step may round
a value to fp32."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.parallel_harness import global_batch, tiny_config
from train.loop import build_parallel_model, train_step


def _tensors(values) -> list[torch.Tensor]:
    values = values if isinstance(values, (tuple, list)) else (values,)
    return [t for t in values if isinstance(t, torch.Tensor)]


class _RoundsToFp32(TorchDispatchMode):
    """Records the ops that take a float64 tensor fp32 cannot hold exactly and produce an fp32
    one: a float64 value rounded to fp32 (casts down, in-place updates of fp32 buffers). The
    attention's fp32 masks (segment ids, 0 / -inf biases) are exact and not recorded."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _tensors(args) + _tensors(list((kwargs or {}).values()))
        if (any(t.dtype == torch.float32 for t in _tensors(out))
                and any(t.dtype == torch.float64 and not torch.equal(t.float().double(), t)
                        for t in inputs)):
            self.ops.add(str(func))
        return out


def test_fp64_trains_k3_tiny_in_float64_end_to_end():
    """Every parameter and buffer is float64, and no op of a training step rounds a value to
    fp32: forward and backward (norms, gates, attention, KDA, AttnRes mixes, router, experts,
    loss), gradient clipping, Per-Head Muon's Newton-Schulz, AdamW, QK-Clip (every head clips)
    and the Quantile Balancing update."""
    torch.manual_seed(0)
    cfg = tiny_config("muon", "fp64")
    model, precision, parallel, optimizers = build_parallel_model(cfg, None, torch.device("cpu"))
    assert precision.describe() == "fp64"
    floats = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    assert {t.dtype for t in floats} == {torch.float64}
    seen = _RoundsToFp32()
    with seen:
        result = train_step(model, optimizers, [global_batch(0)], torch.device("cpu"), precision,
                            parallel, cfg.optim)
    assert result.finite and result.loss.dtype == torch.float64
    assert result.clip_row["attn/clipped_heads"] > 0  # QK-Clip ran
    assert not seen.ops, f"ops that rounded to fp32 under precision=fp64: {sorted(seen.ops)}"
