"""Whole checkpoints in the layouts inference engines load: quantizing a Hugging Face
folder into compressed-tensors or ModelOpt (:func:`quantize_engine_checkpoint`), and moving a
quantized checkpoint between lowprec's, compressed-tensors' and ModelOpt's layouts without
requantizing (:func:`convert_checkpoint`). What each layout stores, and what its loaders
compute, is :mod:`lowprec.checkpoint._engine_layouts`; the schemes (weights and activations)
:mod:`lowprec.checkpoint._engine_schemes`; activation statistics
:mod:`lowprec.checkpoint._calibrate`; the write phase is the one every conversion shares
(:mod:`lowprec.checkpoint._pipeline`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from typing import Optional, Sequence

import numpy as np

from ._calibrate import calibrate, read_amax
from ._chunk import finite_amax
from ._engine_layouts import (
    CT_SCALE_RULES,
    DEFAULT_IGNORE,
    ORIGIN_KEY,
    WEIGHT_FORMATS,
    EngineSpec,
    add_stats,
    exact_reciprocal,
    input_scale,
    layout_arrays,
    quantize_arrays,
    requantize_fp8,
    scheme_bits,
)
from ._engine_schemes import SCHEMES, WEIGHT_SCHEMES, EngineScheme, engine_scheme, fused_groups
from ._errors import CheckpointError
from ._formats import check_scale_rule
from ._layouts import get_layout, is_default, layouts
from ._logical import logical_tensors
from ._pipeline import (
    Outputs,
    check_collisions,
    check_unquantized,
    keep_tensor,
    open_readers,
    plan_shards,
    write_outputs,
)
from ._qconfig import config_keeping, load_json, read_quant_config
from ._report import TensorReport
from ._safetensors import FLOAT_DTYPES, numpy_dtype
from ._source import open_source
from ._stats import ErrorStats



def _parse_schemes(schemes) -> list:
    """``[(compiled pattern, EngineScheme)]`` from ``{pattern: scheme}`` or
    ``["PATTERN=SCHEME", ...]``."""
    items = schemes.items() if isinstance(schemes, dict) else []
    if not isinstance(schemes, dict):
        for s in schemes or ():
            if "=" not in s:
                raise CheckpointError(
                    f"--scheme {s!r}: write PATTERN=SCHEME (e.g. 're:.*mlp.*=NVFP4A16'), or "
                    "give the scheme of every module as --scheme SCHEME / --format SCHEME")
            pat, _, fmt = s.rpartition("=")
            items = [*items, (pat, fmt)]
    return [(_pattern(p, "--scheme"), engine_scheme(f)) for p, f in items]


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


def plan_modules(names_infos, default: Optional[EngineScheme], schemes, ignore) -> tuple:
    """Which Linear weights get which scheme: ``({weight name: EngineScheme}, kept modules)``
    (kept: the other 2-D float ``*.weight`` modules)."""
    chosen, kept = {}, []
    for name, info in names_infos:
        if not name.endswith(".weight") or len(info.shape) != 2 or info.dtype not in FLOAT_DTYPES:
            continue
        module = name[: -len(".weight")]
        scheme = next((s for p, s in schemes if _matches(p, module)), None)
        if info.numel == 0 or any(_matches(p, module) for p in ignore) or (
                scheme is None and (default is None or re.search(DEFAULT_IGNORE, module, re.I))):
            kept.append(module)  # an empty weight has nothing to quantize: kept, and listed
            continue
        scheme = scheme or default
        group = scheme.w.block_size
        if info.shape[1] % group:
            raise CheckpointError(
                f"{name}: {info.shape[1]} input features are not a multiple of the {scheme.name} "
                f"group size {group}; --ignore 're:{re.escape(module)}' keeps it"
            )
        chosen[name] = scheme
    return chosen, kept


def check_fused(schemes: dict) -> None:
    """Refuses a fused layer (:data:`~lowprec.checkpoint._engine_schemes.FUSED_LAYERS`) whose
    modules do not all have one scheme; ``schemes``: every Linear module → its scheme name,
    or None where it is kept in high precision."""
    for group in fused_groups(schemes):
        got = {m: schemes[m] for m in group}
        if len(set(got.values())) > 1:
            listed = ", ".join(f"{m} ({s or 'kept in high precision'})" for m, s in got.items())
            leaves = "|".join(re.escape(m.rpartition(".")[2]) for m in group)
            parent = re.escape(group[0].rpartition(".")[0])
            raise CheckpointError(
                f"{listed}: vLLM loads these as one fused layer and refuses different schemes "
                f"within it; give them one scheme (--scheme 're:{parent}\\.({leaves})=SCHEME') "
                "or keep them all (--ignore)")


def _fused_max(values: dict) -> dict:
    """``values`` (module → number) with every fused layer's members set to the group's
    largest value (one global or input scale per fused layer, as vLLM keeps one)."""
    out = dict(values)
    for group in fused_groups(values):
        top = max(values[m] for m in group)
        out.update(dict.fromkeys(group, top))
    return out


def _activation_amax(source, needed: list, linear_modules: set, calibration, activation_amax,
                     max_seq_length: int, progress) -> dict:
    """``{module: amax}`` of the inputs of the static-scheme modules ``needed``."""
    if not needed:
        if calibration is not None or activation_amax is not None:
            raise CheckpointError(
                "--calibration / --activation-amax give activation statistics, which only the "
                "static schemes (FP8, NVFP4) store; these schemes have none: drop them")
        return {}
    if calibration is not None and activation_amax is not None:
        raise CheckpointError("give activation statistics once: --calibration or "
                              "--activation-amax, not both")
    if calibration is None and activation_amax is None:
        who = needed[0] + (f" (and {len(needed) - 1} more)" if len(needed) > 1 else "")
        raise CheckpointError(
            f"{who}: a static activation scheme (FP8 and NVFP4 store the input's scale, "
            "computed from its largest magnitude); give activation statistics with "
            "--calibration FILE "
            "(token ids or text, run through the model with transformers) or "
            "--activation-amax FILE.json; or choose a weight-only scheme (NVFP4A16, FP8A16, "
            "...) or a dynamic one (FP8_DYNAMIC, MXFP8, MXFP4)")
    if activation_amax is not None:
        if isinstance(activation_amax, dict):
            amax = {str(k): float(v) for k, v in activation_amax.items()}
            where = "activation_amax"
            for m, v in amax.items():
                if not (np.isfinite(v) and v > 0):
                    raise CheckpointError(f"{where}: the amax of {m} is {v!r}; an activation "
                                          "amax must be positive and finite")
        else:
            amax, where = read_amax(activation_amax), str(activation_amax)
        unknown = sorted(set(amax) - linear_modules)
        if unknown:
            raise CheckpointError(
                f"{where}: {unknown[0]} is no Linear module of this checkpoint"
                + (f" (nor {len(unknown) - 1} other names)" if len(unknown) > 1 else "")
                + "; the file is for another model, or names modules another way")
        missing = [m for m in needed if m not in amax]
        if missing:
            raise CheckpointError(
                f"{where}: no amax for {missing[0]}"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                + ", which has a static activation scheme")
    else:
        if source.home is None:
            raise CheckpointError(
                "calibration runs the model through transformers and needs its folder "
                "(config.json beside the weights); give the folder, or --activation-amax")
        amax = calibrate(source.home, calibration, needed, max_seq_length=max_seq_length,
                         progress=bool(progress))
    return {m: amax[m] for m in needed}


def quantize_engine_checkpoint(
    src, dst, format=None, *, layout: str = "compressed-tensors",
    schemes=None, ignore: Sequence[str] = (), scale_rule: Optional[str] = None,
    calibration=None, activation_amax=None, max_seq_length: int = 2048,
    force: bool = False, progress: Optional[bool] = None, report=None,
    follow_symlinks: bool = False, jobs: int = 1,
):
    """Quantizes the Linear weights of a Hugging Face safetensors checkpoint into a layout
    vLLM / SGLang / transformers load, with the bytes that layout's own tool writes (see
    :mod:`lowprec.checkpoint._engine_layouts`).

    Args:
      src, dst: as :func:`~lowprec.checkpoint.quantize_checkpoint` (a folder gives a folder
        whose ``config.json`` gets ``quantization_config``; ModelOpt also gets
        ``hf_quant_config.json``).
      format: the scheme of every Linear weight not matched otherwise: an llm-compressor
        preset — ``"NVFP4A16"``, ``"MXFP4A16"``, ``"MXFP6A16"``, ``"MXFP8A16"`` (weight-only),
        ``"MXFP4"``, ``"MXFP8"``, ``"FP8_DYNAMIC"`` (dynamic activations), ``"NVFP4"``,
        ``"FP8"`` (static activations: need ``calibration`` or ``activation_amax``), any case
        — or ``"FP8A16"`` / ``"FP8A16_CHANNEL"`` (weight-only FP8). ModelOpt: NVFP4,
        NVFP4A16, FP8, FP8_DYNAMIC, one per checkpoint.
      layout: ``"compressed-tensors"`` or ``"modelopt"``.
      schemes: per-module schemes, ``{pattern: scheme}`` or ``["PATTERN=SCHEME", ...]``; a
        pattern is an exact module name or ``re:REGEX`` (matched from the start, as
        compressed-tensors does); the first match wins. Such modules are quantized even if
        the default rule would keep them. The modules vLLM fuses (q/k/v, gate/up, ...) must
        share a scheme.
      ignore: module patterns kept in their original precision (besides the default:
        ``lm_head``, embeddings, norms — :data:`DEFAULT_IGNORE`).
      scale_rule: MX schemes: the E8M0 scale rule (default: the layout's own,
        :data:`~lowprec.checkpoint._engine_layouts.CT_SCALE_RULES`).
      calibration: a token (``.json``) or text file to measure activation amax on, running
        the model with transformers (:func:`~lowprec.checkpoint._calibrate.calibrate`).
      activation_amax: ``{module: amax}`` or a JSON file of it.
      max_seq_length: calibration: tokens per sample at most.

    Returns:
      The :class:`~lowprec.checkpoint.ConversionReport`; its ``options`` hold the written
      ``quantization_config`` and the activation amax used.

    Example:
        >>> import tempfile, numpy as np
        >>> from lowprec.checkpoint import SafetensorsWriter, load_checkpoint
        >>> d = tempfile.mkdtemp()
        >>> w = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
        >>> with SafetensorsWriter(f"{d}/m.safetensors", [("fc.weight", "F32", w.shape)]) as f:
        ...     f.write("fc.weight", w)
        >>> rep = quantize_engine_checkpoint(f"{d}/m.safetensors", f"{d}/q.safetensors",
        ...                                  "NVFP4A16")
        >>> rep.tensors[0].stored_as
        ('fc.weight_packed', 'fc.weight_scale', 'fc.weight_global_scale')
        >>> float(np.abs(load_checkpoint(f"{d}/q.safetensors")["fc.weight"] - w).max()) < 0.1
        True
    """
    start = time.perf_counter()
    lay = get_layout(layout)
    if not hasattr(lay, "encode_fp8"):
        engine = [l.name for l in layouts() if hasattr(l, "encode_fp8")]
        raise CheckpointError(
            f"unknown engine layout {layout!r}; choose one of: {', '.join(engine)}")
    default, parsed, rules = _scheme_options(lay, format, schemes, scale_rule)
    ignore_p = [_pattern(p, "--ignore") for p in ignore]
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        check_unquantized(source, readers)
        chosen, kept_all, infos = {}, [], {}
        for rel, reader in readers.items():
            c, kept = plan_modules(reader.tensors.items(), default, parsed, ignore_p)
            chosen.update(c)
            kept_all += kept
            infos.update({n: (rel, reader.tensors[n]) for n in c})
        if not chosen:
            raise CheckpointError(f"{source.given}: no Linear weight ([out, in] '*.weight') to "
                                  "quantize with these options")
        modules = {n[: -len(".weight")]: s.name for n, s in chosen.items()}
        check_fused({**dict.fromkeys(kept_all), **modules})
        wide = _tensor_amax(readers, chosen, infos, layout)
        needed = sorted(m for m, s in modules.items() if SCHEMES[s].inputs == "static")
        linear = {n[: -len(".weight")] for r in readers.values() for n, i in r.tensors.items()
                  if n.endswith(".weight") and len(i.shape) == 2}
        act = _activation_amax(source, needed, linear, calibration, activation_amax,
                               max_seq_length, progress)
        act_used = _fused_max(act)

        groups = {}

        def plan_file(reader):
            for info in reader.tensors.values():
                scheme = chosen.get(info.name)
                if scheme is None:
                    yield (info, None, None, None, None), [(info.name, info.dtype, info.shape)]
                    continue
                module = info.name[: -len(".weight")]
                d = lay.fp8_scale_dtype(scheme.w, info.dtype)
                spec = EngineSpec(scheme.weights, layout, tuple(info.shape), info.dtype,
                                  rules.get(scheme.weights), scale_dtype=d, input_dtype=d,
                                  inputs=scheme.inputs if scheme.inputs == "static" else None)
                groups.setdefault(scheme.name, []).append(module)
                yield ((info, spec, scheme, wide.get(module), act_used.get(module)),
                       [(st, dt, shp) for _, st, dt, shp in spec.parts(info.name)])

        plans = plan_shards(readers, plan_file, "--ignore the module of one of them")
        groups = {s: sorted(m) for s, m in groups.items()}
        qconfig, texts = lay.config(source, outputs, groups, kept_all)

        def convert(reader, writer, item, bar, runner):
            info, spec, scheme, amax, act_amax = item
            bar.set_postfix_str(info.name[-40:], refresh=False)
            if spec is None:
                return keep_tensor(reader, writer, info.name, bar, "kept")
            return _quantize_engine_tensor(reader, writer, info, spec, scheme, amax, act_amax,
                                           bar, runner)

        options = {"layout": layout, "format": None if default is None else default.name,
                   "schemes": list(schemes or ()), "ignore": list(ignore),
                   "quantization_config": qconfig}
        if act:
            options["activation_amax"] = act

        def metadata(plan):
            return lay.table({i.name: s for i, s, *_ in plan if s is not None})

        return write_outputs(source, outputs, readers, plans, "quantize", options, start,
                             force=force, progress=progress, metadata=metadata,
                             convert=convert, texts=texts)


def _scheme_options(lay, format, schemes, scale_rule) -> tuple:
    """``(default scheme, [(pattern, scheme)], {MX weights: scale rule})`` of
    :func:`quantize_engine_checkpoint`'s options, refused where the layout cannot hold them
    or a scale rule is given without an MX scheme."""
    if format is not None and not isinstance(format, (str, EngineScheme)):
        format = getattr(format, "name", format)  # a lowprec format object: by its name
    default = None if format is None else engine_scheme(format)
    parsed = _parse_schemes(schemes)
    used = {default} | {s for _, s in parsed}
    used.discard(None)
    if not used:
        raise CheckpointError(
            "give a scheme (--scheme SCHEME or --format SCHEME) or per-module schemes "
            "(--scheme PATTERN=SCHEME)")
    lay.check_schemes(used)
    if scale_rule is not None and not any(s.w.mx for s in used):
        raise CheckpointError(
            f"--scale-rule / scale_rule applies to the MX schemes (MXFP4, MXFP6, MXFP8), not "
            f"{', '.join(sorted(s.name for s in used))}: NVFP4's scales follow its own rule and "
            "FP8's scale is amax / 448; drop it")
    given_rule = None if scale_rule is None else check_scale_rule(scale_rule)
    rules = {w: given_rule or check_scale_rule(CT_SCALE_RULES[w]) for w in CT_SCALE_RULES}
    return default, parsed, rules


def _tensor_amax(readers, chosen: dict, infos: dict, layout: str) -> dict:
    """``{module: amax}`` of the weights with a tensor-wide scale (a first pass); NVFP4's
    global scale is one per fused layer, so its members share the group's largest."""
    wide = {}
    for name, scheme in chosen.items():
        if scheme.w.tensor_scale:
            rel, info = infos[name]
            spec = EngineSpec(scheme.weights, layout, tuple(info.shape))
            wide[name[: -len(".weight")]] = max(
                (np.float32(finite_amax(readers[rel].read_rows(name, r0, r1)))
                 for r0, r1 in spec.row_blocks()), default=np.float32(0))
    nvfp4 = {m: a for m, a in wide.items() if chosen[m + ".weight"].w.global_scale}
    wide.update(_fused_max(nvfp4))
    return wide


