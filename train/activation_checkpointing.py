"""Activation checkpointing and sublayer compile live in parallel.activation_checkpointing
(parallelize applies them); re-exported here for the code that imports them from train."""

from parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    compile_sublayers,
    is_checkpointed,
)

__all__ = ["apply_activation_checkpointing", "compile_sublayers", "is_checkpointed"]
