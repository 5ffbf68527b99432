"""How one tensor is stored in a quantized checkpoint, and its quantization error.

A :class:`TensorSpec` says how a logical tensor is stored (format, scale rule, axis,
layout, original shape and dtype) and names the stored parts:

===============  =======================  ==========================================
format / layout  stored parts             values
===============  =======================  ==========================================
MX, lowprec      ``<name>_elements`` U8   element codes, MXArray.elements (FP4 packed
                                          two per byte along ``axis``, low nibble first)
                 ``<name>_scales`` U8     E8M0 codes, MXArray.scales
mxfp4, gpt-oss   ``<name>_blocks`` U8     [..., K/32, 16] packed FP4 codes
                 ``<name>_scales`` U8     [..., K/32] E8M0 codes
fp8_e4m3/e5m2    ``<name>`` F8_E4M3/E5M2  FP8(x / s), saturating
                 ``<name>_scale`` F32 []  s = amax / max_fp8 (``fp8_scale="tensor"``)
bf16 / fp16      ``<name>`` BF16 / F16    x rounded to nearest even
===============  =======================  ==========================================

Dequantized values: MX: exactly :func:`lowprec.dequantize`; FP8: float32(FP8 value × s);
BF16/FP16: the value itself.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
import numpy as np

from .._codec import decode, encode
from .._format import element_format, mx_format
from .._mx import MXArray, dequantize, quantize_mx
from .._scale_rules import DEFAULT_SCALE_RULE, SCALE_RULES
from ._safetensors import CheckpointError, numpy_dtype

MX_FORMATS = ("mxfp4", "mxfp8_e4m3", "mxfp8_e5m2")
# cast format → (element format, safetensors dtype, takes a per-tensor scale)
CAST_FORMATS = {
    "fp8_e4m3": ("e4m3", "F8_E4M3", True),
    "fp8_e5m2": ("e5m2", "F8_E5M2", True),
    "bf16": ("bf16", "BF16", False),
    "fp16": ("fp16", "F16", False),
}
FORMATS = MX_FORMATS + tuple(CAST_FORMATS)
LAYOUTS = ("lowprec", "gpt-oss")
FP8_SCALINGS = ("tensor", "none")
_ALIASES = {
    "mxfp8": "mxfp8_e4m3",
    "mxfp4_e2m1": "mxfp4",
    "fp8": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "fp8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}


def canonical_format(name: str) -> str:
    """The checkpoint format name for ``name`` (aliases accepted).

    Example:
        >>> canonical_format("MXFP8"), canonical_format("bfloat16")
        ('mxfp8_e4m3', 'bf16')
    """
    key = str(name).lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise CheckpointError(
            f"unknown checkpoint format {name!r}; choose one of: {', '.join(FORMATS)}"
        )
    return key


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """How one logical tensor is stored. ``shape``/``dtype`` are the original ones."""

    format: str
    shape: tuple
    dtype: str
    axis: Optional[int] = None
    scale_rule: Optional[str] = None
    layout: str = "lowprec"
    fp8_scale: Optional[str] = None

    @property
    def is_mx(self) -> bool:
        return self.format in MX_FORMATS

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def parts(self, name: str) -> list:
        """``[(role, stored name, safetensors dtype, stored shape), ...]`` in file order."""
        shape = tuple(self.shape)
        if self.is_mx:
            fmt = mx_format(self.format)
            n = shape[self.axis]
            groups = n // fmt.block_size
            if self.layout == "gpt-oss":
                return [
                    ("blocks", f"{name}_blocks", "U8", shape[:-1] + (groups, fmt.block_size // 2)),
                    ("scales", f"{name}_scales", "U8", shape[:-1] + (groups,)),
                ]
            elem = list(shape)
            elem[self.axis] = n // 2 if fmt.packed else n
            scales = list(shape)
            scales[self.axis] = groups
            return [
                ("elements", f"{name}_elements", "U8", tuple(elem)),
                ("scales", f"{name}_scales", "U8", tuple(scales)),
            ]
        _, st_dtype, _ = CAST_FORMATS[self.format]
        parts = [("values", name, st_dtype, shape)]
        if self.fp8_scale == "tensor":
            parts.append(("scale", f"{name}_scale", "F32", ()))
        return parts

    def nbytes(self) -> int:
        """Stored bytes (all parts)."""
        from ._safetensors import nbytes_of

        return sum(nbytes_of(dt, shp) for _, _, dt, shp in self.parts("x"))

    def to_json(self, name: str) -> dict:
        out = {"format": self.format, "shape": list(self.shape), "dtype": self.dtype}
        if self.is_mx:
            out.update(axis=self.axis, scale_rule=self.scale_rule, layout=self.layout)
        elif self.fp8_scale is not None:
            out.update(fp8_scale=self.fp8_scale)
        out["parts"] = {role: stored for role, stored, _, _ in self.parts(name)}
        return out

    @classmethod
    def from_json(cls, name: str, entry, where: str) -> "TensorSpec":
        """Parses and checks one entry of the ``lowprec.tensors`` metadata."""
        try:
            fmt = canonical_format(entry["format"])
            shape = tuple(int(d) for d in entry["shape"])
            dtype = str(entry["dtype"])
            numpy_dtype(dtype)
            if fmt in MX_FORMATS:
                spec = cls(
                    fmt,
                    shape,
                    dtype,
                    axis=int(entry["axis"]),
                    scale_rule=entry.get("scale_rule"),
                    layout=entry.get("layout", "lowprec"),
                )
                if not 0 <= spec.axis < len(shape) or shape[spec.axis] % 32:
                    raise ValueError(f"axis {spec.axis} does not fit shape {list(shape)}")
                if spec.layout not in LAYOUTS:
                    raise ValueError(f"unknown layout {spec.layout!r}")
            else:
                spec = cls(fmt, shape, dtype, fp8_scale=entry.get("fp8_scale"))
            if spec.to_json(name)["parts"] != entry.get("parts"):
                raise ValueError(f"parts {entry.get('parts')} do not match the format")
            return spec
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise CheckpointError(f"{where}: tensor {name!r}: {e}") from None
            raise CheckpointError(
                f"{where}: malformed lowprec metadata for tensor {name!r} ({type(e).__name__}: {e})"
            ) from None


def make_spec(
    fmt: str,
    shape,
    dtype: str,
    *,
    axis: int = -1,
    scale_rule: Optional[str] = None,
    layout: str = "lowprec",
    fp8_scale: str = "tensor",
) -> TensorSpec:
    """A :class:`TensorSpec` for quantizing a tensor of ``shape`` to ``fmt`` (checked)."""
    fmt = canonical_format(fmt)
    shape = tuple(int(d) for d in shape)
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; choose one of: {', '.join(LAYOUTS)}")
    if fmt in MX_FORMATS:
        scale_rule = DEFAULT_SCALE_RULE if scale_rule is None else scale_rule
        if scale_rule not in SCALE_RULES:
            raise CheckpointError(
                f"unknown scale rule {scale_rule!r}; choose one of: {', '.join(SCALE_RULES)}"
            )
        if not shape:
            raise CheckpointError("a scalar cannot be MX-quantized (blocks run along an axis)")
        if not -len(shape) <= axis < len(shape):
            raise CheckpointError(f"axis {axis} is out of range for shape {list(shape)}")
        axis %= len(shape)
        if shape[axis] % 32:
            raise CheckpointError(
                f"axis {axis} has length {shape[axis]}, not a multiple of the MX block size 32"
            )
        if layout == "gpt-oss":
            if fmt != "mxfp4":
                raise CheckpointError(
                    f"the gpt-oss layout holds MXFP4 only, not {fmt}; use --layout lowprec"
                )
            if axis != len(shape) - 1:
                raise CheckpointError("the gpt-oss layout blocks the last axis; use axis=-1")
        return TensorSpec(fmt, shape, dtype, axis=axis, scale_rule=scale_rule, layout=layout)
    if scale_rule is not None:
        raise CheckpointError(f"scale rules apply to MX formats only, not {fmt}")
    if layout != "lowprec":
        raise CheckpointError(f"the {layout} layout holds MXFP4 only, not {fmt}")
    if fp8_scale not in FP8_SCALINGS:
        raise CheckpointError(f"unknown fp8_scale {fp8_scale!r}; choose one of: {FP8_SCALINGS}")
    takes_scale = CAST_FORMATS[fmt][2]
    return TensorSpec(fmt, shape, dtype, fp8_scale=fp8_scale if takes_scale else None)


# -- error statistics ---------------------------------------------------------------
class ErrorStats:
    """Accumulates error statistics of a tensor over chunks (float64 throughout)."""

    def __init__(self):
        self.sum_x2 = 0.0
        self.sum_e2 = 0.0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.count = 0
        self.nonfinite = 0  # elements excluded: non-finite input or output
        self.clipped = 0
        self.clip_total = 0

    def update(self, x, q):
        x = np.array(x, np.float64).reshape(-1)  # own copies, modified in place below
        q = np.array(q, np.float64).reshape(-1)
        ok = np.isfinite(x) & np.isfinite(q)
        self.nonfinite += int(ok.size - np.count_nonzero(ok))
        if not ok.all():
            x, q = x[ok], q[ok]
        del ok
        err = np.subtract(x, q, out=q)
        np.abs(err, out=err)
        self.count += x.size
        self.sum_x2 += float(np.dot(x, x))
        self.sum_e2 += float(np.dot(err, err))
        if err.size:
            self.max_abs = max(self.max_abs, float(err.max()))
            np.abs(x, out=x)
            rel = np.divide(err, x, out=np.zeros_like(err), where=x != 0)
            self.max_rel = max(self.max_rel, float(rel.max()))

    def add_clipped(self, clipped: int, total: int):
        self.clipped += int(clipped)
        self.clip_total += int(total)

    @property
    def sqnr_db(self) -> float:
        if self.sum_e2 == 0:
            return math.inf
        if self.sum_x2 == 0:
            return -math.inf
        return 10 * math.log10(self.sum_x2 / self.sum_e2)

    @property
    def clipped_fraction(self) -> Optional[float]:
        return self.clipped / self.clip_total if self.clip_total else 0.0


def _mx_clipped(x32: np.ndarray, scales: np.ndarray, spec: TensorSpec) -> tuple[int, int]:
    """(blocks whose max magnitude exceeds max_elem × scale, i.e. got saturated; blocks)."""
    fmt = mx_format(spec.format)
    a = np.moveaxis(np.abs(x32), spec.axis, -1)  # float32 |x| and max are exact
    amax = a.reshape(*a.shape[:-1], -1, fmt.block_size).max(axis=-1).astype(np.float64)
    codes = np.moveaxis(scales, spec.axis, -1).astype(np.int64)
    limit = np.ldexp(fmt.element.max_finite, codes - 127)
    with np.errstate(invalid="ignore"):
        clipped = (codes != 0xFF) & (amax > limit)
    return int(np.count_nonzero(clipped)), int(codes.size)


# -- quantize / dequantize ----------------------------------------------------------
def finite_amax(x: np.ndarray) -> float:
    """max |x| over the finite elements of ``x`` (0 if there are none)."""
    a = np.abs(np.asarray(x, np.float32).reshape(-1))
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def tensor_scale(amax, spec: TensorSpec) -> np.float32:
    """The per-tensor FP8 scale float32(amax) / float32(max_fp8), from the tensor's finite
    max magnitude ``amax`` (see :func:`finite_amax`); 1 if amax is 0."""
    elem = element_format(CAST_FORMATS[spec.format][0])
    amax = np.float32(amax)
    if not amax > 0:
        return np.float32(1)
    s = amax / np.float32(elem.max_finite)
    return s if np.isfinite(s) and s > 0 else np.float32(1)


def quantize_chunk(x: np.ndarray, spec: TensorSpec, scale=None, stats: Optional[ErrorStats] = None):
    """Quantizes ``x`` (a piece of the tensor along a non-block axis, or all of it).

    Returns ``{role: stored array}`` (without the per-tensor scale); updates ``stats``.
    """
    x32 = np.asarray(x).astype(np.float32)
    if spec.is_mx:
        mx = quantize_mx(jnp.asarray(x32), spec.format, axis=spec.axis, scale_rule=spec.scale_rule)
        elements = np.asarray(mx.elements)
        scales = np.asarray(mx.scales)
        if stats is not None:
            stats.update(x, np.asarray(dequantize(mx)))
            stats.add_clipped(*_mx_clipped(x32, scales, spec))
        if spec.layout == "gpt-oss":
            blocks = elements.reshape(*elements.shape[:-1], scales.shape[-1], 16)
            return {"blocks": blocks, "scales": scales}
        return {"elements": elements, "scales": scales}
    elem_name, _, _ = CAST_FORMATS[spec.format]
    elem = element_format(elem_name)
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
    elem = element_format(CAST_FORMATS[spec.format][0])
    values = np.asarray(decode(jnp.asarray(codes.view(elem.code_dtype)), elem))
    if spec.fp8_scale == "tensor":
        with np.errstate(over="ignore"):
            values = values * np.float32(scale)
    return values


def dequantize_chunk(parts: dict, spec: TensorSpec, shape, dtype) -> np.ndarray:
    """Values of stored ``parts`` (a chunk of original ``shape``) as NumPy ``dtype``."""
    dtype = np.dtype(dtype)
    if spec.is_mx:
        fmt = mx_format(spec.format)
        if spec.layout == "gpt-oss":
            blocks = parts["blocks"]
            elements = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1])
        else:
            elements = parts["elements"]
        mx = MXArray(
            elements=jnp.asarray(elements),
            scales=jnp.asarray(parts["scales"]),
            fmt=fmt,
            axis=spec.axis,
            shape=tuple(shape),
            scale_rule=spec.scale_rule,
        )
        if dtype in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)):
            return np.asarray(dequantize(mx, dtype))
        return np.asarray(dequantize(mx)).astype(dtype)
    values = _decode_values(np.asarray(parts["values"]), spec, parts.get("scale"))
    return values.astype(dtype)
