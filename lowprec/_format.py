"""Format objects: frozen, hashable views of the data in ``formats/elements.json``.

A format is usable as a static argument to :func:`jax.jit`. Derived numbers are
properties computed from the raw layout fields; nothing is duplicated from the
data table.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import operator
import re
import warnings
from fractions import Fraction
from typing import Optional, Union

import numpy as np

import lowprec_formats as _data

from . import _tapered
from ._scheme import ScaleScheme, registered, registered_names, scheme_class


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A scalar number format: FP16, BF16, TF32, the FP8/FP6/FP4 families, E8M0, the MX INT8
    element, and the parametric IEEE P3109 formats.

    Attributes mirror ``formats/elements.json``; see its ``_about`` entry.

    Example:
        >>> fmt = element_format("e4m3")
        >>> fmt.max_finite, fmt.min_normal, fmt.min_subnormal, fmt.code_bits
        (448.0, 0.015625, 0.001953125, 8)
        >>> element_format("float8_e4m3fnuz").max_finite, element_format("e4m3fnuz").nan_code
        (240.0, 128)
    """

    name: str
    sign_bits: int
    exponent_bits: int
    mantissa_bits: int
    bias: int
    inf: bool
    nan: str  # "ieee" | "all_ones" | "negative_zero" | "none"
    zero: bool
    subnormals: bool
    nan_code: Optional[int]
    ml_dtypes_name: Optional[str]
    inf_code: Optional[int] = None  # code of +inf (None without infinities)
    encoding: str = "sign_magnitude"  # | "twos_complement" (MX INT8) | "tapered" (HiFloat8)
    ties: str = "significand"  # | "code": ties to even compare the code's last bit
    tapered: Optional[tuple] = None  # a tapered format's layout (_tapered.freeze)

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
        """Unbiased exponent of the smallest normal binade (of a tapered format: the lowest
        binade with mantissa bits)."""
        if self.encoding == "tapered":
            return _tapered.smallest_normal_binade(self)
        return self.min_exponent_field - self.bias

    def is_nan_magnitude(self, mag: int) -> bool:
        """Whether the magnitude code ``mag`` (sign bit clear) is a NaN of this format.

        "ieee": the all-ones exponent with a nonzero mantissa; "all_ones": only the all-ones
        magnitude; "negative_zero" (fnuz, P3109) and "none": no magnitude is NaN (the fnuz
        NaN is the code with only the sign bit set).
        """
        all_ones = (1 << self.magnitude_bits) - 1
        if self.nan == "ieee":
            top = (mag >> self.mantissa_bits) == (1 << self.exponent_bits) - 1
            return top and (mag & self.mantissa_mask) != 0
        return self.nan == "all_ones" and mag == all_ones

    @property
    def max_magnitude_code(self) -> int:
        """Code (sign bit clear) of the largest finite value.

        The all-ones magnitude is the largest finite value unless it is reserved: "ieee"
        formats reserve the whole top exponent (inf/NaN), "all_ones" formats that one code
        (e4m3: max = 0b0_1111_110; e8m0: max = 0xFE = 2^127), and P3109's extended formats
        the +inf code just below their NaNs (binary8p3 signed: max = 0x7E).
        """
        return _max_magnitude_code(self)

    @property
    def max_exponent_field(self) -> int:
        """Largest exponent field holding finite numbers."""
        return self.max_magnitude_code >> self.mantissa_bits

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite binade: floor(log2(max finite)).

        For a format whose every value is subnormal (no exponent field: the MX INT8 element,
        P3109 with P = K) this lies below ``emin``.
        """
        return _floor_log2(self.max_finite_exact)

    @property
    def top_quantum_exponent(self) -> int:
        if self.encoding == "tapered":
            return _tapered.top_quantum_exponent(self)
        return self._top_quantum_exponent

    @property
    def _top_quantum_exponent(self) -> int:
        """log2 of the spacing of the values in the largest finite binade.

        ``emax - mantissa_bits`` for a normal top binade; ``emin - mantissa_bits`` when the
        top binade is subnormal (INT8: values k/64 have spacing 2^-6 everywhere).
        """
        return max(self.emax, self.emin) - self.mantissa_bits

    # -- values ---------------------------------------------------------------
    def magnitude_value(self, mag: int) -> Fraction:
        """Exact value of the finite magnitude code ``mag`` (sign bit clear)."""
        if self.encoding == "tapered":
            return _tapered.finite_codes(self).get(mag, Fraction(0))
        e_field, m_field = mag >> self.mantissa_bits, mag & self.mantissa_mask
        if e_field == 0 and self.subnormals:
            return Fraction(m_field) * Fraction(2) ** (self.emin - self.mantissa_bits)
        return Fraction((1 << self.mantissa_bits) + m_field) * (
            Fraction(2) ** (e_field - self.bias - self.mantissa_bits)
        )

    @property
    def max_finite_exact(self) -> Fraction:
        return self.magnitude_value(self.max_magnitude_code)

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
        if self.encoding == "tapered":
            return float(Fraction(2) ** _tapered.smallest_binade(self))
        return float(Fraction(2) ** (self.emin - self.mantissa_bits))

    @property
    def eps(self) -> float:
        """Distance from 1 to the next larger value: 2^-mantissa_bits (2^(emin - M) when 1.0
        is subnormal-like, as in MX INT8: 2^-6)."""
        return float(Fraction(2) ** (max(0, self.emin) - self.mantissa_bits))

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
        """The ml_dtypes / NumPy scalar type with this exact layout, or None (TF32, P3109)."""
        if self.ml_dtypes_name is None:
            return None
        import ml_dtypes
        import numpy as np

        return np.dtype(getattr(ml_dtypes, self.ml_dtypes_name, None) or self.ml_dtypes_name)


def _floor_log2(v: Fraction) -> int:
    """floor(log2 v) of a rational v > 0, exactly."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    return e if (v.numerator << max(-e, 0)) >= (v.denominator << max(e, 0)) else e - 1


