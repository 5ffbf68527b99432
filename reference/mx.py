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

This module implements that rule (``scale_rule="floor"``) and five variants in use elsewhere
(``"ceil"``, ``"even"``, ``"rceil"``, ``"even_e2m1"``, ``"floor_log2f"``; see
:func:`shared_exponent`). Elements are rounded
exactly from the rational value V_i / 2^shared_exp by :mod:`lowprec_reference.element`. The
element formats are those of §5.3 — FP8 (E4M3, E5M2), FP6 (E2M3, E3M2), FP4 (E2M1) and INT8
("a signed two's complement integer with an implicit scale of 2^-6", emax_elem = 0: the largest
value 127/64 lies in binade 0) — and blocks may have any size in ``lowprec_formats.BLOCK_SIZES``
(§5 leaves k to the format; the concrete MX formats use 32).

NVIDIA's NVFP4 (E2M1 elements, an E4M3 scale per 16, a float32 tensor scale) follows
torchao's recipe (``torchao/prototype/mx_formats/nvfp4_tensor.py``: ``per_tensor_amax_to_scale``
returns ``amax / (F8E4M3_MAX * F4_E2M1_MAX)``; ``_nvfp4_quantize`` divides the block amax by
``F4_E2M1_MAX`` and by the tensor scale, clamps to ``[E4M3_EPS, F8E4M3_MAX]`` = [2^-6, 448], casts
to float8_e4m3fn, multiplies the tensor scale by it, divides the data by that product, clamps to
±6 and rounds to E2M1), computed here with NumPy float32 scalars — IEEE 754 arithmetic, one
rounding per operation — see :func:`quantize_nvfp4`. NVINT4 (Chen et al. 2025, "INT v.s. FP",
arXiv 2510.25602: INT4 elements k ∈ [−7, 7] under NVFP4's two-level scales) is the same recipe
with the element's largest value 7 where E2M1 has 6 (the paper's quantizer divides each block's
amax by Qmax = 7, the largest block scale by 448).

Example:
    >>> import numpy as np
    >>> x = np.array([480.0] + [1.0] * 31, np.float32)
    >>> elements, scales = quantize_mx(x, "mxfp8_e4m3")
    >>> int(scales[0]), int(elements[0]), float(dequantize_mx(elements, scales, "mxfp8")[0])
    (127, 126, 448.0)
