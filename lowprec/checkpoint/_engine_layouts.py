"""Checkpoint layouts that inference engines load: compressed-tensors and NVIDIA ModelOpt.

lowprec's own layout (``<name>_elements`` / ``<name>_scales`` / ``<name>_scale``, see
:mod:`lowprec.checkpoint._layout`) is read by lowprec only. vLLM, SGLang and transformers
load two other layouts of the same bits, facts taken from compressed-tensors 0.20 (its
compressors and ``forward._dequantize``), llm-compressor 0.14.0.1 and ModelOpt 0.47's unified
Hugging Face export. Stored tensors of a Linear ``M`` (weight [out, in]; D is the model's
dtype, the dtype the weight was stored in) and the value each loader computes:

- compressed-tensors ``nvfp4-pack-quantized``: ``M.weight_packed`` U8 [out, in/2] (E2M1,
  low nibble first), ``M.weight_scale`` F8_E4M3 [out, in/16] (s), ``M.weight_global_scale``
  F32 [1] (gs = 2688 / amax: the *reciprocal* of lowprec's tensor scale); value
  e × float32(s / gs), then D.
- ``mxfp4-pack-quantized``: ``M.weight_packed`` U8 [out, in/2], ``M.weight_scale`` U8
  [out, in/32] (E8M0 code c); e × 2^(c − 127) in bfloat16 (c = 0xFF reads as inf, not NaN).
- ``mxfp6-pack-quantized`` (compressed-tensors ≥ 0.20): ``M.weight_packed`` U8 [out, 3 in/4]
  (E2M3 codes, four to three bytes: code j of a group in bits 6j..6j+5 of the little-endian
  24-bit word, lowprec's own FP6 packing), ``M.weight_scale`` U8 [out, in/32]; as MXFP4.
- ``mxfp8-quantized``: ``M.weight`` F8_E4M3 [out, in], ``M.weight_scale`` U8 [out, in/32];
  e × 2^(c − 127) in bfloat16.
- ``float-quantized`` (FP8): ``M.weight`` F8_E4M3, ``M.weight_scale`` in D (as llm-compressor
  writes it: BF16 for a bfloat16 model) [1] (per tensor) or [out, 1] (per channel); e × s.
- ModelOpt ``NVFP4`` / ``W4A16_NVFP4``: ``M.weight`` U8 [out, in/2], ``M.weight_scale``
  F8_E4M3 [out, in/16], ``M.weight_scale_2`` F32 [] (ts = amax / 2688, lowprec's tensor
  scale as is). lowprec decodes it as its own NVFP4, e × float32(ts × s); vLLM's ModelOpt
  kernels fold ts into the GEMM's alpha (the exact e × s products, summed, times ts), so
  there is no per-element loader value to match.
- ModelOpt ``FP8``: ``M.weight`` F8_E4M3, ``M.weight_scale`` F32 []; ``FP8_PER_CHANNEL_PER_TOKEN``:
  ``M.weight_scale`` F32 [out]; e × s.

Activation scales, where the scheme has static ones (:mod:`lowprec.checkpoint._engine_schemes`):
compressed-tensors FP8 ``M.input_scale`` in D [1] (amax / 448), NVFP4
``M.input_global_scale`` F32 [1] (2688 / amax, as the weights' gs); ModelOpt ``M.input_scale`` F32 [] (amax / 448
for FP8, amax / 2688 for NVFP4). A reader claims them as part of their weight (``dequantize``
drops them with the config; ``convert`` moves them).

**The writers' own rules.** Each layout is written with the arithmetic of the tool whose
layout it is, so that lowprec's file holds the same bytes as that tool's for the same weights
and activation statistics (:func:`quantize_arrays`; tests/test_checkpoint_presets.py checks
them against llm-compressor's and ModelOpt's own outputs):

- compressed-tensors (llm-compressor's ``QuantizationModifier``, compressed-tensors'
  ``calculate_qparams`` and ``quantize``), D the model dtype: FP8 scale s = D(amax / 448) (a
  zero one becomes D's epsilon), codes E4M3(clamp(D(x / s), ±448)) — the quotient is rounded
  to D first, then to E4M3, as torch's bfloat16 division does; NVFP4 global scale gs =
  float32(D(D(1 / amax) × 2688)) over the whole fused layer (torch divides a number by a
  tensor through the tensor's reciprocal), block scale s = E4M3(clamp(float32(gs ×
  D(block_amax / 6)), ±448)) (0 becomes 0.125), codes E2M1(clamp(float32(x / float32(s / gs)),
  ±6)); MX schemes: lowprec's MX quantizer with the scale rule of :data:`CT_SCALE_RULES`
  (round to nearest even elements, saturating).
- ModelOpt (``NVFP4QTensor`` and the FP8 export): FP8 s = float32(amax / 448), codes
  E4M3(D(x / s)) per tensor (torch's type promotion ignores the 0-d scale) and
  E4M3(float32(x / s)) per channel; NVFP4 ts = float32(amax / 2688) over the fused layer, block scale
  E4M3(clamp(float32(block_amax / float32(6 × ts)), 2^-9, 448)) (0 becomes 1), codes
  E2M1(float32(x / float32(s × ts))).

Where these differ from lowprec's own recipes (docs/design.md §3, §3b), the layout's rule wins
in that layout: the same weights give other bits in lowprec's layout. Non-finite weights (no
tool defines them) follow lowprec's conventions: amax is the largest finite magnitude, FP8 and
E2M1 codes saturate, an NVFP4 block holding NaN or inf gets the E4M3 NaN scale 0x7F.

**The reciprocal global scale.** lowprec (and ModelOpt) decode NVFP4 as e × float32(ts × s);
compressed-tensors as e × float32(s / gs). With gs = float32(1 / ts) the two differ in the last
bit for some (ts, s) unless ts is a power of two. So converting an NVFP4 tensor between the
layouts (:func:`~lowprec.checkpoint.convert_checkpoint`) moves the bits only when it is exact
— for every block-scale code s the tensor uses, float32(s / gs) = float32(ts × s), and gs ↔ ts
maps back to the same bits — and otherwise is refused, naming the tensor, unless
``requantize``: then the elements are re-encoded from the decoded values against the new
scale (:func:`requantize_nvfp4`) and the report says how many decoded values changed.
Likewise a float32 FP8 scale (lowprec's, ModelOpt's) moved to compressed-tensors, which
stores FP8 scales in the model dtype D (transformers' default loader creates them in D): moved
when it is a D value (:func:`ct_fp8_scale_dtype`), else refused or re-encoded against D(s)
(:func:`requantize_fp8`).

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

import ml_dtypes
import numpy as np

from .._format import element_format, mx_format
from .._lazy import lazy_module
from ..kernels import _ckpt_cpu
from ._chunk import (
    CodedPiece,
    count_nonfinite,
    decode_coded,
    element_table,
    encode_rows,
    mx_coded,
    narrow,
    native,
    wide_dtype,
)
from ._engine_schemes import WEIGHT_SCHEMES, WEIGHTS, engine_scheme
from ._errors import CheckpointError
from ._layouts import get_layout, layouts
from ._safetensors import FLOAT_DTYPES, nbytes_of, numpy_dtype

# Imported on first use: the checkpoint command line's native path needs no JAX.
jnp = lazy_module("jax.numpy")

#: Layouts written for inference engines (``--layout``).
ENGINE_LAYOUTS = ("compressed-tensors", "modelopt")
#: The compressed-tensors release whose layout and config lowprec writes (``version``).
CT_VERSION = "0.20.0"
#: ModelOpt's ``producer`` as lowprec writes it (the release whose export lowprec's matches).
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}

_E4M3 = element_format("e4m3")
_E2M1 = element_format("e2m1")
_NVFP4 = mx_format("nvfp4")

#: Weight formats of the engine layouts: name → lowprec format of the stored codes.
WEIGHT_FORMATS = {n: w.format for n, w in WEIGHT_SCHEMES.items()}

#: The E8M0 scale rule of each MX weight format in the compressed-tensors layout: what
#: llm-compressor writes (compressed-tensors' ``generate_mx_scales``: the block maximum's
#: significand rounded half up to E2M1's one fraction bit for MXFP4 and MXFP8, to E2M3's three
#: for MXFP6, then floor). For E2M1 and E2M3 elements that is lowprec's ``even``; for MXFP8 it is
#: ``even_e2m1`` (E2M1's rounding whatever the element). Since E4M3's largest value is
#: 448 = 1.75 × 2^8, that differs from ``rceil`` only where a block maximum's significand is
#: exactly 1.75 (scaled one higher; rceil stores it as 448): 8 of 2304 MXFP8 scales of
#: tests/data/engines (256 with ``even``, 325 with ``floor``, which also clips).
CT_SCALE_RULES = {"mxfp4": "even", "mxfp6": "even", "mxfp8": "even_e2m1"}

#: Safetensors metadata key of the engine layouts lowprec writes: per tensor, the original
#: dtype and scale rule, kept across layouts (so lowprec → engine → lowprec is byte-identical).
ORIGIN_KEY = "lowprec.origin"

#: Module names kept in high precision by default (``re.search``, case-insensitive): the
#: output head, embeddings, norms; only 2-D ``*.weight`` tensors (Linear layers) are quantized.
DEFAULT_IGNORE = r"lm_head|embed|norm|(^|[._])(wte|wpe|ln_\w*)([._]|$)"

_F8_MAX = np.float32(448.0)
_F4_MAX = np.float32(6.0)
#: Elements per block of rows that a conversion holds at once (as lowprec's own layout's
#: pieces, :data:`lowprec.checkpoint._convert.CHUNK_ELEMENTS`).
ROW_BLOCK_ELEMENTS = 1 << 20
_NVFP4_DIVISOR = np.float32(2688)  # 448 · 6 = F8E4M3_MAX · F4E2M1_MAX
_E4M3_NAN = 0x7F
_E4M3_EIGHTH = 0b0_0100_000  # 0.125 = 2^(4 - 7): compressed-tensors' "eps" for an FP8 scale
# torch.finfo(D).tiny and .eps of the model dtypes (compressed-tensors clamps amax to tiny
# before dividing, and replaces a zero FP8 scale by eps).
_TINY = {"BF16": np.float32(2.0 ** -126), "F16": np.float32(2.0 ** -14),
         "F32": np.float32(2.0 ** -126)}
_EPS = {"BF16": np.float32(2.0 ** -7), "F16": np.float32(2.0 ** -10),
        "F32": np.float32(2.0 ** -23)}
_HALF = {"BF16": ml_dtypes.bfloat16, "F16": np.float16}


def writer_dtype(dtype: str) -> str:
    """The dtype compressed-tensors computes and stores FP8 scales in for weights stored as
    ``dtype`` (the model dtype; float64 weights are taken as float32)."""
    return dtype if dtype in ("BF16", "F16") else "F32"


def _in(dtype: str, x) -> np.ndarray:
    """float32 ``x`` rounded (to nearest even) to the model dtype, as float32 again: the
    result of a torch operation in ``dtype`` (computed in float32, then rounded)."""
    x = np.asarray(x, np.float32)
    half = _HALF.get(dtype)
    return x if half is None else x.astype(half).astype(np.float32)


def scheme_name(fmt) -> str:
    """The engine scheme name (:mod:`lowprec.checkpoint._engine_schemes`) of ``fmt``: an
    llm-compressor preset in any case (``"nvfp4a16"``, ``"FP8_DYNAMIC"``), ``FP8A16``,
    ``FP8A16_CHANNEL``, or an :class:`EngineScheme`.

    Example:
        >>> scheme_name("nvfp4"), scheme_name("mxfp8a16"), scheme_name("fp8_dynamic")
        ('NVFP4', 'MXFP8A16', 'FP8_DYNAMIC')
    """
    return engine_scheme(fmt).name


# -- one tensor: the stored parts ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A Linear weight stored in an engine layout (duck-types :class:`TensorSpec` for the
    readers in :mod:`lowprec.checkpoint._logical` and :mod:`lowprec.checkpoint._convert`).

    ``scheme`` is the weight format (a key of :data:`WEIGHT_FORMATS`); ``inputs`` is
    ``"static"`` when the module stores its activation scale (``input_scale`` /
    ``input_global_scale``) beside the weight, else None; ``scale_dtype`` and
    ``input_dtype`` the dtypes of FP8's ``weight_scale`` and of ``input_scale``."""

    scheme: str
    layout: str
    shape: tuple
    dtype: str = "BF16"
    scale_rule: Optional[str] = None
    scale_dtype: str = "F32"
    inputs: Optional[str] = None
    input_dtype: str = "F32"

    @property
    def w(self):
        """The weight format (a :class:`~lowprec.checkpoint._engine_schemes.WeightScheme`)."""
        return WEIGHT_SCHEMES[self.scheme]

    @property
    def lay(self):
        """The layout object (:class:`~lowprec.checkpoint._layout_ct.EngineLayout`)."""
        return get_layout(self.layout)

    @property
    def reciprocal(self) -> bool:
        """Whether its tensor scale is stored as a reciprocal global scale (compressed-tensors'
        NVFP4 ``weight_global_scale``): decoded e × float32(s / gs)."""
        return self.w.global_scale and self.lay.reciprocal_global_scale

    @property
    def format(self):
        """The lowprec format of the stored codes (its object)."""
        return self.w.format

    @property
    def label(self) -> str:
        channel = ", per channel" if self.w.per_channel else ""
        inputs = ", static input scale" if self.inputs == "static" else ""
        return f"{self.format.name} ({self.layout}{channel}{inputs})"

    def is_whole(self, role: str) -> bool:
        """Whether part ``role`` is one number for the whole tensor (not cut into rows)."""
        return role in ("global_scale", "input_scale") or (
            role == "scale" and not self.w.per_channel)

    @property
    def view(self) -> tuple:
        return (1, math.prod(self.shape), 1)

    piece_view = view

    def parts(self, name: str) -> list:
        """``[(role, stored name, dtype, shape)]``; ``name`` is the weight's (``M.weight``):
        what its layout stores (:meth:`~lowprec.checkpoint._layout_ct.EngineLayout.parts`)."""
        return self.lay.parts(self, name)

    def nbytes(self) -> int:
        return sum(nbytes_of(dt, shp) for _, _, dt, shp in self.parts("x.weight"))

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