def _quantize_engine_tensor(reader, writer, info, spec, scheme, amax, act_amax, bar,
                            runner) -> TensorReport:
    """Quantizes one Linear weight a block of rows at a time on the runner's workers, with
    its layout's writer rules, each part's rows written at their place; its report."""
    parts = spec.parts(info.name)

    def piece(block):
        r0, r1 = block
        x = reader.read_rows(info.name, r0, r1)
        arrays = quantize_arrays(x, spec.scheme, spec.layout, dtype=info.dtype,
                                 scale_rule=spec.scale_rule, amax=amax)
        if spec.inputs == "static":
            arrays["input_scale"] = input_scale(act_amax, spec.scheme, spec.layout, info.dtype)
        for role, stored, _, _ in parts:
            if not spec.is_whole(role):
                writer.write_rows(stored, r0, arrays[role])
            elif r0 == 0:
                writer.write(stored, arrays[role])
        piece_stats = ErrorStats()
        add_stats(piece_stats, x, arrays, dataclasses.replace(spec, shape=x.shape))
        return piece_stats, x.nbytes

    stats = ErrorStats()

    def done(block, result):
        stats.merge(result[0])
        bar.update(result[1])

    runner.run(piece, list(spec.row_blocks()), done)
    what = (f"{spec.layout} {scheme.name}" + (" (weight-only)" if scheme.weight_only else
                                             f" ({scheme.inputs} activations)"))
    return TensorReport(
        info.name, info.shape, info.dtype, spec.label, info.nbytes, spec.nbytes(),
        reason=what, scale_rule=spec.scale_rule,
        sqnr_db=stats.sqnr_db, max_abs_err=stats.max_abs, max_rel_err=stats.max_rel,
        nonfinite=stats.nonfinite, stored_as=tuple(p[1] for p in parts), exact=stats.exact)


