"""compressed-tensors' layout (vLLM, SGLang, transformers load it), as llm-compressor 0.14
writes it: ``M.weight_packed`` / ``M.weight_scale`` / ``M.weight_global_scale``, FP8 and
MXFP8 under ``M.weight``, and the ``quantization_config`` of config.json. What each tensor
stores and how it is computed is :mod:`lowprec.checkpoint._engine_layouts`; holds the engine
schemes (:mod:`lowprec.checkpoint._engine_schemes`), not lowprec's other formats.

:class:`EngineLayout` is the base of the engine layouts (this one and ModelOpt's): what such
a layout says is data (how it stores a tensor-wide scale, in which dtype, under which names)
and its writer's rules (``encode_nvfp4``, ``encode_fp8``, ``input_scale``); the pipeline of
:mod:`lowprec.checkpoint._engine_convert` does the rest.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

from ._engine_convert import (
    check_engine_fused,
    config_texts,
    convert_layouts,
    quantize_engine_checkpoint,
)
from ._engine_layouts import (
    ORIGIN_KEY,
    EngineSpec,
    complete_specs,
    ct_fp8,
    ct_fp8_scale_dtype,
    ct_input_scale,
    ct_nvfp4,
    ct_quantization_config,
    writer_dtype,
)
from ._engine_schemes import SCHEMES, WEIGHT_SCHEMES
from ._errors import CheckpointError
from ._layouts import Layout, get_layout, layouts, register
from ._qconfig import ct_config, ct_keeping
from ._validate import check_engine


@dataclasses.dataclass(frozen=True)
class EngineLayout(Layout):
    """A layout an inference engine loads: recognized by stored names and dtypes, written
    with the bytes of the engine's own tool, weights given as schemes (llm-compressor
    presets). A subclass says how it stores things (the class attributes below, ``parts``,
    ``recognize_weights``), its writer's arithmetic and its config files."""

    #: NVFP4's tensor scale stored as its reciprocal, the global scale gs = 1 / ts.
    reciprocal_global_scale: ClassVar[bool] = False
    #: FP8 weight and input scales stored in the model dtype (else float32).
    scales_in_model_dtype: ClassVar[bool] = False
    #: The stored shape of a tensor-wide number (a tensor scale, an input scale).
    scalar_shape: ClassVar[tuple] = ()
    #: At most one scheme per checkpoint.
    one_scheme: ClassVar[bool] = False
    #: Where to go instead, for a scheme it does not hold (in a refusal).
    scheme_instead: ClassVar[str] = "use --layout compressed-tensors"
    instead_convert: ClassVar[str] = "use compressed-tensors"

    def holds(self, fmt) -> bool:
        return fmt in {s.w.format for s in self.schemes()}

    def holdable(self) -> str:
        return "the schemes " + ", ".join(s.name for s in self.schemes())

    def schemes(self) -> list:
        """The engine schemes (:class:`~._engine_schemes.EngineScheme`) it stores."""
        return list(SCHEMES.values())

    def channel_shape(self, out: int) -> tuple:
        """The stored shape of per-channel FP8 scales of ``out`` rows."""
        return (out, 1)

    def input_dtypes(self, w) -> tuple:
        """The dtypes a static input scale of weight format ``w`` may be stored in."""
        return ("F32", "BF16", "F16") if self.scales_in_model_dtype and not w.blocks \
            else ("F32",)

    def stores_values(self, w) -> bool:
        """Whether the codes of ``w`` are stored as F8_E4M3 values (else packed U8)."""
        return not w.packed

    # -- the reader side ---------------------------------------------------------------
    def recognize(self, reader):
        found = complete_specs(reader, self.recognize_weights(reader))
        return {n: (s, None) for n, s in found.items()}

    def recognize_weights(self, reader) -> dict:
        """``{weight name: EngineSpec}`` of the weights of ``reader`` stored in this layout,
        by stored names, dtypes and shapes (one pass over the header)."""
        return {}

    def _fp8(self, name, info, sc) -> EngineSpec | None:
        """A ``.weight`` F8_E4M3 with a float scale of this layout's FP8 shape."""
        out, k = info.shape
        if info.dtype != "F8_E4M3" or sc.dtype not in ("F32", "BF16", "F16"):
            return None
        for w in WEIGHT_SCHEMES.values():
            shape = self.channel_shape(out) if w.per_channel else self.scalar_shape
            if not w.blocks and tuple(sc.shape) == shape:
                return EngineSpec(w.name, self.name, (out, k), scale_dtype=sc.dtype)
        return None

    def parts(self, spec, name: str) -> list:
        """The stored parts of the engine tensor ``spec`` named ``name`` (``M.weight``):
        ``[(role, stored name, dtype, shape)]``, its weight's and its input scale's."""
        out, k = spec.shape
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        parts = self.weight_parts(spec, name, out, k)
        if spec.inputs == "static":
            parts.append(self.input_scale_part(spec, module))
        return parts

    def weight_parts(self, spec, name: str, out: int, k: int) -> list:
        """The stored parts of the weight ``name`` [out, k] (``spec`` an EngineSpec)."""
        raise NotImplementedError

    def input_scale_part(self, spec, module: str) -> tuple:
        """The stored part of a static scheme's input scale of ``module``."""
        raise NotImplementedError

    def check(self, reader, name, spec, parts, config, data):
        # FP8 per tensor is the same bits in every engine layout (a scale of shape [] or
        # [1]): a config of any of them reads it.
        others = tuple(l.name for l in _engine_layouts() if l is not self) \
            if spec.w.tensor_scale and not spec.w.blocks else ()
        check_engine(reader, name, spec, parts, config, data, (self.name, *others))

    def label(self, spec) -> str:
        return spec.label

    # -- the writer side -------------------------------------------------------------
    def check_schemes(self, used) -> None:
        """Refuses schemes (a set of EngineScheme) a checkpoint in this layout cannot hold."""
        held = self.schemes()
        if any(s not in held for s in used) or (self.one_scheme and len(used) > 1):
            raise CheckpointError(
                f"the {self.title} layout holds {'one scheme of ' if self.one_scheme else ''}"
                f"{', '.join(s.name for s in held)}"
                f"{' per checkpoint' if self.one_scheme else ''}, not "
                f"{', '.join(sorted(s.name for s in used))}; {self.scheme_instead}")

    def fp8_scale_dtype(self, w, dtype: str) -> str:
        """The stored dtype of FP8 scales of a ``dtype`` model (float32 for block formats)."""
        return writer_dtype(dtype) if self.scales_in_model_dtype and not w.blocks else "F32"

    def encode_nvfp4(self, x32, dtype: str, amax) -> dict:
        """NVFP4 of rows ``x32`` by the layout's writer, ``amax`` the tensor-wide one."""
        raise NotImplementedError

    def encode_fp8(self, x32, w, dtype: str, amax) -> dict:
        """FP8 of rows ``x32`` (per tensor or per channel, ``w``) by the layout's writer."""
        raise NotImplementedError

    def input_scale(self, amax, w, dtype: str):
        """The stored input scale of a static scheme with weights ``w`` from the largest
        input magnitude ``amax``, by the layout's writer."""
        raise NotImplementedError

    def config(self, source, outputs, groups: dict, kept) -> tuple:
        """``(quantization_config, {relative path: text})``: the folder's config files for
        modules ``groups`` (``{scheme: [module]}``) and ``kept`` (kept in high precision)."""
        raise NotImplementedError

    def table(self, specs: dict) -> dict:
        """The safetensors metadata of the written tensors ``specs`` (``{name: spec}``): each
        one's original dtype and scale rule (``lowprec.origin``), kept across layouts."""
        return {ORIGIN_KEY: json.dumps({n: {"dtype": t.dtype, "scale_rule": t.scale_rule}
                                        for n, t in specs.items()}, separators=(",", ":"))}

    def convert_target(self, name, spec, w, bits, scheme, dtype, rule, requantize) -> tuple:
        """``(target spec, scheme)`` of a tensor (``spec``, weights ``w``, scheme ``scheme``
        where its layout has one) moved into this layout, or a refusal naming it."""
        if scheme is None:  # lowprec's / gpt-oss's layout: weight-only
            scheme = next(s for s in SCHEMES.values() if s.w == w and s.inputs is None)
        if scheme not in self.schemes():
            names = ", ".join(s.name for s in self.schemes())
            raise CheckpointError(f"{name}: {scheme.name} has no {self.title} layout "
                                  f"({names} have); {self.instead_convert}")
        scale_dtype = "F32"
        if self.scales_in_model_dtype and not w.blocks:
            if get_layout(spec.layout).scales_in_model_dtype:
                scale_dtype = spec.scale_dtype  # a file of this layout rewritten
            else:  # a float32 scale: in the model dtype, as the layout's writer stores it
                scale_dtype, _ = ct_fp8_scale_dtype(
                    name, bits["ts"] if "ts" in bits else bits["scale"], dtype, requantize)
        input_dtype = getattr(spec, "input_dtype", "F32")
        if get_layout(spec.layout) is not self:  # FP8's input scale: as its weight scale
            input_dtype = scale_dtype if w.tensor_scale and not w.blocks else "F32"
        target = EngineSpec(w.name, self.name, tuple(spec.shape), dtype, rule,
                            scale_dtype=scale_dtype,
                            inputs="static" if scheme.inputs == "static" else None,
                            input_dtype=input_dtype)
        return target, scheme

    def convert_texts(self, source, outputs, plans, groups, kept, linear, config) -> dict:
        """The config files of a checkpoint converted into this layout."""
        if not groups:
            return {}
        check_engine_fused(plans, linear, self.name)
        return self.config(source, outputs, {s: sorted(m) for s, m in groups.items()}, kept)[1]

    def quantize(self, src, dst, fmt, *, include=None, exclude=None, axis=None,
                 block_size=None, fp8_scale="tensor", **options):
        if include or exclude or axis is not None or block_size is not None \
                or fp8_scale != "tensor":
            raise CheckpointError(
                f"the {self.name} layout takes --ignore / --scheme, not --include, --exclude, "
                "--axis, --block-size or --fp8-scale")
        return quantize_engine_checkpoint(src, dst, fmt, layout=self.name, **options)

    def convert(self, src, dst, **options):
        return convert_layouts(src, dst, self.name, **options)


