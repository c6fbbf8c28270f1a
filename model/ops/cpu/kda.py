"""The KDA kernels that exist only as C loops: the recurrence itself with its checkpointed
backward (what kda_chunk's `auto` backend takes for fp32 CPU tensors) and the KDA layer's inputs
(q and k L2-normalised, beta, K3's bounded gate) as one pass each way. On a CPU the state of a
head (4 KiB at K = V = 32) stays in cache, where the chunk form's small matmuls and element-wise
passes go through memory and torch's per-operator cost."""

from __future__ import annotations

import torch

from model.kda import kda_inputs_reference

from . import bindings


def kda_recurrence(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                   lower_bound):
    """kda_chunk's (o, final state or None) as the recurrence in C loops, g clamped at
    lower_bound (a safe bound or None); None where the kernel does not take the inputs."""
    if not bindings.kda_usable(q, k, v, g, beta, initial_state):
        return None
    if cu_seqlens is None:  # each row one sequence
        bounds = torch.arange(q.shape[0] + 1) * q.shape[1]
    else:
        bounds = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    floor = -torch.inf if lower_bound is None else lower_bound  # the bounded form clamps too
    o, final = _NativeRecurrence.apply(q, k, v, g, beta, initial_state, bounds, scale, floor)
    return o, final if output_final_state else None


class _NativeRecurrence(torch.autograd.Function):
    """kda_recurrent (with g clamped at `floor`) forward and backward in C loops; it keeps its
    inputs and the state at every bindings.KDA_SEGMENT-th token of each sequence, and the
    backward recomputes the states in between."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, bounds, scale, floor):
        inputs = [x.contiguous() for x in (q, k, v, g, beta)]
        initial = None if initial_state is None else initial_state.contiguous()
        o, final, checkpoints = bindings.kda_forward(*inputs, initial, bounds, scale, floor)
        ctx.save_for_backward(*inputs, checkpoints, bounds)
        ctx.scale, ctx.floor = scale, floor
        ctx.set_materialize_grads(False)  # an unused final state needs no zero gradient
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        *inputs, checkpoints, bounds = ctx.saved_tensors
        grads = bindings.kda_backward(*inputs, checkpoints, bounds, ctx.scale, ctx.floor, do,
                                      dfinal, ctx.needs_input_grad[5])
        return *grads, None, None, None


def kda_inputs(q, k, beta_logits, z, a_log, lower_bound: float, eps: float):
    """model/kda.py's kda_inputs_reference with K3's bounded gate, as one pass each way; None
    where the kernel does not take the inputs."""
    if not bindings.kda_inputs_usable(q, k, beta_logits, z, a_log):
        return None
    return _NativeKDAInputs.apply(q, k, beta_logits, z, a_log, lower_bound, eps)


class _NativeKDAInputs(torch.autograd.Function):
    """Saves only the inputs (the torch ops would keep about a dozen intermediates)."""

    @staticmethod
    def forward(ctx, q, k, beta_logits, z, a_log, lower_bound, eps):
        ctx.save_for_backward(q, k, beta_logits, z, a_log)
        ctx.lower_bound, ctx.eps = lower_bound, eps
        return bindings.kda_inputs_forward(q, k, beta_logits, z, a_log, lower_bound, eps)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_beta, grad_g):
        inputs = ctx.saved_tensors
        grads = bindings.kda_inputs_backward(*inputs, grad_q, grad_k, grad_beta, grad_g,
                                             ctx.lower_bound, ctx.eps)
        if grads is None:  # e.g. gradients of another dtype: autograd through the reference
            with torch.enable_grad():
                leaves = [x.detach().requires_grad_() for x in inputs]
                outs = kda_inputs_reference(*leaves, "lower_bound", ctx.lower_bound)
                grads = torch.autograd.grad(outs, leaves, (grad_q, grad_k, grad_beta, grad_g))
        return *grads, None, None