def config_texts(source, outputs, qconfig: Optional[dict], extra: dict) -> dict:
    """``{relative path: text}`` replacing or adding the folder's config files (a single-file
    output has none: the config is in the report)."""
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
            raise CheckpointError(f"{source.path('config.json')}: cannot read it as JSON "
                                  "(nested too deeply)") from None
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
        outputs.add_file(rel)
    return texts


def plain_config_texts(source, outputs, config=None, kept=(), decoded=()) -> dict:
    """For a dequantized folder: ``config.json`` without ``quantization_config`` (else the
    engines would look for quantized tensors) and no ``hf_quant_config.json`` — unless
    modules ``kept`` stay quantized (``keep_undecodable``): then the config keeps their part,
    and the ``decoded`` modules are listed as kept in high precision
    (:func:`~lowprec.checkpoint._qconfig.config_keeping`)."""
    q, hf = config_keeping(config, kept, decoded) if kept and config is not None else (None, None)
    extra = {}
    if source.is_folder and ("hf_quant_config.json" in source.others or hf is not None):
        extra["hf_quant_config.json"] = None if hf is None else json.dumps(hf, indent=2) + "\n"
    if q is None:
        texts = config_texts(source, outputs, None, {})
        texts.update(extra)
        return texts
    return config_texts(source, outputs, q, extra)


