"""`k3-plan`'s old module path (`python -m train.plan`, `from train.plan import ...`): the
sizing itself is train.sizing."""

from .sizing import (
    H200_BYTES,
    LONG_CONTEXT,
    RESERVE,
    GiB,
    activation_bytes,
    data_parallel_bytes,
    expert_traffic,
    fitted_saved_after_forward,
    format_plan,
    layout_dict,
    long_context_memory,
    main,
    memory_per_gpu,
    plan,
    plan_topology,
    saved_after_forward,
)

__all__ = ["GiB", "H200_BYTES", "LONG_CONTEXT", "RESERVE", "activation_bytes",
           "data_parallel_bytes", "expert_traffic", "fitted_saved_after_forward", "format_plan",
           "layout_dict", "long_context_memory", "main", "memory_per_gpu", "plan",
           "plan_topology", "saved_after_forward"]

if __name__ == "__main__":
    main()
