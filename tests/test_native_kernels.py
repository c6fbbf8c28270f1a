"""The native CPU kernels (model/ops/native.py, native_kernels.c) against the plain references:
forward and backward, strided views, infinities and NaN, any thread count, and the torch forms
wherever a kernel does not apply."""

import warnings

import pytest
import torch

from model.activations import situ_glu, situ_glu_reference
from model.ops import native
from tests.tolerances import assert_close_rms


def _values() -> torch.Tensor:
    """Dense around 0, wide up to +-1e4, the extremes fp32 holds, infinities, NaN, zeros and
    subnormal-sized inputs."""
    return torch.cat([torch.linspace(-10, 10, 161), torch.linspace(-1e4, 1e4, 41),
                      torch.tensor([-3e38, -1e30, 1e30, 3e38, float("inf"), -float("inf"),
                                    float("nan"), 0.0, -0.0, 1e-30, 1e-40])])


def _situ_glu_with_grads(gate, up, cotangent):
    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = situ_glu(gate, up)
    out.backward(cotangent)
    return out, gate.grad, up.grad


def _assert_like_torch(gate, up, what):
    """The native results against the torch forms (the reference's forward, its recomputing
    backward) on the same inputs: non-finite values in the same places, the rest within 1e-6
    relative RMS, as the compiled kernels are held."""
    assert native.situ_glu_forward(gate, up, 4.0, 25.0) is not None, f"{what}: not native"
    torch.manual_seed(0)
    cotangent = torch.randn(gate.shape)
    got = _situ_glu_with_grads(gate, up, cotangent)
    with native.native_kernels(False):
        expected = _situ_glu_with_grads(gate, up, cotangent)
    for name, ref, x in zip(("out", "d gate", "d up"), expected, got, strict=True):
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(x)), f"{what}: {name} non-finite elsewhere"
        assert torch.equal(ref.isnan(), x.isnan()), f"{what}: {name} NaN elsewhere"
        assert torch.equal(ref[~finite & ~ref.isnan()], x[~finite & ~x.isnan()])
        assert_close_rms(ref[finite], x[finite], 1e-6, f"{what}: {name}")


def test_the_kernels_build_on_this_machine():
    assert native.available()


def test_situ_glu_matches_the_reference_on_every_layout():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 4096, 64) * 4
    _assert_like_torch(gate, up, "contiguous [4096, 64]")
    fused = torch.randn(3, 100, 2 * 48) * 8  # the MLP's [gate | up] projection: strided halves
    _assert_like_torch(*fused.chunk(2, dim=-1), "halves of [3, 100, 96]")
    _assert_like_torch(*torch.randn(2, 37) * 3, "one dim")
    grid = _values()
    gate, up = (t.contiguous() for t in torch.meshgrid(grid, grid, indexing="ij"))
    _assert_like_torch(gate, up, "grid with extremes, inf and NaN")
    assert situ_glu(gate, up)[torch.isfinite(gate) & torch.isfinite(up)].abs().max() <= 100.0


def test_situ_glu_results_do_not_depend_on_the_thread_count():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 512, 256) * 4  # above the kernels' parallel grain
    cotangent = torch.randn(512, 256)
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 3):
            torch.set_num_threads(n)
            runs.append(_situ_glu_with_grads(gate, up, cotangent))
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(*runs, strict=True):
        assert torch.equal(one, many)


class _Subclass(torch.Tensor):
    pass


def test_torch_forms_run_where_the_kernels_do_not_apply():
    torch.manual_seed(0)
    gate, up = torch.randn(2, 64, 32) * 4
    cases = {"bf16": (gate.bfloat16(), up.bfloat16()), "float64": (gate.double(), up.double()),
             "every other column": (gate[:, ::2], up[:, ::2]),
             "tensor subclass": (gate.as_subclass(_Subclass), up.as_subclass(_Subclass)),
             "shapes differ": (gate, up[:1])}
    for what, (g, u) in cases.items():
        assert native.situ_glu_forward(g, u, 4.0, 25.0) is None, what
    g, u = cases["every other column"]
    assert torch.equal(situ_glu(g, u), situ_glu_reference(g, u))
    with native.native_kernels(False):
        assert not native.available()
        assert native.situ_glu_forward(gate, up, 4.0, 25.0) is None
        assert torch.equal(situ_glu(gate, up), situ_glu_reference(gate, up))


def test_without_a_compiler_the_torch_forms_run_after_one_warning(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native._library.cache_clear()
    try:
        gate, up = torch.randn(2, 16, 8)
        with pytest.warns(UserWarning, match="native CPU kernels unavailable.*/nonexistent/cc"):
            assert not native.available()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per process, not per call
            assert torch.equal(situ_glu(gate, up), situ_glu_reference(gate, up))
    finally:
        monkeypatch.undo()
        native._library.cache_clear()
    assert native.available()
