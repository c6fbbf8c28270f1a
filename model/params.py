"""Parameter counts of a built (possibly meta-device) K3 model."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .moe.experts import GroupedExperts


@dataclass
class ParamCount:
    total: int  # every parameter of the multimodal model
    language_model: int  # without the vision encoder and projector
    vision: int
    embedding: int
    routed_experts: int
    active: int  # per text token: LM without the input embedding, routed experts at top_k/E

    def as_dict(self) -> dict:
        return asdict(self)


def count_parameters(model) -> ParamCount:
    """Counts a built (possibly meta-device) K3Model."""
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for p in model.vision.parameters()) if model.vision is not None else 0
    embedding = model.embed.weight.numel()
    routed = sum(p.numel() for m in model.modules() if isinstance(m, GroupedExperts)
                 for p in m.parameters())
    moe = model.cfg.moe
    active = total - vision - embedding - routed + routed * moe.top_k // moe.num_experts
    return ParamCount(total, total - vision, vision, embedding, routed, active)
