"""fused_kernels=true: the compiled element-wise kernels (model/ops/fused.py) against the plain
references, with the tolerances of the eager forms' own tests (fp32 1e-6, KDA's 5e-3 against
the recurrence), forward and every gradient. Each kernel compiles once here (seconds each)."""

import pytest
import torch

from model.activations import situ_glu, situ_glu_reference
from model.attnres import depth_mix, depth_mix_reference
from model.norms import rms_norm, rms_norm_reference
from model.ops import fused
from model.ops.kda import kda_chunk, kda_recurrent
from model.short_conv import doc_causal_conv1d_silu, doc_causal_conv1d_silu_reference
from tests.helpers.tolerances import assert_close_rms, rel_rms
from tests.unit.model.test_kda_ops import BOUND, assert_all_close, cotangents_for, make_inputs, run


@pytest.fixture
def fused_kernels(torch_forms):
    """Compiled kernels on, the native ones off (they would take the fp32 CPU calls)."""
    fused.enable_fused_kernels(True)
    yield
    fused.enable_fused_kernels(False)


def _forward_and_grads(fn, inputs, cotangent):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(cotangent)
    return [out, *(x.grad for x in leaves)]


def _assert_matches(reference, fast, inputs, what):
    torch.manual_seed(0)
    cotangent = torch.randn_like(reference(*inputs))
    expected = _forward_and_grads(reference, inputs, cotangent)
    got = _forward_and_grads(fast, inputs, cotangent)
    for name, ref, x in zip(["out", *(f"d{i}" for i in range(len(inputs)))], expected, got):
        assert_close_rms(ref, x, 1e-6, f"{what}: {name}")


def _assert_as_exact_as_reference(reference, fast, inputs, what):
    """For sums with cancellation (the depth mix's query gradient: the fp32 reference itself is
    1.3e-6 off the float64 result here): every result within 1e-6 of the float64 reference, or
    within twice the fp32 reference's own error where that is larger."""
    torch.manual_seed(0)
    cotangent = torch.randn_like(reference(*inputs))
    truth = _forward_and_grads(reference, [x.double() for x in inputs], cotangent.double())
    plain = _forward_and_grads(reference, inputs, cotangent)
    got = _forward_and_grads(fast, inputs, cotangent)
    for i, (exact, ref, x) in enumerate(zip(truth, plain, got)):
        name = "out" if i == 0 else f"d{i - 1}"
        assert_close_rms(exact, x, max(1e-6, 2 * rel_rms(exact, ref)), f"{what}: {name}")


def test_element_wise_kernels_compile_and_match_the_references(fused_kernels):
    torch.manual_seed(0)
    gate, up = torch.randn(2, 4096, 64) * 4
    _assert_matches(situ_glu_reference, situ_glu, (gate, up), "SiTU-GLU")
    x, weight = torch.randn(4, 512, 64) * 3, 1 + 0.1 * torch.randn(64)
    _assert_matches(lambda x, w: rms_norm_reference(x, w, 1e-5),
                    lambda x, w: rms_norm(x, w, 1e-5), (x, weight), "RMSNorm")
    _assert_matches(lambda x: rms_norm_reference(x, None, 1e-5),
                    lambda x: rms_norm(x, None, 1e-5), (x,), "RMSNorm without a weight")
    segments = torch.zeros(4, 512, dtype=torch.long)
    segments[:, 300:] = 1
    segments[1, 77:] += 1
    conv_weight = torch.randn(64, 4) / 2
    _assert_matches(lambda x, w: doc_causal_conv1d_silu_reference(x, w, segments),
                    lambda x, w: doc_causal_conv1d_silu(x, w, segments), (x, conv_weight),
                    "short conv + SiLU")
    query = torch.randn(64)
    _assert_as_exact_as_reference(lambda a, b, q, w: depth_mix_reference([a, b], q, w, 1e-5),
                                  lambda a, b, q, w: depth_mix([a, b], q, w, 1e-5),
                                  (x, x.flip(1) * 5, query, weight), "depth mix")
    compiled = set(fused.compiled_kernels())
    for kernel in ("activations.situ_glu_reference", "activations._situ_glu_backward",
                   "attnres._depth_mix_forward", "attnres._depth_mix_backward",
                   "norms._rms_norm_forward", "norms._rms_norm_backward",
                   "short_conv.doc_causal_conv1d_silu_reference",
                   "short_conv._conv_silu_backward"):
        assert f"model.{kernel}" in compiled, (kernel, compiled)


