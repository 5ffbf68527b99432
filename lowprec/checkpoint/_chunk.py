"""Encoding and decoding one piece of a tensor (see :func:`lowprec.checkpoint._layout.pieces`).

A piece of an MX tensor is a region of its (P, A, S) view, given as a 3-D array
(p, a, s) — or 2-D (p, a) when s = 1 — with the blocks along axis 1; a piece of a cast
tensor has any shape. The codecs are the library's: :func:`lowprec.quantize_mx`,
:func:`lowprec.dequantize`, :func:`lowprec.to_gpt_oss` / :func:`lowprec.from_gpt_oss`,
:func:`lowprec.encode` / :func:`lowprec.decode`. Decoded values are, bit for bit, those of
the in-memory API on the whole tensor: blocks never straddle pieces, and a per-tensor scale
(FP8 casts, NVFP4) is computed over the whole tensor first (:func:`finite_amax`,
:func:`tensor_scale`) and passed to every piece (NVFP4: ``quantize_mx(..., tensor_scale=)``).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .._codec import decode, encode
from .._gpt_oss import from_gpt_oss, to_gpt_oss
from .._mx import MXArray, dequantize, quantize_mx
from .._options import MXCast
from ._errors import CheckpointError
from ._layout import TensorSpec
from ._stats import ErrorStats

_NATIVE = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def finite_amax(x: np.ndarray) -> float:
    """max |x| over the finite elements of ``x`` (0 if there are none).

    Example:
        >>> finite_amax(np.array([1.0, -3.0, np.inf, np.nan]))
        3.0
    """
    a = np.abs(np.asarray(x, np.float32).reshape(-1))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def tensor_scale(amax, spec: TensorSpec) -> np.float32:
    """The per-tensor scale from the tensor's finite max magnitude ``amax`` (see
    :func:`finite_amax`). FP8: float32(amax) / float32(max_fp8); 1 if amax is 0. NVFP4: the
    library's, float32(amax / 2688) raised to at least 2^-143 (1 if amax is 0), which is
    what ``quantize_mx`` computes from the whole tensor.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> float(tensor_scale(896.0, make_spec("e4m3", (4,), "F32")))
        2.0
        >>> float(tensor_scale(5376.0, make_spec("nvfp4", (16,), "F32")))
        2.0
    """
    if spec.is_mx:
        amax_bits = jnp.asarray([np.float32(amax).view(np.uint32)], jnp.uint32)
        return np.uint32(_tensor_scale_bits(amax_bits, MXCast(spec.format))).view(np.float32)
    elem = spec.format
    amax = np.float32(amax)
    if not amax > 0:
        return np.float32(1)
    s = amax / np.float32(elem.max_finite)
    return s if np.isfinite(s) and s > 0 else np.float32(1)


@functools.partial(jax.jit, static_argnums=(1,))
def _tensor_scale_bits(amax_bits, cast: MXCast):
    # The scheme computes it from the finite max magnitude of what it is given: here a single
    # value, the whole tensor's amax. One compiled program (op by op, each of its dozens of
    # integer steps would be compiled on its own: ~50 MB of peak memory).
    return cast.fmt.scheme.tensor_scale_bits(amax_bits, None, cast)


@functools.partial(jax.jit, static_argnums=(0,))
def _element_scales(fmt, tensor_scale):
    """What block scale code c multiplies its elements by, for every c (one program)."""
    return fmt.scheme.element_scale(jnp.arange(256, dtype=jnp.uint8), tensor_scale)


def check_scales(values, where: str) -> None:
    """Refuses stored per-tensor or per-channel scales (an FP8 weight's, NVFP4's tensor or
    global scale) that are not positive and finite: decoding with them would give NaN, ±inf,
    zeros or flipped signs without a word. ``where`` names the stored tensor in the message.

    Example:
        >>> check_scales(np.float32([0.5, 2.0]), "w_scale")
        >>> check_scales(np.float32([0.5, -2.0]), "w_scale")
        Traceback (most recent call last):
        ...
        lowprec.checkpoint._errors.CheckpointError: w_scale: 1 of 2 scale(s) not positive and finite (e.g. -2.0); a scale must be a positive finite number: the file is damaged or not in the layout its names claim
    """
    v = np.asarray(values, np.float32).reshape(-1)  # BF16/F16 scales widen exactly
    with np.errstate(invalid="ignore"):
        bad = ~(np.isfinite(v) & (v > 0))
    if bad.any():
        raise CheckpointError(
            f"{where}: {int(np.count_nonzero(bad))} of {v.size} scale(s) not positive and finite "
            f"(e.g. {float(v[np.argmax(bad)])!r}); a scale must be a positive finite number: the "
            "file is damaged or not in the layout its names claim")


def _as_piece(x: np.ndarray) -> np.ndarray:
    """(p, a, s) → (p, a) when s = 1, so that the block axis is the last one."""
    return x.reshape(x.shape[:2]) if x.ndim == 3 and x.shape[2] == 1 else x


@functools.lru_cache(maxsize=None)
def _scale_values(scale_fmt) -> np.ndarray:
    """The value of each uint8 scale code (float64; decoded once per scale format)."""
    return np.asarray(decode(jnp.arange(256, dtype=jnp.uint8), scale_fmt), np.float64)


def _scale_nan(scale_fmt) -> np.ndarray:
    """For each uint8 scale code: whether it is the scale format's NaN (E8M0: 0xFF; E4M3:
    0x7F and 0xFF), i.e. marks a block that held a NaN or an infinity."""
    return np.isnan(_scale_values(scale_fmt))


def _mx_clipped(x, scales: np.ndarray, fmt, ts=None) -> tuple:
    """(blocks whose max magnitude exceeds max_elem × scale, i.e. got saturated; blocks).
    ``x``: a piece with the blocks along axis 1; ``scales`` its scale codes; ``ts`` the
    NVFP4 tensor scale (a block's scale is then float32(ts × E4M3 block scale), as the
    quantizer divides by it)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    mag = x.view(np.uint32) & np.uint32(0x7FFF_FFFF)
    amax = mag.reshape(x.shape[0], -1, fmt.block_size, *x.shape[2:]).max(axis=2)
    codes = scales.reshape(amax.shape)
    # A block is clipped iff its max |x| exceeds max_elem times what its scheme scales its
    # elements by: 2^e for shared-exponent scales, else the float32 factor (NVFP4: float32(ts x
    # E4M3 block scale), the quantizer's divisor). Both products are exact in float64; a NaN
    # block (its scale code the scale format's NaN) is never clipped.
    factor = np.asarray(_element_scales(fmt, ts))
    if np.issubdtype(factor.dtype, np.integer):
        factor = np.ldexp(1.0, factor)
    limits = factor.astype(np.float64) * fmt.element.max_finite
    nan = _scale_nan(fmt.scale)
    with np.errstate(invalid="ignore"):
        clipped = (amax.view(np.float32) > limits[codes]) & ~nan[codes]
    return int(np.count_nonzero(clipped)), int(scales.size)


