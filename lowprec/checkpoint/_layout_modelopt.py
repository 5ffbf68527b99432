"""NVIDIA ModelOpt's unified Hugging Face export (0.47): ``M.weight`` / ``M.weight_scale`` /
``M.weight_scale_2`` and ``hf_quant_config.json``; one scheme per checkpoint, of NVFP4 and
FP8 (per tensor or per channel). What each tensor stores is
:mod:`lowprec.checkpoint._engine_layouts`."""

from __future__ import annotations

import dataclasses
import json

from ._engine_convert import config_texts
from ._engine_layouts import modelopt_quant_config
from ._engine_schemes import SCHEMES
from ._errors import CheckpointError
from ._layout_ct import EngineLayout
from ._layouts import register
from ._validate import check_modelopt


@dataclasses.dataclass(frozen=True)
class ModelOptLayout(EngineLayout):
    def _schemes(self):
        return [s for s in SCHEMES.values() if s.modelopt is not None]

    def weight_parts(self, spec, name, out, k) -> list:
        if spec.scheme == "nvfp4":
            return [("elements", name, "U8", (out, k // 2)),
                    ("scales", f"{name}_scale", "F8_E4M3", (out, k // 16)),
                    ("scale", f"{name}_scale_2", "F32", ())]
        shape = (out,) if spec.scheme == "fp8_channel" else ()
        return [("values", name, "F8_E4M3", (out, k)),
                ("scale", f"{name}_scale", spec.scale_dtype, shape)]

    def input_scale_part(self, spec, module) -> tuple:
        return ("input_scale", f"{module}.input_scale", "F32", ())

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

    def check(self, reader, name, spec, parts, config, data):
        check_modelopt(reader, name, spec, parts, config, data)


MODELOPT = register(ModelOptLayout("modelopt", "M.weight + M.weight_scale (+ M.weight_scale_2), "
                                               "hf_quant_config.json (ModelOpt's export)"))