def test_row_wise_kernels_compile_once_per_width(fused_kernels):
    """The norms and SiTU-GLU take any leading shape with one graph per width and direction
    (the demo's norms ran at 11 shapes of 3 widths; each graph costs 1-2 s of compiling)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    weight = 1 + 0.1 * torch.randn(48)  # widths no other test compiles
    shapes = [(3, 40), (130,), (2, 3, 17)]
    before = counters["stats"]["unique_graphs"]
    for lead in shapes:
        x = torch.randn(*lead, 48) * 3
        _assert_matches(lambda x, w: rms_norm_reference(x, w, 1e-5),
                        lambda x, w: rms_norm(x, w, 1e-5), (x, weight), f"RMSNorm {lead}")
    assert counters["stats"]["unique_graphs"] - before == 2  # forward and backward
    for lead in shapes:
        gate, up = torch.randn(2, *lead, 24) * 4
        _assert_matches(situ_glu_reference, situ_glu, (gate, up), f"SiTU-GLU {lead}")
    assert counters["stats"]["unique_graphs"] - before == 4


def test_depth_mix_compiles_once_for_any_number_of_sources(fused_kernels):
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    query, weight = torch.randn(40), 1 + 0.1 * torch.randn(40)  # a width no other test compiles
    before = counters["stats"]["unique_graphs"]
    for n in (2, 3, 4):
        sources = [torch.randn(2, 30, 40) * (i + 1) for i in range(n)]
        _assert_as_exact_as_reference(
            lambda *a: depth_mix_reference(list(a[:-2]), a[-2], a[-1], 1e-5),
            lambda *a: depth_mix(list(a[:-2]), a[-2], a[-1], 1e-5), (*sources, query, weight),
            f"depth mix of {n} sources")
    assert counters["stats"]["unique_graphs"] - before == 2  # forward and backward


def test_bounded_kda_kernels_compile_and_match_the_recurrence(fused_kernels):
    """Packed documents in rows that each start one, initial states: the layer's case."""
    torch.manual_seed(0)
    lengths = [100, 156, 40, 216]  # two rows of 256: the second row holds two documents
    inputs = make_inputs(1, sum(lengths), num_states=len(lengths))
    cu_seqlens = torch.tensor([0, 100, 256, 296, 512])
    cot = cotangents_for(inputs, len(lengths))
    ref = run(kda_recurrent, inputs, cot, cu_seqlens=cu_seqlens)
    got = run(kda_chunk, inputs, cot, cu_seqlens=cu_seqlens, lower_bound=BOUND, rows=2,
              chunk_size=32)
    assert_all_close(ref, got)
    for kernel in ("_bounded_forward", "_bounded_backward"):
        assert f"model.ops.kda.bounded.{kernel}" in fused.compiled_kernels()
    # Against the eager chunk form: fp32 round-off only.
    fused.enable_fused_kernels(False)
    eager = run(kda_chunk, inputs, cot, cu_seqlens=cu_seqlens, lower_bound=BOUND, rows=2,
                chunk_size=32)
    for name in eager:
        assert_close_rms(eager[name], got[name], 1e-5, f"eager vs fused: {name}")


class _Subclass(torch.Tensor):
    """Stands for DTensor: any tensor subclass."""


def test_only_plain_tensors_take_the_compiled_kernel(fused_kernels):
    @fused.fusable
    def double_plus_one(x):
        return x * 2 + 1

    def compiled():
        return any("double_plus_one" in name for name in fused.compiled_kernels())

    x = torch.arange(4.0)
    fused.enable_fused_kernels(False)
    assert torch.equal(double_plus_one(x), x * 2 + 1) and not compiled()  # off: the eager form
    fused.enable_fused_kernels(True)
    assert torch.equal(double_plus_one(x.as_subclass(_Subclass)), x * 2 + 1) and not compiled()
    assert torch.equal(double_plus_one(x), x * 2 + 1) and compiled()


def test_the_run_config_switches_them(fused_kernels):
    from model.k3 import K3Model
    from parallel.apply import parallelize
    from train.config import TrainConfig

    cfg = TrainConfig()
    model = K3Model(cfg.model)
    parallelize(model, None, cfg)
    assert not fused.fused_kernels_enabled()
    cfg.fused_kernels = True
    parallelize(model, None, cfg)
    assert fused.fused_kernels_enabled()


def test_a_run_without_a_cpp_compiler_fails_at_start_naming_the_flag():
    """fused_kernels and compile on CPU refuse to start without a C++ compiler (instead of
    failing inside torch.compile at the first step); eager runs do not need one."""
    from torch._inductor import config as inductor_config

    from model.config import ConfigError
    from train.config import TrainConfig
    from train.startup_checks import check_kernel_compiler

    cpu = torch.device("cpu")
    for flags in ({"fused_kernels": True}, {"compile": True}):
        check_kernel_compiler(TrainConfig(**flags), cpu)  # this machine has one
    # torch's own config patch: monkeypatch's setattr/undo on a config module leaves the
    # entry hidden for the compiles of later tests
    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/g++")}):
        check_kernel_compiler(TrainConfig(), cpu)
        with pytest.raises(ConfigError, match=r"fused_kernels=true on CPU needs a C\+\+ compiler "
                                              r".*'/nonexistent/g\+\+'.*set fused_kernels=false"):
            check_kernel_compiler(TrainConfig(fused_kernels=True), cpu)
        with pytest.raises(ConfigError, match=r"fused_kernels=true and compile=true .* set "
                                              r"fused_kernels=false compile=false"):
            check_kernel_compiler(TrainConfig(fused_kernels=True, compile=True), cpu)