def quantize_chunk(x: np.ndarray, spec: TensorSpec, scale=None,
                   stats: Optional[ErrorStats] = None) -> dict:
    """Quantizes one piece ``x`` of a tensor stored as ``spec``.

    Returns ``{role: stored array}`` in the piece's shape (without the per-tensor scale,
    which the caller passes as ``scale``: the whole tensor's :func:`tensor_scale`, needed for
    NVFP4 and FP8 with ``fp8_scale="tensor"``); updates ``stats``.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> parts = quantize_chunk(np.ones((2, 64), np.float32), make_spec("mxfp4", (2, 64), "F32"))
        >>> {k: v.shape for k, v in parts.items()}
        {'elements': (2, 32), 'scales': (2, 2)}
    """
    x = np.asarray(x)
    if spec.is_mx:
        x = _as_piece(x)
        xin = x if x.dtype in _NATIVE else x.astype(np.float32)
        fmt = spec.format
        if fmt.tensor_scale and scale is None:
            raise ValueError(f"{fmt.name}: pass the whole tensor's scale (tensor_scale())")
        ts = np.float32(scale) if fmt.tensor_scale else None
        mx = quantize_mx(jnp.asarray(xin), fmt, axis=1, scale_rule=spec.scale_rule,
                         tensor_scale=ts)
        scales = np.asarray(mx.scales)
        if stats is not None:
            stats.update(x, np.asarray(dequantize(mx)))
            stats.add_clipped(*_mx_clipped(xin, scales, fmt, ts))
            stats.add_nan_blocks(scales, _scale_nan(fmt.scale))
        if spec.layout == "gpt-oss":
            blocks, scales = to_gpt_oss(mx)
            return {"blocks": np.asarray(blocks), "scales": np.asarray(scales)}
        return {"elements": np.asarray(mx.elements), "scales": scales}
    elem = spec.format
    x32 = x.astype(np.float32)
    if spec.fp8_scale == "tensor":
        scale = np.float32(1) if scale is None else np.float32(scale)
        with np.errstate(over="ignore", invalid="ignore"):
            y = x32 / scale
    else:
        y = x32
    codes = np.asarray(encode(jnp.asarray(y), elem, overflow="saturate"))
    if stats is not None:
        stats.update(x, _decode_values(codes, spec, scale))
        with np.errstate(invalid="ignore"):
            stats.add_clipped(np.count_nonzero(np.abs(y) > elem.max_finite), y.size)
    return {"values": codes}


