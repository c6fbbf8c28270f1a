"""Stable LatentMoE with Quantile Balancing."""

from model.moe.balancing import (
    QuantileBalancer,
    load_statistics,
    no_reduce,
    statistics_paused,
    update_balancers,
)
from model.moe.dispatch import Dispatched, LocalDispatcher
from model.moe.experts import GroupedExperts, grouped_mm_supported
from model.moe.layer import LatentMoE
from model.moe.router import Routing, SigmoidRouter, route

__all__ = [
    "Dispatched",
    "GroupedExperts",
    "LatentMoE",
    "LocalDispatcher",
    "QuantileBalancer",
    "Routing",
    "SigmoidRouter",
    "grouped_mm_supported",
    "load_statistics",
    "no_reduce",
    "route",
    "statistics_paused",
    "update_balancers",
]