@functools.lru_cache(maxsize=None)
def _max_magnitude_code(fmt: ElementFormat) -> int:
    if fmt.encoding == "tapered":  # codes do not order like values
        return _tapered.max_magnitude_code(fmt)
    mag = (1 << fmt.magnitude_bits) - 1
    while fmt.is_nan_magnitude(mag) or mag == fmt.inf_code:
        mag -= 1
    return mag


@dataclasses.dataclass(frozen=True)
class MXFormat:
    """A block format: ``block_size`` elements sharing one scale, encoded by a scale scheme
    (:func:`scale_scheme`: E8M0 in OCP MX; E4M3 times a float32 per-tensor scale in NVFP4).

    The name carries a non-default block size (``"mxfp4_b16"``), so a format and its name
    round-trip through :func:`resolve_format`. Construction checks the parts: ``scheme`` must
    be a registered scale scheme (not a bare scale format: the scheme says how scales are
    chosen and decoded), one that serves ``element``, and ``block_size`` one of
    ``lowprec_formats.BLOCK_SIZES`` holding whole bytes of codes.

    Example:
        >>> fmt = mx_format("mxfp4")
        >>> fmt.element.name, fmt.block_size, fmt.emax_elem, fmt.scheme
        ('e2m1', 32, 2, E8M0Scheme('e8m0'))
        >>> mx_format("mxfp4", block_size=16)
        MXFormat('mxfp4_b16')
        >>> mx_format("nvfp4").scale.name, mx_format("nvfp4").tensor_scale
        ('e4m3', True)
        >>> MXFormat("my_mxfp8", element_format("e4m3"), 32, element_format("e4m3"))
        Traceback (most recent call last):
        ...
        TypeError: MXFormat my_mxfp8: scheme must be a scale scheme (lowprec.scale_scheme('e8m0'), lowprec.scale_scheme('nvfp4'), lowprec.scale_scheme('nvfp4_4over6'), lowprec.scale_scheme('if4'), lowprec.scale_scheme('mixfp4')), got ElementFormat('e4m3'): a bare scale format says nothing of how the block scales are chosen or decoded (E4M3 block scales: scale_scheme('nvfp4'), under a float32 tensor scale)
    """

    name: str
    element: ElementFormat
    block_size: int
    scheme: ScaleScheme

    def __post_init__(self):
        what = f"MXFormat {self.name}"
        if not isinstance(self.name, str):
            raise TypeError(f"MXFormat name must be a string, got {self.name!r}")
        if not isinstance(self.element, ElementFormat):
            raise TypeError(f"{what}: element must be an ElementFormat (element_format(name)), "
                            f"got {self.element!r}")
        if isinstance(self.block_size, (ElementFormat, ScaleScheme)):
            raise TypeError(
                f"{what}: the arguments are (name, element, block_size, scheme); got "
                f"{self.block_size!r} as block_size")
        if not registered(self.scheme):
            schemes = ", ".join(f"lowprec.scale_scheme({n!r})" for n in SCALE_SCHEME_NAMES)
            if isinstance(self.scheme, ElementFormat):
                raise TypeError(
                    f"{what}: scheme must be a scale scheme ({schemes}), got {self.scheme!r}: "
                    "a bare scale format says nothing of how the block scales are chosen or "
                    "decoded (E4M3 block scales: scale_scheme('nvfp4'), under a float32 "
                    "tensor scale)")
            raise TypeError(f"{what}: scheme must be a registered scale scheme ({schemes}), "
                            f"got {self.scheme!r}")
        if self.element.code_bits not in _STORED_CODE_BITS:
            raise ValueError(
                f"{what}: block formats store 4-, 6- or 8-bit element codes (packed along the "
                f"block axis), got {self.element.name} with {self.element.code_bits} bits")
        self.scheme.check_element(self.element, self.name)
        object.__setattr__(self, "block_size",
                           check_block_size(self.block_size, self.name, self.element))

    def __repr__(self) -> str:
        return f"MXFormat({self.name!r})"

    @property
    def scale(self) -> ElementFormat:
        """The element format of the block scale codes (the scheme's)."""
        return self.scheme.scale

    @property
    def tensor_scale(self) -> bool:
        """Whether a float32 scale of the whole tensor multiplies the block scales (the
        scheme's; NVFP4)."""
        return self.scheme.tensor_scale

    @property
    def base_name(self) -> str:
        """The format's name without a block-size suffix (``"mxfp4"`` for ``"mxfp4_b16"``)."""
        return _BLOCK_SUFFIX.sub("", self.name)

    @property
    def emax_elem(self) -> int:
        """emax of the element format: floor(log2 max) (8 for E4M3, 15 for E5M2, 2 for E2M1,
        2 for E2M3, 4 for E3M2, 0 for the INT8 element, whose largest value is 127/64)."""
        return self.element.emax

    @property
    def packed(self) -> bool:
        """Whether codes are narrower than a byte and packed (FP4: two per byte; FP6: four
        in three bytes), as a little-endian bit stream along the block axis."""
        return self.element.code_bits < 8

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's element codes (block_size * code bits / 8)."""
        return self.block_size * self.element.code_bits // 8

    @property
    def bits_per_element(self) -> float:
        """Storage cost per element, block scale included (8.25 for MXFP8, 4.25 for MXFP4,
        4.5 for NVFP4; its single float32 tensor scale is not counted)."""
        return self.element.code_bits + self.scale.code_bits / self.block_size


