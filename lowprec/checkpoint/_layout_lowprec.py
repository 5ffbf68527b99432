"""lowprec's own layout: ``<name>_elements`` / ``<name>_scales`` (/ ``<name>_scale``) or a
cast tensor under its own name, described in the ``lowprec.tensors`` metadata
(:class:`~lowprec.checkpoint._layout.TensorSpec`, :func:`~._layout.metadata_table`). Holds
every checkpoint format; read by lowprec only."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import numpy as np

from ._convert import quantize_lowprec
from ._engine_convert import convert_layouts, plain_config_texts
from ._errors import CheckpointError
from ._formats import FORMATS, cast_dtype
from ._layout import METADATA_KEY, METADATA_VERSION, METADATA_VERSION_KEY, make_spec, metadata_table
from ._layout_codes import CodesLayout, convert_codes
from ._layouts import Layout, layouts, register
from ._pipeline import open_readers
from ._source import check_symlinks, open_source
from ._validate import check_lowprec


@dataclasses.dataclass(frozen=True)
class LowprecLayout(Layout):
    """lowprec's layout (and the base of gpt-oss's, which its metadata also records)."""

    exclusive = True  # the metadata names every quantized tensor of the file

    def holds(self, fmt) -> bool:
        return True

    def holdable(self) -> str:
        return ", ".join(FORMATS)

    def parts(self, spec, name: str) -> list:
        """The stored parts of ``spec`` (a :class:`~._layout.TensorSpec`) named ``name``:
        ``<name>_elements`` (codes packed along the block axis) and ``<name>_scales``, or a
        cast's values under ``name``; ``<name>_scale`` (float32) where there is a tensor
        scale."""
        shape = tuple(spec.shape)
        if spec.is_mx:
            elem, scales = list(shape), list(shape)
            elem[spec.axis] = spec.part_length("elements", shape[spec.axis])
            scales[spec.axis] = shape[spec.axis] // spec.block_size
            parts = [("elements", f"{name}_elements", "U8", tuple(elem)),
                     ("scales", f"{name}_scales", "U8", tuple(scales))]
        else:
            parts = [("values", name, cast_dtype(spec.format), shape)]
        if spec.has_tensor_scale:
            parts.append(("scale", f"{name}_scale", "F32", ()))
        return parts

    def recognize(self, reader):
        table = metadata_table(reader)
        return None if table is None else {n: (spec, None) for n, spec in table.items()}

    def check(self, reader, name, spec, parts, config, data):
        check_lowprec(reader, name, spec, parts, config, data)

    def quantize(self, src, dst, fmt, **options):
        return quantize_lowprec(src, dst, fmt, layout=self.name, **options)

    def convert(self, src, dst, **options):
        if _holds_codes_layout(src, options.get("follow_symlinks", False)):
            return convert_codes(self, src, dst, **options)  # bits moved, as for the engines'
        return convert_layouts(src, dst, self.name, **options)

    def label(self, spec) -> str:
        return spec.format.name

    def lowprec_arrays(self, spec, arrays: dict) -> dict:
        return arrays

    # What convert_layouts asks of its target (NVFP4 / MX / FP8 bits moved into lowprec's).
    def stores_values(self, w) -> bool:
        """Whether the codes of engine weight format ``w`` are stored as values (a cast's)
        rather than U8 elements (every block format's)."""
        return not w.blocks

    def convert_target(self, name, spec, w, bits, scheme, dtype, rule, requantize) -> tuple:
        """``(spec, None)`` of a tensor moved into lowprec's layout (weights only)."""
        if w.per_channel:
            raise CheckpointError(f"{name}: per-channel FP8 has no lowprec layout; "
                                  "keep it in compressed-tensors or dequantize it")
        return make_spec(w.format, spec.shape, dtype, axis=-1 if w.blocks else None,
                         scale_rule=rule if w.mx else None), None

    def convert_texts(self, source, outputs, plans, groups, kept, linear, config) -> dict:
        """A folder's config.json without ``quantization_config`` (no engine config)."""
        return plain_config_texts(source, outputs)

    # What convert_codes asks of its target (a codes layout moved into lowprec's).
    def spec_for(self, fmt, shape, dtype, scale_rule):
        return make_spec(fmt, shape, dtype, axis=-1, scale_rule=scale_rule, layout=self.name)

    def pack(self, mx) -> dict:
        out = {"elements": np.asarray(mx.elements), "scales": np.asarray(mx.scales)}
        if mx.tensor_scale is not None:
            out["scale"] = np.asarray(mx.tensor_scale, np.float32).reshape(())
        return out

    def table(self, specs: dict) -> dict:
        return {METADATA_VERSION_KEY: METADATA_VERSION,
                METADATA_KEY: json.dumps({n: s.to_json(n) for n, s in specs.items()},
                                         separators=(",", ":"))}


def _holds_codes_layout(src, follow_symlinks: bool) -> bool:
    """Whether the checkpoint ``src`` holds tensors of a codes layout
    (:mod:`lowprec.checkpoint._layout_codes`; reads the headers only)."""
    codes = [lay for lay in layouts() if isinstance(lay, CodesLayout)]
    if not codes:
        return False
    source = open_source(src)
    if not follow_symlinks:
        check_symlinks(source)  # refused before any header is read, as the conversion would
    with contextlib.ExitStack() as stack:
        for reader in open_readers(stack, source).values():
            if any(lay.recognize(reader) for lay in codes):
                return True
    return False


LOWPREC = register(LowprecLayout("lowprec", "<name>_elements + <name>_scales (+ <name>_scale), "
                                            "described in the lowprec.tensors metadata"))
