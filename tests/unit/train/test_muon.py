"""Per-Head Muon (train/optim/muon.py) against torch.optim.Muon and its own per-matrix path.

torch.optim.Muon always runs Newton-Schulz in bf16, so comparisons with it use ns_dtype=bf16;
our fp32 path (the CPU default) is checked against itself on separate parameters, exactly.
"""

from __future__ import annotations

import io
import itertools

import pytest
import torch

from tests.helpers.static_shapes import assert_static, record
from tests.helpers.tolerances import assert_close_rms, rel_rms
from train.optim.muon import Muon
from train.optim.newton_schulz import newton_schulz

HYPER = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
STEPS = 4
# Against torch's Muon (bf16 Newton-Schulz, same op sequence): observed bit-identical on x86
# CPUs; 1e-6 on the parameter change admits fp32 reordering but not one differing bf16 rounding.
STOCK_TOL = 1e-6


def _grads(shape: tuple[int, ...], steps: int = STEPS) -> list[torch.Tensor]:
    return [torch.randn(shape) for _ in range(steps)]


def _run_muon(w0: torch.Tensor, grads: list[torch.Tensor], **kwargs) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ("ns_dtype", "exchange")}
    opt = Muon([dict(params=[p], **kwargs)], **HYPER, **opt_kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def _matrix_slices(shape: tuple[int, ...], num_heads: int, head_axis: int) -> list[tuple]:
    """Index of every matrix Muon should orthogonalise on its own (expert x head blocks)."""
    rows, cols = shape[-2:]
    out = []
    for lead in itertools.product(*map(range, shape[:-2])):
        for h in range(num_heads):
            if head_axis == 0:
                block = (slice(h * rows // num_heads, (h + 1) * rows // num_heads), slice(None))
            else:
                block = (slice(None), slice(h * cols // num_heads, (h + 1) * cols // num_heads))
            out.append(lead + block)
    return out


def _run_on_slices(w0, grads, slices, make_opt) -> torch.Tensor:
    """Each matrix slice as its own parameter in one optimizer; reassembled afterwards."""
    params = [torch.nn.Parameter(w0[s].clone()) for s in slices]
    opt = make_opt(params)
    for g in grads:
        for p, s in zip(params, slices):
            p.grad = g[s].clone()
        opt.step()
    out = w0.clone()
    for p, s in zip(params, slices):
        out[s] = p.detach()
    return out


@pytest.mark.parametrize("shape", [(48, 32), (24, 80)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust,torch_adjust", [("match_rms_adamw", "match_rms_adamw"),
                                                 ("spectral", "original")])
def test_single_head_matches_torch_muon(shape, nesterov, adjust, torch_adjust):
    w0, grads = torch.randn(shape), _grads(shape)
    ours = _run_muon(w0, grads, nesterov=nesterov, adjust_lr=adjust, ns_dtype=torch.bfloat16)
    stock = _run_on_slices(w0, grads, [(slice(None), slice(None))], lambda ps: torch.optim.Muon(
        ps, **HYPER, nesterov=nesterov, adjust_lr_fn=torch_adjust))
    assert_close_rms(stock - w0, ours - w0, STOCK_TOL, "parameter change vs torch.optim.Muon")


@pytest.mark.parametrize("shape,num_heads,head_axis", [
    ((4 * 8, 24), 4, 0),      # Q/K/V-like: 4 heads of 8 rows
    ((24, 4 * 8), 4, 1),      # output-projection-like: 4 heads of 8 columns
    ((3, 16, 40), 1, 0),      # stacked experts: 3 matrices
    ((3, 16, 2 * 12), 2, 1),  # stacked experts with column heads: 6 matrices
    ((2, 2 * 20, 12), 2, 0),  # stacked experts with row heads, rows > cols per block
])
def test_per_matrix_equals_separate_parameters(shape, num_heads, head_axis):
    """Per-head blocks and expert slices are each stock Muon on their own (SPEC 7)."""
    w0, grads = torch.randn(shape), _grads(shape)
    slices = _matrix_slices(shape, num_heads, head_axis)
    group = dict(num_heads=num_heads, head_axis=head_axis)

    ours_fp32 = _run_muon(w0, grads, **group, ns_dtype=torch.float32)
    separate_fp32 = _run_on_slices(w0, grads, slices, lambda ps: Muon(
        ps, **HYPER, ns_dtype=torch.float32))
    assert torch.equal(ours_fp32, separate_fp32), rel_rms(separate_fp32 - w0, ours_fp32 - w0)

    ours_bf16 = _run_muon(w0, grads, **group, ns_dtype=torch.bfloat16)
    stock = _run_on_slices(w0, grads, slices, lambda ps: torch.optim.Muon(
        ps, **HYPER, adjust_lr_fn="match_rms_adamw"))
    assert_close_rms(stock - w0, ours_bf16 - w0, STOCK_TOL, "per-matrix vs torch.optim.Muon")


def test_per_head_differs_from_whole_matrix():
    """Guards the test above against a per-head path that silently does the whole matrix."""
    w0, grads = torch.randn(32, 24), _grads((32, 24))
    per_head = _run_muon(w0, grads, num_heads=4, head_axis=0)
    whole = _run_muon(w0, grads)
    assert rel_rms(whole - w0, per_head - w0) > 0.1


def _well_conditioned(batch: int, rows: int, cols: int, cond: float = 5.0) -> torch.Tensor:
    k = min(rows, cols)
    u = torch.linalg.qr(torch.randn(batch, rows, k)).Q
    v = torch.linalg.qr(torch.randn(batch, cols, k)).Q
    s = torch.linspace(1.0 / cond, 1.0, k).expand(batch, k) * torch.rand(batch, 1) * 10
    return u @ torch.diag_embed(s) @ v.mT


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_singular_values(dtype, rows, cols):
    x = _well_conditioned(3, rows, cols)
    sv = torch.linalg.svdvals(newton_schulz(x, dtype=dtype).double())
    assert sv.min() >= 0.5 and sv.max() <= 1.5, (sv.min(), sv.max())


def test_newton_schulz_fp32_close_to_fp64():
    x = torch.randn(4, 24, 40)
    ref = newton_schulz(x, dtype=torch.float64)
    assert_close_rms(ref, newton_schulz(x, dtype=torch.float32), 1e-5, "NS fp32 vs fp64")


def test_per_head_update_singular_values():
    """Through the optimizer: each head block of the raw update (lr 1, no momentum, no decay,
    no scale) is orthogonalised on its own."""
    heads, hd, cols = 4, 12, 20
    grad = _well_conditioned(heads, hd, cols).reshape(heads * hd, cols)
    w0 = torch.randn(heads * hd, cols)
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([dict(params=[p], num_heads=heads)], lr=1.0, momentum=0.0, weight_decay=0.0,
               adjust_lr="none")
    p.grad = grad
    opt.step()
    update = (w0 - p.detach()).reshape(heads, hd, cols)
    sv = torch.linalg.svdvals(update.double())
    assert sv.min() >= 0.5 and sv.max() <= 1.5, (sv.min(), sv.max())


def _two_group_optimizer(params: list[torch.nn.Parameter]) -> Muon:
    return Muon([dict(params=[params[0]], num_heads=4, head_axis=1, name="attn.o_proj"),
                 dict(params=[params[1]], lr=0.01, name="moe.experts.w1")],
                **HYPER)


def test_state_dict_round_trip_continues_identically():
    shapes = [(16, 4 * 6), (3, 12, 20)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    grads = [_grads(s, 6) for s in shapes]
    opt = _two_group_optimizer(params)

    def step(opt, params, t):
        for p, g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()

    for t in range(3):
        step(opt, params, t)
    blob = io.BytesIO()
    torch.save(opt.state_dict(), blob)
    blob.seek(0)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = Muon([dict(params=[resumed_params[0]]), dict(params=[resumed_params[1]])], lr=1.0)
    resumed.load_state_dict(torch.load(blob))
    assert resumed.param_groups[0]["num_heads"] == 4 and resumed.param_groups[1]["lr"] == 0.01

    for t in range(3, 6):
        step(opt, params, t)
        step(resumed, resumed_params, t)
    for p, q in zip(params, resumed_params):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["momentum_buffer"], resumed.state[q]["momentum_buffer"])


class _HeadHalves:
    """A toy exchange that hands the orthogonaliser blocks of whole heads (as a head-sharded
    tensor-parallel rank does) and puts the results back together."""

    def orthogonalize(self, jobs, ortho):
        out = []
        for job in jobs:
            first, second = job.update.chunk(2, dim=job.head_axis - 2)
            out.append(torch.cat([ortho(first.contiguous(), job), ortho(second.contiguous(), job)],
                                 dim=job.head_axis - 2))
        return out


@pytest.mark.parametrize("head_axis", [0, 1])
def test_exchange_of_whole_head_blocks_matches_local(head_axis):
    """Head split and update scale follow the logical parameter, whatever block of whole heads
    the exchange orthogonalises."""
    shape = (4 * 10, 28) if head_axis == 0 else (28, 4 * 10)
    w0, grads = torch.randn(shape), _grads(shape)
    group = dict(num_heads=4, head_axis=head_axis, adjust_lr="spectral")  # rows/cols matter
    local = _run_muon(w0, grads, **group)
    halves = _run_muon(w0, grads, **group, exchange=_HeadHalves())
    assert torch.equal(local, halves)


def test_step_has_no_host_sync():
    params = [torch.nn.Parameter(torch.randn(16, 24)), torch.nn.Parameter(torch.randn(2, 8, 12))]
    opt = _two_group_optimizer(params)

    def step(scale):
        for p in params:
            p.grad = torch.randn_like(p) * scale
        opt.step()

    step(1.0)  # creates the momentum buffers
    assert_static(record(step, 1.0), record(step, 1e3))


@pytest.mark.parametrize("shape,group,message", [
    ((30, 16), dict(num_heads=4, head_axis=0, name="blocks.0.q"), "num_heads=4 does not divide"),
    ((16, 30), dict(num_heads=4, head_axis=1), "(16, 30)"),
    ((16,), dict(), "give it to AdamW"),
    ((16, 16), dict(head_axis=2), "head_axis=2"),
    ((16, 16), dict(adjust_lr="original"), "adjust_lr='original'"),
])
def test_invalid_groups_fail_clearly(shape, group, message):
    with pytest.raises(ValueError) as err:
        Muon([dict(params=[torch.nn.Parameter(torch.zeros(shape))], **group)], lr=0.1)
    assert message in str(err.value)
    assert "Muon param group 0" in str(err.value)
    if "name" in group:
        assert group["name"] in str(err.value)


class _CountingExchange:
    """The local exchange, counting its calls (one per bucket)."""

    def __init__(self):
        self.calls = 0

    def orthogonalize(self, jobs, ortho):
        self.calls += 1
        return [ortho(job.update, job) for job in jobs]


def test_buckets_step_the_same_bits_as_one_bucket():
    """A step in buckets (here one parameter each: 1 byte) makes, orthogonalises and applies each
    bucket's updates before the next one's exist; every parameter and momentum buffer ends the
    same, bit for bit, as with the whole step in one bucket, and the exchange is called once per
    bucket."""
    torch.manual_seed(0)
    shapes = [((48, 32), dict(num_heads=4, head_axis=0)), ((3, 16, 24), {}), ((24, 40), {})]
    w0 = [torch.randn(shape) for shape, _ in shapes]
    grads = [[torch.randn(shape) for shape, _ in shapes] for _ in range(STEPS)]
    runs = []
    for bucket_bytes in (1 << 30, 1, (48 * 32 + 3 * 16 * 24) * 4):  # one, three, two buckets
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        exchange = _CountingExchange()
        opt = Muon([dict(params=[p], **extra) for p, (_, extra) in zip(params, shapes)], **HYPER,
                   exchange=exchange, bucket_bytes=bucket_bytes)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        runs.append((params, opt, exchange.calls))
    (ref, ref_opt, calls), *others = runs
    assert calls == STEPS
    for (params, opt, calls), buckets in zip(others, (3, 2)):
        assert calls == STEPS * buckets
        for p, p_ref in zip(params, ref):
            assert torch.equal(p, p_ref)
            assert torch.equal(opt.state[p]["momentum_buffer"],
                               ref_opt.state[p_ref]["momentum_buffer"])
    with pytest.raises(ValueError, match="bucket_bytes=0 is invalid"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **HYPER, bucket_bytes=0)


def test_the_bucket_size_is_checked_at_start_up():
    from model.errors import ConfigError
    from train.config import TrainConfig, validate_train_config

    cfg = TrainConfig()
    cfg.optim.muon_bucket_mb = 0
    with pytest.raises(ConfigError, match=r"optim.muon_bucket_mb=0 is invalid: must be >= 1"):
        validate_train_config(cfg, 1, data=False)