# The NumPy side of the engine layouts (no compiled program per tensor shape): E4M3 and
# E2M1 through ml_dtypes, whose casts are the reference lowprec's codecs match bit for bit
# (round to nearest even; docs/design.md §2).
def _e4m3(codes) -> np.ndarray:
    return np.asarray(codes).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def _to_e4m3(y) -> np.ndarray:
    """E4M3 codes (uint8) of float32 ``y``, saturating at ±448."""
    y = np.clip(np.asarray(y, np.float32), -_F8_MAX, _F8_MAX)
    return y.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def _e2m1_values(codes) -> np.ndarray:
    return (np.asarray(codes, np.uint8) & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _to_e2m1(y) -> np.ndarray:
    """E2M1 codes (uint8, 0..15) of float32 ``y``, saturating at ±6."""
    return np.asarray(y, np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def _e2m1_unpacked(packed: np.ndarray) -> np.ndarray:
    """E2M1 values of packed codes (low nibble first along the last axis)."""
    p = np.asarray(packed).view(np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return _e2m1_values(codes)


def _pack_e2m1(codes: np.ndarray) -> np.ndarray:
    c = np.asarray(codes, np.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def decode_arrays(arrays: dict, spec: EngineSpec) -> np.ndarray:
    """float32 values of one tensor from its stored ``arrays`` (``{role: array}``), with the
    arithmetic of the layout's loader (before its cast to the model dtype)."""
    out, k = spec.shape
    if spec.reciprocal:
        b = spec.w.block_size
        e = _e2m1_unpacked(arrays["elements"]).reshape(out, k // b, b)
        s = _e4m3(arrays["scales"]).reshape(out, k // b, 1)
        gs = np.float32(np.asarray(arrays["global_scale"]).reshape(-1)[0])
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            return (e * (s / gs)).reshape(out, k)
    if spec.w.blocks:
        from .._mx import dequantize  # noqa: PLC0415 - JAX, imported where it is used

        return np.asarray(dequantize(_mxarray(arrays, spec)), np.float32)
    e = _e4m3(arrays["values"])
    s = np.asarray(arrays["scale"], np.float32)
    s = s.reshape((-1, 1) if spec.w.per_channel else ())
    with np.errstate(over="ignore", invalid="ignore"):
        return e * s


def coded_arrays(arrays: dict, spec: EngineSpec) -> Optional[CodedPiece]:
    """The stored ``arrays`` of one tensor (or block of rows) as a
    :class:`~lowprec.checkpoint._chunk.CodedPiece`: the values :func:`decode_arrays`
    computes, element for element, as ``table[code] × factor`` (compressed-tensors NVFP4:
    the factor float32(s / gs) per E4M3 code; FP8: the scale per tensor or per row; the MX
    schemes and ModelOpt NVFP4: lowprec's decode)."""
    out, k = spec.shape
    if not spec.w.blocks:
        s = np.asarray(arrays["scale"], np.float32).reshape(-1)
        codes = np.asarray(arrays["values"]).view(np.uint8).reshape(-1)
        return CodedPiece(codes, 8, element_table(spec.format), s,
                          k if spec.w.per_channel else max(codes.size, 1), False)
    fmt = spec.format
    elements = np.asarray(arrays.get("elements", arrays.get("values"))).view(np.uint8)
    scales = np.asarray(arrays["scales"]).view(np.uint8).reshape(-1)
    want = (out * k * fmt.element.code_bits // 8, out * k // fmt.block_size)
    if (elements.size, scales.size) != want:
        raise CheckpointError(
            f"cannot decode {spec.label} data of shape {list(spec.shape)}: {elements.size} "
            f"element bytes and {scales.size} scales (need {want[0]} and {want[1]})")
    if spec.reciprocal:
        gs = np.float32(np.asarray(arrays["global_scale"]).reshape(-1)[0])
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            table = element_table(_E4M3) / gs  # float32(s / gs), the loader's division
        return CodedPiece(elements.reshape(-1), fmt.element.code_bits,
                          element_table(fmt.element), np.take(table, scales), fmt.block_size, False)
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
    if native() and x.dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        coded = coded_arrays(arrays, spec)
        if coded is not None:
            stats.add_vector(_ckpt_cpu.stats(x, **coded.args()))
            return
    stats.update(x, decode_arrays(arrays, spec))


def _mxarray(arrays: dict, spec: EngineSpec):
    from .._mxarray import MXArray  # noqa: PLC0415 - JAX, imported where it is used

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
    layout (each registered engine layout's ``recognize``, by stored names, dtypes and
    shapes; nothing else is claimed)."""
    found = {}
    for lay in layouts():
        if hasattr(lay, "recognize_weights"):
            for name, (spec, _) in (lay.recognize(reader) or {}).items():
                found.setdefault(name, spec)
    return found


def complete_specs(reader, found: dict) -> dict:
    """``found`` (``{weight name: EngineSpec}`` a layout recognized) with what a file holds
    beside the weights: a static activation scale stored next to one (its layout's
    ``input_scale_part``, in a dtype ``input_dtypes`` allows), and the original dtype where
    lowprec wrote the file (``lowprec.origin``)."""
    t = reader.tensors
    for name, spec in list(found.items()):  # a static activation scale beside the weight
        static = dataclasses.replace(spec, inputs="static")
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        _, stored, _, shape = spec.lay.input_scale_part(static, module)
        info = t.get(stored)
        if info is not None and tuple(info.shape) == shape and \
                info.dtype in spec.lay.input_dtypes(spec.w):
            found[name] = dataclasses.replace(spec, inputs="static", input_dtype=info.dtype)
    origin = {}
    with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
        origin = dict(json.loads(reader.metadata.get(ORIGIN_KEY, "{}")))
    for name, spec in found.items():  # the original dtype, when lowprec wrote the file
        o = origin.get(name)
        if isinstance(o, dict) and o.get("dtype") in FLOAT_DTYPES:
            found[name] = dataclasses.replace(spec, dtype=o["dtype"])
    return found


# -- quantizing one tensor: the writers' own rules --------------------------------------
def _finite_abs(x32: np.ndarray) -> np.ndarray:
    a = np.abs(x32)
    return np.where(np.isfinite(a), a, np.float32(0))


def quantize_arrays(x: np.ndarray, scheme: str, layout, *, dtype: str = "F32",
                    scale_rule=None, amax=None) -> dict:
    """Quantizes one [out, in] weight (or a block of its rows) with the rule of ``layout``'s
    own writer (see the module docstring; its ``encode_nvfp4`` / ``encode_fp8``);
    ``{role: array}`` in the layout's dtypes.

    Args:
      x: the weight's values (of dtype ``dtype``, the model dtype).
      scheme: the weight format (a key of :data:`WEIGHT_FORMATS`).
      layout: the layout (its name, or the object).
      scale_rule: MX formats: the E8M0 scale rule.
      amax: NVFP4 and per-tensor FP8: the largest finite magnitude of the whole tensor (of the
        whole fused layer, for NVFP4); computed from ``x`` if None.
    """
    w, lay = WEIGHT_SCHEMES[scheme], get_layout(layout)
    x32 = np.asarray(x).astype(np.float32)
    if w.blocks and w.format.element == _E2M1:
        # Both writers' E2M1 casts take the sign from the rounded value's sign, which torch
        # gives −0.0 only for a negative input: a stored −0.0 weight becomes code 0, not 8.
        x32 = np.where(x32 == 0, np.float32(0), x32)
    if w.mx:
        # quantize_mx's codes, block for block: the native MX kernel where it serves
        el, scales = encode_rows(x32, w.format, scale_rule)
        return {w.code_role: el if w.packed else el.view(numpy_dtype("F8_E4M3")),
                "scales": scales}
    if w.per_channel:
        amax = _finite_abs(x32).max(axis=1, initial=0).reshape(-1, 1)
    else:
        amax = np.float32(_finite_abs(x32).max(initial=0) if amax is None else amax)
    if w.global_scale:
        return lay.encode_nvfp4(x32, dtype, amax)
    return lay.encode_fp8(x32, w, dtype, amax)


def ct_fp8(x32, w, dtype: str, amax) -> dict:
    """compressed-tensors' FP8: scale and quotient in the model dtype D (see the module
    docstring); ``amax`` per tensor, or per row [out, 1]."""
    d = writer_dtype(dtype)
    s = _in(d, np.asarray(amax, np.float32) / _F8_MAX)
    s = np.where(s == 0, _EPS[d], s).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = _in(d, x32 / s)
    shape = (-1, 1) if w.per_channel else (1,)
    return {"values": _to_e4m3(y).view(numpy_dtype("F8_E4M3")),
            "scale": s.reshape(shape).astype(numpy_dtype(d))}


def modelopt_fp8(x32, w, dtype: str, amax) -> dict:
    """ModelOpt's FP8: a float32 scale (1 for an all-zero tensor or row); the quotient by a
    per-tensor scale (a 0-d tensor, which torch's type promotion ignores) is in D, by
    per-channel scales in float32."""
    s = np.asarray(amax, np.float32) / _F8_MAX
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x32 / s if w.per_channel else _in(writer_dtype(dtype), x32 / s)
    return {"values": _to_e4m3(y).view(numpy_dtype("F8_E4M3")),
            "scale": s.reshape(-1) if w.per_channel else s.reshape(())}


_NVFP4_BLOCK = _NVFP4.block_size


def _block_amax(x32: np.ndarray):
    """(finite block maxima [out, in / block], blocks holding a NaN or inf)."""
    blocks = x32.reshape(x32.shape[0], -1, _NVFP4_BLOCK)
    return _finite_abs(blocks).max(axis=-1), ~np.isfinite(blocks).all(axis=-1)


def _nvfp4_codes(x32, factor, bad) -> dict:
    """E2M1 codes of ``x32`` / ``factor`` (per block, float32), rounded to nearest even and
    saturating; blocks ``bad`` (holding NaN or inf) get zero codes."""
    out, k = x32.shape
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        q = x32.reshape(out, -1, _NVFP4_BLOCK) / factor[..., None]
    q = np.where(bad[..., None], np.float32(0), q)
    return _pack_e2m1(_to_e2m1(q).reshape(out, k))


def _ct_global_scale(amax, d: str) -> np.float32:
    """compressed-tensors' ``generate_gparam``: 2688 / amax in D, amax at least D's tiny,
    an infinite result 1. torch computes a number over a tensor as the tensor's reciprocal
    times the number, each rounded to D: D(D(1 / amax) × 2688)."""
    with np.errstate(over="ignore", divide="ignore"):
        gs = _in(d, _in(d, np.float32(1) / max(_in(d, amax), _TINY[d])) * _NVFP4_DIVISOR)
    return np.float32(gs if np.isfinite(gs) else 1)  # torch.nan_to_num(posinf=1)


def ct_nvfp4(x32, dtype: str, amax) -> dict:
    """compressed-tensors' NVFP4 (``generate_gparam``, ``calculate_qparams``, ``quantize``)."""
    d = writer_dtype(dtype)
    gs = _ct_global_scale(amax, d)
    bmax, bad = _block_amax(x32)
    s = (gs * _in(d, bmax / _F4_MAX)).astype(np.float32)
    codes = _to_e4m3(s)
    codes = np.where(_e4m3(codes) == 0, np.uint8(_E4M3_EIGHTH), codes)  # 0 → 0.125
    codes = np.where(bad, np.uint8(_E4M3_NAN), codes).astype(np.uint8)
    factor = (_e4m3(codes) / gs).astype(np.float32)
    return {"elements": _nvfp4_codes(x32, factor, bad),
            "scales": codes.view(numpy_dtype("F8_E4M3")),
            "global_scale": np.array([gs], np.float32)}


def modelopt_nvfp4(x32, dtype: str, amax) -> dict:
    """ModelOpt's NVFP4 (``NVFP4QTensor.get_weights_scaling_factor(_2)``, ``quantize``); an
    all-zero tensor gets ts = 1 (ModelOpt divides by zero)."""
    ts = np.float32(amax) / _NVFP4_DIVISOR if amax > 0 else np.float32(1)
    bmax, bad = _block_amax(x32)
    with np.errstate(divide="ignore", over="ignore"):
        pbs = (bmax / np.float32(_F4_MAX * ts)).astype(np.float32)
    pbs = np.where(pbs == 0, np.float32(1), pbs)
    codes = _to_e4m3(np.clip(pbs, np.float32(2.0 ** -9), _F8_MAX))
    codes = np.where(bad, np.uint8(_E4M3_NAN), codes).astype(np.uint8)
    factor = (_e4m3(codes) * ts).astype(np.float32)
    return {"elements": _nvfp4_codes(x32, factor, bad),
            "scales": codes.view(numpy_dtype("F8_E4M3")), "scale": np.asarray(ts, np.float32)}


def input_scale(amax, weights: str, layout, dtype: str) -> np.ndarray:
    """The stored activation scale of a static scheme from the largest magnitude ``amax`` of
    the Linear's input (over the whole fused layer), with the layout's writer's arithmetic
    (its ``input_scale``: :func:`ct_input_scale`, :func:`modelopt_input_scale`)."""
    return get_layout(layout).input_scale(np.float32(amax), WEIGHT_SCHEMES[weights], dtype)


def modelopt_input_scale(a: np.float32, w, dtype: str) -> np.ndarray:
    """ModelOpt's input scale: float32(amax / 448) (FP8) or float32(amax / 2688) (NVFP4)."""
    return np.asarray(a / (_NVFP4_DIVISOR if w.global_scale else _F8_MAX), np.float32)


def ct_input_scale(a: np.float32, w, dtype: str) -> np.ndarray:
    """compressed-tensors' input scale: FP8 D(D(amax) / 448) in D (0 → eps), NVFP4 as the
    weights' global scale, float32(D(D(1 / D(amax)) × 2688))."""
    d = writer_dtype(dtype)
    if w.global_scale:
        return np.array([_ct_global_scale(a, d)], np.float32)
    s = _in(d, _in(d, a) / _F8_MAX)
    return np.array([s if s != 0 else _EPS[d]], np.float32).astype(numpy_dtype(d))


# -- configs -------------------------------------------------------------------------------
def ct_quantization_config(groups: dict, ignore: Sequence[str]) -> dict:
    """``config.json``'s ``quantization_config`` for compressed-tensors, field for field as
    llm-compressor 0.14.0.1 writes it, but ``version`` and ``moe_sparsity_config`` (the
    layout is compressed-tensors 0.20's, which MXFP6 needs, and these are the fields its
    ``ModelCompressor.update_config`` writes) and ``ignore``, which names every module kept in high
    precision, not the user's patterns: lowprec cannot tell a Linear from an embedding by its
    stored weight (GPT-NeoX's output ``Linear`` is ``embed_out``), so it lists every kept
    2-D weight. ``groups``: scheme name → sorted module names. One scheme: targets
    ``["Linear"]``; several: each group targets its exact module names (compressed-tensors
    prefers exact names over patterns, so no module can land in another group)."""
    single = len(groups) == 1
    ignore = _with_head(groups, ignore)
    config_groups = {}
    for i, (name, modules) in enumerate(sorted(groups.items())):
        scheme = engine_scheme(name)
        config_groups[f"group_{i}"] = {
            "format": WEIGHTS[scheme.weights],
            "input_activations": scheme.ct_input_args(),
            "output_activations": None,
            "targets": ["Linear"] if single else list(modules),
            "weights": scheme.ct_weight_args(),
        }
    formats = {WEIGHTS[engine_scheme(s).weights] for s in groups}
    return {
        "config_groups": config_groups,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "global_compression_ratio": None,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        # ModelCompressor.update_config's fields: no sparsity, no transforms
        # (moe_sparsity_config is compressed-tensors 0.20's; 0.19 has none).
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def _with_head(groups: dict, ignore) -> set:
    """``ignore`` plus ``lm_head`` unless a group quantizes it: a model with tied embeddings
    has an ``lm_head`` Linear but no ``lm_head.weight`` in the file, which the loader must not
    look for."""
    ignore = set(ignore)
    if not any("lm_head" in modules for modules in groups.values()):
        ignore.add("lm_head")
    return ignore


def modelopt_quant_config(scheme, exclude: Sequence[str]) -> tuple:
    """``(hf_quant_config.json, config.json's quantization_config)`` of a ModelOpt 0.47
    export of one ``scheme``: the first with ``producer`` and ``quantization`` {quant_algo,
    kv_cache_quant_algo, group_size (NVFP4), exclude_modules}; the second what ModelOpt's
    ``convert_hf_quant_config_format`` makes of it (``config_groups`` for the algorithms it
    maps, ``ignore`` — the key vLLM reads there —, ``quant_algo``, ``producer``,
    ``quant_method``)."""
    scheme = engine_scheme(scheme)
    algo = scheme.modelopt
    w = scheme.w
    q = {"quant_algo": algo, "kv_cache_quant_algo": None}
    if w.blocks:
        q["group_size"] = w.block_size
    q["exclude_modules"] = sorted(_with_head({algo: ()}, exclude))
    hf = {"producer": dict(MODELOPT_PRODUCER), "quantization": q}
    weights = {"dynamic": False, "num_bits": w.code_bits, "type": "float"}
    inputs = dict(weights)
    if w.blocks:
        weights["group_size"] = inputs["group_size"] = w.block_size
    config = {}
    if algo in ("FP8", "NVFP4", "W4A16_NVFP4"):
        group = {"input_activations": inputs, "weights": weights, "targets": ["Linear"]}
        if algo == "W4A16_NVFP4":
            del group["input_activations"]
        config["config_groups"] = {"group_0": group}
    config.update(ignore=list(q["exclude_modules"]), quant_algo=algo,
                  producer=dict(MODELOPT_PRODUCER), quant_method="modelopt")
    return hf, config


# -- converting between layouts without requantizing ------------------------------------
def scheme_bits(name, spec, arrays, target: str = "compressed-tensors",
                requantize: bool = False) -> tuple:
    """``(weights, {role: array})`` in the roles of :class:`EngineSpec` (elements/values,
    scales, ``ts`` = the float32 tensor scale of NVFP4 / FP8, or ``scale`` for per-channel
    FP8, and ``input_scale`` as stored) from a tensor stored in any layout (its scales checked
    by the reader: :mod:`lowprec.checkpoint._validate`), to be moved to the ``target`` layout.
    A compressed-tensors NVFP4 global scale without an exact reciprocal is refused unless
    ``requantize`` (then ``ts`` is float32(1 / gs) and ``gs`` is kept for the re-encoding)."""
    if isinstance(spec, EngineSpec):
        bits = dict(arrays)
        if spec.reciprocal:
            gs = np.float32(np.asarray(bits.pop("global_scale")).reshape(-1)[0])
            if requantize and not reciprocal_is_exact(gs, bits["scales"], False):
                bits["ts"], bits["gs"] = np.float32(np.float32(1) / gs), gs
            else:
                bits["ts"] = exact_reciprocal(name, gs, bits["scales"], "lowprec", False)
        elif "scale" in bits and not spec.w.per_channel:
            bits["ts"] = np.float32(np.asarray(bits.pop("scale")).reshape(-1)[0])
        return spec.scheme, bits
    # lowprec's own roles (gpt-oss's [out, K/32, 16] blocks are its packed elements)
    moved = get_layout(spec.layout).lowprec_arrays(spec, arrays)
    if moved is None or len(spec.shape) != 2 or (spec.is_mx and spec.axis != 1):
        shape = "x".join(map(str, spec.shape))
        raise CheckpointError(
            f"{name}: {spec.format.name} of shape {shape} in the {spec.layout} layout"
            + (f", blocked along axis {spec.axis}," if spec.is_mx else "")
            + (f" has no {target} equivalent (the {target} layout holds [out, in] weights "
               "blocked along in); dequantize it instead" if target != "lowprec" else
               " cannot be moved: convert moves [out, in] weights blocked along in; dequantize "
               "it, or quantize the original weights with --layout lowprec"))
    arrays = moved
    w = _BY_FORMAT.get(spec.format)
    if w is None or (not w.blocks and not spec.has_tensor_scale):
        raise CheckpointError(f"{name}: lowprec format {spec.format.name} has no {target} "
                              "equivalent (nvfp4, mxfp4, mxfp6_e2m3, mxfp8_e4m3, e4m3 with a "
                              "tensor scale have); dequantize it instead")
    bits = {"scales": arrays.get("scales")} if spec.is_mx else {}
    bits[w.code_role] = arrays.get("elements", arrays.get("values"))
    if "scale" in arrays:
        bits["ts"] = np.float32(np.asarray(arrays["scale"]).reshape(()))
    return w.name, bits


#: The engine weight format of each lowprec format (per-tensor FP8 for E4M3).
_BY_FORMAT = {}
for _w in WEIGHT_SCHEMES.values():
    _BY_FORMAT.setdefault(_w.format, _w)


def _factors_equal(gs: np.float32, ts: np.float32, scales) -> bool:
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        s = np.unique(_e4m3(np.asarray(scales)))
        s = s[np.isfinite(s)]
        return np.array_equal((s / gs).astype(np.float32).view(np.uint32),
                              (ts * s).astype(np.float32).view(np.uint32))


def reciprocal_is_exact(x: np.float32, scales, to_global: bool) -> bool:
    """Whether 1 / ``x`` (gs from ts where ``to_global``, else ts from gs) changes no decoded
    value of a tensor with block ``scales`` and maps back to x's bits."""
    x = np.float32(x)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        r = np.float32(1) / x
    if not (np.isfinite(r) and r > 0 and x > 0 and np.float32(1) / r == x):
        return False
    gs, ts = (r, x) if to_global else (x, r)
    return _factors_equal(gs, ts, scales)


def exact_reciprocal(name, x: np.float32, scales, what: str, to_global: bool) -> np.float32:
    """1 / x (a global scale gs from a tensor scale ts where ``to_global``, or ts from gs)
    when swapping them changes no decoded value — float32(s / gs) = float32(ts × s) for every
    block-scale code s the tensor uses — and maps back to x's bits (the rule in the module
    docstring); otherwise a CheckpointError naming the tensor. ``what``: the target layout."""
    if not reciprocal_is_exact(x, scales, to_global):
        raise CheckpointError(
            f"{name}: NVFP4 tensor scale {float(x)!r} has no exact reciprocal for the "
            f"{what} layout (float32(s / gs) differs from float32(ts * s) for some block scale "
            "s): converting would change decoded values. --requantize (requantize=True) "
            "re-encodes it against the nearest scale and reports how many values change; or "
            "dequantize it")
    return np.float32(np.float32(1) / np.float32(x))


def ct_fp8_scale_dtype(name: str, scale, dtype: str, requantize: bool) -> tuple:
    """``(stored dtype, re-encode?)`` of a float32 FP8 weight scale (lowprec's or ModelOpt's)
    moved to compressed-tensors for a ``dtype`` model: the model dtype D, as llm-compressor
    stores it, since transformers' default loader creates ``weight_scale`` in D and so decodes
    e × D(s). Exact when every scale is a D value; otherwise refused, naming the tensor, unless
    ``requantize`` (then :func:`requantize_fp8` re-encodes against D(s)).

    Example:
        >>> ct_fp8_scale_dtype("w", np.float32(2.0 ** -7), "BF16", False)
        ('BF16', False)
        >>> ct_fp8_scale_dtype("w", np.float32(0.1), "F32", False)
        ('F32', False)
    """
    d = writer_dtype(dtype)
    s = np.asarray(scale, np.float32)
    if np.array_equal(_in(d, s), s):
        return d, False
    if not requantize:
        bad = s.reshape(-1)[np.flatnonzero(_in(d, s).reshape(-1) != s.reshape(-1))[0]]
        raise CheckpointError(
            f"{name}: its FP8 scale {str(bad)} is no {d} value; compressed-tensors stores "
            f"FP8 scales in the model dtype ({d}), which transformers' default loader reads "
            "them in, so these bits would decode to other values there; --requantize "
            "re-encodes the tensor against the rounded scale (and counts the values that "
            "change), or keep the ModelOpt or lowprec layout")
    return d, True


def requantize_fp8(values, scale, dtype: str) -> tuple:
    """``(codes, scale in dtype D, changed decoded values)``: FP8 codes ``values`` (E4M3 as
    uint8 or float8) with their float32 ``scale`` ([1] or [rows, 1]) re-encoded against
    s' = D(scale) by compressed-tensors' rule (E4M3(clamp(D(x / s'), ±448)) of the decoded
    x = e × s), as :func:`quantize_arrays` writes FP8 for a D model."""
    s = np.asarray(scale, np.float32)
    s2 = _in(dtype, s)
    e = _e4m3(values)
    x = (e * s).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        codes = _to_e4m3(_in(dtype, x / s2))
    after = (_e4m3(codes) * s2).astype(np.float32)
    changed = int(np.count_nonzero(x.view(np.uint32) != after.view(np.uint32)))
    return (codes.view(numpy_dtype("F8_E4M3")), s2.astype(_HALF.get(dtype, np.float32)),
            changed)


def requantize_nvfp4(bits: dict, source_ts: bool) -> tuple:
    """Re-encodes an NVFP4 block of rows whose tensor scale moves to its float32 reciprocal:
    the decoded values (e × float32(s / gs) or e × float32(ts × s), ``source_ts`` saying
    which) are encoded again against the target's factors with the same block scales, E2M1
    rounding to nearest even. Returns ``(elements, changed)``: the new packed codes and how
    many decoded values differ (bitwise) from the source's."""
    el = np.asarray(bits["elements"]).view(np.uint8)
    out = el.shape[0]
    e = _e2m1_unpacked(el).reshape(out, -1, _NVFP4_BLOCK)
    s = _e4m3(bits["scales"]).reshape(out, -1, 1)
    gs, ts = np.float32(bits["gs"]), np.float32(bits["ts"])
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        before = e * ((ts * s) if source_ts else (s / gs)).astype(np.float32)
        after_f = ((s / gs) if source_ts else (ts * s)).astype(np.float32)
        q = np.where(after_f > 0, before / after_f, np.float32(0))
    codes = _to_e2m1(q)
    after = _e2m1_values(codes) * after_f
    changed = int(np.count_nonzero(before.astype(np.float32).view(np.uint32)
                                   != after.astype(np.float32).view(np.uint32)))
    return _pack_e2m1(codes.reshape(out, -1)), changed


def layout_arrays(name, scheme: str, bits: dict, layout, requantize: bool = False) -> tuple:
    """``({role: array} in ``layout``'s dtypes, changed decoded values)`` for the bits of
    :func:`scheme_bits`; NVFP4 moving to a layout storing the reciprocal global scale without
    an exact reciprocal is refused unless ``requantize`` (:func:`requantize_nvfp4`)."""
    w, lay = WEIGHT_SCHEMES[scheme], get_layout(layout)
    out = {k: v for k, v in bits.items() if k not in ("ts", "gs")}
    changed = 0
    if "scale" in out:  # per-channel FP8 scales (BF16/F16 ones widen exactly)
        out["scale"] = np.asarray(out["scale"]).astype(np.float32)
        out["scale"] = out["scale"].reshape(lay.channel_shape(-1))
    if "ts" in bits:
        ts = np.float32(bits["ts"])
        if w.global_scale and lay.reciprocal_global_scale:
            if requantize and not reciprocal_is_exact(ts, bits["scales"], True):
                gs = np.float32(np.float32(1) / ts)
                out["elements"], changed = requantize_nvfp4(dict(bits, gs=gs), True)
            else:
                gs = exact_reciprocal(name, ts, bits["scales"], lay.name, True)
            out["global_scale"] = np.array([gs], np.float32)
        else:
            if "gs" in bits:  # compressed-tensors → ts without an exact reciprocal
                out["elements"], changed = requantize_nvfp4(bits, False)
            out["scale"] = np.asarray(ts, np.float32).reshape(lay.scalar_shape)
    if w.blocks and w.scales_dtype == "F8_E4M3":
        out["scales"] = np.asarray(out["scales"]).view(numpy_dtype("F8_E4M3"))
    if "values" in out:
        out["values"] = np.asarray(out["values"]).view(numpy_dtype("F8_E4M3"))
        if not lay.stores_values(w):  # lowprec stores MX codes as U8 elements
            out["elements"] = out.pop("values").view(np.uint8)
    return out, changed
