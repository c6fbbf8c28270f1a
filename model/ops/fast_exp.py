"""exp on the hot paths, computed as exp2 of the exponent times log2(e).

torch's CPU exp goes through MKL's vector math library on x86 builds, and on AMD CPUs that runs
its generic code (slow, and slower still on subnormal results), while ATen vectorises exp2
itself. The product with log2(e) rounds once: the result is exp of the exponent perturbed by at
most half an ulp (relative error up to |x| 2^-24, 4e-6 at x = -80 in fp32), the size of the
rounding any computed exponent (a cumsum, a difference) already carries. The references
(kda_recurrent, the dense attention, torch.logsumexp) keep torch.exp; tests compare against
them.
"""

from __future__ import annotations

import math

import torch

LOG2_E = 1.0 / math.log(2.0)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in place."""
    return x.mul_(LOG2_E).exp2_()