# -- convert ------------------------------------------------------------------------------
_BY_PARTS = {(w, i): n for n, s in SCHEMES.items() for w, i in [(s.weights, s.inputs)]}


def source_scheme(name: str, spec, config) -> EngineScheme:
    """The scheme a stored tensor is in: its weights, and its activations as its config says
    (a file without a config: static where it stores an input scale, else weight-only)."""
    if not isinstance(spec, EngineSpec):  # lowprec's or gpt-oss's layout: weights only
        return None
    module = name[: -len(".weight")]
    group = config.group_of(module) if config is not None and config.readable else None
    inputs = group.inputs if group is not None else spec.inputs
    if inputs == "static" and spec.inputs != "static":
        raise CheckpointError(
            f"{name}: its config gives it static input activations but no input scale is "
            "stored beside it; the checkpoint is incomplete (an engine would run with an "
            "uninitialized scale)")
    found = _BY_PARTS.get((spec.scheme, inputs))
    if found is None:
        raise CheckpointError(
            f"{name}: {spec.format.name} weights with {inputs or 'no'} input activation "
            f"quantization ({group.what if group else 'no config'}) are no scheme lowprec "
            f"writes ({', '.join(SCHEMES)}); dequantize it instead")
    return SCHEMES[found]


_CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _model_dtype(source) -> Optional[str]:
    """The model dtype ``config.json`` names (``dtype``; ``torch_dtype`` before transformers
    5), for tensors whose file does not record their original dtype (other tools' files)."""
    path = os.path.join(source.home, "config.json") if source.home else None
    if path is None or not os.path.isfile(path):
        return None
    config = load_json(path)
    return _CONFIG_DTYPES.get(config.get("dtype", config.get("torch_dtype")))


