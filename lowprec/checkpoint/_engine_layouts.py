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
bit for some (ts, s) unless ts is a power of two. So :func:`quantize_engine_checkpoint` writing
compressed-tensors NVFP4 rounds the tensor scale *up to a power of two* (ts = 2^⌈log2(amax /
2688)⌉, at least 2^-126 so that gs is a finite float32): the block scales keep their E4M3
precision (they only move down a binade at most), and every value the loader computes equals
lowprec's bit for bit. Converting an existing NVFP4 tensor between the layouts
(:func:`convert_checkpoint`) is done only when it is exact — for every block-scale code s the
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
import os
import re
import time
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from .._codec import decode, encode
from .._format import element_format, mx_format
from .._mx import MXArray, dequantize, quantize_mx
from ._errors import CheckpointError
from ._formats import canonical_format
from ._safetensors import FLOAT_DTYPES, nbytes_of, numpy_dtype

#: Layouts written for inference engines (``--layout``).
ENGINE_LAYOUTS = ("compressed-tensors", "modelopt")

#: Schemes an engine layout can hold: scheme → (lowprec format, compressed-tensors format).
SCHEMES = {
    "nvfp4": ("nvfp4", "nvfp4-pack-quantized"),
    "mxfp4": ("mxfp4", "mxfp4-pack-quantized"),
    "mxfp8": ("mxfp8_e4m3", "mxfp8-quantized"),
    "fp8": ("e4m3", "float-quantized"),
    "fp8_channel": ("e4m3", "float-quantized"),
}
_MODELOPT_SCHEMES = {"nvfp4": "NVFP4", "fp8": "FP8"}

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


def scheme_name(fmt: str) -> str:
    """The engine scheme for a format name: ``"nvfp4"``, ``"mxfp4"``, ``"mxfp8"`` (E4M3
    elements), ``"fp8"`` (E4M3, one scale per tensor) or ``"fp8_channel"`` (one per row);
    lowprec names and aliases are accepted (``"e4m3"``, ``"mxfp8_e4m3"``).

    Example:
        >>> scheme_name("e4m3"), scheme_name("MXFP8"), scheme_name("fp8_channel")
        ('fp8', 'mxfp8', 'fp8_channel')
    """
    if fmt in SCHEMES:
        return fmt
    if fmt in ("e4m3_channel", "fp8_per_channel"):
        return "fp8_channel"
    canon = canonical_format(fmt)
    for name, (lp, _) in SCHEMES.items():
        if lp == canon:
            return name
    raise CheckpointError(
        f"format {fmt!r} has no compressed-tensors/ModelOpt scheme; choose one of: "
        f"{', '.join(SCHEMES)}"
    )


# -- one tensor: the stored parts ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """A Linear weight stored in an engine layout (duck-types :class:`TensorSpec` for the
    readers in :mod:`lowprec.checkpoint._convert`)."""

    scheme: str
    layout: str
    shape: tuple
    dtype: str = "BF16"
    scale_rule: Optional[str] = None
    scale_dtype: str = "F32"  # FP8's weight_scale: F32 as lowprec writes; BF16/F16 are read too

    @property
    def format(self) -> str:
        return SCHEMES[self.scheme][0]

    @property
    def label(self) -> str:
        channel = ", per channel" if self.scheme == "fp8_channel" else ""
        return f"{self.format} ({self.layout}{channel})"

    def is_whole(self, role: str) -> bool:
        """Whether part ``role`` is one number for the whole tensor (not cut into rows)."""
        return role in _WHOLE or (role == "scale" and self.scheme != "fp8_channel")

    @property
    def view(self) -> tuple:
        return (1, math.prod(self.shape), 1)

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

    def decode_regions(self, reader, parts, dtype):
        """Yields ``(rect, values)`` per block of rows, decoded as the engine's loader does."""
        k = self.shape[1]
        for r0, r1 in self.row_blocks():
            rows = dataclasses.replace(self, shape=(r1 - r0, k))
            values = decode_arrays(self.read_rows(reader, parts, r0, r1), rows)
            yield (0, 1, r0 * k, r1 * k, 0, 1), _cast(values, dtype).reshape(1, -1, 1)


