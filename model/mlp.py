"""The dense SiTU-GLU MLP: the first decoder layer's MLP and the MoE's fused shared experts."""

import torch
from torch import nn

from model.activations import situ_glu_halves


class SiTUGLUMLP(nn.Module):
    """down(situ_glu(gate(x), up(x))) with gate and up fused into one Linear.

    `gate_up.weight` is [2 * intermediate, dim]: rows [0, intermediate) are the gate, the rest
    the up projection. No biases.
    """

    def __init__(self, dim: int, intermediate: int, beta_gate: float = 4.0,
                 beta_up: float = 25.0, init_std: float = 0.02):
        super().__init__()
        self.intermediate = intermediate
        self.beta_gate = beta_gate
        self.beta_up = beta_up
        self.gate_up = nn.Linear(dim, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, dim, bias=False)
        for linear in (self.gate_up, self.down):
            nn.init.normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(situ_glu_halves(self.gate_up(x), self.beta_gate, self.beta_up))