def _engine_layouts() -> list:
    return [l for l in layouts() if isinstance(l, EngineLayout)]


@dataclasses.dataclass(frozen=True)
class CompressedTensorsLayout(EngineLayout):
    quant_method = "compressed-tensors"
    reciprocal_global_scale = True
    scales_in_model_dtype = True
    scalar_shape = (1,)

    def recognize_weights(self, reader) -> dict:
        t, found = reader.tensors, {}
        for name, info in t.items():
            if name.endswith(".weight_packed") and info.dtype == "U8" and len(info.shape) == 2:
                w = name[: -len("_packed")]
                sc = t.get(f"{w}_scale")
                if w in t or sc is None or sc.dtype not in ("F8_E4M3", "U8") \
                        or len(sc.shape) != 2 or sc.shape[0] != info.shape[0]:
                    continue
                gs = t.get(f"{w}_global_scale")
                gs = gs if gs is not None and gs.dtype == "F32" else None
                for ws in WEIGHT_SCHEMES.values():
                    has_gs = (gs is not None and gs.numel == 1) if ws.global_scale \
                        else gs is None
                    k = sc.shape[1] * ws.block_size
                    if ws.packed and sc.dtype == ws.scales_dtype and has_gs \
                            and ws.packed_length(k) == info.shape[1]:
                        found[w] = EngineSpec(ws.name, self.name, (info.shape[0], k))
                        break
            elif name.endswith(".weight") and len(info.shape) == 2:
                sc = t.get(f"{name}_scale")
                if sc is None:
                    continue
                out, k = info.shape
                for ws in WEIGHT_SCHEMES.values():  # MX codes as F8_E4M3 values (MXFP8)
                    if ws.blocks and not ws.packed and info.dtype == "F8_E4M3" \
                            and sc.dtype == ws.scales_dtype and k % ws.block_size == 0 \
                            and sc.shape == (out, k // ws.block_size):
                        found[name] = EngineSpec(ws.name, self.name, (out, k))
                        break
                else:
                    spec = self._fp8(name, info, sc)
                    if spec is not None:
                        found[name] = spec
        return found

    def weight_parts(self, spec, name, out, k) -> list:
        w = spec.w
        if w.blocks:
            code = (("elements", f"{name}_packed", "U8", (out, w.packed_length(k))) if w.packed
                    else ("values", name, "F8_E4M3", (out, k)))
            parts = [code, ("scales", f"{name}_scale", w.scales_dtype, (out, k // w.block_size))]
            if w.global_scale:
                parts.append(("global_scale", f"{name}_global_scale", "F32", self.scalar_shape))
            return parts
        shape = self.channel_shape(out) if w.per_channel else self.scalar_shape
        return [("values", name, "F8_E4M3", (out, k)),
                ("scale", f"{name}_scale", spec.scale_dtype, shape)]

    def input_scale_part(self, spec, module) -> tuple:
        if spec.w.global_scale:
            return ("input_scale", f"{module}.input_global_scale", "F32", self.scalar_shape)
        return ("input_scale", f"{module}.input_scale", spec.input_dtype, self.scalar_shape)

    def encode_nvfp4(self, x32, dtype, amax) -> dict:
        return ct_nvfp4(x32, dtype, amax)

    def encode_fp8(self, x32, w, dtype, amax) -> dict:
        return ct_fp8(x32, w, dtype, amax)

    def input_scale(self, amax, w, dtype):
        return ct_input_scale(amax, w, dtype)

    def read_config(self, q, hf, where):
        return ct_config(q, where)

    def keep_config(self, config, groups, decoded) -> tuple:
        return ct_keeping(config, groups, decoded)

    def config(self, source, outputs, groups: dict, kept) -> tuple:
        qconfig = ct_quantization_config(groups, kept)
        texts = config_texts(source, outputs, qconfig, {})
        if source.is_folder and "hf_quant_config.json" in source.others:
            texts["hf_quant_config.json"] = None  # ModelOpt's, no longer true
        return qconfig, texts


COMPRESSED_TENSORS = register(CompressedTensorsLayout(
    "compressed-tensors", "M.weight_packed + M.weight_scale (+ M.weight_global_scale), "
                          "config.json quantization_config (llm-compressor's)"))
