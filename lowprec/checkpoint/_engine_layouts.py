"""Checkpoint layouts that inference engines load: compressed-tensors and NVIDIA ModelOpt.

lowprec's own layout (``<name>_elements`` / ``<name>_scales`` / ``<name>_scale``, see
:mod:`lowprec.checkpoint._layout`) is read by lowprec only. vLLM, SGLang and transformers
load two other layouts of the same bits, facts taken from compressed-tensors 0.20 (its
compressors and ``forward._dequantize``) and ModelOpt's unified Hugging Face export.
Stored tensors of a Linear ``M`` (weight [out, in]) and the value each loader computes:

- compressed-tensors ``nvfp4-pack-quantized``: ``M.weight_packed`` U8 [out, in/2] (E2M1,
  low nibble first), ``M.weight_scale`` F8_E4M3 [out, in/16] (s), ``M.weight_global_scale``
  F32 [1] (gs = 2688 / amax: the *reciprocal* of lowprec's tensor scale); value
  e × float32(s / gs), then the model dtype (bfloat16).
- ``mxfp4-pack-quantized``: ``M.weight_packed`` U8 [out, in/2], ``M.weight_scale`` U8
  [out, in/32] (E8M0 code c); e × 2^(c − 127) in bfloat16 (c = 0xFF reads as inf, not NaN).
- ``mxfp8-quantized``: ``M.weight`` F8_E4M3 [out, in], ``M.weight_scale`` U8 [out, in/32];
  e × 2^(c − 127) in bfloat16.
- ``float-quantized`` (FP8): ``M.weight`` F8_E4M3, ``M.weight_scale`` F32 [1] (per tensor)
  or [out, 1] (per channel); e × s in float32 (BF16/F16 scales, as other tools write them,
  are read too).
- ModelOpt ``NVFP4``: ``M.weight`` U8 [out, in/2], ``M.weight_scale`` F8_E4M3 [out, in/16],
  ``M.weight_scale_2`` F32 [] (ts = amax / 2688, lowprec's tensor scale as is), and
  ``M.input_scale`` (activations; copied). lowprec decodes it as its own NVFP4,
  e × float32(ts × s); vLLM's ModelOpt kernels fold ts into the GEMM's alpha (the exact
  e × s products, summed, times ts), so there is no per-element loader value to match.
- ModelOpt ``FP8``: ``M.weight`` F8_E4M3, ``M.weight_scale`` F32 []; e × s.

The folder's ``config.json`` carries ``quantization_config`` (compressed-tensors:
``quant_method: "compressed-tensors"``, ``format``, ``quantization_status: "compressed"``,
``config_groups`` of {targets, weights: QuantizationArgs}, ``ignore``; ModelOpt:
``hf_quant_config.json`` with ``quantization.quant_algo``, ``group_size`` and
``exclude_modules``, mirrored in ``config.json`` with ``quant_method: "modelopt"``).

**The reciprocal global scale.** lowprec (and ModelOpt) decode NVFP4 as e × float32(ts × s);
compressed-tensors as e × float32(s / gs). With gs = float32(1 / ts) the two differ in the last
bit for some (ts, s) unless ts is a power of two. So :func:`~lowprec.checkpoint.quantize_engine_checkpoint` writing
compressed-tensors NVFP4 rounds the tensor scale *up to a power of two* (ts = 2^⌈log2(amax /
2688)⌉, at least 2^-126 so that gs is a finite float32): the block scales keep their E4M3
precision (they only move down a binade at most), and every value the loader computes equals
lowprec's bit for bit. Converting an existing NVFP4 tensor between the layouts
(:func:`~lowprec.checkpoint.convert_checkpoint`) is done only when it is exact — for every block-scale code s the
tensor uses, float32(s / gs) = float32(ts × s) and gs ↔ ts maps back to the same bits — and
refused otherwise, naming the tensor (dequantize, or requantize from the original weights).

Tensors are recognized by their stored names and dtypes (no lowprec metadata needed), so
``lowprec dequantize`` / ``inspect`` / :func:`~lowprec.checkpoint.load_checkpoint` read
folders written by llm-compressor or ModelOpt too. Conversions here hold a block of rows
(:data:`ROW_BLOCK_ELEMENTS`) at a time; a tensor-wide scale comes from a first pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from .._codec import decode
from .._format import element_format, mx_format
from .._mx import MXArray, dequantize
from ..kernels import _ckpt_cpu
from ._chunk import (
    CodedPiece,
    count_nonfinite,
    decode_coded,
    element_table,
    encode_blocks,
    encode_cast,
    finite_amax,
    finite_amax_rows,
    mx_coded,
    narrow,
    native,
    wide_dtype,
)
from ._errors import CheckpointError
from ._formats import checkpoint_format
from ._safetensors import FLOAT_DTYPES, nbytes_of, numpy_dtype

#: Layouts written for inference engines (``--layout``).
ENGINE_LAYOUTS = ("compressed-tensors", "modelopt")
#: The compressed-tensors release whose layout and config lowprec writes (``version``).
CT_VERSION = "0.20.0"

_E4M3 = element_format("e4m3")
_E2M1 = element_format("e2m1")
_NVFP4 = mx_format("nvfp4")
_MXFP4 = mx_format("mxfp4")
_MXFP8 = mx_format("mxfp8_e4m3")

#: Schemes an engine layout can hold: scheme → (lowprec format, compressed-tensors format).
SCHEMES = {
    "nvfp4": (_NVFP4, "nvfp4-pack-quantized"),
    "mxfp4": (_MXFP4, "mxfp4-pack-quantized"),
    "mxfp8": (_MXFP8, "mxfp8-quantized"),
    "fp8": (_E4M3, "float-quantized"),
    "fp8_channel": (_E4M3, "float-quantized"),
}
_SCHEME_ALIASES = {"e4m3_channel": "fp8_channel", "fp8_per_channel": "fp8_channel"}
#: Schemes the ModelOpt layout holds: scheme → its ``quant_algo``.
MODELOPT_SCHEMES = {"nvfp4": "NVFP4", "fp8": "FP8"}

#: Safetensors metadata key of the engine layouts lowprec writes: per tensor, the original
#: dtype and scale rule, kept across layouts (so lowprec → engine → lowprec is byte-identical).
ORIGIN_KEY = "lowprec.origin"

#: Module names kept in high precision by default (``re.search``, case-insensitive): the
#: output head, embeddings, norms; only 2-D ``*.weight`` tensors (Linear layers) are quantized.
DEFAULT_IGNORE = r"lm_head|embed|norm|(^|[._])(wte|wpe|ln_\w*)([._]|$)"

_F32_MAX_E4M3 = 448.0
#: Elements per block of rows that a conversion holds at once (as lowprec's own layout's
#: pieces, :data:`lowprec.checkpoint._convert.CHUNK_ELEMENTS`).
ROW_BLOCK_ELEMENTS = 1 << 20
_WHOLE = ("global_scale",)
_NVFP4_DIVISOR = np.float32(2688)  # 448 · 6 = F8E4M3_MAX · F4E2M1_MAX
_MIN_TS = np.float32(2.0 ** -126)  # 1 / ts must be a finite float32


def scheme_name(fmt) -> str:
    """The engine scheme for a scheme name or a format: ``"nvfp4"``, ``"mxfp4"``,
    ``"mxfp8"`` (E4M3 elements), ``"fp8"`` (E4M3, one scale per tensor) or ``"fp8_channel"``
    (one per row); lowprec format objects, names and aliases are accepted (``"e4m3"``,
    ``"mxfp8_e4m3"``).

    Example:
        >>> scheme_name("e4m3"), scheme_name("MXFP8"), scheme_name("fp8_channel")
        ('fp8', 'mxfp8', 'fp8_channel')
    """
    if isinstance(fmt, str) and (fmt in SCHEMES or fmt in _SCHEME_ALIASES):
        return _SCHEME_ALIASES.get(fmt, fmt)
    resolved = checkpoint_format(fmt)
    for name, (lp, _) in SCHEMES.items():
        if lp == resolved:
            return name
    given = fmt if isinstance(fmt, str) else resolved.name
    raise CheckpointError(
        f"format {given!r} has no compressed-tensors/ModelOpt scheme; choose one of: "
        f"{', '.join(SCHEMES)}"
    )


# -- one tensor: the stored parts ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A Linear weight stored in an engine layout (duck-types :class:`TensorSpec` for the
    readers in :mod:`lowprec.checkpoint._logical` and :mod:`lowprec.checkpoint._convert`)."""

    scheme: str
    layout: str
    shape: tuple
    dtype: str = "BF16"
    scale_rule: Optional[str] = None
    scale_dtype: str = "F32"  # FP8's weight_scale: F32 as lowprec writes; BF16/F16 are read too

    @property
    def format(self):
        """The lowprec format of the stored codes (its object)."""
        return SCHEMES[self.scheme][0]

    @property
    def label(self) -> str:
        channel = ", per channel" if self.scheme == "fp8_channel" else ""
        return f"{self.format.name} ({self.layout}{channel})"

    def is_whole(self, role: str) -> bool:
        """Whether part ``role`` is one number for the whole tensor (not cut into rows)."""
        return role in _WHOLE or (role == "scale" and self.scheme != "fp8_channel")

    @property
    def view(self) -> tuple:
        return (1, math.prod(self.shape), 1)

    piece_view = view

    def parts(self, name: str) -> list:
        """``[(role, stored name, dtype, shape)]``; ``name`` is the weight's (``M.weight``)."""
        out, k = self.shape
        if self.layout == "modelopt":
            if self.scheme == "nvfp4":
                return [("elements", name, "U8", (out, k // 2)),
                        ("scales", f"{name}_scale", "F8_E4M3", (out, k // 16)),
                        ("scale", f"{name}_scale_2", "F32", ())]
            return [("values", name, "F8_E4M3", (out, k)),
                    ("scale", f"{name}_scale", self.scale_dtype, ())]
        if self.scheme == "nvfp4":
            return [("elements", f"{name}_packed", "U8", (out, k // 2)),
                    ("scales", f"{name}_scale", "F8_E4M3", (out, k // 16)),
                    ("global_scale", f"{name}_global_scale", "F32", (1,))]
        if self.scheme == "mxfp4":
            return [("elements", f"{name}_packed", "U8", (out, k // 2)),
                    ("scales", f"{name}_scale", "U8", (out, k // 32))]
        if self.scheme == "mxfp8":
            return [("values", name, "F8_E4M3", (out, k)),
                    ("scales", f"{name}_scale", "U8", (out, k // 32))]
        rows = out if self.scheme == "fp8_channel" else 1
        shape = (rows, 1) if self.scheme == "fp8_channel" else (1,)
        return [("values", name, "F8_E4M3", (out, k)),
                ("scale", f"{name}_scale", self.scale_dtype, shape)]

    def nbytes(self) -> int:
        return sum(nbytes_of(dt, shp) for _, _, dt, shp in self.parts("x"))

    def row_blocks(self):
        """``(r0, r1)`` ranges of about :data:`ROW_BLOCK_ELEMENTS` elements (at least a row)."""
        out, k = self.shape
        step = max(1, ROW_BLOCK_ELEMENTS // max(k, 1))
        for r0 in range(0, out, step):
            yield r0, min(r0 + step, out)

    def read_rows(self, reader, parts, r0: int, r1: int) -> dict:
        """``{role: stored rows r0..r1}``; a tensor-wide scale is read whole."""
        return {role: reader.read(stored) if self.is_whole(role)
                else reader.read_rows(stored, r0, r1) for role, stored, _, _ in parts}

    def decode_pieces(self, reader, parts) -> list:
        """``[(rect, decode)]`` per block of rows: ``decode(np_dtype, saturate, name)`` reads
        the rows and returns ``(values, saturated, non-finite values)``, decoded as the
        engine's loader does (its stored scales were checked by the reader:
        :mod:`lowprec.checkpoint._validate`) and narrowed to ``np_dtype``."""
        k = self.shape[1]

        def task(r0, r1):
            rows = dataclasses.replace(self, shape=(r1 - r0, k))

            def decode(np_dtype, saturate: bool, name: str):
                return decode_values(self.read_rows(reader, parts, r0, r1), rows, np_dtype,
                                     saturate=saturate, name=name)
            return (0, 1, r0 * k, r1 * k, 0, 1), decode

        return [task(r0, r1) for r0, r1 in self.row_blocks()]


def _cast(values: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def _e4m3(codes) -> np.ndarray:
    return np.asarray(decode(jnp.asarray(np.asarray(codes).view(np.uint8)), _E4M3), np.float32)


def _e2m1_unpacked(packed: np.ndarray) -> np.ndarray:
    """E2M1 values of packed codes (low nibble first along the last axis)."""
    p = np.asarray(packed).view(np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return np.asarray(decode(jnp.asarray(codes), _E2M1), np.float32)


def decode_arrays(arrays: dict, spec: EngineSpec) -> np.ndarray:
    """float32 values of one tensor from its stored ``arrays`` (``{role: array}``), with the
    arithmetic of the layout's loader (before its cast to the model dtype)."""
    out, k = spec.shape
    if spec.scheme == "nvfp4" and spec.layout == "compressed-tensors":
        e = _e2m1_unpacked(arrays["elements"]).reshape(out, k // 16, 16)
        s = _e4m3(arrays["scales"]).reshape(out, k // 16, 1)
        gs = np.float32(np.asarray(arrays["global_scale"]).reshape(-1)[0])
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            return (e * (s / gs)).reshape(out, k)
    if spec.scheme in ("nvfp4", "mxfp4", "mxfp8"):
        return np.asarray(dequantize(_mxarray(arrays, spec)), np.float32)
    e = _e4m3(arrays["values"])
    s = np.asarray(arrays["scale"], np.float32)
    s = s.reshape((-1, 1) if spec.scheme == "fp8_channel" else ())
    with np.errstate(over="ignore", invalid="ignore"):
        return e * s


def coded_arrays(arrays: dict, spec: EngineSpec) -> Optional[CodedPiece]:
    """The stored ``arrays`` of one tensor (or block of rows) as a
    :class:`~lowprec.checkpoint._chunk.CodedPiece`: the values :func:`decode_arrays`
    computes, element for element, as ``table[code] × factor`` (compressed-tensors NVFP4:
    the factor float32(s / gs) per E4M3 code; FP8: the scale per tensor or per row; the MX
    schemes and ModelOpt NVFP4: lowprec's decode)."""
    out, k = spec.shape
    if spec.scheme in ("fp8", "fp8_channel"):
        s = np.asarray(arrays["scale"], np.float32).reshape(-1)
        codes = np.asarray(arrays["values"]).view(np.uint8).reshape(-1)
        return CodedPiece(codes, 8, element_table(_E4M3), s,
                          k if spec.scheme == "fp8_channel" else max(codes.size, 1), False)
    fmt = spec.format
    elements = np.asarray(arrays.get("elements", arrays.get("values"))).view(np.uint8)
    scales = np.asarray(arrays["scales"]).view(np.uint8).reshape(-1)
    want = (out * k * fmt.element.code_bits // 8, out * k // fmt.block_size)
    if (elements.size, scales.size) != want:
        raise CheckpointError(
            f"cannot decode {spec.label} data of shape {list(spec.shape)}: {elements.size} "
            f"element bytes and {scales.size} scales (need {want[0]} and {want[1]})")
    if spec.scheme == "nvfp4" and spec.layout == "compressed-tensors":
        gs = np.float32(np.asarray(arrays["global_scale"]).reshape(-1)[0])
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            table = element_table(_E4M3) / gs  # float32(s / gs), the loader's division
        return CodedPiece(elements.reshape(-1), 4, element_table(_E2M1), table[scales], 16,
                          False)
    ts = np.asarray(arrays["scale"], np.float32).reshape(()) if fmt.tensor_scale else None
    return mx_coded(elements, scales, fmt, ts)


def decode_values(arrays: dict, spec: EngineSpec, np_dtype, *, saturate: bool,
                  name: str) -> tuple:
    """``(values, saturated, non-finite values)``: :func:`decode_arrays` narrowed to
    ``np_dtype`` as the pipeline narrows (:func:`lowprec.checkpoint._chunk.narrow`), in one
    native pass where it serves."""
    np_dtype = np.dtype(np_dtype)
    if native() and np_dtype in _ckpt_cpu.KINDS:
        coded = coded_arrays(arrays, spec)
        if coded is not None:
            return decode_coded(coded, spec.shape, np_dtype, saturate=saturate, name=name)
    values = _cast(decode_arrays(arrays, spec), wide_dtype(np_dtype))
    values, n = narrow(values, np_dtype, name, saturate)
    return values, n, count_nonfinite(values)


def add_stats(stats, x: np.ndarray, arrays: dict, spec: EngineSpec) -> None:
    """Adds the errors of one block of rows ``x`` stored as ``arrays`` to ``stats`` (an
    :class:`~lowprec.checkpoint._stats.ErrorStats`): from the stored codes by the native
    pass where it serves, else against :func:`decode_arrays`."""
    if native() and x.dtype in (np.float32, jnp.bfloat16, np.float16):
        coded = coded_arrays(arrays, spec)
        if coded is not None:
            stats.add_vector(_ckpt_cpu.stats(x, **coded.args()))
            return
    stats.update(x, decode_arrays(arrays, spec))


def _mxarray(arrays: dict, spec: EngineSpec) -> MXArray:
    fmt = spec.format
    elements = np.asarray(arrays.get("elements", arrays.get("values"))).view(np.uint8)
    ts = None
    if fmt.tensor_scale:
        ts = jnp.asarray(np.asarray(arrays["scale"], np.float32).reshape(()))
    try:
        return MXArray(elements=jnp.asarray(elements),
                       scales=jnp.asarray(np.asarray(arrays["scales"]).view(np.uint8)),
                       fmt=fmt, axis=1, shape=tuple(spec.shape), scale_rule=spec.scale_rule,
                       tensor_scale=ts)
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            f"cannot decode {spec.label} data of shape {list(spec.shape)}: {e}") from None


# -- recognizing engine tensors in a file ----------------------------------------------
def engine_specs(reader) -> dict:
    """``{weight name: EngineSpec}`` for the tensors of ``reader`` stored in an engine
    layout, recognized by stored names, dtypes and shapes (nothing else is claimed)."""
    t = reader.tensors
    found = {}

    def get(name, dtype=None, ndim=None):
        info = t.get(name)
        if info is None or (dtype and info.dtype not in dtype):
            return None
        if ndim is not None and len(info.shape) != ndim:
            return None
        return info

    for name, info in t.items():
        if name.endswith(".weight_packed") and info.dtype == "U8" and len(info.shape) == 2:
            w = name[: -len("_packed")]
            if w in t:
                continue
            out, half = info.shape
            sc = get(f"{w}_scale", ("F8_E4M3", "U8"), 2)
            if sc is None or sc.shape[0] != out:
                continue
            gs = get(f"{w}_global_scale", ("F32",))
            nvfp4 = sc.dtype == "F8_E4M3" and gs is not None and gs.numel == 1
            if nvfp4 and sc.shape[1] * 8 == half:
                found[w] = EngineSpec("nvfp4", "compressed-tensors", (out, 2 * half))
            elif sc.dtype == "U8" and gs is None and sc.shape[1] * 16 == half:
                found[w] = EngineSpec("mxfp4", "compressed-tensors", (out, 2 * half))
        elif name.endswith(".weight") and len(info.shape) == 2:
            out, k = info.shape
            sc = t.get(f"{name}_scale")
            if sc is None:
                continue
            if info.dtype == "U8" and sc.dtype == "F8_E4M3" and sc.shape == (out, k // 8) \
                    and get(f"{name}_scale_2", ("F32",), 0) is not None:
                found[name] = EngineSpec("nvfp4", "modelopt", (out, 2 * k))
            elif info.dtype == "F8_E4M3" and sc.dtype == "U8" and k % 32 == 0 \
                    and sc.shape == (out, k // 32):
                found[name] = EngineSpec("mxfp8", "compressed-tensors", (out, k))
            elif info.dtype == "F8_E4M3" and sc.dtype in ("F32", "BF16", "F16"):
                sd = sc.dtype
                if sc.shape == ():
                    found[name] = EngineSpec("fp8", "modelopt", (out, k), scale_dtype=sd)
                elif sc.shape == (1,):
                    found[name] = EngineSpec("fp8", "compressed-tensors", (out, k), scale_dtype=sd)
                elif sc.shape == (out, 1):
                    found[name] = EngineSpec("fp8_channel", "compressed-tensors", (out, k),
                                             scale_dtype=sd)
    origin = {}
    with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
        origin = dict(json.loads(reader.metadata.get(ORIGIN_KEY, "{}")))
    for name, spec in found.items():  # the original dtype, when lowprec wrote the file
        o = origin.get(name)
        if isinstance(o, dict) and o.get("dtype") in FLOAT_DTYPES:
            found[name] = dataclasses.replace(spec, dtype=o["dtype"])
    return found


# -- quantizing one tensor ----------------------------------------------------------------
def _pow2_at_least(x: np.float32) -> np.float32:
    """The smallest power of two ≥ x (x a positive finite float32), at least 2^-126."""
    x = max(np.float32(x), _MIN_TS)
    m, e = math.frexp(float(x))  # x = m · 2^e, m in [0.5, 1)
    return np.float32(math.ldexp(1.0, e - 1 if m == 0.5 else e))


def quantize_arrays(x: np.ndarray, scheme: str, layout: str, *, scale_rule=None,
                    amax=None) -> dict:
    """Quantizes one [out, in] weight (or a block of its rows, with ``amax`` the whole
    tensor's finite max magnitude) with lowprec's quantizers; ``{role: array}`` in the
    layout's dtypes (see the table in the module docstring)."""
    x = np.asarray(x)
    xin = x if x.dtype in (np.float32, jnp.bfloat16, np.float16) else x.astype(np.float32)
    if scheme == "nvfp4":
        amax = np.float32(finite_amax(xin) if amax is None else amax)
        ts = np.float32(amax / _NVFP4_DIVISOR) if amax > 0 else np.float32(1)
        if layout == "compressed-tensors":
            ts = _pow2_at_least(ts)  # exact reciprocal: see the module docstring
        else:
            ts = max(ts, np.float32(2.0 ** -143))  # lowprec's own floor (docs/design.md §3b)
        elements, scales, _ = encode_blocks(xin, _NVFP4, None, ts)
        out = {"elements": elements, "scales": scales.view(numpy_dtype("F8_E4M3"))}
        if layout == "compressed-tensors":
            out["global_scale"] = np.array([np.float32(1) / ts], np.float32)
        else:
            out["scale"] = np.asarray(ts, np.float32)
        return out
    if scheme in ("mxfp4", "mxfp8"):
        el, scales, _ = encode_blocks(xin, SCHEMES[scheme][0], scale_rule)
        return {("elements" if scheme == "mxfp4" else "values"):
                el if scheme == "mxfp4" else el.view(numpy_dtype("F8_E4M3")),
                "scales": scales}
    # FP8: s = amax / 448 (1 for an all-zero tensor or row), codes = E4M3(x / s), saturating
    if scheme == "fp8_channel":
        amax = finite_amax_rows(xin).reshape(-1, 1)
    else:
        amax = np.float32(finite_amax(xin) if amax is None else amax)
    s = np.where(amax > 0, amax / np.float32(_F32_MAX_E4M3), np.float32(1)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = xin.astype(np.float32) / s
    codes = encode_cast(y, _E4M3)
    if scheme == "fp8_channel":
        scale_shape = (x.shape[0], 1)
    else:
        scale_shape = (1,) if layout == "compressed-tensors" else ()
    return {"values": codes.view(numpy_dtype("F8_E4M3")), "scale": s.reshape(scale_shape)}


# -- configs -------------------------------------------------------------------------------
def _ct_weights_args(scheme: str) -> dict:
    """compressed-tensors ``QuantizationArgs`` of the weights (weight-only schemes)."""
    base = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    if scheme == "nvfp4":
        return {**base, "num_bits": 4, "group_size": 16, "strategy": "tensor_group",
                "scale_dtype": "torch.float8_e4m3fn"}
    if scheme == "mxfp4":
        return {**base, "num_bits": 4, "group_size": 32, "strategy": "group",
                "scale_dtype": "torch.uint8"}
    if scheme == "mxfp8":
        return {**base, "group_size": 32, "strategy": "group", "scale_dtype": "torch.uint8"}
    return {**base, "strategy": "channel" if scheme == "fp8_channel" else "tensor"}


def ct_quantization_config(groups: dict, ignore: Sequence[str]) -> dict:
    """``config.json``'s ``quantization_config`` for compressed-tensors. ``groups``: scheme →
    sorted module names. One scheme: targets ``["Linear"]`` and the kept Linear modules in
    ``ignore``; several: each group targets its exact module names (compressed-tensors
    prefers exact names over patterns, so no module can land in another group)."""
    single = len(groups) == 1
    ignore = _with_head(groups, ignore)
    config_groups = {}
    for i, (scheme, modules) in enumerate(sorted(groups.items())):
        config_groups[f"group_{i}"] = {
            "targets": ["Linear"] if single else list(modules),
            "weights": _ct_weights_args(scheme),
            "input_activations": None,
            "output_activations": None,
            "format": SCHEMES[scheme][1],
        }
    formats = {SCHEMES[s][1] for s in groups}
    return {
        "quant_method": "compressed-tensors",
        # The compressed-tensors release whose layout this is; its fields, as its
        # ModelCompressor.update_config writes them (sparsity and transforms: none).
        "version": CT_VERSION,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "moe_sparsity_config": None,
        "transform_config": {},
    }


def _with_head(groups: dict, ignore) -> set:
    """``ignore`` plus ``lm_head`` unless a group quantizes it: a model with tied embeddings
    has an ``lm_head`` Linear but no ``lm_head.weight`` in the file, which the loader must not
    look for."""
    ignore = set(ignore)
    if not any("lm_head" in modules for modules in groups.values()):
        ignore.add("lm_head")
    return ignore


def modelopt_quant_config(scheme: str, exclude: Sequence[str]) -> dict:
    """``hf_quant_config.json`` of a ModelOpt export (``quantization`` section)."""
    q = {"quant_algo": MODELOPT_SCHEMES[scheme], "kv_cache_quant_algo": None,
         "exclude_modules": sorted(_with_head({scheme: ()}, exclude))}
    if scheme == "nvfp4":
        q["group_size"] = 16
    return {"producer": {"name": "lowprec"}, "quantization": q}


# -- converting between layouts without requantizing ------------------------------------


def scheme_bits(name, spec, arrays, target: str = "compressed-tensors") -> tuple:
    """``(scheme, {role: array})`` in the roles of :class:`EngineSpec` (elements/values,
    scales, and ``ts`` = the float32 tensor scale of NVFP4 / FP8, or ``scale`` for per-channel
    FP8) from a tensor stored in any layout (its scales checked by the reader:
    :mod:`lowprec.checkpoint._validate`), to be moved to the ``target`` layout."""
    if isinstance(spec, EngineSpec):
        bits = dict(arrays)
        if spec.scheme == "nvfp4" and spec.layout == "compressed-tensors":
            gs = np.float32(np.asarray(bits.pop("global_scale")).reshape(-1)[0])
            bits["ts"] = exact_reciprocal(name, gs, bits["scales"], "lowprec")
        elif "scale" in bits and spec.scheme != "fp8_channel":
            bits["ts"] = np.float32(np.asarray(bits.pop("scale")).reshape(-1)[0])
        return spec.scheme, bits
    if spec.layout == "gpt-oss" and len(spec.shape) == 2:  # [out, K/32, 16]: the packed bytes
        arrays = {"elements" if k == "blocks" else k: v for k, v in arrays.items()}
        if arrays.get("elements") is not None:
            blocks = np.asarray(arrays["elements"])
            arrays["elements"] = blocks.reshape(blocks.shape[0], -1)
    elif spec.layout != "lowprec" or len(spec.shape) != 2 or (spec.is_mx and spec.axis != 1):
        shape = "x".join(map(str, spec.shape))
        raise CheckpointError(
            f"{name}: {spec.format.name} of shape {shape} in the {spec.layout} layout"
            + (f", blocked along axis {spec.axis}," if spec.is_mx else "")
            + (f" has no {target} equivalent (the {target} layout holds [out, in] weights "
               "blocked along in); dequantize it instead" if target != "lowprec" else
               " cannot be moved: convert moves [out, in] weights blocked along in; dequantize "
               "it, or quantize the original weights with --layout lowprec"))
    schemes = {_NVFP4: "nvfp4", _MXFP4: "mxfp4", _MXFP8: "mxfp8", _E4M3: "fp8"}
    scheme = schemes.get(spec.format)
    if scheme is None or (scheme == "fp8" and spec.fp8_scale != "tensor"):
        raise CheckpointError(f"{name}: lowprec format {spec.format.name} has no {target} "
                              "equivalent (nvfp4, mxfp4, mxfp8_e4m3, e4m3 with a tensor scale "
                              "have); dequantize it instead")
    bits = {"scales": arrays.get("scales")} if spec.is_mx else {}
    bits["elements" if scheme in ("nvfp4", "mxfp4") else "values"] = arrays.get(
        "elements", arrays.get("values"))
    if "scale" in arrays:
        bits["ts"] = np.float32(np.asarray(arrays["scale"]).reshape(()))
    return scheme, bits


def exact_reciprocal(name, x: np.float32, scales, what: str) -> np.float32:
    """1 / x (a global scale gs from a tensor scale ts, or ts from gs) when swapping them
    changes no decoded value — float32(s / gs) = float32(ts × s) for every block-scale code s
    the tensor uses — and maps back to x's bits (the rule in the module docstring);
    otherwise a CheckpointError naming the tensor. ``what``: the target layout."""
    x = np.float32(x)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        r = np.float32(1) / x
        gs, ts = (r, x) if what == "compressed-tensors" else (x, r)
        s = np.unique(_e4m3(np.asarray(scales)))
        s = s[np.isfinite(s)]
        ok = (np.isfinite(r) and r > 0 and x > 0 and np.float32(1) / r == x
              and np.array_equal((s / gs).astype(np.float32).view(np.uint32),
                                 (ts * s).astype(np.float32).view(np.uint32)))
    if not ok:
        raise CheckpointError(
            f"{name}: NVFP4 tensor scale {float(x)!r} has no exact reciprocal for the "
            f"{what} layout (float32(s / gs) differs from float32(ts * s) for some block scale "
            "s): converting would change decoded values. Dequantize it, or requantize the "
            "original weights with --layout compressed-tensors (which uses a power-of-two "
            "tensor scale)")
    return r


def layout_arrays(name, scheme: str, bits: dict, layout: str) -> dict:
    out = {k: v for k, v in bits.items() if k != "ts"}
    if "scale" in out:  # per-channel FP8 scales (BF16/F16 ones widen exactly)
        out["scale"] = np.asarray(out["scale"]).astype(np.float32)
    if "ts" in bits:
        ts = np.float32(bits["ts"])
        if scheme == "nvfp4" and layout == "compressed-tensors":
            out["global_scale"] = np.array([exact_reciprocal(name, ts, bits["scales"], layout)],
                                           np.float32)
        else:
            shape = (1,) if layout == "compressed-tensors" else ()
            out["scale"] = np.asarray(ts, np.float32).reshape(shape)
    if scheme == "nvfp4":
        out["scales"] = np.asarray(out["scales"]).view(numpy_dtype("F8_E4M3"))
    if "values" in out:
        out["values"] = np.asarray(out["values"]).view(numpy_dtype("F8_E4M3"))
        if layout == "lowprec" and scheme == "mxfp8":  # lowprec stores MX codes as U8 elements
            out["elements"] = out.pop("values").view(np.uint8)
    return out