"""

from __future__ import annotations

import decimal
import functools
import math
from fractions import Fraction
from typing import Optional, Tuple

import numpy as np

import lowprec_formats

from .element import _exact_float64, _fmt, _quantum_exponent, decode, encode, encode_value, max_finite

__all__ = [
    "FP4_VALUES",
    "decode_gpt_oss",
    "dequantize_mx",
    "mx_block_size",
    "mx_element_format",
    "nvfp4_tensor_scale",
    "pack_codes",
    "quantize_mx",
    "quantize_nvfp4",
    "shared_exponent",
    "unpack_codes",
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


def _mx(fmt: str, block_size: Optional[int] = None) -> Tuple[str, str, int]:
    """(canonical MX name, element format, block size) of an MX format name or alias,
    optionally with a block-size suffix ``_b<k>`` or an explicit ``block_size``."""
    valid = tuple(lowprec_formats.MX_FORMATS)
    name, named_block = fmt, None
    if isinstance(fmt, str) and "_b" in fmt and fmt.rsplit("_b", 1)[1].isdigit():
        name, named_block = fmt.rsplit("_b", 1)[0], int(fmt.rsplit("_b", 1)[1])
    canonical = lowprec_formats.ALIASES.get(name) if isinstance(name, str) else None
    if canonical not in lowprec_formats.MX_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; valid: {valid} (aliases: "
                         f"{sorted(a for a, n in lowprec_formats.ALIASES.items() if n in valid)})")
    spec = lowprec_formats.MX_FORMATS[canonical]
    block = block_size or named_block or spec["block_size"]
    if block not in lowprec_formats.BLOCK_SIZES:
        raise ValueError(f"block size {block} not in {lowprec_formats.BLOCK_SIZES}")
    return canonical, spec["element"], block


def _scheme(canonical: str) -> Tuple[str, dict]:
    """(name, entry) of the scale scheme of a canonical MX format (``lowprec_formats
    .SCALE_SCHEMES``): ``"e8m0"`` (OCP MX, §5.4.1) or ``"nvfp4"`` (torchao's two-level recipe),
    the two this module implements."""
    name = lowprec_formats.MX_FORMATS[canonical]["scheme"]
    if name not in ("e8m0", "nvfp4"):
        raise NotImplementedError(f"{canonical}: the reference has no arithmetic for scale "
                                  f"scheme {name!r}")
    return name, lowprec_formats.SCALE_SCHEMES[name]


def mx_element_format(fmt: str) -> str:
    """Element format of an MX format, e.g. ``"mxfp4"`` → ``"e2m1"``.

    Example:
        >>> mx_element_format("mxfp8"), mx_element_format("mxfp4"), mx_element_format("mxint8")
        ('e4m3', 'e2m1', 'ocp_int8')
    """
    return _mx(fmt)[1]


def mx_block_size(fmt: str) -> int:
    """Block size of an MX format name (``"mxfp4"`` → 32, ``"nvfp4"`` → 16, ``"mxfp4_b16"``
    → 16)."""
    return _mx(fmt)[2]


def _floor_log2_float(a: float) -> int:
    """floor(log2 a) of a finite float a > 0, exactly: frexp gives a = m × 2^k, 0.5 ≤ m < 1."""
    return math.frexp(a)[1] - 1


def _f32_bits(a: float) -> int:
    return int(np.array([a], np.float32).view(np.uint32)[0])


_LN2 = None


@functools.lru_cache(maxsize=65536)
def _floor_log2f(a: float) -> int:
    """floor(RN32(log2 a)) of a float32 value a > 0: the logarithm to 60 decimal digits, then
    the nearest binary32 (ties to even), then its floor."""
    global _LN2
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        if _LN2 is None:
            _LN2 = decimal.Decimal(2).ln()
        l = decimal.Decimal(a).ln() / _LN2
        c = np.float32(float(l))
        near = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]

        def distance(f):  # then an even significand first
            return abs(decimal.Decimal(float(f)) - l), int(np.float32(f).view(np.uint32)) & 1

        return math.floor(float(min(near, key=distance)))


def shared_exponent(amax: float, elem: str, scale_rule: str = "floor") -> int:
    """Shared exponent (before the E8M0 bias) of a finite block maximum, after clamping.

    Let emax_elem = floor(log2(max finite of the element)) (8 for E4M3, 15 for E5M2, 2 for
    E2M1 and E2M3, 4 for E3M2, 0 for INT8), m_elem the number of fraction bits of the element
    grid in that top binade (its mantissa width; 6 for INT8, whose grid k/64 has spacing
    2^-6), e = floor(log2 amax) read exactly (``math.frexp``, never a floating-point log2).
    ``amax`` must be a float32 value.

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

    * ``"even_e2m1"`` (compressed-tensors and llm-compressor, MXFP4 and MXFP8): ``"even"``
      with m_elem = 1, E2M1's mantissa width, whatever the element (compressed-tensors'
      ``round_to_power_2`` adds ``1 << (mantissa − FP4_E2M1_DATA.mantissa − 1)`` to the bits
      of the block maximum and keeps its sign and exponent fields).
    * ``"floor_log2f"`` (ggml: ``floorf(log2f(amax)) - 2 + 127`` in llama.cpp's
      ``quantize_row_mxfp4_ref``): floor of log2(amax) correctly rounded to binary32 (ties
      to even), here from a 60-digit decimal logarithm, minus emax_elem. (ggml casts a
      negative result to uint8, which C leaves undefined; here it clamps like every rule.)

    The result is clamped to [−127, 127] (E8M0 codes 0..254). amax = 0 gives −127 in every
    rule.

    Example:
        >>> [shared_exponent(480.0, "e4m3", r) for r in ("floor", "ceil", "even", "rceil")]
        [0, 1, 0, 1]
        >>> shared_exponent(448.0, "e4m3", "even_e2m1"), shared_exponent(448.0, "e4m3", "even")
        (1, 0)
        >>> shared_exponent(float(np.float32(8 - 2**-21)), "e2m1", "floor_log2f")
        1
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
    m_elem = emax_elem - _quantum_exponent(_fmt(elem), max_elem)
    e = _floor_log2_float(amax)
    if scale_rule == "floor":
        shared = e - emax_elem
    elif scale_rule == "ceil":
        shared = (e if amax == 2.0**e else e + 1) - emax_elem
    elif scale_rule in ("even", "even_e2m1"):
        m = m_elem if scale_rule == "even" else 1
        bits = _f32_bits(amax)
        bits = (bits + (1 << (_F32_MANT - m - 1))) & ~((1 << (_F32_MANT - m)) - 1)
        shared = ((bits >> _F32_MANT) - 127) - emax_elem
    elif scale_rule == "floor_log2f":
        shared = _floor_log2f(amax) - emax_elem
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
    block_size: Optional[int] = None,
    tensor_scale=None,
):
    """MX-quantizes ``x`` in blocks of consecutive elements along ``axis`` (32 by default).

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
      for FP4, 0x20 for FP6), in every block including all-zero ones, because P_i is always
      the signed encoding of V_i / X (IEEE 754 §6.3: the sign of a zero result is that of
      the operand). INT8 has one zero.

    NVFP4 (a format with a tensor scale) is delegated to :func:`quantize_nvfp4`.

    Args:
      x: float32 or bfloat16 (or float16, or an ml_dtypes float) array.
      fmt: an MX format name (``lowprec_formats.MX_FORMATS``, aliases in
        ``lowprec_formats.ALIASES``), optionally with a block-size suffix (``"mxfp4_b16"``).
      axis: the block axis.
      scale_rule: ``"floor"`` (default, the spec), ``"ceil"``, ``"even"``, ``"rceil"``,
        ``"even_e2m1"`` or ``"floor_log2f"``.
      rounding: element rounding mode (see :func:`lowprec_reference.encode`).
      random_bits: for ``rounding="stochastic"``: uint32 array of the padded x shape (x's
        shape is also accepted when padding; padded elements are zeros, exact anyway).
      pad: zero-pad the axis at the end to a multiple of the block size instead of raising.
      block_size: another block size (``lowprec_formats.BLOCK_SIZES``).
      tensor_scale: NVFP4 only (see :func:`quantize_nvfp4`).

    Returns:
      ``(element_codes, scale_codes)``: uint8 element codes with x's (padded) shape,
      UNPACKED (one FP4/FP6 code per byte; :func:`pack_codes` packs them), and uint8 scale
      codes with x's shape except ``axis`` has length (padded length) / block size; NVFP4
      adds the float32 tensor scale: ``(element_codes, scale_codes, tensor_scale)``.

    Raises:
      ValueError: unknown names, axis length not a multiple of the block size without
        ``pad=True``, missing or mis-shaped random_bits.
      TypeError: unsupported dtypes.

    Example:
        >>> x = np.zeros((2, 32), np.float32); x[0, 0] = 6.0; x[1, :] = np.nan
        >>> e, s = quantize_mx(x, "mxfp4")
        >>> s.tolist(), int(e[0, 0]), int(e[1].max())
        ([[127], [255]], 7, 0)
    """
    canonical, elem, block = _mx(fmt, block_size)
    if _scheme(canonical)[0] == "nvfp4":
        return quantize_nvfp4(x, canonical, axis=axis, rounding=rounding, random_bits=random_bits,
                              pad=pad, block_size=block, tensor_scale=tensor_scale)
    if tensor_scale is not None:
        raise ValueError(f"{canonical} has no tensor scale")
    if scale_rule not in lowprec_formats.SCALE_RULES:
        raise ValueError(
            f"unknown scale_rule {scale_rule!r}; valid: {tuple(lowprec_formats.SCALE_RULES)}"
        )
    encode_value(elem, 0.0, rounding, "saturate", 0)  # validates `rounding` for the element
    blocks, words, finish = _blocks_of(x, block, axis, pad, rounding, random_bits)
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
    return finish(elements, scales)