def _cast(values: np.ndarray, dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        return values.astype(dtype)


def _e4m3(codes) -> np.ndarray:
    return np.asarray(decode(jnp.asarray(np.asarray(codes).view(np.uint8)), "e4m3"), np.float32)


def _e2m1_unpacked(packed: np.ndarray) -> np.ndarray:
    """E2M1 values of packed codes (low nibble first along the last axis)."""
    p = np.asarray(packed).view(np.uint8)
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return np.asarray(decode(jnp.asarray(codes), "e2m1"), np.float32)


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


def _mxarray(arrays: dict, spec: EngineSpec) -> MXArray:
    fmt = mx_format(spec.format)
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


def _finite_amax(x: np.ndarray, axis=None):
    a = np.abs(x.astype(np.float32))
    a = np.where(np.isfinite(a), a, np.float32(0))
    return a.max(axis=axis) if a.size else np.float32(0)


def quantize_arrays(x: np.ndarray, scheme: str, layout: str, *, scale_rule=None,
                    amax=None) -> dict:
    """Quantizes one [out, in] weight (or a block of its rows, with ``amax`` the whole
    tensor's finite max magnitude) with lowprec's quantizers; ``{role: array}`` in the
    layout's dtypes (see the table in the module docstring)."""
    x32 = np.asarray(x).astype(np.float32)
    if scheme == "nvfp4":
        amax = np.float32(_finite_amax(x32) if amax is None else amax)
        ts = np.float32(amax / _NVFP4_DIVISOR) if amax > 0 else np.float32(1)
        if layout == "compressed-tensors":
            ts = _pow2_at_least(ts)  # exact reciprocal: see the module docstring
        else:
            ts = max(ts, np.float32(2.0 ** -143))  # lowprec's own floor (docs/design.md §3b)
        mx = quantize_mx(jnp.asarray(x32), "nvfp4", axis=1, tensor_scale=ts)
        out = {"elements": np.asarray(mx.elements),
               "scales": np.asarray(mx.scales).view(numpy_dtype("F8_E4M3"))}
        if layout == "compressed-tensors":
            out["global_scale"] = np.array([np.float32(1) / ts], np.float32)
        else:
            out["scale"] = np.asarray(ts, np.float32)
        return out
    if scheme in ("mxfp4", "mxfp8"):
        mx = quantize_mx(jnp.asarray(x32), SCHEMES[scheme][0], axis=1, scale_rule=scale_rule)
        el = np.asarray(mx.elements)
        return {("elements" if scheme == "mxfp4" else "values"):
                el if scheme == "mxfp4" else el.view(numpy_dtype("F8_E4M3")),
                "scales": np.asarray(mx.scales)}
    # FP8: s = amax / 448 (1 for an all-zero tensor or row), codes = E4M3(x / s), saturating
    if scheme == "fp8_channel":
        amax = np.asarray(_finite_amax(x32, axis=1), np.float32).reshape(-1, 1)
    else:
        amax = np.float32(_finite_amax(x32) if amax is None else amax)
    s = np.where(amax > 0, amax / np.float32(_F32_MAX_E4M3), np.float32(1)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x32 / s
    codes = np.asarray(encode(jnp.asarray(y), "e4m3", overflow="saturate"))
    if scheme == "fp8_channel":
        scale_shape = (x32.shape[0], 1)
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
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
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
    q = {"quant_algo": _MODELOPT_SCHEMES[scheme], "kv_cache_quant_algo": None,
         "exclude_modules": sorted(_with_head({scheme: ()}, exclude))}
    if scheme == "nvfp4":
        q["group_size"] = 16
    return {"producer": {"name": "lowprec"}, "quantization": q}


# -- whole checkpoints ---------------------------------------------------------------------
def _parse_schemes(schemes) -> list:
    """``[(compiled pattern, scheme)]`` from ``{pattern: format}`` or ``["PATTERN=FORMAT"]``."""
    items = schemes.items() if isinstance(schemes, dict) else []
    if not isinstance(schemes, dict):
        for s in schemes or ():
            if "=" not in s:
                raise CheckpointError(
                    f"--scheme {s!r}: write PATTERN=FORMAT, e.g. 're:.*mlp.*=nvfp4'")
            pat, _, fmt = s.rpartition("=")
            items = [*items, (pat, fmt)]
    return [(_pattern(p, "--scheme"), scheme_name(f)) for p, f in items]


def _pattern(p: str, what: str):
    """A module pattern as compressed-tensors writes them: ``re:REGEX`` (``re.match``) or an
    exact module name."""
    if not isinstance(p, str) or not p:
        raise CheckpointError(f"{what} pattern {p!r} must be a non-empty string")
    if p.startswith("re:"):
        try:
            return re.compile(p[3:])
        except re.error as e:
            raise CheckpointError(f"{what} {p!r} is not a valid regular expression: {e}") from None
    return re.compile(re.escape(p) + r"\Z")


def _matches(pattern, module: str) -> bool:
    return pattern.match(module) is not None


def plan_modules(names_infos, default: Optional[str], schemes, ignore) -> tuple:
    """Which Linear weights get which scheme: ``({weight name: scheme}, kept modules)``."""
    chosen, kept = {}, []
    for name, info in names_infos:
        if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
            continue
        module = name[: -len(".weight")]
        if info.numel == 0:
            continue
        scheme = next((s for p, s in schemes if _matches(p, module)), None)
        if any(_matches(p, module) for p in ignore) or (
                scheme is None and (default is None or re.search(DEFAULT_IGNORE, module, re.I))):
            kept.append(module)
            continue
        scheme = scheme or default
        group = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}.get(scheme, 1)
        if info.shape[1] % group:
            raise CheckpointError(
                f"{name}: {info.shape[1]} input features are not a multiple of the {scheme} "
                f"group size {group}; --ignore 're:{re.escape(module)}' keeps it"
            )
        chosen[name] = scheme
    return chosen, kept


def quantize_engine_checkpoint(
    src, dst, format: Optional[str] = None, *, layout: str = "compressed-tensors",
    schemes=None, ignore: Sequence[str] = (), scale_rule: Optional[str] = None,
    force: bool = False, progress: Optional[bool] = None, report=None,
    follow_symlinks: bool = False, jobs: int = 1,
):
    """Quantizes the Linear weights of a Hugging Face safetensors checkpoint into a layout
    vLLM / SGLang / transformers load (see the module docstring for the stored tensors).

    Args:
      src, dst: as :func:`~lowprec.checkpoint.quantize_checkpoint` (a folder gives a folder
        whose ``config.json`` gets ``quantization_config``; ModelOpt also gets
        ``hf_quant_config.json``).
      format: the scheme of every Linear weight not matched otherwise: ``"nvfp4"``,
        ``"mxfp4"``, ``"mxfp8"``, ``"fp8"`` (per tensor) or ``"fp8_channel"`` (lowprec names
        ``"e4m3"``, ``"mxfp8_e4m3"`` too). ModelOpt: ``"nvfp4"`` or ``"fp8"``.
      layout: ``"compressed-tensors"`` or ``"modelopt"``.
      schemes: per-module schemes, ``{pattern: format}`` or ``["PATTERN=FORMAT", ...]``; a
        pattern is an exact module name or ``re:REGEX`` (matched from the start, as
        compressed-tensors does); the first match wins. Such modules are quantized even if
        the default rule would keep them.
      ignore: module patterns kept in their original precision (besides the default:
        ``lm_head``, embeddings, norms — :data:`DEFAULT_IGNORE`).
      scale_rule: MX schemes: the E8M0 scale rule (default ``"floor"``).

    Returns:
      The :class:`~lowprec.checkpoint.ConversionReport`; its ``options`` hold the written
      ``quantization_config``.

    Example:
        >>> import tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        >>> with SafetensorsWriter(f"{d}/m.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> rep = quantize_engine_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors", "nvfp4")
        >>> rep.tensors[0].stored_as
        ('fc.weight_packed', 'fc.weight_scale', 'fc.weight_global_scale')
        >>> float(np.abs(load_checkpoint(f"{d}/q.safetensors")["fc.weight"] - w).max()) < 0.1
        True
    """
    from . import _convert as cv
    from ._report import TensorReport
    from ._stats import ErrorStats

    start = time.perf_counter()
    if layout not in ENGINE_LAYOUTS:
        raise CheckpointError(
            f"unknown engine layout {layout!r}; choose one of: {', '.join(ENGINE_LAYOUTS)}")
    default = None if format is None else scheme_name(format)
    parsed = _parse_schemes(schemes)
    ignore_p = [_pattern(p, "--ignore") for p in ignore]
    used = {default} | {s for _, s in parsed}
    used.discard(None)
    if not used:
        raise CheckpointError(
            "give a format (--format) or per-module schemes (--scheme PATTERN=FORMAT)")
    if layout == "modelopt":
        bad = used - set(_MODELOPT_SCHEMES)
        if bad or len(used) > 1:
            raise CheckpointError(
                f"the ModelOpt layout holds one scheme of {', '.join(_MODELOPT_SCHEMES)} per "
                f"checkpoint, not {', '.join(sorted(used))}; use --layout compressed-tensors"
            )
    from ._formats import DEFAULT_SCALE_RULE, check_scale_rule
    scale_rule = check_scale_rule(DEFAULT_SCALE_RULE if scale_rule is None else scale_rule)
    source = cv.open_source(src)
    outputs = cv._Outputs(source, dst, report, force, follow_symlinks, jobs)
    with contextlib.ExitStack() as stack:
        readers = cv._open_readers(stack, source)
        plans, groups, kept_all = {}, {}, []
        for rel, reader in readers.items():
            if cv.METADATA_KEY in reader.metadata or engine_specs(reader):
                raise CheckpointError(f"{reader.path}: already quantized; use lowprec convert "
                                      "to change its layout, or dequantize it first")
            chosen, kept = plan_modules(reader.tensors.items(), default, parsed, ignore_p)
            kept_all += kept
            plan, entries = [], []
            for info in reader.tensors.values():
                scheme = chosen.get(info.name)
                spec = None
                if scheme is not None:
                    spec = EngineSpec(scheme, layout, tuple(info.shape), info.dtype, scale_rule)
                    entries += [(st, dt, shp) for _, st, dt, shp in spec.parts(info.name)]
                    groups.setdefault(scheme, []).append(info.name[: -len(".weight")])
                else:
                    entries.append((info.name, info.dtype, info.shape))
                plan.append((info, spec))
            cv._check_collisions(entries, reader.path)
            plans[rel] = (plan, entries)
        if not groups:
            raise CheckpointError(f"{source.given}: no Linear weight ([out, in] '*.weight') to "
                                  "quantize with these options")
        groups = {s: sorted(m) for s, m in groups.items()}
        if layout == "compressed-tensors":
            qconfig = ct_quantization_config(groups, kept_all)
            extra = {}
        else:
            (scheme,) = groups
            hf = modelopt_quant_config(scheme, kept_all)
            qconfig = {"quant_method": "modelopt", **hf["quantization"]}
            extra = {"hf_quant_config.json": json.dumps(hf, indent=2) + "\n"}
        texts = _config_texts(source, outputs, qconfig, extra, force)

        def convert(reader, writer, item, bar):
            info, spec = item
            bar.set_postfix_str(info.name[-40:], refresh=False)
            if spec is None:
                cv._copy_tensor(reader, writer, info.name, bar)
                return TensorReport(info.name, info.shape, info.dtype, "kept",
                                    info.nbytes, info.nbytes, reason="kept")
            parts = spec.parts(info.name)
            blocks = list(spec.row_blocks())
            amax = None
            if spec.scheme in ("nvfp4", "fp8"):  # one scale for the whole tensor: a first pass
                amax = max((np.float32(_finite_amax(reader.read_rows(info.name, r0, r1)))
                            for r0, r1 in blocks), default=np.float32(0))
            stats = ErrorStats()
            for r0, r1 in blocks:
                x = reader.read_rows(info.name, r0, r1)
                arrays = quantize_arrays(x, spec.scheme, layout, scale_rule=scale_rule, amax=amax)
                for role, stored, _, _ in parts:
                    if r0 == 0 or not spec.is_whole(role):
                        writer.write(stored, arrays[role])
                stats.update(x, decode_arrays(arrays, dataclasses.replace(spec, shape=x.shape)))
                bar.update(x.nbytes)
            return TensorReport(
                info.name, info.shape, info.dtype, spec.label, info.nbytes, spec.nbytes(),
                reason=f"{layout} " + (SCHEMES[spec.scheme][1] if layout != "modelopt"
                                       else _MODELOPT_SCHEMES[spec.scheme]),
                scale_rule=scale_rule if spec.scheme in ("mxfp4", "mxfp8") else None,
                sqnr_db=stats.sqnr_db, max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
                nonfinite=stats.nonfinite, stored_as=tuple(p[1] for p in parts), exact=stats.exact)

        options = {"layout": layout, "format": default, "schemes": list(schemes or ()),
                   "ignore": list(ignore), "quantization_config": qconfig}
        def metadata(plan):
            return {ORIGIN_KEY: json.dumps({i.name: {"dtype": i.dtype, "scale_rule": scale_rule
                                                     if s.scheme in ("mxfp4", "mxfp8") else None}
                                            for i, s in plan if s is not None},
                                           separators=(",", ":"))}

        return cv._write_outputs(source, outputs, readers, plans, "quantize", options, start,
                                 force=force, progress=progress, metadata=metadata,
                                 convert=convert, texts=texts)


def _config_texts(source, outputs, qconfig: dict, extra: dict, force: bool) -> dict:
    """``{relative path: text}`` replacing or adding the folder's config files (a single-file
    output has none: the config is in the report)."""
    from ._atomic import check_output

    if not source.is_folder:
        return {}
    texts = dict(extra)
    config = {}
    if qconfig is None and "config.json" not in source.others:
        return texts
    if "config.json" in source.others:
        try:
            with open(source.path("config.json"), encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(
                f"{source.path('config.json')}: cannot read it as JSON ({e})") from None
        except RecursionError:
            raise CheckpointError(
                f"{source.path('config.json')}: cannot read it as JSON (nested too deeply)") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{source.path('config.json')}: is not a JSON object")
    if qconfig is None:
        if "quantization_config" not in config:
            return texts  # nothing to take out: config.json is copied as it is
        config.pop("quantization_config")
    else:
        config["quantization_config"] = qconfig
    texts["config.json"] = json.dumps(config, indent=2) + "\n"
    for rel in texts:
        if rel not in outputs.files:
            path = os.path.join(outputs.dst, rel)
            if not outputs.create_folder:
                check_output(path, force=force, inputs=source.inputs)
            outputs.files[rel] = path
    return texts


def plain_config_texts(source, outputs, force: bool) -> dict:
    """For a dequantized folder: ``config.json`` without ``quantization_config`` (else the
    engines would look for quantized tensors) and no ``hf_quant_config.json``."""
    texts = _config_texts(source, outputs, None, {}, force)
    if source.is_folder and "hf_quant_config.json" in source.others:
        texts["hf_quant_config.json"] = None
    return texts


# -- converting between layouts without requantizing ------------------------------------
ORIGIN_KEY = "lowprec.origin"  # per tensor: original dtype and scale rule, kept across layouts


def _bits_of(name, spec, arrays) -> tuple:
    """``(scheme, {role: array})`` in the roles of :class:`EngineSpec` (elements/values,
    scales, and ``ts`` = the float32 tensor scale of NVFP4 / FP8, or ``scale`` for per-channel
    FP8) from a tensor stored in any layout."""
    if isinstance(spec, EngineSpec):
        bits = dict(arrays)
        if spec.scheme == "nvfp4" and spec.layout == "compressed-tensors":
            gs = np.float32(np.asarray(bits.pop("global_scale")).reshape(-1)[0])
            bits["ts"] = _exact_reciprocal(name, gs, bits["scales"], "lowprec")
        elif "scale" in bits and spec.scheme != "fp8_channel":
            bits["ts"] = np.float32(np.asarray(bits.pop("scale")).reshape(-1)[0])
        return spec.scheme, bits
    if spec.layout == "gpt-oss" and len(spec.shape) == 2:  # [out, K/32, 16]: the packed bytes
        arrays = {"elements" if k == "blocks" else k: v for k, v in arrays.items()}
        if arrays.get("elements") is not None:
            blocks = np.asarray(arrays["elements"])
            arrays["elements"] = blocks.reshape(blocks.shape[0], -1)
    elif spec.layout != "lowprec" or len(spec.shape) != 2 or (spec.is_mx and spec.axis != 1):
        raise CheckpointError(f"{name}: {spec.format} in the {spec.layout} layout blocked along "
                              f"axis {spec.axis} has no engine equivalent (2-D, last axis only)")
    schemes = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8_e4m3": "mxfp8", "e4m3": "fp8"}
    scheme = schemes.get(spec.format)
    if scheme is None or (scheme == "fp8" and spec.fp8_scale != "tensor"):
        raise CheckpointError(f"{name}: lowprec format {spec.format} has no compressed-tensors/"
                              "ModelOpt equivalent (nvfp4, mxfp4, mxfp8_e4m3, e4m3 with a tensor "
                              "scale have); dequantize it instead")
    bits = {"scales": arrays.get("scales")} if spec.is_mx else {}
    bits["elements" if scheme in ("nvfp4", "mxfp4") else "values"] = arrays.get(
        "elements", arrays.get("values"))
    if "scale" in arrays:
        bits["ts"] = np.float32(np.asarray(arrays["scale"]).reshape(()))
    return scheme, bits


def _exact_reciprocal(name, x: np.float32, scales, what: str) -> np.float32:
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


def _target_arrays(name, scheme: str, bits: dict, layout: str) -> dict:
    out = {k: v for k, v in bits.items() if k != "ts"}
    if "scale" in out:  # per-channel FP8 scales (BF16/F16 ones widen exactly)
        out["scale"] = np.asarray(out["scale"]).astype(np.float32)
    if "ts" in bits:
        ts = np.float32(bits["ts"])
        if scheme == "nvfp4" and layout == "compressed-tensors":
            out["global_scale"] = np.array([_exact_reciprocal(name, ts, bits["scales"], layout)],
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


def convert_checkpoint(src, dst, layout: str, *, force: bool = False,
                       progress: Optional[bool] = None, report=None,
                       follow_symlinks: bool = False, jobs: int = 1):
    """Rewrites a quantized checkpoint (lowprec, compressed-tensors or ModelOpt layout) in
    another of these layouts, moving the stored bits: no requantization, every decoded value
    unchanged. Refused, naming the tensor, where the target cannot hold the bits exactly
    (lowprec has no per-channel FP8, ModelOpt holds NVFP4 and FP8 only, an NVFP4 tensor scale
    without an exact reciprocal; see the module docstring). Tensors that are not quantized
    and the folder's other files are copied; ``config.json``'s ``quantization_config`` (and
    ModelOpt's ``hf_quant_config.json``) are rewritten for the target. The original dtype and
    scale rule of each tensor travel in the safetensors metadata (``lowprec.origin``), so
    lowprec → compressed-tensors → lowprec gives back the same tensor files byte for byte.

    Example:
        >>> import tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter, quantize_checkpoint, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        >>> with SafetensorsWriter(f"{d}/m.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> _ = quantize_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors", "mxfp4")
        >>> rep = convert_checkpoint(f"{d}/q.safetensors", f"{d}/ct.safetensors",
        ...                          "compressed-tensors")
        >>> rep.tensors[0].stored_as
        ('fc.weight_packed', 'fc.weight_scale')
        >>> a, b = load_checkpoint(f"{d}/q.safetensors"), load_checkpoint(f"{d}/ct.safetensors")
        >>> bool(np.array_equal(a["fc.weight"], b["fc.weight"]))
        True
    """
    from . import _convert as cv
    from ._layout import make_spec
    from ._report import TensorReport

    start = time.perf_counter()
    if layout not in ENGINE_LAYOUTS + ("lowprec",):
        raise CheckpointError(f"unknown layout {layout!r}; choose one of: lowprec, "
                              f"{', '.join(ENGINE_LAYOUTS)}")
    source = cv.open_source(src)
    outputs = cv._Outputs(source, dst, report, force, follow_symlinks, jobs)
    with contextlib.ExitStack() as stack:
        readers = cv._open_readers(stack, source)
        plans, groups, kept = {}, {}, []
        for rel, reader in readers.items():
            origin = {}
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                origin = dict(json.loads(reader.metadata.get(ORIGIN_KEY, "{}")))
            plan, entries = [], []
            for name, spec, parts in cv._logical(reader):
                if spec is None:
                    info = reader.tensors[name]
                    entries.append((name, info.dtype, info.shape))
                    plan.append((name, None, None, None, None))
                    if name.endswith(".weight") and len(info.shape) == 2:
                        kept.append(name[: -len(".weight")])
                    continue
                # the tensor-wide parts and the scales: enough to check exactness up front
                arrays = {role: reader.read(stored) for role, stored, _, _ in parts
                          if role in ("scale", "scales", "global_scale")}
                scheme, bits = _bits_of(name, spec, arrays)
                o = origin.get(name, {}) if isinstance(origin.get(name), dict) else {}
                dtype = o.get("dtype", spec.dtype)
                rule = o.get("scale_rule", spec.scale_rule)
                if layout == "lowprec":
                    if scheme == "fp8_channel":
                        raise CheckpointError(f"{name}: per-channel FP8 has no lowprec layout; "
                                              "keep it in compressed-tensors or dequantize it")
                    target = make_spec(SCHEMES[scheme][0], spec.shape, dtype,
                                       axis=-1 if scheme != "fp8" else None,
                                       scale_rule=rule if scheme in ("mxfp4", "mxfp8") else None)
                    tparts = target.parts(name)
                else:
                    if layout == "modelopt" and scheme not in _MODELOPT_SCHEMES:
                        raise CheckpointError(f"{name}: {scheme} has no ModelOpt layout (NVFP4 "
                                              "and FP8 per tensor have); use compressed-tensors")
                    target = EngineSpec(scheme, layout, tuple(spec.shape), dtype, rule)
                    tparts = target.parts(name)
                    if scheme == "nvfp4" and layout == "compressed-tensors" and "ts" in bits:
                        _exact_reciprocal(name, bits["ts"], bits["scales"], layout)
                    groups.setdefault(scheme, []).append(name[: -len(".weight")])
                entries += [(st, dt, shp) for _, st, dt, shp in tparts]
                plan.append((name, spec, parts, target, scheme))
                del arrays, bits
                origin[name] = {"dtype": dtype, "scale_rule": rule}
            cv._check_collisions(entries, reader.path)
            plans[rel] = (plan, entries)
        texts = {}
        if layout == "lowprec":
            texts = plain_config_texts(source, outputs, force)
        elif groups:
            groups = {s: sorted(m) for s, m in groups.items()}
            if layout == "compressed-tensors":
                qconfig = ct_quantization_config(groups, kept)
                texts = _config_texts(source, outputs, qconfig, {}, force)
            else:
                if len(groups) > 1:
                    raise CheckpointError("the ModelOpt layout holds one scheme per checkpoint, "
                                          f"not {', '.join(sorted(groups))}")
                (scheme,) = groups
                hf = modelopt_quant_config(scheme, kept)
                qconfig = {"quant_method": "modelopt", **hf["quantization"]}
                extra = {"hf_quant_config.json": json.dumps(hf, indent=2) + "\n"}
                texts = _config_texts(source, outputs, qconfig, extra, force)

        def metadata(plan):
            specs = {n: t for n, s, _, t, _ in plan if t is not None}
            if layout == "lowprec":  # lowprec's own metadata holds dtype and scale rule
                return {cv.METADATA_VERSION_KEY: cv.METADATA_VERSION,
                        cv.METADATA_KEY: json.dumps({n: t.to_json(n) for n, t in specs.items()},
                                                    separators=(",", ":"))}
            return {ORIGIN_KEY: json.dumps({n: {"dtype": t.dtype, "scale_rule": t.scale_rule}
                                            for n, t in specs.items()}, separators=(",", ":"))}

        def convert(reader, writer, item, bar):
            name, spec, parts, target, scheme = item
            if spec is None:
                info = reader.tensors[name]
                cv._copy_tensor(reader, writer, name, bar)
                return TensorReport(name, info.shape, info.dtype, "kept", info.nbytes,
                                    info.nbytes, reason="not quantized")
            tparts = target.parts(name)
            rows = EngineSpec(scheme, layout if layout != "lowprec" else "compressed-tensors",
                              tuple(spec.shape))
            for r0, r1 in rows.row_blocks():  # move the bits a block of rows at a time
                if isinstance(spec, EngineSpec):
                    got = spec.read_rows(reader, parts, r0, r1)
                else:
                    got = {role: reader.read(stored) if role == "scale"
                           else reader.read_rows(stored, r0, r1) for role, stored, _, _ in parts}
                out = _target_arrays(name, scheme, _bits_of(name, spec, got)[1], layout)
                for role, stored, _, _ in tparts:
                    if r0 == 0 or not rows.is_whole(role):
                        writer.write(stored, out[role])
            before = sum(reader.tensors[p[1]].nbytes for p in parts)
            bar.update(before)
            label = getattr(target, "label", target.format)
            return TensorReport(name, spec.shape, target.dtype, label,
                                before, target.nbytes(), reason=f"moved from {spec.layout}",
                                scale_rule=target.scale_rule, stored_as=tuple(p[1] for p in tparts))

        return cv._write_outputs(source, outputs, readers, plans, "convert", {"layout": layout},
                                 start, force=force, progress=progress, metadata=metadata,
                                 convert=convert, texts=texts)