# Element code widths an MXArray stores: bytes, or packed FP4 pairs / FP6 fours (_pack.py).
_STORED_CODE_BITS = (4, 6, 8)


def _choices(kind: str, names) -> str:
    return f"valid {kind}: " + ", ".join(repr(n) for n in names)


def _element_from_spec(name: str, spec) -> ElementFormat:
    def code(v):
        return None if v is None else int(v, 16)

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
        nan_code=code(spec["nan_code"]),
        ml_dtypes_name=spec["ml_dtypes"],
        inf_code=code(spec["inf_code"]),
        encoding=spec.get("encoding", "sign_magnitude"),
        ties=spec.get("ties", "significand"),
        tapered=_tapered.freeze(spec.get("tapered")),
    )


def _element_by_name(name: str) -> ElementFormat:
    return _element_by_canonical(_data.element_spec(name)[0])


@functools.lru_cache(maxsize=None)
def _element_by_canonical(canonical: str) -> ElementFormat:
    fmt = _element_from_spec(canonical, _data.element_spec(canonical)[1])
    _check_float32_range(fmt)
    return fmt


def _check_float32_range(fmt: ElementFormat) -> None:
    """lowprec encodes from and decodes to float32: every value must be a float32."""
    lowest = fmt.emin - fmt.mantissa_bits if fmt.subnormals else fmt.emin
    if fmt.emax > 127 or lowest < -149 or fmt.mantissa_bits > 22:
        raise ValueError(
            f"{fmt.name}: values span 2^{lowest}..2^{fmt.emax} with {fmt.mantissa_bits} mantissa "
            "bits, beyond float32 (2^-149..2^127, 23 bits), which lowprec encodes from and "
            "decodes to; choose a narrower exponent range"
        )