def _blocks_of(x, block: int, axis: int, pad: bool, rounding: str, random_bits):
    """Exact float64 values of ``x`` as ``[rows, blocks, block]`` (axis moved last, zero
    padded), the matching random words (or None), and a function putting per-element and
    per-block uint8 results back in x's layout."""
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

    def finish(elements, scales):
        elements = np.moveaxis(elements.reshape(lead + (n_pad,)), -1, ax)
        scales = np.moveaxis(scales.reshape(lead + (n_pad // block,)), -1, ax)
        return elements, scales

    return values.reshape(-1, n_pad // block, block), words, finish


# torchao nvfp4_tensor.py constants: F8E4M3_MAX = 448, F4_E2M1_MAX = 6,
# E4M3_EPS = torch.finfo(torch.float8_e4m3fn).tiny = 2^-6.
_F8E4M3_MAX = np.float32(448.0)
_E4M3_EPS = np.float32(2.0**-6)
_E4M3_NAN = 0x7F
_MIN_TENSOR_SCALE = np.float32(2.0**-143)


def nvfp4_tensor_scale(x, fmt: str = "nvfp4") -> np.float32:
    """torchao's ``per_tensor_amax_to_scale``: float32(amax) / float32(448 * Q), Q the largest
    element value of ``fmt`` (6 for NVFP4's E2M1, 7 for NVINT4's INT4), with amax the
    largest *finite* magnitude of ``x`` (lowprec keeps one inf/NaN from poisoning every
    block); an all-zero tensor gets 1.0 (TransformerEngine's convention; torchao would give
    0 and divide by it), and a scale below 2^-143 is raised to it (so that tensor scale x
    block scale, with block scales >= 2^-6, never underflows to 0).

    Example:
        >>> float(nvfp4_tensor_scale(np.array([2688.0, -1.0], np.float32)))
        1.0
    """
    q = _element_max(_mx(fmt)[1])
    v = _as_float32_values(x)
    finite = np.abs(v[np.isfinite(v)])
    amax = np.float32(finite.max()) if finite.size else np.float32(0)
    if amax == 0:
        return np.float32(1.0)
    with np.errstate(under="ignore"):
        ts = np.float32(amax / (_F8E4M3_MAX * q))
    return max(ts, _MIN_TENSOR_SCALE)


def _element_max(elem: str) -> np.float32:
    """The largest value of an NVFP4-scheme element as a float32 (6 for E2M1, 7 for INT4)."""
    q = max_finite(elem)
    assert Fraction(float(np.float32(q))) == q, q
    return np.float32(q)


def quantize_nvfp4(x, fmt: str = "nvfp4", *, axis: int = -1, rounding: str = "nearest_even",
                   random_bits=None, pad: bool = False, block_size: Optional[int] = None,
                   tensor_scale=None):
    """NVFP4 quantization by torchao's two-level recipe, in NumPy float32 arithmetic.

    With ts the tensor scale (``tensor_scale``, or :func:`nvfp4_tensor_scale` of ``x``; at
    least 2^-143), for
    each block of 16 (``block_size``) along ``axis`` (every step an IEEE float32 operation):

    * ``s = float32(float32(block_amax / Q) / ts)`` (Q = 6, E2M1's largest value; 7 for
      NVINT4), clamped to [2^-6, 448], rounded to the nearest E4M3 value: the block's scale
      code;
    * ``total = float32(ts * s)``; each element ``q = float32(x_i / total)``, encoded to the
      element format (E2M1; INT4 for NVINT4) with ``rounding``, saturating at ±Q (torchao
      clamps, then rounds to nearest even);
    * a block holding NaN or ±inf gets the E4M3 NaN scale 0x7F and element codes 0.

    Returns:
      ``(element_codes, scale_codes, tensor_scale)``: unpacked uint8 element codes, uint8
      E4M3 codes, float32 tensor scale.

    Example:
        >>> x = np.zeros(16, np.float32); x[:3] = [6.0, -1.0, 0.25]
        >>> e, s, ts = quantize_nvfp4(x)  # s = 1 / ts = 447.99997 -> E4M3 448 (0x7E)
        >>> float(ts) == float(np.float32(6) / np.float32(2688)), int(s[0]), e[:3].tolist()
        (True, 126, [7, 10, 0])
    """
    canonical, elem, block = _mx(fmt, block_size)
    scheme, spec = _scheme(canonical)
    if scheme != "nvfp4":
        raise ValueError(f"{canonical} has no tensor scale; use quantize_mx")
    scale_fmt = spec["scale"]
    encode_value(elem, 0.0, rounding, "saturate", 0)  # validates `rounding`
    q_max = _element_max(elem)
    ts = nvfp4_tensor_scale(x, canonical) if tensor_scale is None else np.float32(tensor_scale)
    if not (np.isfinite(ts) and ts > 0):
        raise ValueError(f"tensor_scale must be positive and finite, got {ts}")
    ts = max(ts, _MIN_TENSOR_SCALE)
    blocks, words, finish = _blocks_of(x, block, axis, pad, rounding, random_bits)
    elements = np.zeros(blocks.shape, np.uint8)
    scales = np.zeros(blocks.shape[:-1], np.uint8)
    with np.errstate(all="ignore"):
        for row in range(blocks.shape[0]):
            for b in range(blocks.shape[1]):
                v = blocks[row, b].astype(np.float32)  # exact: the values are float32
                if not np.isfinite(v).all():
                    scales[row, b] = _E4M3_NAN
                    continue
                block_amax = np.float32(np.abs(v).max())
                s = np.float32(np.float32(block_amax / q_max) / ts)
                s = min(max(s, _E4M3_EPS), _F8E4M3_MAX)
                code = encode(scale_fmt, np.array([s], np.float32), "nearest_even", "saturate")
                scales[row, b] = code[0]
                total = np.float32(ts * np.float32(decode(scale_fmt, code)[0]))
                q = (v / total).astype(np.float32)  # elementwise IEEE float32 division
                r = None if words is None else words[row, b]
                elements[row, b] = encode(elem, q, rounding, "saturate", r)
    elements, scales = finish(elements, scales)
    return elements, scales, np.float32(ts)


def pack_codes(codes, bits: int, axis: int = -1) -> np.ndarray:
    """Packs ``bits``-bit codes along ``axis`` as a little-endian bit stream (FP4: two per
    byte, the first in the low nibble; FP6: four per three bytes, code j in bits 6j..6j+5 of
    the little-endian 24-bit group), with Python integers.

    Example:
        >>> pack_codes(np.array([0x3F, 0x00, 0x15, 0x2A]), 6).tolist()
        [63, 80, 169]
    """
    codes = np.moveaxis(np.asarray(codes), axis, -1)
    if bits == 8:
        return np.moveaxis(codes.astype(np.uint8), -1, axis)
    flat = codes.reshape(-1, codes.shape[-1])
    n_bytes = codes.shape[-1] * bits // 8
    out = np.zeros((flat.shape[0], n_bytes), np.uint8)
    for r, row in enumerate(flat.tolist()):
        stream = sum((int(c) & ((1 << bits) - 1)) << (bits * i) for i, c in enumerate(row))
        out[r] = [(stream >> (8 * j)) & 0xFF for j in range(n_bytes)]
    return np.moveaxis(out.reshape(codes.shape[:-1] + (n_bytes,)), -1, axis)


def unpack_codes(packed, bits: int, axis: int = -1) -> np.ndarray:
    """Inverse of :func:`pack_codes`.

    Example:
        >>> unpack_codes(np.array([63, 80, 169], np.uint8), 6).tolist()
        [63, 0, 21, 42]
    """
    packed = np.moveaxis(np.asarray(packed, np.uint8), axis, -1)
    if bits == 8:
        return np.moveaxis(packed, -1, axis)
    flat = packed.reshape(-1, packed.shape[-1])
    n = packed.shape[-1] * 8 // bits
    out = np.zeros((flat.shape[0], n), np.uint8)
    for r, row in enumerate(flat.tolist()):
        stream = sum(int(b) << (8 * j) for j, b in enumerate(row))
        out[r] = [(stream >> (bits * i)) & ((1 << bits) - 1) for i in range(n)]
    return np.moveaxis(out.reshape(packed.shape[:-1] + (n,)), -1, axis)


def dequantize_mx(element_codes, scale_codes, fmt: str, *, axis: int = -1,
                  block_size: Optional[int] = None, tensor_scale=None) -> np.ndarray:
    """Values of an MX array, as float64: 2^(scale − 127) × value(element), exact.

    A scale code 0xFF (E8M0 NaN, MX v1.0 §5.4.1) makes its whole block NaN. Products are exact
    in float64: element magnitudes lie in [2^-16, 57344] and scales in [2^-127, 2^127]. For
    NVFP4 the value is float32(element × float32(tensor scale × E4M3 scale)), in NumPy float32
    arithmetic, as torchao's ``NVFP4Tensor.to_dtype`` computes it (float32 output); the E4M3
    NaN scale makes the block NaN.

    Args:
      element_codes: uint8 unpacked element codes (block axis length a multiple of the block).
      scale_codes: uint8 scale codes, ``element_codes``' shape with ``axis`` divided by the
        block size.
      fmt: MX format name or alias.
      axis: the block axis.
      block_size: another block size.
      tensor_scale: the float32 tensor scale (NVFP4).

    Returns:
      float64 array of ``element_codes``' shape.

    Example:
        >>> e = np.full((32,), 0x38, np.uint8)  # E4M3 1.0
        >>> dequantize_mx(e, np.array([130], np.uint8), "mxfp8_e4m3")[:2].tolist()
        [8.0, 8.0]
    """
    canonical, elem, block = _mx(fmt, block_size)
    scheme, spec = _scheme(canonical)
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
    if scheme == "nvfp4":
        if tensor_scale is None:
            raise ValueError(f"{canonical} values need the tensor_scale")
        with np.errstate(over="ignore", invalid="ignore"):
            total = (decode(spec["scale"], scale).astype(np.float32) * np.float32(tensor_scale))
            return (values.astype(np.float32) * total).astype(np.float64)
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
