"""NVIDIA ModelOpt's unified Hugging Face export (0.47): ``M.weight`` / ``M.weight_scale`` /
``M.weight_scale_2`` and ``hf_quant_config.json``; one scheme per checkpoint, of NVFP4 and
FP8 (per tensor or per channel). What each tensor stores is
:mod:`lowprec.checkpoint._engine_layouts`."""

from __future__ import annotations

import dataclasses
import json

from ._engine_convert import config_texts
from ._engine_layouts import (
    EngineSpec,
    modelopt_fp8,
    modelopt_input_scale,
    modelopt_nvfp4,
    modelopt_quant_config,
)
from ._engine_schemes import SCHEMES, WEIGHT_SCHEMES
from ._errors import CheckpointError
from ._layout_ct import EngineLayout
from ._layouts import register
from ._qconfig import MODELOPT_CONFIG_NAME, modelopt_config, modelopt_keeping


@dataclasses.dataclass(frozen=True)
class ModelOptLayout(EngineLayout):
    quant_method = "modelopt"
    config_file = MODELOPT_CONFIG_NAME
    one_scheme = True
    title = "ModelOpt"

    def schemes(self):
        return [s for s in SCHEMES.values() if s.modelopt is not None]

    def channel_shape(self, out: int) -> tuple:
        return (out,)

    def recognize_weights(self, reader) -> dict:
        t, found = reader.tensors, {}
        for name, info in t.items():
            if not name.endswith(".weight") or len(info.shape) != 2:
                continue
            sc = t.get(f"{name}_scale")
            if sc is None:
                continue
            (out, k), s2 = info.shape, t.get(f"{name}_scale_2")
            for w in WEIGHT_SCHEMES.values():  # packed codes with a float32 tensor scale
                n = k * 8 // w.format.element.code_bits if w.global_scale else 0
                if n and info.dtype == "U8" and sc.dtype == w.scales_dtype \
                        and w.packed_length(n) == k and sc.shape == (out, n // w.block_size) \
                        and s2 is not None and s2.dtype == "F32" and len(s2.shape) == 0:
                    found[name] = EngineSpec(w.name, self.name, (out, n))
                    break
            else:
                spec = self._fp8(name, info, sc)
                if spec is not None:
                    found[name] = spec
        return found

    def weight_parts(self, spec, name, out, k) -> list:
        w = spec.w
        if w.global_scale:
            return [("elements", name, "U8", (out, w.packed_length(k))),
                    ("scales", f"{name}_scale", w.scales_dtype, (out, k // w.block_size)),
                    ("scale", f"{name}_scale_2", "F32", self.scalar_shape)]
        shape = self.channel_shape(out) if w.per_channel else self.scalar_shape
        return [("values", name, "F8_E4M3", (out, k)),
                ("scale", f"{name}_scale", spec.scale_dtype, shape)]

    def input_scale_part(self, spec, module) -> tuple:
        return ("input_scale", f"{module}.input_scale", "F32", self.scalar_shape)

    def encode_nvfp4(self, x32, dtype, amax) -> dict:
        return modelopt_nvfp4(x32, dtype, amax)

    def encode_fp8(self, x32, w, dtype, amax) -> dict:
        return modelopt_fp8(x32, w, dtype, amax)

    def input_scale(self, amax, w, dtype):
        return modelopt_input_scale(amax, w, dtype)

    def read_config(self, q, hf, where):
        return modelopt_config(q, hf, where)

    def keep_config(self, config, groups, decoded) -> tuple:
        return modelopt_keeping(config, groups, decoded)

    def config(self, source, outputs, groups: dict, kept) -> tuple:
        """config.json's ``quantization_config`` and ``hf_quant_config.json``, as ModelOpt's
        export writes them: one scheme per checkpoint."""
        if len(groups) > 1:
            raise CheckpointError("the ModelOpt layout holds one scheme per checkpoint, "
                                  f"not {', '.join(sorted(groups))}")
        (name,) = groups
        hf, qconfig = modelopt_quant_config(name, kept)
        extra = {"hf_quant_config.json": json.dumps(hf, indent=4) + "\n"}
        return qconfig, config_texts(source, outputs, qconfig, extra)


MODELOPT = register(ModelOptLayout("modelopt", "M.weight + M.weight_scale (+ M.weight_scale_2), "
                                               "hf_quant_config.json (ModelOpt's export)"))
