"""Strides of a contiguous tensor of a given shape: what `DTensor.from_local` needs beside the
logical shape of a tensor that no rank holds whole."""

from __future__ import annotations


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))