def _original_dtype(spec, origin: dict, model_dtype: Optional[str]) -> str:
    """A quantized tensor's original (model) dtype: as lowprec recorded it (its own layout's
    metadata, or ``lowprec.origin``), else what a compressed-tensors FP8 scale is stored in
    (llm-compressor's model dtype), else the config's, else bfloat16."""
    if "dtype" in origin or not isinstance(spec, EngineSpec):
        return origin.get("dtype", spec.dtype)
    if spec.lay.scales_in_model_dtype and spec.scale_dtype in ("BF16", "F16"):
        return spec.scale_dtype  # an FP8 scale (the only kind not stored in float32)
    return model_dtype or spec.dtype


def _move_input_scale(name, value, src: EngineSpec, target: EngineSpec, requantize: bool):
    """The stored input scale of ``target`` from ``src``'s (``value``): FP8's is the scale
    itself in both layouts (widened exactly); NVFP4's is 2688 / amax in compressed-tensors and
    amax / 2688 in ModelOpt, moved by a float32 reciprocal when it maps back exactly (else
    refused, or with ``requantize`` taken and counted). Returns ``(array, changed)``."""
    v = np.float32(np.asarray(value, np.float32).reshape(-1)[0])
    flip = src.w.global_scale and \
        src.lay.reciprocal_global_scale != target.lay.reciprocal_global_scale
    changed = 0
    if flip:
        with np.errstate(divide="ignore", over="ignore"):
            r = np.float32(np.float32(1) / v)
        if not (np.isfinite(r) and np.float32(1) / r == v):
            if not requantize:
                raise CheckpointError(
                    f"{name}: its NVFP4 input scale {float(v)!r} has no exact reciprocal for "
                    f"the {target.layout} layout; --requantize takes the nearest (and counts "
                    "it as changed)")
            changed = 1
        v = r
    d = target.input_dtype if target.lay.scales_in_model_dtype else "F32"
    if d != "F32" and not src.lay.scales_in_model_dtype:  # FP8's, in the model dtype (as the weight's)
        if np.float32(np.asarray(v).astype(numpy_dtype(d))) != v:
            if not requantize:
                raise CheckpointError(
                    f"{name}: its FP8 input scale {str(v)} is no {d} value; compressed-tensors "
                    f"stores it in the model dtype ({d}); --requantize takes the nearest (and "
                    "counts it as changed)")
            changed = 1
    shape = target.lay.scalar_shape
    return np.asarray(v, np.float32).astype(numpy_dtype(d)).reshape(shape), changed