def element_format(fmt: Union[str, ElementFormat]) -> ElementFormat:
    """Returns the :class:`ElementFormat` named ``fmt`` (names and aliases accepted).

    Args:
      fmt: a format object (returned as is) or a name such as ``"e4m3"``, ``"fp8_e4m3fn"``,
        ``"bf16"``, ``"fp4"``, an ml_dtypes dtype name (``"float8_e4m3fnuz"``,
        ``"float6_e2m3fn"``) or a P3109 name (``"p3109_k8p3se"``, see :func:`p3109`).

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
        raise TypeError(_not_a_format(fmt, "an ElementFormat"))
    try:
        return _element_by_name(fmt.lower())
    except KeyError:
        pass
    if _mx_name(fmt.lower()) is not None:
        raise ValueError(
            f"{fmt!r} is a block (MX) format, not an element format; use "
            f"quantize_mx(x, {fmt!r}) instead. "
            + _choices("element formats", _data.ELEMENT_FORMATS)
        )
    close = difflib.get_close_matches(
        fmt.lower(), list(dict.fromkeys(n.lower() for n in (*_data.ELEMENT_FORMATS, *_data.ALIASES)
                                        if _data.ALIASES.get(n.lower(), n.lower())
                                        not in _data.MX_FORMATS)), n=3)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(
        f"unknown element format {fmt!r}; {hint}" + _choices("formats", _data.ALIASES)
        + " or a P3109 name such as 'p3109_k8p3se'"
    )


_BLOCK_SUFFIX = re.compile(r"_b(\d+)$")


def _mx_name(name: str) -> Optional[tuple]:
    """``(canonical base name, block size or None)`` of an MX name such as ``"mxfp4_b16"``."""
    canonical = _data.ALIASES.get(name)
    if canonical in _data.MX_FORMATS:
        return canonical, None
    m = _BLOCK_SUFFIX.search(name)
    if m is not None:
        canonical = _data.ALIASES.get(name[: m.start()])
        if canonical in _data.MX_FORMATS:
            return canonical, int(m.group(1))
    return None


def check_block_size(block_size, fmt_name: str = "", element: Optional[ElementFormat] = None) -> int:
    """``block_size`` as an int if it is one of ``formats/elements.json``'s block sizes (and
    holds whole bytes of packed codes); else a ValueError naming the choices."""
    try:
        block_size = operator.index(block_size)
    except TypeError:
        raise TypeError(f"block_size must be an integer, got {block_size!r}") from None
    if block_size not in _data.BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size} is not supported; valid block sizes: "
            + ", ".join(map(str, _data.BLOCK_SIZES))
        )
    if element is not None and (block_size * element.code_bits) % 8:
        smallest = next(b for b in _data.BLOCK_SIZES if (b * element.code_bits) % 8 == 0)
        raise ValueError(
            f"{fmt_name}: a block of {block_size} {element.code_bits}-bit codes is not a whole "
            f"number of bytes; choose block_size >= {smallest}"
        )
    return block_size


@functools.lru_cache(maxsize=None)
def scale_scheme(name: str) -> ScaleScheme:
    """Returns the scale scheme named ``name`` in ``formats/elements.json``'s
    ``scale_schemes``: its registered arithmetic on the entry's scale format.

    Args:
      name: ``"e8m0"`` (OCP MX: E8M0 shared exponents chosen by a scale rule) or ``"nvfp4"``
        (E4M3 block scales under a float32 tensor scale).

    Raises:
      ValueError: an unknown name, or an entry without registered arithmetic, or one whose
        data disagree with its arithmetic.

    Example:
        >>> scale_scheme("nvfp4").scale.name, scale_scheme("nvfp4").tensor_scale
        ('e4m3', True)
        >>> mx_format("mxfp8").scheme is scale_scheme("e8m0")
        True
    """
    if not isinstance(name, str) or name not in _data.SCALE_SCHEMES:
        raise ValueError(f"unknown scale scheme {name!r}; valid schemes: "
                         + ", ".join(map(repr, _data.SCALE_SCHEMES)))
    return scheme_from_spec(name, _data.SCALE_SCHEMES[name])


def scheme_from_spec(name: str, spec) -> ScaleScheme:
    """The scheme of a ``scale_schemes`` entry ``spec``: the class registered as ``name``,
    on the entry's scale format, checked against the entry's ``tensor_scale``."""
    cls = scheme_class(name)
    if cls is None:
        raise ValueError(
            f"scale scheme {name!r} has no registered arithmetic (a ScaleScheme subclass, "
            f"decorated with register({name!r}), in lowprec/_scheme_{name}.py); registered: "
            + ", ".join(map(repr, registered_names())))
    if bool(spec["tensor_scale"]) != cls.tensor_scale:
        raise ValueError(
            f"scale scheme {name!r}: the data say tensor_scale={spec['tensor_scale']} but its "
            f"arithmetic ({cls.__name__}) {'has a' if cls.tensor_scale else 'has no'} float32 "
            "tensor scale; the data and the arithmetic must agree")
    return cls(element_format(spec["scale"]))


@functools.lru_cache(maxsize=None)
def _mx_by_name(name: str, block_size: Optional[int] = None) -> MXFormat:
    spec = _data.MX_FORMATS[name]
    element = element_format(spec["element"])
    default = spec["block_size"]
    block = default if block_size is None else check_block_size(block_size, name, element)
    scheme = scale_scheme(spec["scheme"])
    if spec.get("scheme_params"):
        # A variant of its scheme's arithmetic (Four over Six's error metric): the same
        # registered class with other parameters, which the class checks on construction.
        scheme = dataclasses.replace(scheme, **spec["scheme_params"])
    return MXFormat(
        name=name if block == default else f"{name}_b{block}",
        element=element,
        block_size=block,
        scheme=scheme,
    )


def mx_format(fmt: Union[str, MXFormat], block_size: Optional[int] = None) -> MXFormat:
    """Returns the :class:`MXFormat` named ``fmt``, optionally with another block size.

    Args:
      fmt: a format object or name: ``"mxfp8_e4m3"`` (``"mxfp8"``), ``"mxfp8_e5m2"``,
        ``"mxfp6_e2m3"`` (``"mxfp6"``), ``"mxfp6_e3m2"``, ``"mxfp4"``, ``"mxint8"``,
        ``"nvfp4"``, or such a name with a block-size suffix (``"mxfp4_b16"``).
      block_size: a power of two from 2 to 1024 (``lowprec_formats.BLOCK_SIZES``); None
        keeps the format's own (32 for the OCP MX formats, 16 for NVFP4). Packed codes must
        fill whole bytes per block (FP6: at least 4).

    Example:
        >>> mx_format("mxfp8").element.name
        'e4m3'
        >>> mx_format("mxfp4_b16") == mx_format("mxfp4", block_size=16)
        True
    """
    if block_size is not None:
        block_size = check_block_size(block_size)  # before the cache: 16.0 hashes like 16
    if isinstance(fmt, MXFormat):
        if block_size is None or block_size == fmt.block_size:
            return fmt
        canonical = _data.ALIASES.get(fmt.base_name)
        if canonical in _data.MX_FORMATS:
            return _mx_by_name(canonical, block_size)
        # A format built directly (not in formats/): the same parts at another block size.
        return dataclasses.replace(fmt, name=f"{fmt.base_name}_b{block_size}",
                                   block_size=block_size)
    if not isinstance(fmt, str):
        raise TypeError(f"MX format must be a name or an MXFormat, got {type(fmt).__name__}")
    parsed = _mx_name(fmt.lower())
    if parsed is None:
        raise ValueError(f"unknown MX format {fmt!r}; " + _choices("MX formats", _data.MX_FORMATS))
    canonical, named_block = parsed
    if block_size is None:
        block_size = named_block
    elif named_block is not None and named_block != block_size:
        raise ValueError(f"{fmt!r} names block size {named_block} but block_size={block_size}")
    if block_size == _data.MX_FORMATS[canonical]["block_size"]:
        block_size = None
    return _mx_by_name(canonical, block_size)


ELEMENT_FORMAT_NAMES: tuple[str, ...] = tuple(_data.ELEMENT_FORMATS)
MX_FORMAT_NAMES: tuple[str, ...] = tuple(_data.MX_FORMATS)
SCALE_SCHEME_NAMES: tuple[str, ...] = tuple(_data.SCALE_SCHEMES)

#: An element format or its name (``"e4m3"``, ``"float8_e4m3fn"``, ``"bf16"``, ...).
ElementFormatLike = Union[str, ElementFormat]
#: A block format or its name (``"mxfp8_e4m3"``, ``"mxfp4"``, ...).
MXFormatLike = Union[str, MXFormat]
#: Any format or its name.
FormatLike = Union[str, ElementFormat, MXFormat]


def _not_a_format(obj, objects: str) -> str:
    """Says in words what was given where a format name was expected: a NumPy/JAX dtype
    (``jnp.float8_e4m3fn``) is the usual slip, and has a format of the same name."""
    try:
        dt = None if obj is None or isinstance(obj, (int, float, bool)) else np.dtype(obj)
    except TypeError:
        dt = None
    if dt is not None:
        try:
            _element_by_name(dt.name)
            fix = f"pass its name, {dt.name!r}, for lowprec's format of that dtype"
        except KeyError:
            fix = "lowprec has no format of that name"
        return (f"expected a lowprec format name or {objects}, got the dtype {dt.name} (a "
                f"NumPy/JAX dtype, not a format): {fix}; ml_dtypes.finfo({dt.name}) "
                "describes the dtype itself")
    return (f"expected a lowprec format name (e.g. 'e4m3', 'mxfp8') or {objects}, got "
            f"{type(obj).__name__} {obj!r:.60}")


def resolve_format(fmt: FormatLike) -> Union[ElementFormat, MXFormat]:
    """Returns the element or block format named ``fmt``; the one lookup of every name.

    Args:
      fmt: a format object (returned as is) or any name or alias of an element format
        (``"e4m3"``, ``"float8_e4m3fn"``, ``"bfloat16"``, ``"p3109_k8p3se"``) or a block
        format (``"mxfp8"``, ``"nvfp4"``, ``"mxfp4_b16"``).

    Raises:
      ValueError: for an unknown name; the message lists the valid ones.

    Example:
        >>> resolve_format("float8_e4m3fn"), resolve_format("MXFP8")
        (ElementFormat('e4m3'), MXFormat('mxfp8_e4m3'))
    """
    if isinstance(fmt, (ElementFormat, MXFormat)):
        return fmt
    if not isinstance(fmt, str):
        raise TypeError(_not_a_format(fmt, "a format object"))
    name = fmt.lower()
    try:
        return _element_by_name(name)
    except KeyError:
        pass
    if _mx_name(name) is not None:
        return mx_format(name)
    known = dict.fromkeys(n.lower() for n in (*ELEMENT_FORMAT_NAMES, *MX_FORMAT_NAMES,
                                              *_data.ALIASES))
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    raise ValueError(
        f"unknown format {fmt!r}; {hint}valid element formats: {', '.join(ELEMENT_FORMAT_NAMES)} "
        f"and P3109 names such as 'p3109_k8p3se'; block formats: {', '.join(MX_FORMAT_NAMES)} "
        f"(optionally with a block size, 'mxfp4_b16'; aliases: {', '.join(sorted(_data.ALIASES))})"
    )


def is_format_like(v) -> bool:
    """Whether ``v`` names or is a format (a string or a format object), not an array."""
    return isinstance(v, (str, ElementFormat, MXFormat))


def array_then_format(first, second, func: str):
    """Returns ``(array, format)`` from a call's first two positional arguments.

    lowprec's argument order is array first, format second. The order of lowprec 0.1
    (format first, as in ``encode("e4m3", x)``) is recognised by type — an array is never a
    string or a format object — and still works, with a DeprecationWarning.
    """
    if is_format_like(first) and not is_format_like(second):
        warnings.warn(
            f"lowprec.{func}(fmt, x) is the old argument order; write lowprec.{func}(x, fmt) "
            "(array first, format second). The old order will be removed.",
            DeprecationWarning,
            stacklevel=3,
        )
        return second, first
    return first, second
