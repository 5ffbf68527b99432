"""Format objects: frozen, hashable views of the data in ``formats/elements.json``.

A format is usable as a static argument to :func:`jax.jit`. Derived numbers are
properties computed from the raw layout fields; nothing is duplicated from the
data table.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from fractions import Fraction
from typing import Optional, Union

import lowprec_formats as _data


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A scalar floating-point format (FP16, BF16, TF32, E4M3, E5M2, E2M1, E8M0).

    Attributes mirror ``formats/elements.json``; see its ``_about`` entry.

    Example:
        >>> fmt = element_format("e4m3")
        >>> fmt.max_finite, fmt.min_normal, fmt.min_subnormal, fmt.code_bits
        (448.0, 0.015625, 0.001953125, 8)
    """

    name: str
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    inf: bool
    nan: str  # "ieee" | "all_ones" | "none"
    zero: bool
    subnormals: bool
    nan_code: Optional[int]
    ml_dtypes_name: Optional[str]

    def __repr__(self) -> str:
        return f"ElementFormat({self.name!r})"

    # -- layout ---------------------------------------------------------------
    @property
    def code_bits(self) -> int:
        """Total number of bits of a code."""
        return self.sign_bits + self.exponent_bits + self.mantissa_bits

    @property
    def magnitude_bits(self) -> int:
        """Bits below the sign bit (exponent + mantissa)."""
        return self.exponent_bits + self.mantissa_bits

    @property
    def signed(self) -> bool:
        return self.sign_bits == 1

    @property
    def sign_mask(self) -> int:
        return (1 << self.magnitude_bits) if self.signed else 0

    @property
    def mantissa_mask(self) -> int:
        return (1 << self.mantissa_bits) - 1

    # -- exponent range -------------------------------------------------------
    @property
    def min_exponent_field(self) -> int:
        """Smallest exponent field of a normal number (1, or 0 without subnormals)."""
        return 1 if self.subnormals else 0

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal binade."""
        return self.min_exponent_field - self.bias

    @property
    def max_magnitude_code(self) -> int:
        """Code (sign bit clear) of the largest finite value.

        The all-ones magnitude is the largest finite value unless it is reserved:
        "ieee" formats reserve the whole top exponent (inf/NaN), "all_ones" formats only
        that one code (e4m3: max = 0b0_1111_110; e8m0: max = 0xFE = 2^127).
        """
        all_ones = (1 << self.magnitude_bits) - 1
        if self.nan == "ieee":
            return all_ones - (1 << self.mantissa_bits)  # top exponent field - 1, mantissa all ones
        if self.nan == "all_ones":
            return all_ones - 1
        return all_ones

    @property
    def max_exponent_field(self) -> int:
        """Largest exponent field holding finite numbers."""
        return self.max_magnitude_code >> self.mantissa_bits

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade."""
        return self.max_exponent_field - self.bias

    @property
    def inf_code(self) -> Optional[int]:
        """Code of +inf (None when the format has no infinity)."""
        return ((1 << self.exponent_bits) - 1) << self.mantissa_bits if self.inf else None

    # -- values ---------------------------------------------------------------
    @property
    def max_finite_exact(self) -> Fraction:
        top_mantissa = self.max_magnitude_code & self.mantissa_mask
        return Fraction((1 << self.mantissa_bits) + top_mantissa, 1 << self.mantissa_bits) * (
            Fraction(2) ** self.emax
        )

    @property
    def max_finite(self) -> float:
        return float(self.max_finite_exact)

    @property
    def min_normal(self) -> float:
        return float(Fraction(2) ** self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (the smallest normal when there are no subnormals)."""
        if not self.subnormals:
            return self.min_normal
        return float(Fraction(2) ** (self.emin - self.mantissa_bits))

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value: 2^-mantissa_bits."""
        return float(Fraction(1, 1 << self.mantissa_bits))

    @property
    def precision(self) -> int:
        """Significand bits including the implicit bit."""
        return self.mantissa_bits + 1

    @property
    def code_dtype(self):
        """NumPy unsigned dtype holding one code (uint8 / uint16 / uint32)."""
        import numpy as np

        return np.dtype(
            np.uint8 if self.code_bits <= 8 else np.uint16 if self.code_bits <= 16 else np.uint32
        )

    @property
    def storage_dtype(self):
        """The ml_dtypes / NumPy scalar type with this exact layout, or None (TF32)."""
        if self.ml_dtypes_name is None:
            return None
        import ml_dtypes
        import numpy as np

        return np.dtype(getattr(ml_dtypes, self.ml_dtypes_name, None) or self.ml_dtypes_name)


@dataclasses.dataclass(frozen=True)
class MXFormat:
    """An OCP MX block format: ``block_size`` elements sharing one E8M0 scale.

    Example:
        >>> fmt = mx_format("mxfp4")
        >>> fmt.element.name, fmt.block_size, fmt.emax_elem
        ('e2m1', 32, 2)
    """

    name: str
    element: ElementFormat
    scale: ElementFormat
    block_size: int

    def __repr__(self) -> str:
        return f"MXFormat({self.name!r})"

    @property
    def emax_elem(self) -> int:
        """emax of the element format (8 for E4M3, 15 for E5M2, 2 for E2M1)."""
        return self.element.emax

    @property
    def packed(self) -> bool:
        """Whether elements are stored two per byte (FP4)."""
        return self.element.code_bits == 4

    @property
    def bits_per_element(self) -> float:
        """Storage cost per element, scale included (8.25 for MXFP8, 4.25 for MXFP4)."""
        return self.element.code_bits + self.scale.code_bits / self.block_size


def _choices(kind: str, names) -> str:
    return f"valid {kind}: " + ", ".join(repr(n) for n in names)


@functools.lru_cache(maxsize=None)
def _element_by_name(name: str) -> ElementFormat:
    spec = _data.ELEMENT_FORMATS[name]
    nan_code = spec["nan_code"]
    return ElementFormat(
        name=name,
        sign_bits=spec["sign_bits"],
        exponent_bits=spec["exponent_bits"],
        mantissa_bits=spec["mantissa_bits"],
        bias=spec["bias"],
        inf=spec["inf"],
        nan=spec["nan"],
        zero=spec["zero"],
        subnormals=spec["subnormals"],
        nan_code=None if nan_code is None else int(nan_code, 16),
        ml_dtypes_name=spec["ml_dtypes"],
    )


def element_format(fmt: Union[str, ElementFormat]) -> ElementFormat:
    """Returns the :class:`ElementFormat` named ``fmt`` (names and aliases accepted).

    Args:
      fmt: a format object (returned as is) or a name such as ``"e4m3"``, ``"fp8_e4m3fn"``,
        ``"bf16"``, ``"fp4"``.

    Raises:
      ValueError: for an unknown name; the message lists the valid ones.

    Example:
        >>> element_format("fp8_e4m3fn") is element_format("e4m3")
        True
    """
    if isinstance(fmt, ElementFormat):
        return fmt
    if isinstance(fmt, MXFormat):
        raise TypeError(
            f"{fmt!r} is a block format; pass its element format ({fmt.element.name!r}) "
            "or use quantize_mx/dequantize for block quantization"
        )
    if not isinstance(fmt, str):
        raise TypeError(f"format must be a name or an ElementFormat, got {type(fmt).__name__}")
    canonical = _data.ALIASES.get(fmt.lower())
    if canonical is None or canonical not in _data.ELEMENT_FORMATS:
        if canonical in _data.MX_FORMATS:
            raise ValueError(
                f"{fmt!r} is a block (MX) format, not an element format; use "
                f"quantize_mx(x, {fmt!r}) instead. "
                + _choices("element formats", _data.ELEMENT_FORMATS)
            )
        raise ValueError(f"unknown element format {fmt!r}; " + _choices("formats", _data.ALIASES))
    return _element_by_name(canonical)


@functools.lru_cache(maxsize=None)
def _mx_by_name(name: str) -> MXFormat:
    spec = _data.MX_FORMATS[name]
    return MXFormat(
        name=name,
        element=element_format(spec["element"]),
        scale=element_format(spec["scale"]),
        block_size=spec["block_size"],
    )


def mx_format(fmt: Union[str, MXFormat]) -> MXFormat:
    """Returns the :class:`MXFormat` named ``fmt`` (``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp4"``).

    Example:
        >>> mx_format("mxfp8").element.name
        'e4m3'
    """
    if isinstance(fmt, MXFormat):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"MX format must be a name or an MXFormat, got {type(fmt).__name__}")
    canonical = _data.ALIASES.get(fmt.lower())
    if canonical is None or canonical not in _data.MX_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; " + _choices("MX formats", _data.MX_FORMATS))
    return _mx_by_name(canonical)


