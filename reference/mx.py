"""Exact, slow reference for OCP MX v1.0 block quantization and the gpt-oss MXFP4 decoder.

OCP Microscaling Formats (MX) Specification v1.0, §5: "Each MX-compliant format consists of a
shared scale X and k scalar elements {P_i}"; "the value of the i-th element is X × P_i"
(§5.2), with k = 32 and X an E8M0 power of two. §6.3 ("Conversion from vectors of FP32 to MX
formats") gives the reference algorithm:

    shared_exp ← floor(log2(max_i(|V_i|))) − emax_elem
    X ← 2^shared_exp
    for i in 1..k:  P_i = quantize_to_element_format(V_i / X)
        "normal numbers that exceed the representable range of the element format after
         scaling are clamped to the maximum representable value of the element format"

This module implements that rule (``scale_rule="floor"``) and three variants in use elsewhere
(``"ceil"``, ``"even"``, ``"rceil"``; see :func:`shared_exponent`). Elements are rounded
exactly from the rational value V_i / 2^shared_exp by :mod:`lowprec_reference.element`.

Example:
    >>> import numpy as np
    >>> x = np.array([480.0] + [1.0] * 31, np.float32)
    >>> elements, scales = quantize_mx(x, "mxfp8_e4m3")
    >>> int(scales[0]), int(elements[0]), float(dequantize_mx(elements, scales, "mxfp8")[0])
    (127, 126, 448.0)
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Tuple

import numpy as np

import lowprec_formats

from .element import _exact_float64, decode, encode_value, max_finite

__all__ = [
    "FP4_VALUES",
    "decode_gpt_oss",
    "dequantize_mx",
    "mx_element_format",
    "quantize_mx",
    "shared_exponent",
]

_E8M0_BIAS = 127  # MX v1.0 §5.4.1: E8M0 has "Exponent bias 127"
_E8M0_NAN = 0xFF
_F32_MANT = 23  # binary32 trailing significand width

#: The gpt-oss / Hugging Face MXFP4 lookup table, indexed by an FP4 (E2M1) nibble.
FP4_VALUES = np.array(
    [+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float64,
)
FP4_VALUES.flags.writeable = False


def _mx(fmt: str) -> Tuple[str, str, int]:
    """(canonical MX name, element format, block size) of an MX format name or alias."""
    valid = tuple(lowprec_formats.MX_FORMATS)
    canonical = lowprec_formats.ALIASES.get(fmt) if isinstance(fmt, str) else None
    if canonical not in lowprec_formats.MX_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; valid: {valid} (aliases: "
                         f"{sorted(a for a, n in lowprec_formats.ALIASES.items() if n in valid)})")
    spec = lowprec_formats.MX_FORMATS[canonical]
    return canonical, spec["element"], spec["block_size"]


def mx_element_format(fmt: str) -> str:
    """Element format of an MX format, e.g. ``"mxfp4"`` → ``"e2m1"``.

    Example:
        >>> mx_element_format("mxfp8"), mx_element_format("mxfp4")
        ('e4m3', 'e2m1')
    """
    return _mx(fmt)[1]


def _floor_log2_float(a: float) -> int:
    """floor(log2 a) of a finite float a > 0, exactly: frexp gives a = m × 2^k, 0.5 ≤ m < 1."""
    return math.frexp(a)[1] - 1


def _f32_bits(a: float) -> int:
    return int(np.array([a], np.float32).view(np.uint32)[0])


def shared_exponent(amax: float, elem: str, scale_rule: str = "floor") -> int:
    """Shared exponent (before the E8M0 bias) of a finite block maximum, after clamping.

    Let emax_elem = floor(log2(max finite of the element)) (8 for E4M3, 15 for E5M2, 2 for
    E2M1), m_elem its mantissa width, e = floor(log2 amax) read exactly (``math.frexp``, never a
    floating-point log2). ``amax`` must be a float32 value.

    * ``"floor"`` (OCP MX v1.0 §6.3): e − emax_elem.
    * ``"ceil"``: ceil(log2 amax) − emax_elem (= e if amax is a power of two, else e + 1).
    * ``"even"`` (torchao EVEN): on the binary32 bit pattern of amax, add
      ``1 << (23 − m_elem − 1)`` (half an element ulp at amax's binade, round half up),
      mask off the low ``23 − m_elem`` bits, read the biased exponent field E' and take
      (E' − 127) − emax_elem. (E' = 0 — subnormal amax — reads as −127, which clamps the same
      as the exact floor(log2); E' = 255 after a carry from the top binade reads as 128.)
    * ``"rceil"`` (NVIDIA; JAX ``cast_to_e8m0_with_rounding_up``): q = amax / max_elem as a
      correctly rounded binary32 division (numpy, subnormals kept); from q's bits (exponent
      field E, mantissa m) the E8M0 code is E + 1 if m > 0 and E ≠ 0xFE and not
      (E = 0 and m ≤ 0x400000), else E; shared_exp = code − 127. (JAX's ``quantize`` divides
      in the input dtype, so for bfloat16 input it rounds q to bfloat16 first; here the
      division is always binary32.)

    The result is clamped to [−127, 127] (E8M0 codes 0..254). amax = 0 gives −127 in every
    rule.

    Example:
        >>> [shared_exponent(480.0, "e4m3", r) for r in ("floor", "ceil", "even", "rceil")]
        [0, 1, 0, 1]
        >>> shared_exponent(496.0, "e4m3", "even"), shared_exponent(2.0**-130, "e4m3")
        (1, -127)
    """
    valid = tuple(lowprec_formats.SCALE_RULES)
    if scale_rule not in valid:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; valid: {valid}")
    amax = float(amax)
    if not (math.isfinite(amax) and amax >= 0):
        raise ValueError(f"amax must be finite and non-negative, got {amax}")
    if float(np.float32(amax)) != amax:
        raise ValueError(f"amax must be a float32 value, got {amax!r}")
    if amax == 0:
        return -_E8M0_BIAS
    max_elem = max_finite(elem)
    emax_elem = _floor_log2_float(float(max_elem))
    m_elem = lowprec_formats.ELEMENT_FORMATS[elem]["mantissa_bits"]
    e = _floor_log2_float(amax)
    if scale_rule == "floor":
        shared = e - emax_elem
    elif scale_rule == "ceil":
        shared = (e if amax == 2.0**e else e + 1) - emax_elem
    elif scale_rule == "even":
        bits = _f32_bits(amax)
        bits = (bits + (1 << (_F32_MANT - m_elem - 1))) & ~((1 << (_F32_MANT - m_elem)) - 1)
        shared = ((bits >> _F32_MANT) - 127) - emax_elem
    else:  # rceil
        with np.errstate(all="ignore"):
            q = np.float32(amax) / np.float32(float(max_elem))
        bits = int(np.array([q], np.float32).view(np.uint32)[0])
        exp_field, mant = bits >> _F32_MANT, bits & ((1 << _F32_MANT) - 1)
        if exp_field == 0:
            code = 1 if mant > 0x400000 else 0
        else:
            code = exp_field + 1 if (mant > 0 and exp_field != 0xFE) else exp_field
        shared = code - _E8M0_BIAS
    return max(-127, min(127, shared))


def _as_float32_values(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype == np.float64:
        raise TypeError(
            "quantize_mx takes float32 or bfloat16 (or float16) input, got float64: the scale "
            "rules read binary32 bits; cast with x.astype(np.float32)"
        )
    try:
        return _exact_float64(x)  # float16 / bfloat16 / float32 → exact float64 values
    except TypeError:
        raise TypeError(
            f"quantize_mx takes float32 or bfloat16 (or float16) input, got dtype {x.dtype}"
        ) from None


def _normalize_axis(axis: int, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis!r} is out of range for an array of {ndim} dimensions")
    return int(axis) % ndim


def quantize_mx(
    x,
    fmt: str,
    *,
    axis: int = -1,
    scale_rule: str = "floor",
    rounding: str = "nearest_even",
    random_bits=None,
    pad: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """MX-quantizes ``x`` in blocks of 32 consecutive elements along ``axis``.

    Per block V (OCP MX v1.0 §6.3, with the scale rule of :func:`shared_exponent`):

    * amax = max |V_i|; X = 2^shared_exp; scale code = shared_exp + 127.
    * P_i = element code of V_i / X, divided exactly (a Fraction), rounded with ``rounding``
      and SATURATED (overflow="saturate": ±max finite of the element format, as §6.3 clamps).
      Under ``"floor"`` a block maximum above 1.75 × 2^emax (FP8) or 1.5 × 2^emax (FP4)
      relative to 2^e is therefore clipped — by design of the spec.
    * A block holding any NaN or ±Inf → scale code 0xFF and element codes 0 (the block
      dequantizes to NaN).
    * An all-zero block (amax = 0) → scale code 0 (2^-127) in every rule.
    * −0.0 keeps its sign: its element code is the negative-zero code (0x80 for FP8, 0x8
      for FP4), in every block including all-zero ones, because P_i is always the signed
      encoding of V_i / X (IEEE 754 §6.3: the sign of a zero result is that of the operand).

    Args:
      x: float32 or bfloat16 (or float16) array.
      fmt: ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"`` or ``"mxfp4"`` (aliases in
        ``lowprec_formats.ALIASES``).
      axis: the block axis.
      scale_rule: ``"floor"`` (default, the spec), ``"ceil"``, ``"even"`` or ``"rceil"``.
      rounding: element rounding mode (see :func:`lowprec_reference.encode`).
      random_bits: for ``rounding="stochastic"``: uint32 array of the padded x shape (x's
        shape is also accepted when padding; padded elements are zeros, exact anyway).
      pad: zero-pad the axis at the end to a multiple of 32 instead of raising.

    Returns:
      ``(element_codes, scale_codes)``: uint8 element codes with x's (padded) shape,
      UNPACKED (one FP4 code per byte for MXFP4), and uint8 E8M0 scale codes with x's shape
      except ``axis`` has length (padded length) / 32.

    Raises:
      ValueError: unknown names, axis length not a multiple of 32 without ``pad=True``,
        missing or mis-shaped random_bits.
      TypeError: unsupported dtypes.

    Example:
        >>> x = np.zeros((2, 32), np.float32); x[0, 0] = 6.0; x[1, :] = np.nan
        >>> e, s = quantize_mx(x, "mxfp4")
        >>> s.tolist(), int(e[0, 0]), int(e[1].max())
        ([[127], [255]], 7, 0)
    """
    _, elem, block = _mx(fmt)
    if scale_rule not in lowprec_formats.SCALE_RULES:
        raise ValueError(
            f"unknown scale_rule {scale_rule!r}; valid: {tuple(lowprec_formats.SCALE_RULES)}"
        )
    encode_value(elem, 0.0, rounding, "saturate", 0)  # validates `rounding` for the element
    values = _as_float32_values(x)
    ax = _normalize_axis(axis, values.ndim) if values.ndim else None
    if ax is None:
        raise ValueError("quantize_mx needs an array with at least one dimension")
    values = np.moveaxis(values, ax, -1)
    n = values.shape[-1]
    n_pad = -(-n // block) * block
    if n != n_pad and not pad:
        raise ValueError(
            f"axis {axis} has length {n}, not a multiple of the MX block size {block}; "
            f"pass pad=True to zero-pad it to {n_pad}"
        )
    values = np.concatenate(
        [values, np.zeros(values.shape[:-1] + (n_pad - n,), np.float64)], axis=-1
    )

    words = None
    if rounding == "stochastic":
        if random_bits is None:
            raise ValueError("rounding='stochastic' needs random_bits (uint32, x's padded shape)")
        random_bits = np.asarray(random_bits)
        if random_bits.dtype != np.uint32:
            raise TypeError(f"random_bits must have dtype uint32, got {random_bits.dtype}")
        padded_shape = list(np.shape(x))
        padded_shape[ax] = n_pad
        if random_bits.shape not in (tuple(padded_shape), np.shape(x)):
            raise ValueError(
                f"random_bits has shape {random_bits.shape}; expected x's padded shape "
                f"{tuple(padded_shape)}"
            )
        words = np.moveaxis(random_bits, ax, -1)
        if words.shape[-1] != n_pad:
            words = np.concatenate(
                [words, np.zeros(words.shape[:-1] + (n_pad - n,), np.uint32)], axis=-1
            )
        words = words.reshape(-1, n_pad // block, block)

    lead = values.shape[:-1]
    blocks = values.reshape(-1, n_pad // block, block)
    elements = np.zeros(blocks.shape, np.uint8)
    scales = np.zeros(blocks.shape[:-1], np.uint8)
    for row in range(blocks.shape[0]):
        for b in range(blocks.shape[1]):
            v = blocks[row, b].tolist()
            if not all(math.isfinite(t) for t in v):
                scales[row, b] = _E8M0_NAN
                continue  # element codes stay 0
            amax = max(abs(t) for t in v)
            shared = shared_exponent(amax, elem, scale_rule)
            scales[row, b] = shared + _E8M0_BIAS
            x_scale = Fraction(2) ** shared
            for i, t in enumerate(v):
                r = None if words is None else int(words[row, b, i])
                elements[row, b, i] = encode_value(
                    elem,
                    Fraction(t) / x_scale,
                    rounding,
                    "saturate",
                    r,
                    negative=math.copysign(1.0, t) < 0,
                )
    elements = np.moveaxis(elements.reshape(lead + (n_pad,)), -1, ax)
    scales = np.moveaxis(scales.reshape(lead + (n_pad // block,)), -1, ax)
    return elements, scales


def dequantize_mx(element_codes, scale_codes, fmt: str, *, axis: int = -1) -> np.ndarray:
    """Values 2^(scale − 127) × value(element) of an MX array, as float64 (exact).

    A scale code 0xFF (E8M0 NaN, MX v1.0 §5.4.1) makes its whole block NaN. Products are exact
    in float64: element magnitudes lie in [2^-16, 57344] and scales in [2^-127, 2^127].

    Args:
      element_codes: uint8 unpacked element codes (block axis length a multiple of 32).
      scale_codes: uint8 E8M0 codes, ``element_codes``' shape with ``axis`` divided by 32.
      fmt: MX format name or alias.
      axis: the block axis.

    Returns:
      float64 array of ``element_codes``' shape.

    Example:
        >>> e = np.full((32,), 0x38, np.uint8)  # E4M3 1.0
        >>> dequantize_mx(e, np.array([130], np.uint8), "mxfp8_e4m3")[:2].tolist()
        [8.0, 8.0]
    """
    _, elem, block = _mx(fmt)
    e = np.asarray(element_codes)
    s = np.asarray(scale_codes)
    if e.dtype.kind not in "ui" or s.dtype.kind not in "ui":
        raise TypeError(f"codes must be integer arrays, got {e.dtype} and {s.dtype}")
    ax = _normalize_axis(axis, e.ndim)
    expected = list(e.shape)
    if expected[ax] % block:
        raise ValueError(f"element axis length {expected[ax]} is not a multiple of {block}")
    expected[ax] //= block
    if s.shape != tuple(expected):
        raise ValueError(f"scale_codes has shape {s.shape}; expected {tuple(expected)}")
    if s.size and (s.min() < 0 or s.max() > 0xFF):
        raise ValueError("scale codes must be in 0..255")
    values = decode(elem, e)
    scale = np.repeat(s.astype(np.int64), block, axis=ax)
    factor = np.array([math.nan if c == _E8M0_NAN else 2.0 ** (c - _E8M0_BIAS)
                       for c in scale.ravel().tolist()], np.float64).reshape(scale.shape)
    return values * factor


def decode_gpt_oss(blocks, scales) -> np.ndarray:
    """Decodes the gpt-oss / Hugging Face MXFP4 checkpoint layout, as published.

    Layout: ``<name>_blocks`` uint8 [..., G, 16] (two FP4 codes per byte: element 2k in the
    LOW nibble, 2k+1 in the HIGH nibble) and ``<name>_scales`` uint8 [..., G]; each group of 32
    shares one scale. Value = FP4_VALUES[nibble] × 2^(scale − 127). Written from that
    description alone. The published rule has no NaN case: scale 0xFF gives
    FP4_VALUES × 2^128 here (finite in float64; the HF bf16 code would overflow to ±inf).

    Args:
      blocks: uint8 array [..., G, 16].
      scales: uint8 array [..., G].

    Returns:
      float64 array [..., G * 32].

    Example:
        >>> decode_gpt_oss(np.array([[0x21] + [0] * 15], np.uint8),
        ...                np.array([128], np.uint8))[:3].tolist()
        [1.0, 2.0, 0.0]
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise ValueError(
            f"expected blocks [..., G, 16] and scales [..., G], got {blocks.shape}, {scales.shape}"
        )
    low = blocks & 0x0F
    high = blocks >> 4
    nibbles = np.stack([low, high], axis=-1).reshape(blocks.shape[:-1] + (32,))  # low first
    values = FP4_VALUES[nibbles]
    exponents = scales.astype(np.int64) - 127
    values = np.ldexp(values, exponents[..., None])  # exact: multiplication by a power of two
    return values.reshape(blocks.shape[:-2] + (blocks.shape[-2] * 32,))