def _check_fused_scales(plans: dict, layout: str) -> None:
    """Converting to an engine layout: refuses NVFP4 fused layers whose members do not share
    one tensor scale (vLLM keeps one for the fused layer)."""
    ts = {}
    for plan, _ in plans.values():
        for name, spec, parts, target, scheme, bits in plan:
            if target is not None and scheme is not None and \
                    scheme.w.global_scale and "ts" in bits:
                ts[name[: -len(".weight")]] = float(bits["ts"])
    for group in fused_groups(ts):
        values = {ts[m] for m in group}
        if len(values) > 1:
            raise CheckpointError(
                f"{', '.join(group)}: NVFP4 tensor scales {sorted(values)} differ, but vLLM "
                f"loads these as one fused layer with one scale, which would decode all but "
                f"one of them wrongly; quantize the original weights with lowprec quantize "
                f"--layout {layout} (which gives a fused layer one scale)")


def convert_checkpoint(src, dst, layout: str, *, requantize: bool = False, force: bool = False,
                       progress: Optional[bool] = None, report=None,
                       follow_symlinks: bool = False, jobs: int = 1):
    """Rewrites a quantized checkpoint (lowprec, compressed-tensors or ModelOpt layout) in
    another of these layouts, moving the stored bits: no requantization, every decoded value
    unchanged. Refused, naming the tensor, where the target cannot hold the bits exactly
    (lowprec has no per-channel FP8, ModelOpt holds NVFP4 and FP8 only, an NVFP4 tensor scale
    without an exact reciprocal, a float32 FP8 scale moved to compressed-tensors that is no
    value of the model dtype, which compressed-tensors stores it in — unless ``requantize``,
    which re-encodes such a tensor from its decoded values against the nearest scale and
    reports how many values changed: see :mod:`lowprec.checkpoint._engine_layouts`). Activation schemes move with the weights
    (input scales included); lowprec's own layout holds weights only. Tensors that are not
    quantized and the folder's other files are copied; ``config.json``'s
    ``quantization_config`` (and ModelOpt's ``hf_quant_config.json``) are rewritten for the
    target. The original dtype and scale rule of each tensor travel in the safetensors
    metadata (``lowprec.origin``), so lowprec → compressed-tensors → lowprec gives back the
    same tensor files byte for byte.

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
    options = {k: v for k, v in dict(requantize=requantize, force=force, progress=progress,
                                     report=report, follow_symlinks=follow_symlinks,
                                     jobs=jobs).items()
               if not is_default(v, _CONVERT_DEFAULTS[k])}
    return get_layout(layout, writes="convert").convert(src, dst, **options)


#: The defaults of :func:`convert_checkpoint`'s options (a layout is handed the set ones).
_CONVERT_DEFAULTS = dict(requantize=False, force=False, progress=None, report=None,
                         follow_symlinks=False, jobs=1)


def convert_layouts(src, dst, layout: str, *, requantize: bool = False, force: bool = False,
                    progress: Optional[bool] = None, report=None,
                    follow_symlinks: bool = False, jobs: int = 1):
    """:func:`convert_checkpoint` into a layout that moves NVFP4, MX and FP8 bits (its
    ``convert``: lowprec's, compressed-tensors', ModelOpt's). The target layout says what is
    its own (``convert_target``: the spec of a moved tensor, or a refusal; ``table``: its
    metadata; ``convert_texts``: its config files; how it stores tensor-wide scales); this
    plans, checks exactness up front and moves the bits a block of rows at a time."""
    start = time.perf_counter()
    lay = get_layout(layout)
    if not hasattr(lay, "convert_target"):
        names = [l.name for l in layouts() if l.converts and hasattr(l, "convert_target")]
        raise CheckpointError(f"unknown layout {layout!r} for convert; choose one of: "
                              f"{', '.join(names)}")
    source = open_source(src)
    outputs = Outputs(source, dst, report, force, follow_symlinks, jobs)
    config = read_quant_config(source.home)
    model_dtype = _model_dtype(source)
    with contextlib.ExitStack() as stack:
        readers = open_readers(stack, source)
        plans, groups, kept, found_in, linear = {}, {}, [], set(), {}
        for rel, reader in readers.items():
            origin = {}
            with contextlib.suppress(ValueError, TypeError, RecursionError):
                origin = dict(json.loads(reader.metadata.get(ORIGIN_KEY, "{}")))
            plan, entries = [], []
            found = logical_tensors(reader, config)
            found_in |= {spec.layout for spec, _ in found.specs.values()}
            if found_in == {lay.name}:
                raise CheckpointError(f"{reader.path}: already in the {layout} layout; "
                                      "nothing to convert")
            for name, spec, parts in found:
                if spec is None:
                    info = reader.tensors[name]
                    entries.append((name, info.dtype, info.shape))
                    plan.append((name, None, None, None, None, None))
                    if name.endswith(".weight") and len(info.shape) == 2:
                        kept.append(name[: -len(".weight")])
                        linear[name[: -len(".weight")]] = None
                    continue
                o = origin.get(name) if isinstance(origin.get(name), dict) else {}
                target, scheme, bits = _move_target(reader, name, spec, parts, lay, o,
                                                    model_dtype, config, requantize)
                if scheme is not None:
                    groups.setdefault(scheme.name, []).append(name[: -len(".weight")])
                    linear[name[: -len(".weight")]] = scheme.name
                entries += [(st, dt, shp) for _, st, dt, shp in target.parts(name)]
                plan.append((name, spec, parts, target, scheme, bits))
            check_collisions(entries, reader.path, "rename one of them in the input")
            plans[rel] = (plan, entries)
        if not found_in:
            raise CheckpointError(
                f"{source.given}: holds no quantized tensors; nothing to convert (lowprec "
                f"quantize --layout {layout} quantizes a high-precision checkpoint)")
        texts = lay.convert_texts(source, outputs, plans, groups, kept, linear, config)
        for plan, _ in plans.values():  # the scales were needed for the checks only
            for i, item in enumerate(plan):
                plan[i] = item[:5]

        def metadata(plan):
            return lay.table({n: t for n, s, _, t, _ in plan if t is not None})

        def convert(reader, writer, item, bar, runner):
            name, spec, parts, target, scheme = item
            if spec is None:
                return keep_tensor(reader, writer, name, bar, "not quantized")
            return _move_tensor(reader, writer, name, spec, parts, target, scheme, lay,
                                requantize, bar, runner)

        return write_outputs(source, outputs, readers, plans, "convert",
                             {"layout": layout, "requantize": requantize},
                             start, force=force, progress=progress, metadata=metadata,
                             convert=convert, texts=texts)


def _move_tensor(reader, writer, name, spec, parts, target, scheme, lay, requantize, bar,
                 runner) -> TensorReport:
    """Moves one tensor's bits into ``target`` (of layout ``lay``) a block of rows at a
    time on the runner's workers (re-encoded only where ``requantize`` allows it, counted);
    its report."""
    layout = lay.name
    tparts = target.parts(name)
    rows = EngineSpec(_weights_of(spec), spec.layout, tuple(spec.shape))
    # a float32 FP8 scale stored in the model dtype (ct_fp8_scale_dtype)
    refit = getattr(target, "scale_dtype", "F32") != "F32" and \
        not get_layout(spec.layout).scales_in_model_dtype

    def piece(block):  # move the bits a block of rows at a time, on a worker
        r0, r1 = block
        changed = 0
        if isinstance(spec, EngineSpec):
            got = spec.read_rows(reader, parts, r0, r1)
        else:
            got = {role: reader.read(stored) if role == "scale"
                   else reader.read_rows(stored, r0, r1) for role, stored, _, _ in parts}
        w, bits = scheme_bits(name, spec, got, layout, requantize)
        src_input = bits.pop("input_scale", None)
        out, n = layout_arrays(name, w, bits, lay, requantize)
        if refit:
            out["values"], out["scale"], n = requantize_fp8(
                out["values"], out["scale"], target.scale_dtype)
        changed += n
        if getattr(target, "inputs", None) == "static":
            out["input_scale"], moved = _move_input_scale(name, src_input, spec, target,
                                                          requantize)
            if r0 == 0:
                changed += moved
        for role, stored, _, _ in tparts:
            if not rows.is_whole(role):
                writer.write_rows(stored, r0, out[role])
            elif r0 == 0:
                writer.write(stored, out[role])
        return changed

    counts = []
    runner.run(piece, list(rows.row_blocks()), lambda block, n: counts.append(n))
    changed = sum(counts)
    before = sum(reader.tensors[p[1]].nbytes for p in parts)
    bar.update(before)
    label = getattr(target, "label", target.format.name)
    reason = f"moved from {spec.layout}"
    if scheme is not None:
        reason += f" ({scheme.name})"
    if getattr(spec, "inputs", None) == "static" and \
            getattr(target, "inputs", None) != "static":
        reason += (f"; its input scale is not kept ({lay.name}'s layout holds weights "
                   "only)")
    if changed:
        why = ("an NVFP4 scale without an exact reciprocal"
               if WEIGHT_SCHEMES[_weights_of(target)].global_scale
               else f"an FP8 scale rounded to {target.scale_dtype}")
        reason += f"; requantized: {changed} decoded value(s) changed ({why})"
    return TensorReport(name, spec.shape, target.dtype, label,
                        before, target.nbytes(), reason=reason,
                        scale_rule=target.scale_rule, stored_as=tuple(p[1] for p in tparts),
                        changed=changed if requantize else None)


def _move_target(reader, name, spec, parts, lay, origin: dict, model_dtype, config,
                 requantize: bool) -> tuple:
    """``(target spec, scheme or None, bits)`` of a tensor moved into layout ``lay``: its
    tensor-wide parts and scales read (enough to check exactness up front), the target's
    ``convert_target`` asked, an inexact reciprocal refused."""
    arrays = {role: reader.read(stored) for role, stored, _, _ in parts
              if role in ("scale", "scales", "global_scale")}
    weights, bits = scheme_bits(name, spec, arrays, lay.name, requantize)
    w = WEIGHT_SCHEMES[weights]
    dtype = _original_dtype(spec, origin, model_dtype)
    rule = origin.get("scale_rule", spec.scale_rule)
    scheme = source_scheme(name, spec, config)
    if w.global_scale and lay.reciprocal_global_scale and "ts" in bits \
            and "gs" not in bits and not requantize:
        exact_reciprocal(name, bits["ts"], bits["scales"], lay.name, True)
    target, scheme = lay.convert_target(name, spec, w, bits, scheme, dtype, rule, requantize)
    return target, scheme, bits


def check_engine_fused(plans: dict, linear: dict, layout: str) -> None:
    """Converting to an engine layout: refuses fused layers of several schemes, or of NVFP4
    tensor scales that differ (:func:`check_fused`, :func:`_check_fused_scales`)."""
    check_fused(linear)
    _check_fused_scales(plans, layout)


def _weights_of(spec) -> str:
    """The weight format (:data:`WEIGHT_FORMATS` key) of a stored tensor's spec."""
    if isinstance(spec, EngineSpec):
        return spec.scheme
    for w, fmt in WEIGHT_FORMATS.items():
        if fmt == spec.format:
            return w
    raise AssertionError(spec)

