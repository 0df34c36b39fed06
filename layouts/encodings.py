"""Element encodings: what a stored code or scale *means* as a number.

Codes are always the stored unsigned integers (a symmetric 4-bit format stores value + 8).
An encoding turns them into real values (float64 here, the reference precision), and
scale formats turn floats into the bytes an engine stores and back. Every table here is
also what a kernel uses (a 16-entry e2m1 table, a 256-entry e4m3 table), so the numpy
reference and the device decode read the same numbers.
"""

from __future__ import annotations

import attrs
import numpy as np

from .checks import one_of

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bytes (bias 7, no inf, 0x7F/0xFF NaN)."""
    byte = np.arange(256)
    sign = np.where(byte & 0x80, -1.0, 1.0)
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7))
    values = sign * magnitude
    values[(byte & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
E4M3_MAX = 448.0

UE5M3_BIAS = 22


def _ue5m3_table() -> np.ndarray:
    """float32 value of each byte of the kernels' unsigned e5m3 scale: 2**(e - 22) * (1 + m / 8)
    for exponent bits e in 1..30; bytes with e = 0 or 31 are not used (NaN)."""
    byte = np.arange(256)
    exponent, mantissa = byte >> 3, byte & 0x7
    values = (1 + mantissa / 8.0) * 2.0 ** (exponent - UE5M3_BIAS)
    values[(exponent == 0) | (exponent == 31)] = np.nan
    return values.astype(np.float32)


UE5M3_VALUES = _ue5m3_table()
UE5M3_FIRST, UE5M3_LAST = 0x08, 0xF7  # 2**-21 and 480: every positive e4m3 value lies between


def _round_to_table(magnitude: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the increasing `positive` table, ties to the even index,
    clamped to the table's ends."""
    upper = np.clip(np.searchsorted(positive, magnitude), 1, positive.size - 1)
    lower = upper - 1
    below, above = magnitude - positive[lower], positive[upper] - magnitude
    choose_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.where(choose_upper, upper, lower)


def e4m3_encode(values: np.ndarray) -> np.ndarray:
    """Round float values to float8_e4m3fn bytes: nearest, ties to even, saturating at ±448."""
    values = np.asarray(values, dtype=np.float32)
    magnitude = np.minimum(np.abs(values), E4M3_MAX)
    code = _round_to_table(magnitude, E4M3_VALUES[:0x7F]).astype(np.uint8)  # bytes 0x00..0x7E, increasing
    code = np.where(np.signbit(values), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(values), np.uint8(0x7F), code).astype(np.uint8)


def ue5m3_encode(values: np.ndarray) -> np.ndarray:
    """Round positive float values to ue5m3 bytes: nearest, ties to even, clamped to
    [2**-21, 480]. The format has no sign, zero or NaN: callers fold those away first."""
    values = np.asarray(values, dtype=np.float32)
    if np.any(~(values > 0)):
        raise ValueError("ue5m3 holds positive scales only (fold signs and zeros into the codes first)")
    positive = UE5M3_VALUES[UE5M3_FIRST:UE5M3_LAST + 1]
    return (_round_to_table(values, positive) + UE5M3_FIRST).astype(np.uint8)


def bf16_encode(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded).astype(np.uint16)


def bf16_decode(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


@attrs.frozen
class IntCode:
    """Unsigned `bits`-wide integer codes. Symmetric formats subtract a fixed `bias`
    (uint4b8: 8, uint8b128: 128); asymmetric ones (bias None) subtract per-group zero points."""

    bits: int = attrs.field()
    bias: int | None = attrs.field(default=None)

    @bits.validator
    def _check_bits(self, attribute, value):
        if value not in (2, 3, 4, 8):
            raise ValueError(f"bits must be one of 2, 3, 4, 8, got {value!r}")

    @bias.validator
    def _check_bias(self, attribute, value):
        if value is not None and not 0 <= value < 1 << self.bits:
            raise ValueError(f"bias must lie in [0, {1 << self.bits}), got {value!r}")

    @property
    def symmetric(self) -> bool:
        return self.bias is not None

    def values(self, codes: np.ndarray, zeros: np.ndarray | None) -> np.ndarray:
        """Real value of each code before scaling: code - bias, or code - zero point."""
        offset = self.bias if self.symmetric else zeros
        return np.asarray(codes, np.float64) - np.asarray(offset, np.float64)

    def __repr__(self) -> str:
        return f"uint{self.bits}" + (f"b{self.bias}" if self.symmetric else "")


@attrs.frozen
class E2M1:
    """FP4 e2m1 nibbles: bit 3 sign, bits 2..0 index [0, .5, 1, 1.5, 2, 3, 4, 6]."""

    bits: int = 4
    bias = None
    symmetric = True

    def values(self, codes: np.ndarray, zeros=None) -> np.ndarray:
        return E2M1_VALUES[np.asarray(codes)].astype(np.float64)

    def __repr__(self) -> str:
        return "e2m1"


@attrs.frozen
class FloatFormat:
    """How scale values are stored: float16, bfloat16 (as uint16 bits, numpy has no bf16),
    float32, float8_e4m3 (as uint8 bytes), or float8_ue5m3 (uint8 bytes).

    float8_ue5m3 is the kernels' own NVFP4 block scale: 5 exponent bits (bias 22) and 3
    mantissa bits, no sign. It holds every positive e4m3 value exactly (e4m3 subnormals
    become normals), and one byte permute plus one shift turn two of them into a half
    pair (`numba_kernels.fragments`). Having no sign or zero, it is `signed=False`: a spec
    storing it moves a negative scale's sign into its e2m1 codes and zeroes the codes of a
    zero scale (`QuantSpec.pack`), which leaves every weight as it was."""

    name: str = attrs.field(validator=one_of(("float16", "bfloat16", "float32", "float8_e4m3", "float8_ue5m3")))

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype({"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32,
                         "float8_e4m3": np.uint8, "float8_ue5m3": np.uint8}[self.name])

    @property
    def torch_bytes(self) -> str | None:
        """The torch dtype (by name) of a checkpoint tensor holding this format's values in
        its own bytes, which numpy lacks: read as those bytes (float8_e4m3 -> float8_e4m3fn)."""
        return {"float8_e4m3": "float8_e4m3fn"}.get(self.name)

    @property
    def byte_values(self) -> np.ndarray | None:
        """float32 value of each stored byte (256 entries) for the float8 formats, else None."""
        return {"float8_e4m3": E4M3_VALUES, "float8_ue5m3": UE5M3_VALUES}.get(self.name)

    @property
    def signed(self) -> bool:
        """Whether the format holds negative scales and zero."""
        return self.name != "float8_ue5m3"

    def encode(self, values: np.ndarray) -> np.ndarray:
        if self.name == "bfloat16":
            return bf16_encode(values)
        if self.name == "float8_e4m3":
            return e4m3_encode(values)
        if self.name == "float8_ue5m3":
            return ue5m3_encode(values)
        return np.asarray(values).astype(self.storage_dtype)

    def decode(self, stored: np.ndarray) -> np.ndarray:
        """float32 values of stored scales."""
        if self.name == "bfloat16":
            return bf16_decode(stored)
        if self.byte_values is not None:
            return self.byte_values[np.asarray(stored, np.uint8)]
        return np.asarray(stored).astype(np.float32)

    def __repr__(self) -> str:
        return self.name
