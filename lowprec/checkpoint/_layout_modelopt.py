"""NVIDIA ModelOpt's unified Hugging Face export (0.47): ``M.weight`` / ``M.weight_scale`` /
``M.weight_scale_2`` and ``hf_quant_config.json``; one scheme per checkpoint, of NVFP4 and
FP8 (per tensor or per channel). What each tensor stores is
:mod:`lowprec.checkpoint._engine_layouts`."""

from __future__ import annotations

import dataclasses

from ._engine_schemes import SCHEMES
from ._layout_ct import EngineLayout
from ._layouts import register
from ._validate import check_modelopt


@dataclasses.dataclass(frozen=True)
class ModelOptLayout(EngineLayout):
    def _schemes(self):
        return [s for s in SCHEMES.values() if s.modelopt is not None]

    def check(self, reader, name, spec, parts, config, data):
        check_modelopt(reader, name, spec, parts, config, data)


MODELOPT = register(ModelOptLayout("modelopt", "M.weight + M.weight_scale (+ M.weight_scale_2), "
                                               "hf_quant_config.json (ModelOpt's export)"))