ELEMENT_FORMAT_NAMES: tuple[str, ...] = tuple(_data.ELEMENT_FORMATS)
MX_FORMAT_NAMES: tuple[str, ...] = tuple(_data.MX_FORMATS)

#: An element format or its name (``"e4m3"``, ``"float8_e4m3fn"``, ``"bf16"``, ...).
ElementFormatLike = Union[str, ElementFormat]
#: A block format or its name (``"mxfp8_e4m3"``, ``"mxfp4"``, ...).
MXFormatLike = Union[str, MXFormat]
#: Any format or its name.
FormatLike = Union[str, ElementFormat, MXFormat]


def resolve_format(fmt: FormatLike) -> Union[ElementFormat, MXFormat]:
    """Returns the element or block format named ``fmt``; the one lookup of every name.

    Args:
      fmt: a format object (returned as is) or any name or alias of an element format
        (``"e4m3"``, ``"float8_e4m3fn"``, ``"bfloat16"``) or a block format (``"mxfp8"``).

    Raises:
      ValueError: for an unknown name; the message lists the valid ones.

    Example:
        >>> resolve_format("float8_e4m3fn"), resolve_format("MXFP8")
        (ElementFormat('e4m3'), MXFormat('mxfp8_e4m3'))
    """
    if isinstance(fmt, (ElementFormat, MXFormat)):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(f"a format must be a name or a format object, got {fmt!r}")
    canonical = _data.ALIASES.get(fmt.lower())
    if canonical in _data.ELEMENT_FORMATS:
        return _element_by_name(canonical)
    if canonical in _data.MX_FORMATS:
        return _mx_by_name(canonical)
    raise ValueError(
        f"unknown format {fmt!r}; valid element formats: {', '.join(ELEMENT_FORMAT_NAMES)}; "
        f"block formats: {', '.join(MX_FORMAT_NAMES)} (aliases: {', '.join(sorted(_data.ALIASES))})"
    )


def _is_format_like(v) -> bool:
    return isinstance(v, (str, ElementFormat, MXFormat))


def array_then_format(first, second, func: str):
    """Returns ``(array, format)`` from a call's first two positional arguments.

    lowprec's argument order is array first, format second. The order of lowprec 0.1
    (format first, as in ``encode("e4m3", x)``) is recognised by type — an array is never a
    string or a format object — and still works, with a DeprecationWarning.
    """
    if _is_format_like(first) and not _is_format_like(second):
        warnings.warn(
            f"lowprec.{func}(fmt, x) is the old argument order; write lowprec.{func}(x, fmt) "
            "(array first, format second). The old order will be removed.",
            DeprecationWarning,
            stacklevel=3,
        )
        return second, first
    return first, second
