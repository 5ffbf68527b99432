"""llama.cpp's GGUF: its own container (not safetensors), ggml's ``MXFP4`` (type 39) and
``NVFP4`` (type 40) blocks with split-half nibble order, NVFP4's tensor scale as a
``<name>.scale`` tensor, every metadata key carried over (:mod:`lowprec.checkpoint._gguf`,
the ``gguf`` extra). Its files are recognized by their magic (or a ``.gguf`` name), so
``quantize``, ``dequantize``, ``inspect`` and ``convert`` of a GGUF path come here."""

from __future__ import annotations

import dataclasses

from ._gguf import (GGUF_FORMATS, convert_gguf, dequantize_gguf, inspect_gguf, is_gguf,
                    quantize_gguf)
from ._errors import CheckpointError
from ._layouts import Layout, register


@dataclasses.dataclass(frozen=True)
class GGUFLayout(Layout):
    #: Why the safetensors-only options are refused for its files.
    why_not: str = "ggml blocks run along ne[0]; one file, one tensor at a time"

    def holds(self, fmt) -> bool:
        return getattr(fmt, "name", fmt) in GGUF_FORMATS

    def holdable(self) -> str:
        return "mxfp4 or nvfp4 (ggml types 39, 40)"

    def owns_path(self, path, *, output: bool = False) -> bool:
        return path.endswith(".gguf") if output else is_gguf(path)

    def _refuse(self, other: dict) -> None:
        if other:
            raise CheckpointError(f"{', '.join(sorted(other))}: not for GGUF files "
                                  f"({self.why_not})")

    def quantize(self, src, dst, fmt, *, include=None, exclude=None, scale_rule=None,
                 rounding=None, force=False, progress=None, report=None, **other):
        self._refuse(other)
        if not is_gguf(src):
            raise CheckpointError(
                f"{src}: the gguf layout requantizes a GGUF file; quantize a safetensors "
                "checkpoint in another layout, then move it: lowprec convert IN OUT.gguf "
                "--template MODEL.gguf")
        return quantize_gguf(src, dst, fmt, include=include, exclude=exclude,
                             scale_rule=scale_rule, rounding=rounding, force=force,
                             progress=progress, report=report)

    def convert(self, src, dst, *, template=None, to=None, layout="lowprec", force=False,
                progress=None, report=None, **other):
        self._refuse(other)
        return convert_gguf(src, dst, template=template, to=to, layout=layout, force=force,
                            progress=progress, report=report)

    def dequantize(self, src, dst, **options):
        return dequantize_gguf(src, dst, **options)

    def inspect(self, src):
        rep = inspect_gguf(src)
        rep.options["layouts"] = {self.name: []}
        return rep


GGUF = register(GGUFLayout("gguf", "llama.cpp's GGUF file: ggml MXFP4 / NVFP4 blocks "
                                   "(+ <name>.scale), metadata carried over"))
