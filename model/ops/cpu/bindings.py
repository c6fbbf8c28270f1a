"""ctypes signatures of native_kernels.c and the thin wrappers that hand it tensors: each takes
the tensors its torch form takes and returns None (False for the in-place loss passes) where the
kernel does not apply (no library, other dtypes or devices, tensor subclasses such as DTensor,
tracing by torch.compile, layouts the loops do not take)."""

from __future__ import annotations

import ctypes
import functools

import torch

from model.ops.fused import plain_tensors

from . import build

# The C side's float* and int64_t* go over as the tensors' data_ptr() integers: a typed
# pointer would need a ctypes.cast per argument, and a step passes thousands.
_F32_P = _I64_P = ctypes.c_void_p
_SIGNATURES = {
    "situ_glu_forward": [_F32_P] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_float] * 2
                        + [ctypes.c_int],
    "situ_glu_backward": [_F32_P] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float] * 2
                         + [ctypes.c_int],
    "conv_silu_forward": [_F32_P, _F32_P, _I64_P, _F32_P] + [ctypes.c_int64] * 4
                         + [ctypes.c_int],
    "conv_silu_backward": [_F32_P, _F32_P, _I64_P] + [_F32_P] * 5 + [ctypes.c_int64] * 5
                          + [ctypes.c_int],
    "rms_norm_forward": [_F32_P] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_float, ctypes.c_int],
    "rms_norm_backward": [_F32_P] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_int],
    "depth_mix_forward": [ctypes.POINTER(_F32_P), _I64_P, ctypes.c_int64] + [_F32_P] * 5
                         + [ctypes.c_int64] * 2 + [ctypes.c_float, ctypes.c_int],
    "depth_mix_backward": [ctypes.POINTER(_F32_P), _I64_P, ctypes.c_int64] + [_F32_P] * 5
                          + [ctypes.c_int64] + [_F32_P] * 4 + [ctypes.c_int64] * 3
                          + [ctypes.c_int],
    "kda_inputs_forward": [_F32_P] * 9 + [ctypes.c_int64] * 3 + [ctypes.c_float] * 2
                          + [ctypes.c_int],
    "kda_inputs_backward": [_F32_P] * 15 + [ctypes.c_int64] * 3 + [ctypes.c_float] * 2
                           + [ctypes.c_int64, ctypes.c_int],
    "log_sum_exp_rows": [_F32_P] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_int],
    "softmax_grad_rows": [_F32_P] * 2 + [_I64_P, _F32_P] + [ctypes.c_int64] * 2
                         + [ctypes.c_int],
    "kda_forward": [_F32_P] * 6 + [_I64_P] + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2
                   + [ctypes.c_int64] + [_F32_P] * 3 + [_I64_P, _F32_P, ctypes.c_int],
    "kda_backward": [_F32_P] * 6 + [_I64_P] + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2
                    + [ctypes.c_int64] + [_F32_P] * 8 + [_I64_P, _F32_P, ctypes.c_int],
    "attention_forward": [_F32_P] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int,
                                                                  ctypes.c_int64]
                         + [_F32_P] * 4 + [ctypes.c_int],
    "attention_backward": [_F32_P] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int,
                                                                   ctypes.c_int64]
                          + [_F32_P] * 4 + [ctypes.c_int],
}
_RESULTS = {"kda_forward": ctypes.c_int64, "attention_forward": ctypes.c_int64,
            "softmax_grad_rows": ctypes.c_int64}
# Rows per block of a weight gradient's sum over rows (see native_kernels.c).
_BLOCK_ROWS = 64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its signatures set (built on first call), or None after one
    warning."""
    lib = build.load()
    if lib is not None:
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = _RESULTS.get(name)
    return lib


def _usable(*tensors: torch.Tensor) -> bool:
    return (not torch.compiler.is_compiling() and plain_tensors(tensors)
            and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() >= 1
                    for t in tensors)
            and library() is not None)


def _as_rows(t: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """t as [rows, width] with contiguous rows (a view) and the rows' stride, or None."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        return None
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims that do not merge into one stride
        return None
    return rows, rows.stride(0)