def _decode_values(codes: np.ndarray, spec: TensorSpec, scale) -> np.ndarray:
    elem = spec.format
    values = np.asarray(decode(jnp.asarray(codes.view(elem.code_dtype)), elem))
    if spec.fp8_scale == "tensor":
        with np.errstate(over="ignore"):
            values = values * np.float32(scale)
    return values


def dequantize_chunk(parts: dict, spec: TensorSpec, shape, dtype) -> np.ndarray:
    """Values of the stored ``parts`` of one piece, as NumPy ``dtype``, in shape ``shape``.

    For MX, ``shape`` is the piece's (p, a, s) in the tensor's (P, A, S) view (the whole
    tensor is the piece ``spec.view``); the parts may come in any shape holding the
    piece's bytes in C order. For casts, ``shape`` is any shape of the values.

    Example:
        >>> from lowprec.checkpoint._layout import make_spec
        >>> spec = make_spec("mxfp8", (1, 32), "F32")
        >>> x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(1, 32)
        >>> got = dequantize_chunk(quantize_chunk(x, spec), spec, (1, 32, 1), np.float32)
        >>> got.shape, float(np.abs(got.reshape(1, 32) - x).max()) < 2**-4
        ((1, 32, 1), True)
    """
    dtype = np.dtype(dtype)
    if not spec.is_mx:
        values = _decode_values(np.asarray(parts["values"]), spec, parts.get("scale"))
        return values.astype(dtype).reshape(shape)
    p, a, s = (int(d) for d in shape)
    try:
        fmt = spec.format
        scales = np.asarray(parts["scales"]).reshape(p, spec.part_length("scales", a), s)
        if spec.layout == "gpt-oss":
            if s != 1:
                raise ValueError("the gpt-oss layout blocks the last axis")
            blocks = np.asarray(parts["blocks"]).reshape(p, a // 32, 16)
            mx = from_gpt_oss(blocks, scales.reshape(p, a // 32), scale_rule=spec.scale_rule)
        else:
            elements = np.asarray(parts["elements"]).reshape(
                p, spec.part_length("elements", a), s)
            piece = (p, a, s)
            if s == 1:
                elements, scales, piece = elements[..., 0], scales[..., 0], (p, a)
            ts = None
            if fmt.tensor_scale:
                ts = jnp.asarray(np.asarray(parts["scale"], np.float32).reshape(()))
            mx = MXArray(elements=jnp.asarray(elements), scales=jnp.asarray(scales), fmt=fmt,
                         axis=1, shape=piece, scale_rule=spec.scale_rule, tensor_scale=ts)
        values = dequantize(mx, dtype) if dtype in _NATIVE else np.asarray(dequantize(mx)).astype(dtype)
    except (ValueError, TypeError) as e:  # wrong sizes; MXArray's own validation
        raise CheckpointError(f"cannot decode {spec.format.name} data of shape {list(spec.shape)}: {e}") from None
    return np.asarray(values).reshape(p, a, s)
