"""2-D axial rotary position embedding for the vision encoder's queries and keys.

The first half of each head's dimensions rotates with the patch row, the second half with the
patch column. Within a half of size D/2, dimension k pairs with k + D/4 and turns at frequency
theta^(-k / (D/4)), so q.k after rotation depends only on the (row, col) difference.
"""

from __future__ import annotations

import torch


def axial_rope_angles(rows: torch.Tensor, cols: torch.Tensor, head_dim: int,
                      theta: float) -> torch.Tensor:
    """[P] rows, [P] cols -> angles [P, 2, head_dim // 4] (axis: row, col; frequency), fp32."""
    quarter = head_dim // 4
    inv_freq = theta ** (-torch.arange(quarter, dtype=torch.float32, device=rows.device) / quarter)
    positions = torch.stack((rows, cols), dim=-1).to(torch.float32)
    return positions.unsqueeze(-1) * inv_freq


def apply_axial_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotates x [P, H, D] by angles [P, 2, D // 4]; computed in fp32, returned in x's dtype."""
    tokens, heads, head_dim = x.shape
    pairs = x.float().view(tokens, heads, 2, 2, head_dim // 4)  # axis, pair member, frequency
    first, second = pairs.unbind(dim=3)
    cos = angles.cos().unsqueeze(1)
    sin = angles.sin().unsqueeze(1)
    rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=3)
    return rotated.reshape(tokens, heads, head_dim).to(x.dtype)
