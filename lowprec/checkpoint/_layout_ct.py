"""compressed-tensors' layout (vLLM, SGLang, transformers load it), as llm-compressor 0.14
writes it: ``M.weight_packed`` / ``M.weight_scale`` / ``M.weight_global_scale``, FP8 and
MXFP8 under ``M.weight``, and the ``quantization_config`` of config.json. What each tensor
stores and how it is computed is :mod:`lowprec.checkpoint._engine_layouts`; holds the engine
schemes (:mod:`lowprec.checkpoint._engine_schemes`), not lowprec's other formats."""

from __future__ import annotations

import dataclasses

from ._engine_convert import config_texts, convert_layouts, quantize_engine_checkpoint
from ._engine_layouts import WEIGHT_FORMATS, ct_quantization_config, engine_specs
from ._engine_schemes import SCHEMES
from ._errors import CheckpointError
from ._layouts import Layout, register
from ._validate import check_compressed_tensors


@dataclasses.dataclass(frozen=True)
class EngineLayout(Layout):
    """A layout an inference engine loads: recognized by stored names and dtypes
    (:func:`~lowprec.checkpoint._engine_layouts.engine_specs`), written with the bytes of the
    engine's own tool, weights given as schemes (llm-compressor presets)."""

    def holds(self, fmt) -> bool:
        return fmt in {WEIGHT_FORMATS[s.weights] for s in self._schemes()}

    def holdable(self) -> str:
        return "the schemes " + ", ".join(s.name for s in self._schemes())

    def _schemes(self):
        return SCHEMES.values()

    def recognize(self, reader):
        return {n: (s, None) for n, s in engine_specs(reader).items() if s.layout == self.name}

    def parts(self, spec, name: str) -> list:
        """The stored parts of the engine tensor ``spec`` named ``name`` (``M.weight``):
        ``[(role, stored name, dtype, shape)]``, its weight's and its input scale's."""
        out, k = spec.shape
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        parts = self.weight_parts(spec, name, out, k)
        if spec.inputs == "static":
            parts.append(self.input_scale_part(spec, module))
        return parts

    def weight_parts(self, spec, name, out, k) -> list:
        if spec.scheme == "nvfp4":
            return [("elements", f"{name}_packed", "U8", (out, k // 2)),
                    ("scales", f"{name}_scale", "F8_E4M3", (out, k // 16)),
                    ("global_scale", f"{name}_global_scale", "F32", (1,))]
        if spec.scheme in ("mxfp4", "mxfp6"):
            packed = k // 2 if spec.scheme == "mxfp4" else 3 * k // 4
            return [("elements", f"{name}_packed", "U8", (out, packed)),
                    ("scales", f"{name}_scale", "U8", (out, k // 32))]
        if spec.scheme == "mxfp8":
            return [("values", name, "F8_E4M3", (out, k)),
                    ("scales", f"{name}_scale", "U8", (out, k // 32))]
        shape = (out, 1) if spec.scheme == "fp8_channel" else (1,)
        return [("values", name, "F8_E4M3", (out, k)),
                ("scale", f"{name}_scale", spec.scale_dtype, shape)]

    def input_scale_part(self, spec, module) -> tuple:
        if spec.scheme == "nvfp4":
            return ("input_scale", f"{module}.input_global_scale", "F32", (1,))
        return ("input_scale", f"{module}.input_scale", spec.input_dtype, (1,))

    def config(self, source, outputs, groups: dict, kept) -> tuple:
        """``(quantization_config, {relative path: text})``: the folder's config files for
        modules ``groups`` (``{scheme: [module]}``) and ``kept`` (kept in high precision)."""
        qconfig = ct_quantization_config(groups, kept)
        texts = config_texts(source, outputs, qconfig, {})
        if source.is_folder and "hf_quant_config.json" in source.others:
            texts["hf_quant_config.json"] = None  # ModelOpt's, no longer true
        return qconfig, texts

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


@dataclasses.dataclass(frozen=True)
class CompressedTensorsLayout(EngineLayout):
    def check(self, reader, name, spec, parts, config, data):
        check_compressed_tensors(reader, name, spec, parts, config, data)


COMPRESSED_TENSORS = register(CompressedTensorsLayout(
    "compressed-tensors", "M.weight_packed + M.weight_scale (+ M.weight_global_scale), "
                          "config.json quantization_config (llm-compressor's)"))