def _grad_rows(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """_as_rows of an incoming gradient, copied first where it has no such view (e.g. the
    expanded gradient of a sum)."""
    return _as_rows(grad) or _as_rows(grad.contiguous())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def situ_glu_forward(gate: torch.Tensor, up: torch.Tensor, beta_gate: float,
                     beta_up: float) -> torch.Tensor | None:
    """situ_glu_reference(gate, up, ...) for fp32 CPU tensors of one shape; None where the
    native kernel does not apply."""
    if gate.shape != up.shape or not _usable(gate, up):
        return None
    g, u = _as_rows(gate), _as_rows(up)
    if g is None or u is None:
        return None
    (g, g_stride), (u, u_stride) = g, u
    out = torch.empty(gate.shape, dtype=torch.float32)
    library().situ_glu_forward(_ptr(g), _ptr(u), _ptr(out), g.shape[0], g.shape[1], g_stride,
                                u_stride, beta_gate, beta_up, torch.get_num_threads())
    return out


def situ_glu_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor,
                      beta_gate: float, beta_up: float) -> torch.Tensor | None:
    """The gradients of gate and up (model/activations.py _situ_glu_backward) as one tensor
    [..., 2 * width], gate's first; None where the native kernel does not apply."""
    if not (gate.shape == up.shape == grad_out.shape) or not _usable(gate, up, grad_out):
        return None
    g, u = _as_rows(gate), _as_rows(up)
    if g is None or u is None:
        return None
    (g, g_stride), (u, u_stride), (d, d_stride) = g, u, _grad_rows(grad_out)
    rows, width = g.shape
    grad = torch.empty(*gate.shape[:-1], 2 * width, dtype=torch.float32)
    library().situ_glu_backward(_ptr(g), _ptr(u), _ptr(d), _ptr(grad), _ptr(grad[..., width:]),
                                 rows, width, g_stride, u_stride, d_stride, 2 * width,
                                 beta_gate, beta_up, torch.get_num_threads())
    return grad


