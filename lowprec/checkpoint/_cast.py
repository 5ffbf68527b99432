"""MXFP4 → NVFP4 of a safetensors checkpoint file, keeping every E2M1 code
(:func:`lowprec.mxfp4_to_nvfp4`; ``lowprec convert IN OUT --to nvfp4 --layout LAYOUT``).

The file is read in any layout lowprec reads (an engine layout is first rewritten in
lowprec's, moving bits), its MXFP4 tensors are cast (exact blocks kept code for code, the
others requantized and counted in the report), every other tensor is copied, and the
result is written in ``layout`` (lowprec's, or an engine's through ``convert_checkpoint``).
GGUF files take the same cast through :mod:`lowprec.checkpoint._gguf`.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

from ._errors import CheckpointError
from ._engine_convert import convert_checkpoint
from ._gguf import check_outputs, write_in_layout, write_report
from ._layout import TensorSpec, make_spec
from ._layout_codes import checkpoint_mxarrays
from ._mxfp4_cast import cast_mxfp4
from ._logical import METADATA_KEY, METADATA_VERSION, METADATA_VERSION_KEY, quantized_specs
from ._report import ConversionReport, TensorReport
from ._safetensors import SafetensorsReader


def _as_lowprec(src: str, tmp_dir: str) -> str:
    """``src`` if its quantized tensors are in lowprec's or gpt-oss's layout (cast as
    stored), else a file in ``tmp_dir`` with its bits moved to lowprec's (``convert``)."""
    with SafetensorsReader(src) as r:
        specs = quantized_specs(r)
    if specs and all(isinstance(s, TensorSpec) for s, _ in specs.values()):
        return src
    tmp = os.path.join(tmp_dir, "lowprec.safetensors")
    convert_checkpoint(src, tmp, "lowprec", progress=False)  # an engine layout
    return tmp


def cast_checkpoint(src, dst, layout: str = "lowprec", *, force: bool = False,
                    progress=None, report=None) -> ConversionReport:
    """Casts the MXFP4 tensors of the safetensors file ``src`` to NVFP4 into ``dst`` (in
    ``layout``): exact where E4M3 holds the block scale under one power-of-two tensor scale,
    the other blocks requantized and counted (``report.options["casts"]``)."""
    src = os.fspath(src)
    if not os.path.isfile(src):
        raise CheckpointError(f"{src}: --to nvfp4 casts one .safetensors file (or a GGUF); "
                              "for a sharded folder cast each shard")
    start = time.perf_counter()
    inputs = check_outputs(src, dst, report, force)  # the shard's model folder included
    where = os.path.dirname(os.path.abspath(os.fspath(dst)))
    with tempfile.TemporaryDirectory(dir=where) as d:
        lp = _as_lowprec(src, d)
        quantized = checkpoint_mxarrays(lp)
        casts, reports, entries, data = {}, [], [], {}
        with SafetensorsReader(lp) as r:
            meta = json.loads(r.metadata.get(METADATA_KEY, "{}"))
            stored = set()
            for name, (fmt, shape, load) in quantized.items():
                if fmt != "mxfp4":
                    continue
                mx = load()
                if mx.axis != len(shape) - 1 or shape[-1] % mx.fmt.block_size:
                    raise CheckpointError(f"{name!r}: cast along the last axis only")
                nv, casts[name] = cast_mxfp4(mx, name)
                spec = make_spec("nvfp4", shape, meta.get(name, {}).get("dtype", "F32"),
                                 axis=len(shape) - 1)
                lay = meta.get(name, {}).get("layout", "gpt-oss")  # gpt-oss: no metadata
                old = make_spec("mxfp4", shape, "F32", axis=len(shape) - 1, layout=lay).parts(name)
                stored |= {s for _, s, _, _ in old}
                parts = {"elements": np.asarray(nv.elements), "scales": np.asarray(nv.scales),
                         "scale": np.asarray(nv.tensor_scale, np.float32).reshape(())}
                for role, s, dt, sh in spec.parts(name):
                    entries.append((s, dt, sh))
                    data[s] = parts[role]
                meta[name] = spec.to_json(name)
                c = casts[name]
                reports.append(TensorReport(name, shape, "mxfp4", "nvfp4", 0, spec.nbytes(),
                                            reason=f"{c.exact}/{c.blocks} blocks exact, "
                                                   f"{c.requantized} requantized",
                                            stored_as=tuple(p[1] for p in spec.parts(name)),
                                            exact=c.requantized == 0))
            if not casts:
                raise CheckpointError(f"{src}: no MXFP4 tensor to cast to NVFP4")
            kept = [(n, info.dtype, info.shape) for n, info in r.tensors.items()
                    if n not in stored]
            for n, _, _ in kept:
                data[n] = r.read(n)
            entries = kept + entries
            metadata = {k: v for k, v in r.metadata.items()}
        metadata[METADATA_KEY] = json.dumps(meta)
        metadata[METADATA_VERSION_KEY] = METADATA_VERSION

        write_in_layout(dst, layout, entries, metadata, data, force=force, inputs=inputs,
                        progress=progress, tmp_dir=d)
    rep = ConversionReport(src, os.fspath(dst), "convert",
                           {"to": "nvfp4", "layout": layout,
                            "casts": {n: vars(c) for n, c in casts.items()}},
                           reports, time.perf_counter() - start)
    if report is not None:
        write_report(rep, report, force, inputs)
    return rep
