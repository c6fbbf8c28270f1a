"""OCP Microscaling (MX) quantisation: MXFP4 (E2M1) and MXFP8 (E4M3) elements, E8M0 block scales.

Blocks of `block_size` (32) consecutive elements along the last dimension (the GEMM reduction
dimension) share one power-of-two scale 2^e, stored as the byte e + 127; 0xFF marks a NaN
block. Elements x / 2^e round to nearest even on the element grid (subnormals included) and
saturate to the largest finite element.

Scale exponent:
  "floor" (OCP MX v1.0): e = floor(log2 amax) - emax_elem   (emax_elem 2 for E2M1, 8 for E4M3)
  "rceil" (NVIDIA cuBLAS/TE): e = ceil(log2(amax / max_elem)), so amax / 2^e never saturates
both clamped to [-127, 127]. An all-zero block gets e = -127 (byte 0); a NaN or Inf anywhere in
a block makes the whole block NaN (byte 0xFF, element codes 0, dequantises to NaN).

Everything is computed in fp32 (fp64 for fp64 inputs, so that a float64 run is not rounded to
fp32 before the element grid) with exact integer/bit arithmetic (no log2, no host sync, static
shapes), so the same code runs inside training forward passes on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

E8M0_BIAS = 127
E8M0_NAN = 0xFF
SCALE_MODES = ("floor", "rceil")


class _FloatBits(NamedTuple):
    mantissa_bits: int
    bias: int
    int_dtype: torch.dtype


# The float formats the quantiser computes in: fp64 inputs in fp64, every other input in fp32.
_FLOAT_BITS = {torch.float32: _FloatBits(23, 127, torch.int32),
               torch.float64: _FloatBits(52, 1023, torch.int64)}


@dataclass(frozen=True)
class ElementFormat:
    """A sign-magnitude minifloat element type; codes are sign | exponent field | mantissa."""

    name: str
    ebits: int
    mbits: int
    bias: int
    max_code: int  # magnitude code of the largest finite value
    nan_code: int | None  # magnitude code that means NaN (E4M3FN: 0x7F), None if there is none

    @property
    def sign_bit(self) -> int:
        return 1 << (self.ebits + self.mbits)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (subnormals share it)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two in the format (OCP's emax_elem)."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_value(self) -> float:
        mantissa = (1 << self.mbits) + (self.max_code & ((1 << self.mbits) - 1))
        return float(mantissa * 2.0 ** (self.emax - self.mbits))


FORMATS = {
    "e2m1": ElementFormat("e2m1", ebits=2, mbits=1, bias=1, max_code=0b111, nan_code=None),
    "e4m3": ElementFormat("e4m3", ebits=4, mbits=3, bias=7, max_code=0x7E, nan_code=0x7F),
}


def element_format(fmt: str) -> ElementFormat:
    if fmt not in FORMATS:
        raise ValueError(f"MX element format must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"MX scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")


class MXPacked(NamedTuple):
    """gpt-oss checkpoint layout: `blocks` (..., K/32, 16) for E2M1 (two codes per byte, even
    element in the low nibble) or (..., K/32, 32) for E4M3, and `scales` (..., K/32)."""

    blocks: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True, eq=False)
class MXTensor:
    """Quantised tensor: one uint8 code per element (unpacked) and one E8M0 byte per block."""

    codes: torch.Tensor  # uint8, shape (..., K)
    scales: torch.Tensor  # uint8, shape (..., K // block_size)
    fmt: str
    block_size: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        spec = element_format(self.fmt)
        values = _decode(self.codes.to(torch.int32), spec)
        values = values.reshape(*self.scales.shape, self.block_size)
        exponent = self.scales.to(torch.int32) - E8M0_BIAS
        values = values * _pow2(exponent.clamp(max=127), torch.float32).unsqueeze(-1)
        values = torch.where((self.scales == E8M0_NAN).unsqueeze(-1), float("nan"), values)
        return values.reshape(self.shape).to(dtype)

    def pack(self) -> MXPacked:
        blocks = self.codes.reshape(*self.scales.shape, self.block_size)
        if self.fmt == "e2m1":
            pairs = blocks.reshape(*self.scales.shape, self.block_size // 2, 2)
            blocks = pairs[..., 0] | (pairs[..., 1] << 4)
        return MXPacked(blocks, self.scales)

    @classmethod
    def from_packed(cls, blocks: torch.Tensor, scales: torch.Tensor, fmt: str) -> MXTensor:
        """Inverse of `pack`; the block size is read off the layout."""
        element_format(fmt)
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"packed MX blocks and scales must be uint8, got "
                             f"{blocks.dtype} and {scales.dtype}")
        if blocks.shape[:-1] != scales.shape:
            raise ValueError(f"packed MX blocks {tuple(blocks.shape)} do not match scales "
                             f"{tuple(scales.shape)}")
        if fmt == "e2m1":
            blocks = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)
        codes = blocks.reshape(*scales.shape[:-1], scales.shape[-1] * blocks.shape[-1])
        return cls(codes, scales, fmt, blocks.shape[-1])


def quantize_mx(x: torch.Tensor, fmt: str, block_size: int = 32,
                scale_mode: str = "floor") -> MXTensor:
    """Quantises `x` into MX blocks along its last dimension (see the module docstring)."""
    spec = element_format(fmt)
    _check_scale_mode(scale_mode)
    blocks = _to_blocks(x, block_size)
    exponent, is_nan = _block_exponent(blocks, spec, scale_mode)
    steps, binade = _round_to_grid(blocks * _pow2(-exponent, blocks.dtype).unsqueeze(-1), spec)
    # Code of steps * 2^(binade - mbits): a carry into the next binade lands on the right code.
    magnitude = ((binade + (spec.bias - 1)) << spec.mbits) + steps.to(torch.int32)
    codes = magnitude.clamp(max=spec.max_code) | (torch.signbit(blocks).to(torch.int32)
                                                  * spec.sign_bit)
    codes = torch.where(is_nan.unsqueeze(-1), 0, codes).to(torch.uint8)
    scales = torch.where(is_nan, E8M0_NAN, exponent + E8M0_BIAS).to(torch.uint8)
    return MXTensor(codes.reshape(x.shape), scales, fmt, block_size)


def fake_quantize_mx(x: torch.Tensor, fmt: str, block_size: int = 32,
                     scale_mode: str = "floor", dim: int = -1) -> torch.Tensor:
    """quantize_mx(x).dequantize(x.dtype) computed directly in value space (no codes), with the
    blocks along `dim`. Not differentiable in a useful way: train through train.precision.qat."""
    if x.dim() > 1 and dim % x.dim() != x.dim() - 1:
        moved = fake_quantize_mx(x.movedim(dim, -1), fmt, block_size, scale_mode)
        return moved.movedim(-1, dim)
    spec = element_format(fmt)
    _check_scale_mode(scale_mode)
    blocks = _to_blocks(x, block_size)
    exponent, is_nan = _block_exponent(blocks, spec, scale_mode)
    steps, binade = _round_to_grid(blocks * _pow2(-exponent, blocks.dtype).unsqueeze(-1), spec)
    magnitude = torch.clamp(steps * _pow2(binade - spec.mbits, blocks.dtype), max=spec.max_value)
    values = torch.copysign(magnitude, blocks) * _pow2(exponent, blocks.dtype).unsqueeze(-1)
    values = torch.where(is_nan.unsqueeze(-1), float("nan"), values)
    return values.reshape(x.shape).to(x.dtype)


def _to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    if not x.is_floating_point():
        raise ValueError(f"MX quantisation needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0 or block_size <= 0 or x.shape[-1] % block_size != 0:
        raise ValueError(f"MX quantisation needs the last dimension of shape {tuple(x.shape)} "
                         f"to be a multiple of block_size={block_size}")
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(compute).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def _pow2(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Exact 2^n in `dtype` (fp32 or fp64) for the integer n used here, built from the bits.
    The one power below the normal range is fp32's 2^-127, the smallest E8M0 scale."""
    bits = _FLOAT_BITS[dtype]
    n = n.to(bits.int_dtype)
    normal = ((n.clamp(min=1 - bits.bias) + bits.bias) << bits.mantissa_bits).view(dtype)
    return torch.where(n < 1 - bits.bias, 2.0**-127, normal)