def _conv_operands(x, weight, segments):
    """(taps [K, C], contiguous document ids or None) where the native convolution applies,
    else None."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        return None
    if not x.is_contiguous() or not _usable(x, weight):
        return None
    if segments is not None:
        if (segments.dtype != torch.int64 or segments.shape != x.shape[:2]
                or segments.device.type != "cpu"):
            return None
        segments = segments.contiguous()
    return weight.t().contiguous(), segments


def conv_silu_forward(x: torch.Tensor, weight: torch.Tensor,
                      segments: torch.Tensor | None) -> torch.Tensor | None:
    """doc_causal_conv1d_silu_reference(x, weight, segments) (model/short_conv.py) for a
    contiguous fp32 CPU x [B, T, C]; None where the native kernel does not apply."""
    operands = _conv_operands(x, weight, segments)
    if operands is None:
        return None
    taps, segments = operands
    out = torch.empty_like(x)
    B, T, C = x.shape
    library().conv_silu_forward(_ptr(x), _ptr(taps), _optional_ptr(segments), _ptr(out), B, T, C,
                                 taps.shape[0], torch.get_num_threads())
    return out


def conv_silu_backward(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None,
                       grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The gradients of x and the weight (model/short_conv.py _conv_silu_backward); None where
    the native kernel does not apply."""
    operands = _conv_operands(x, weight, segments)
    if operands is None or grad_out.shape != x.shape or not _usable(grad_out):
        return None
    taps, segments = operands
    grad_out = grad_out.contiguous()
    B, T, C = x.shape
    K = taps.shape[0]
    blocks = -(-B * T // _BLOCK_ROWS)
    grad_pre, grad_x = torch.empty_like(x), torch.empty_like(x)
    partials, grad_taps = torch.empty(blocks, K, C), torch.empty(K, C)
    library().conv_silu_backward(_ptr(x), _ptr(taps), _optional_ptr(segments), _ptr(grad_out),
                                  _ptr(grad_pre), _ptr(grad_x), _ptr(partials), _ptr(grad_taps),
                                  B, T, C, K, _BLOCK_ROWS, torch.get_num_threads())
    return grad_x, grad_taps.t().contiguous()


def _optional_ptr(t: torch.Tensor | None):
    return None if t is None else _ptr(t)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(y, 1 / rms [..., 1]) of model/norms.py's _rms_norm_forward for fp32 CPU x and weight;
    None where the native kernel does not apply."""
    tensors = (x,) if weight is None else (x, weight)
    if not _usable(*tensors) or (weight is not None and (
            weight.shape != x.shape[-1:] or not weight.is_contiguous())):
        return None
    rows = _as_rows(x)
    if rows is None:
        return None
    rows, stride = rows
    y = torch.empty(x.shape, dtype=torch.float32)
    rstd = torch.empty(*x.shape[:-1], 1, dtype=torch.float32)
    library().rms_norm_forward(_ptr(rows), _optional_ptr(weight), _ptr(y), _ptr(rstd),
                                rows.shape[0], rows.shape[1], stride, eps,
                                torch.get_num_threads())
    return y, rstd


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor,
                      grad_out: torch.Tensor, need_weight: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(grad_x, grad_weight or None) of model/norms.py's _rms_norm_backward; None where the
    native kernel does not apply."""
    tensors = (x, rstd, grad_out) if weight is None else (x, weight, rstd, grad_out)
    if (grad_out.shape != x.shape or rstd.shape != (*x.shape[:-1], 1) or not rstd.is_contiguous()
            or not _usable(*tensors)
            or (weight is not None and (weight.shape != x.shape[-1:]
                                        or not weight.is_contiguous()))):
        return None
    rows = _as_rows(x)
    if rows is None:
        return None
    (rows, x_stride), (grads, grad_stride) = rows, _grad_rows(grad_out)
    n, width = rows.shape
    grad_x = torch.empty(x.shape, dtype=torch.float32)
    grad_weight = partials = None
    if weight is not None and need_weight:
        grad_weight = torch.empty(width, dtype=torch.float32)
        partials = torch.empty(-(-n // _BLOCK_ROWS), width, dtype=torch.float32)
    library().rms_norm_backward(_ptr(rows), _optional_ptr(weight), _ptr(rstd), _ptr(grads),
                                 _ptr(grad_x), _optional_ptr(partials),
                                 _optional_ptr(grad_weight), n, width, x_stride, grad_stride,
                                 _BLOCK_ROWS, torch.get_num_threads())
    return grad_x, grad_weight


def _source_rows(sources, query, norm_weight):
    """(rows views, pointer array, stride array) of the depth mix's sources where the native
    kernel applies (fp32 CPU, one shape, contiguous rows; query and norm weight [width]), else
    None."""
    shape = sources[0].shape
    width = shape[-1]
    if (any(s.shape != shape for s in sources) or query.shape != (width,)
            or norm_weight.shape != (width,) or not query.is_contiguous()
            or not norm_weight.is_contiguous() or not _usable(*sources, query, norm_weight)):
        return None
    views = [_as_rows(s) for s in sources]
    if any(v is None for v in views):
        return None
    pointers = (_F32_P * len(views))(*(_ptr(v) for v, _ in views))
    strides = (ctypes.c_int64 * len(views))(*(stride for _, stride in views))
    return [v for v, _ in views], pointers, strides


def depth_mix_forward(sources: list[torch.Tensor], query: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(mixed [..., d], weights [n, ...], 1 / rms [n, ..., 1]) of model/attnres.py's
    _depth_mix_forward, reading the sources in place (no stacked copy); None where the native
    kernel does not apply."""
    operands = _source_rows(sources, query, norm_weight)
    if operands is None:
        return None
    views, pointers, strides = operands
    lead, n = sources[0].shape[:-1], len(sources)
    rows, width = views[0].shape
    mixed = torch.empty(sources[0].shape, dtype=torch.float32)
    weights = torch.empty(n, *lead, dtype=torch.float32)
    rstd = torch.empty(n, *lead, 1, dtype=torch.float32)
    library().depth_mix_forward(pointers, strides, n, _ptr(query), _ptr(norm_weight),
                                 _ptr(mixed), _ptr(weights), _ptr(rstd), rows, width, eps,
                                 torch.get_num_threads())
    return mixed, weights, rstd


def depth_mix_backward(sources: list[torch.Tensor], query: torch.Tensor,
                       norm_weight: torch.Tensor, weights: torch.Tensor, rstd: torch.Tensor,
                       grad: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(dvalues [n, ..., d], dquery, dnorm_weight) of model/attnres.py's _depth_mix_backward;
    None where the native kernel does not apply."""
    operands = _source_rows(sources, query, norm_weight)
    n = len(sources)
    if (operands is None or grad.shape != sources[0].shape or not _usable(grad, weights, rstd)
            or weights.shape != (n, *grad.shape[:-1]) or not weights.is_contiguous()
            or rstd.shape != (*weights.shape, 1) or not rstd.is_contiguous()):
        return None
    views, pointers, strides = operands
    grads, grad_stride = _grad_rows(grad)
    rows, width = views[0].shape
    dvalues = torch.empty(n, *sources[0].shape, dtype=torch.float32)
    coef = torch.empty(n, rows, dtype=torch.float32)
    partials = torch.empty(-(-rows // _BLOCK_ROWS), width, dtype=torch.float32)
    du = torch.empty(width, dtype=torch.float32)
    library().depth_mix_backward(pointers, strides, n, _ptr(query), _ptr(norm_weight),
                                  _ptr(weights), _ptr(rstd), _ptr(grads), grad_stride,
                                  _ptr(dvalues), _ptr(coef), _ptr(partials), _ptr(du), rows,
                                  width, _BLOCK_ROWS, torch.get_num_threads())
    return dvalues, du * norm_weight, du * query


def _kda_inputs_shape(q, k, beta_logits, z, a_log) -> tuple[int, int, int] | None:
    """(rows, H, K) where the native kernel applies to the KDA inputs (fp32 CPU, contiguous,
    q, k, z [..., H, K], beta_logits [..., H], a_log [H]), else None."""
    tensors = (q, k, beta_logits, z, a_log)
    if q.dim() < 2 or not _usable(*tensors) or not all(t.is_contiguous() for t in tensors):
        return None
    H, K = q.shape[-2:]
    if not (q.shape == k.shape == z.shape and beta_logits.shape == q.shape[:-1]
            and a_log.shape == (H,)):
        return None
    return q.numel() // max(H * K, 1), H, K


def kda_inputs_usable(q, k, beta_logits, z, a_log) -> bool:
    return _kda_inputs_shape(q, k, beta_logits, z, a_log) is not None


def kda_inputs_forward(q, k, beta_logits, z, a_log, lower_bound: float, eps: float):
    """(q and k L2-normalised, sigmoid(beta_logits), lower_bound sigmoid(exp(a_log) z)) of
    model/kda.py's kda_inputs_reference with K3's bounded gate; None where the native kernel
    does not apply (kda_inputs_usable)."""
    shape = _kda_inputs_shape(q, k, beta_logits, z, a_log)
    if shape is None:
        return None
    q_out, k_out, g = (torch.empty(q.shape, dtype=torch.float32) for _ in range(3))
    beta = torch.empty(beta_logits.shape, dtype=torch.float32)
    library().kda_inputs_forward(_ptr(q), _ptr(k), _ptr(beta_logits), _ptr(z), _ptr(a_log),
                                  _ptr(q_out), _ptr(k_out), _ptr(beta), _ptr(g), *shape,
                                  lower_bound, eps, torch.get_num_threads())
    return q_out, k_out, beta, g


def kda_inputs_backward(q, k, beta_logits, z, a_log, grad_q, grad_k, grad_beta, grad_g,
                        lower_bound: float, eps: float):
    """(dq, dk, dbeta_logits, dz, da_log) of kda_inputs_forward from its outputs' gradients;
    None where the native kernel does not apply."""
    shape = _kda_inputs_shape(q, k, beta_logits, z, a_log)
    grads = tuple(grad.contiguous() for grad in (grad_q, grad_k, grad_beta, grad_g))
    if shape is None or not _usable(*grads) or any(
            grad.shape != x.shape for grad, x in zip(grads, (q, k, beta_logits, z))):
        return None
    rows, H, _ = shape
    dq, dk, dz = (torch.empty(q.shape, dtype=torch.float32) for _ in range(3))
    dbeta_logits = torch.empty(beta_logits.shape, dtype=torch.float32)
    partials = torch.empty(-(-rows // _BLOCK_ROWS), H, dtype=torch.float32)
    da_log = torch.empty(H, dtype=torch.float32)
    library().kda_inputs_backward(
        _ptr(q), _ptr(k), _ptr(beta_logits), _ptr(z), _ptr(a_log), *(_ptr(g) for g in grads),
        _ptr(dq), _ptr(dk), _ptr(dbeta_logits), _ptr(dz), _ptr(partials), _ptr(da_log), *shape,
        lower_bound, eps, _BLOCK_ROWS, torch.get_num_threads())
    return dq, dk, dbeta_logits, dz, da_log


def _loss_rows_usable(logits: torch.Tensor, *per_row: torch.Tensor) -> bool:
    """fp32 CPU contiguous logits [rows, V] and per-row fp32 vectors [rows]."""
    return (logits.dim() == 2 and _usable(logits, *per_row) and logits.is_contiguous()
            and all(x.shape == logits.shape[:1] and x.is_contiguous() for x in per_row))


def log_sum_exp_rows(logits: torch.Tensor, out: torch.Tensor) -> bool:
    """torch.logsumexp(logits, -1) of logits [rows, V] into out [rows] (model/head.py
    _log_sum_exp_, leaving logits as they are); False where the native kernel does not
    apply."""
    if not _loss_rows_usable(logits, out):
        return False
    library().log_sum_exp_rows(_ptr(logits), _ptr(out), *logits.shape, torch.get_num_threads())
    return True


def softmax_grad_rows_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor,
                       scale: torch.Tensor) -> bool:
    """logits [rows, V] <- scale (softmax(logits) - one_hot(targets)) in place, softmax from the
    rows' log-sum-exp lse; False where the native kernel does not apply. Raises ValueError for a
    target outside the vocabulary."""
    if (not _loss_rows_usable(logits, lse, scale) or targets.dtype != torch.int64
            or targets.shape != lse.shape or not targets.is_contiguous()
            or targets.device.type != "cpu"):
        return False
    bad = library().softmax_grad_rows(_ptr(logits), _ptr(lse), _optional_ptr(targets), _ptr(scale),
                                       *logits.shape, torch.get_num_threads())
    if bad:
        raise ValueError(f"{bad} labels outside the vocabulary [0, {logits.shape[1]})")
    return True


# Tokens between the KDA recurrence's checkpoints: the backward holds one segment's states
# ([64, K, V] per thread: 256 KiB at K = V = 32, in cache).
KDA_SEGMENT = 64


def kda_usable(*tensors: torch.Tensor | None) -> bool:
    """Whether kda_forward applies: fp32 CPU plain tensors (None: an absent initial state)."""
    return _usable(*(t for t in tensors if t is not None))


def _kda_scratch(bounds: torch.Tensor, floats_per_thread: int):
    threads = torch.get_num_threads()
    first = torch.empty(bounds.shape[0], dtype=torch.int64)
    return first, torch.empty(threads, floats_per_thread), threads


def kda_forward(q, k, v, g, beta, initial_state, bounds, scale: float, floor: float):
    """(o [.., H, V], final states [N, H, K, V], checkpoints) of the KDA recurrence over the
    sequences bounds[n] .. bounds[n + 1] of the flattened tokens (model/ops/kda/naive.py
    kda_recurrent with g clamped at `floor`, -inf for none), for contiguous fp32 CPU q, k, g
    [.., H, K], v [.., H, V], beta [.., H], initial_state [N, H, K, V] or None and int64
    bounds [N + 1]. Raises ValueError where bounds do not run from 0 to the token count
    without decreasing."""
    H, K, V = *q.shape[-2:], v.shape[-1]
    tokens, N = q.numel() // (H * K), bounds.shape[0] - 1
    o = torch.empty(v.shape, dtype=torch.float32)
    final = torch.empty(N, H, K, V)
    # sum of ceil(len_n / segment) <= ceil(tokens / segment) + N - 1: a static count.
    checkpoints = torch.empty(max(-(-tokens // KDA_SEGMENT) + N - 1, 0), H, K, V)
    first, work, threads = _kda_scratch(bounds, K + 2 * V)
    count = library().kda_forward(
        _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _optional_ptr(initial_state),
        _optional_ptr(bounds), N, tokens, H, K, V, scale, floor, KDA_SEGMENT, _ptr(o), _ptr(final),
        _ptr(checkpoints), _optional_ptr(first), _ptr(work), threads)
    if count < 0:
        raise ValueError(f"cu_seqlens {bounds.tolist()} is invalid: must start at 0, never "
                         f"decrease and end at the token count {tokens}")
    return o, final, checkpoints


def kda_backward(q, k, v, g, beta, checkpoints, bounds, scale: float, floor: float,
                 grad_o, grad_final, need_initial: bool):
    """(dq, dk, dv, dg, dbeta, d initial_state or None) of kda_forward from the gradients of o
    and of the final states (None: zero), recomputing the states from the checkpoints."""
    H, K, V = *q.shape[-2:], v.shape[-1]
    tokens, N = q.numel() // (H * K), bounds.shape[0] - 1
    grad_o = torch.zeros_like(v) if grad_o is None else grad_o.contiguous()
    grad_final = None if grad_final is None else grad_final.contiguous()
    dq, dk, dg = (torch.empty(q.shape, dtype=torch.float32) for _ in range(3))
    dv, dbeta = torch.empty(v.shape, dtype=torch.float32), torch.empty(beta.shape)
    grad_initial = torch.empty(N, H, K, V) if need_initial else None
    first, work, threads = _kda_scratch(bounds, (KDA_SEGMENT + 2) * K * V + KDA_SEGMENT * V + 4 * K)
    library().kda_backward(
        _ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(checkpoints), _optional_ptr(bounds), N,
        tokens, H, K, V, scale, floor, KDA_SEGMENT, _ptr(grad_o), _optional_ptr(grad_final),
        _ptr(dq), _ptr(dk), _ptr(dv), _ptr(dg), _ptr(dbeta), _optional_ptr(grad_initial),
        _optional_ptr(first), _ptr(work), threads)
    return dq, dk, dv, dg, dbeta, grad_initial


def attention_forward(q, k, v, q_segments, k_segments, scale: float, causal: bool,
                      q_offset: int):
    """(o [B, H, T, Dv], lse [B, H, T], row_max [B, H, T]) of model/ops/attention.py's
    _BlockwiseAttention forward for fp32 CPU q, k [B, H, T(k), D], v [B, H, Tk, Dv] and fp32
    segment ids [B, T], [B, Tk] (or both None), computing only the keys each query attends;
    None where the native kernel does not apply (or the ids are not sorted along a row)."""
    operands = _attention_operands(q, k, v, q_segments, k_segments)
    if operands is None:
        return None
    q, k, v, q_segments, k_segments = operands
    B, H, T, D = q.shape
    Tk, Dv = k.shape[2], v.shape[3]
    o = torch.empty(B, H, T, Dv)
    lse, row_max = torch.empty(B, H, T), torch.empty(B, H, T)
    threads = torch.get_num_threads()
    work = torch.empty(threads, D + D * Tk + Tk)
    status = library().attention_forward(
        _ptr(q), _ptr(k), _ptr(v), _optional_ptr(q_segments), _optional_ptr(k_segments), B, H,
        T, Tk, D, Dv, scale, causal, q_offset, _ptr(o), _ptr(lse), _ptr(row_max), _ptr(work),
        threads)
    return None if status < 0 else (o, lse, row_max)


def attention_backward(q, k, v, q_segments, k_segments, o, lse, grad_o, scale: float,
                       causal: bool, q_offset: int):
    """(dq, dk, dv) of attention_forward from the gradient of o; None where it does not
    apply."""
    operands = _attention_operands(q, k, v, q_segments, k_segments)
    if operands is None or not _usable(o, lse, grad_o):
        return None
    q, k, v, q_segments, k_segments = operands
    B, H, T, D = q.shape
    Tk, Dv = k.shape[2], v.shape[3]
    o, lse, grad_o = (x.contiguous() for x in (o, lse, grad_o))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    threads = torch.get_num_threads()
    work = torch.empty(threads, 2 * D + (D + Dv) * Tk + 2 * Tk)
    library().attention_backward(
        _ptr(q), _ptr(k), _ptr(v), _optional_ptr(q_segments), _optional_ptr(k_segments),
        _ptr(o), _ptr(lse), _ptr(grad_o), B, H, T, Tk, D, Dv, scale, causal, q_offset,
        _ptr(dq), _ptr(dk), _ptr(dv), _ptr(work), threads)
    return dq, dk, dv


def _attention_operands(q, k, v, q_segments, k_segments):
    tensors = [q, k, v] + ([] if q_segments is None else [q_segments, k_segments])
    if q.dim() != 4 or not _usable(*tensors):
        return None
    return tuple(None if x is None else x.contiguous()
                 for x in (q, k, v, q_segments, k_segments))
