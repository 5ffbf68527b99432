"""The gpt-oss layout: MXFP4 along the last axis as ``<name>_blocks`` U8 [..., K/32, 16]
(consecutive codes, low nibble first) and ``<name>_scales`` U8 [..., K/32] (E8M0), as the
published gpt-oss checkpoints store their experts. lowprec writes it with its metadata (then
read as lowprec's table says); files without metadata are recognized by those names
(``_blocks``/``_scales`` or ``.blocks``/``.scales``), dtypes and shapes, original dtype BF16
(as gpt-oss and Hugging Face decode them)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ._errors import CheckpointError
from ._layout import GPT_OSS_FORMAT, TensorSpec
from ._layout_lowprec import LowprecLayout
from ._layouts import Layout, register
from ._qconfig import gpt_oss_config, modelopt_keeping
from ._validate import check_gpt_oss

_SUFFIXES = (("_blocks", "_scales"), (".blocks", ".scales"))
BLOCK = GPT_OSS_FORMAT.block_size  # 32 FP4 codes per scale, 16 bytes a row


@dataclasses.dataclass(frozen=True)
class GptOssLayout(LowprecLayout):
    exclusive = False
    quant_method = "mxfp4"  # transformers' Mxfp4Config
    code_role = "blocks"  # lowprec's packed elements, in rows of 16 bytes
    instead = "use --layout lowprec"

    def holds(self, fmt) -> bool:
        return fmt == GPT_OSS_FORMAT

    def holdable(self) -> str:
        return "MXFP4 only"

    def check_format(self, fmt, *, axis=None) -> None:
        super().check_format(fmt)
        if axis not in (None, -1):
            raise CheckpointError("the gpt-oss layout blocks the last axis; use axis=-1")

    def parts(self, spec, name: str) -> list:
        """``<name>_blocks`` U8 [..., K/32, 16] and ``<name>_scales`` U8 [..., K/32]."""
        shape, groups = tuple(spec.shape), spec.shape[-1] // BLOCK
        return [("blocks", f"{name}_blocks", "U8", shape[:-1] + (groups, BLOCK // 2)),
                ("scales", f"{name}_scales", "U8", shape[:-1] + (groups,))]

    def recognize(self, reader):
        found = {}
        for info in reader.tensors.values():
            for bsuf, ssuf in _SUFFIXES:
                if not info.name.endswith(bsuf):
                    continue
                base = info.name[: -len(bsuf)]
                sc = reader.tensors.get(base + ssuf)
                if (
                    sc is not None and info.dtype == "U8" and sc.dtype == "U8"
                    and len(info.shape) >= 2 and info.shape[-1] == BLOCK // 2
                    and info.shape[:-1] == sc.shape and base not in reader.tensors
                    and base not in found
                ):
                    shape = info.shape[:-2] + (info.shape[-2] * BLOCK,)
                    spec = TensorSpec(GPT_OSS_FORMAT, shape, "BF16", axis=len(shape) - 1,
                                      scale_rule=None, layout=self.name)
                    found[base] = (spec, {"blocks": info.name, "scales": sc.name})
        return found

    def label(self, spec) -> str:
        return f"{spec.format.name} ({self.name})"

    def lowprec_arrays(self, spec, arrays: dict) -> dict:
        """``<name>_blocks`` [out, K/32, 16] are lowprec's packed elements [out, K/2]."""
        arrays = {"elements" if k == "blocks" else k: v for k, v in arrays.items()}
        if arrays.get("elements") is not None and len(spec.shape) == 2:
            blocks = np.asarray(arrays["elements"])
            arrays["elements"] = blocks.reshape(blocks.shape[0], -1)
        return arrays

    def read_config(self, q, hf, where):
        return gpt_oss_config(q, where)

    def keep_config(self, config, groups, decoded) -> tuple:
        return modelopt_keeping(config, groups, decoded)  # its ignore list, as ModelOpt's

    def check(self, reader, name, spec, parts, config, data):
        check_gpt_oss(reader, name, spec, parts, config, data)

    # convert writes lowprec's, compressed-tensors' and ModelOpt's layouts, not this one
    convert = Layout.convert


GPT_OSS = register(GptOssLayout("gpt-oss", "MXFP4 only: <name>_blocks [..., K/32, 16] + "
                                           "<name>_scales [..., K/32]"))