def _float_fields(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(unbiased exponent, mantissa bits) of non-negative fp32 or fp64 values. Zero and
    subnormals give the format's -bias, which every caller clamps away."""
    fmt = _FLOAT_BITS[v.dtype]
    bits = v.view(fmt.int_dtype)
    return (bits >> fmt.mantissa_bits) - fmt.bias, bits & ((1 << fmt.mantissa_bits) - 1)


def _block_exponent(blocks: torch.Tensor, spec: ElementFormat,
                    scale_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared scale exponent per block (int32 in [-127, 127]) and the NaN-block mask."""
    amax = blocks.abs().amax(dim=-1)  # NaN propagates, Inf stays Inf
    exponent, mantissa = _float_fields(amax)
    exponent = exponent - spec.emax
    if scale_mode == "rceil":
        # amax = 1.m * 2^k: ceil(log2(amax / max_value)) is k - emax, plus one exactly when
        # 1.m exceeds max_value / 2^emax (1.5 for E2M1, 1.75 for E4M3).
        mantissa_bits = _FLOAT_BITS[amax.dtype].mantissa_bits
        threshold = round((spec.max_value / 2.0**spec.emax - 1) * 2**mantissa_bits)
        exponent = exponent + (mantissa > threshold).to(exponent.dtype)
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32), ~torch.isfinite(amax)


def _round_to_grid(scaled: torch.Tensor,
                   spec: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """|scaled| rounded half-to-even to the element grid, unsaturated, as (steps, binade):
    value = steps * 2^(binade - mbits), binade >= emin (the subnormal binade shares emin)."""
    magnitude = scaled.abs()
    binade = _float_fields(magnitude)[0].clamp(min=spec.emin).to(torch.int32)
    # exact scaling; round = RNE
    steps = torch.round(magnitude * _pow2(spec.mbits - binade, magnitude.dtype))
    return steps, binade


def _decode(codes: torch.Tensor, spec: ElementFormat) -> torch.Tensor:
    """fp32 value of each element code (int32), without the block scale."""
    field = (codes >> spec.mbits) & ((1 << spec.ebits) - 1)
    mantissa = codes & ((1 << spec.mbits) - 1)
    significand = mantissa + torch.where(field > 0, 1 << spec.mbits, 0)
    magnitude = significand.float() * _pow2(field.clamp(min=1) - spec.bias - spec.mbits,
                                            torch.float32)
    if spec.nan_code is not None:
        magnitude = torch.where((codes & (spec.sign_bit - 1)) == spec.nan_code, float("nan"),
                                magnitude)
    return torch.where((codes & spec.sign_bit) != 0, -magnitude, magnitude)
