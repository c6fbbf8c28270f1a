"""Element-wise kernels fused by torch.compile where the run asks for it (`fused_kernels=true`).

In eager torch every element-wise op is one pass over memory: at k3_tiny's width the chains
inside the model's autograd functions (SiTU-GLU, RMSNorm, the short convolution, the depth mix,
the KDA intra-chunk work) are most of a CPU step, and their matmuls are not. Inductor turns each
chain into one loop over the elements; where a registered kernel (model/ops/dispatch.py, e.g.
model/ops/cpu's on fp32 CPU tensors) takes an op's inputs, these are not reached. The functions
marked `fusable` are pure tensor code called under no_grad (from an autograd function's forward
or backward), so inductor compiles inference graphs; the marked function itself is the eager
form and what runs when fusion is off.
"""

from __future__ import annotations

import functools

import torch

_enabled = False
_compiled: list[str] = []  # the kernels compiled so far, by name


# Graphs per kernel: each dtype, tensor rank (width, for the row-wise kernels) and None-ness of
# an optional argument compiles one, a size that changes one more (with that size dynamic); a K3
# run meets a few, a test suite more.
_GRAPHS_PER_KERNEL = 64


def enable_fused_kernels(enabled: bool) -> None:
    """Process-wide, like torch.backends' flags: the model's modules call the kernels deep inside
    autograd functions, where no module attribute reaches."""
    global _enabled
    _enabled = enabled
    if enabled:
        import torch._dynamo  # here, not at the top: it imports sympy and inductor's config

        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, _GRAPHS_PER_KERNEL)


def fused_kernels_enabled() -> bool:
    return _enabled


def compiled_kernels() -> list[str]:
    """The qualified names of the kernels compiled so far in this process."""
    return list(_compiled)


def plain_tensors(args) -> bool:
    """No tensor subclass among args: a DTensor (sequence parallelism hands the norms DTensors)
    shards each op in its own dispatch, which these kernels are not compiled or tested for."""
    return all(type(a) in (torch.Tensor, torch.nn.Parameter) for a in args
               if isinstance(a, torch.Tensor))


def fusable(fn=None, *, dynamic: str | None = None):
    """`fn` compiled on first use when fused kernels are on (for the sizes seen first, and once
    more with dynamic sizes where one changes); `fn` itself otherwise, for tensor subclasses
    (DTensor), and inside a graph that torch.compile is already tracing (which then fuses it
    with its surroundings). Each graph is one more compile; `dynamic` says which sizes one
    graph takes, for every tensor argument of two or more dims:

    - "rows", for row-wise kernels (norms, activations): the arguments are [..., width] over the
      same leading dims (tokens, patches, expert slots); the kernel takes them as [rows, width]
      with any number of rows, and its outputs of two dims come back with those leading dims.
      One graph per width (the demo's norms run at 3 widths in 11 shapes).
    - "dim0": any size in the first dim (the depth mix's count of sources)."""
    if dynamic not in (None, "rows", "dim0"):
        raise ValueError(f"dynamic={dynamic!r} is invalid: must be None, 'rows' or 'dim0'")
    if fn is None:
        return functools.partial(fusable, dynamic=dynamic)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if not _enabled or torch.compiler.is_compiling() or not plain_tensors(args):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True)
            _compiled.append(f"{fn.__module__}.{fn.__qualname__}")
        if dynamic is None:
            return compiled(*args, **kwargs)
        return _with_dynamic_dim0(compiled, args, kwargs, flatten=dynamic == "rows")

    return call


def _with_dynamic_dim0(compiled, args, kwargs, flatten: bool):
    """compiled(*args) with dim 0 of the tensor arguments marked dynamic, after flattening their
    leading dims into one (rows) if `flatten`; outputs of two dims get the leading dims back."""
    lead = next((a.shape[:-1] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2),
                None)
    if lead is None:
        return compiled(*args, **kwargs)
    detach = not torch.is_grad_enabled()  # the kernels run under no_grad; keep autograd if not
    prepared = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            if flatten and a.dim() > 2:
                a = a.flatten(0, -2)
            if detach:  # dynamo guards a view's base and requires_grad: one graph for all
                a = a.detach()
            torch._dynamo.maybe_mark_dynamic(a, 0)
        prepared.append(a)
    out = compiled(*prepared, **kwargs)
    if not flatten or len(lead) == 1:
        return out

    def unflatten(x):
        return x.view(*lead, x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() == 2 else x

    return tuple(unflatten(x) for x in out) if isinstance(out, tuple) else unflatten(out)
