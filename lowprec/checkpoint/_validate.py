"""What a reader checks before it decodes anything: it trusts nothing it reads.

Every reader of the package (dequantize, convert, load_checkpoint; inspect, which decodes
nothing, all but the stored scales) walks a file through
:func:`lowprec.checkpoint._logical.logical_tensors`, which calls this module once per file:

* **Each quantized tensor, by its layout** (the layout's ``check``,
  :class:`~lowprec.checkpoint.Layout`, calling the functions here): its
  stored parts have the dtypes and shapes its format needs (checked where the parts are
  named, :func:`~lowprec.checkpoint._logical.quantized_specs`); it agrees with the
  checkpoint's quantization config (:mod:`lowprec.checkpoint._qconfig`): the config's
  ``quant_method`` is its layout's, a group claims its module, and that group's weights are
  its scheme (a file that says MXFP4 while its tensors are NVFP4 is refused, naming both);
  and, for the readers that decode, its stored scales: per-tensor, per-channel and global
  scales positive and finite, NVFP4's E4M3 block scales not negative, and the factor each
  block's values are multiplied by (tensor scale × block scale, or block scale / global
  scale) finite. An E8M0 block scale has no sign and every code is a value (0xFF: a block
  that held NaN or inf, as NVFP4's E4M3 0x7F is in lowprec's writers: decoded as NaN and
  counted in the report).
* **Modules lowprec cannot decode**: stored tensors no layout here claims but whose names say
  they are quantized parameters (``*.weight_packed``, ``*.weight_shape``, ``*.weight_zero_point``,
  ``*.weight_g_idx``, ``*.weight_scale_inv``, a ``weight_scale`` beside a weight that is not a
  float, GPTQ/AWQ's ``qweight``/``qzeros``, bitsandbytes' ``SCB``/``absmax``...). Decoding
  around them would give a half-decoded model (their codes passed off as weights, or the
  weights missing). They are refused with one line naming the first module, what it holds
  and, where its names are those of a layout lowprec reads, which parts do not fit it — or,
  with ``keep_undecodable``, kept as stored (a dequantized folder keeps their part of the
  config), unless the config gives them a scheme lowprec decodes (then the file is damaged).
* **The config as a whole**: a ``quant_method`` lowprec does not read is refused; a module
  that a group targets by name or pattern but whose weight is stored in high precision is a
  contradiction.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import ml_dtypes
import numpy as np

from ._chunk import check_scales
from ._engine_layouts import EngineSpec
from ._errors import CheckpointError
from ._layouts import get_layout
from ._qconfig import QuantConfig
from ._safetensors import FLOAT_DTYPES

#: Parameter names (the last component of a stored tensor's name) that only quantized
#: weights have; ``weight_scale`` counts where the module's weight is not a float.
QUANTIZED_PARAMS = frozenset({
    "weight_packed", "weight_shape", "weight_zero_point", "weight_g_idx", "weight_global_scale",
    "weight_scale_2", "weight_scale_inv", "qweight", "qzeros", "g_idx", "SCB", "weight_format",
    # AWQ / SmoothQuant (ModelOpt): activations are multiplied by it, the weights were
    # divided by it; decoded alone, such weights would be wrong.
    "pre_quant_scale",
    # activation scales: beside a weight lowprec reads they are claimed with it
    "input_scale", "input_global_scale", "input_zero_point",
})
#: bitsandbytes 4-bit state, stored as ``M.weight.<name>``.
_BNB_STATE = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "quant_state.")
_SCALE_CHUNK = 1 << 22  # bytes of block scales read at a time
_READS = ("lowprec's own (its metadata), gpt-oss MXFP4 (*_blocks/*_scales), compressed-tensors "
          "NVFP4, MXFP4, MXFP6, MXFP8 and FP8 per tensor or channel, ModelOpt NVFP4 and FP8 "
          "per tensor or channel")


@dataclasses.dataclass(frozen=True)
class Undecodable:
    """A module whose stored tensors are quantized in a way lowprec does not decode."""

    module: str
    stored: tuple  # (name, dtype, shape) of its tensors
    why: str
    keepable: bool  # False: the config gives it a scheme lowprec decodes (a damaged file)

    def describe(self) -> str:
        held = ", ".join(f"{n} {dt} {list(shp)}" for n, dt, shp in self.stored)
        return f"module {self.module} ({held}): {self.why}"


def layout_of(spec) -> str:
    """The layout a recognized tensor is stored in: ``"lowprec"``, ``"gpt-oss"``,
    ``"compressed-tensors"`` or ``"modelopt"``."""
    return spec.layout


def _module(name: str) -> str:
    for key in _BNB_STATE:
        i = name.find(f".weight.{key}")
        if i >= 0:
            return name[:i]
    return name.rsplit(".", 1)[0] if "." in name else name


def _quantized_param(reader, name: str) -> bool:
    """Whether stored tensor ``name`` (claimed by no layout) is a quantized weight's part."""
    param = name.rsplit(".", 1)[-1]
    if param in QUANTIZED_PARAMS or any(f".weight.{k}" in name for k in _BNB_STATE):
        return True
    module = _module(name)
    if param == "weight_scale":  # beside a weight that is not a float (or none)
        weight = reader.tensors.get(f"{module}.weight")
        return weight is None or weight.dtype not in FLOAT_DTYPES
    if param == "scales":  # GPTQ / AWQ's, beside qweight
        return f"{module}.qweight" in reader.tensors
    if param == "weight":  # FP8 / integer codes with a scale of their own beside them
        info = reader.tensors[name]
        return info.dtype not in FLOAT_DTYPES and any(
            f"{name}{s}" in reader.tensors for s in ("_scale", "_scale_inv", "_scale_2"))
    for suffix, partner in (("_blocks", "_scales"), ("_elements", "_scales")):
        if name.endswith(suffix) and name[: -len(suffix)] + partner in reader.tensors:
            return True  # gpt-oss / lowprec parts that fit no layout
    return False


def _candidates(names: set, hint: Optional[str]) -> list:
    """The (scheme, layout) a module holding ``names`` (its parameters) would be in."""
    if "weight_packed" in names:
        out = [("nvfp4", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
               ("mxfp6", "compressed-tensors")]
    elif "weight_scale_2" in names:
        out = [("nvfp4", "modelopt")]
    elif "weight" in names and "weight_scale" in names:
        out = [("mxfp8", "compressed-tensors"), ("fp8", "compressed-tensors"),
               ("fp8_channel", "compressed-tensors"), ("fp8", "modelopt"),
               ("fp8_channel", "modelopt")]
    else:
        return []
    return [c for c in out if hint is None or c[0] == hint] or out


def _implied_shape(probe_parts, infos) -> Optional[tuple]:
    """[out, in] of a module's weight from its stored block scales (else its codes), read
    against ``probe_parts``: the parts of its layout for 4096 input features."""
    by_role = {role: (stored, shp) for role, stored, _, shp in probe_parts}
    for role in ("scales", "elements", "values"):
        if role not in by_role:
            continue
        stored, shp = by_role[role]
        info = infos.get(stored)
        if info is None or len(info.shape) != 2:
            continue
        return (info.shape[0], info.shape[1] * 4096 // shp[1])
    return None


def _diagnosis(module: str, infos: dict, hint: Optional[str]) -> Optional[str]:
    """Which stored parts of ``module`` do not fit the layout lowprec reads that its names
    are closest to (``hint``: the scheme its config gives it), or None."""
    weight = f"{module}.weight"
    params = {n.rsplit(".", 1)[-1] for n in infos}
    best = None
    for scheme, layout in _candidates(params, hint):
        probe = EngineSpec(scheme, layout, (128, 4096)).parts(weight)
        shape = _implied_shape(probe, infos)
        if shape is None:
            continue
        spec = EngineSpec(scheme, layout, shape)
        wrong = []
        for _, stored, dt, shp in spec.parts(weight):
            info = infos.get(stored)
            if info is None:
                wrong.append(f"{stored} is missing (needs {dt} {list(shp)})")
            elif info.dtype != dt or tuple(info.shape) != tuple(shp):
                wrong.append(f"{stored} is {info.dtype} {list(info.shape)} (needs {dt} "
                             f"{list(shp)})")
        if best is None or len(wrong) < len(best[1]):
            best = (spec, wrong)
    if best is None or not best[1]:
        return None
    spec, wrong = best
    return f"read as {spec.label} of shape {list(spec.shape)}: {'; '.join(wrong)}"


def undecodable_modules(reader, claimed, config: Optional[QuantConfig]) -> dict:
    """``{module: Undecodable}`` for the modules of ``reader`` holding quantized parameters
    that no layout lowprec reads claims (``claimed``: the stored names that one does)."""
    flagged, members = set(), {}
    for name, info in reader.tensors.items():
        if name in claimed:
            continue
        module = _module(name)
        if not name.endswith(".bias"):
            members.setdefault(module, {})[name] = info
        if _quantized_param(reader, name):
            flagged.add(module)
    out = {}
    for module in sorted(flagged):
        infos = members[module]
        group = None
        if config is not None and config.readable:
            group = config.group_of(module)
        hint = group.scheme if group is not None else None
        diagnosis = _diagnosis(module, infos, hint)
        if group is not None and group.scheme is not None:
            why = (f"{config.where} gives it group {group.label}, but its tensors do not fit "
                   + (diagnosis or "that layout"))
            keepable = False
        elif group is not None:
            why = f"{config.where} gives it group {group.label}, a scheme lowprec does not decode"
            keepable = True
        else:
            why = ("quantized in a layout lowprec does not decode"
                   + (f" ({diagnosis})" if diagnosis else "") + f"; it reads {_READS}")
            keepable = True
        stored = tuple((n, i.dtype, tuple(i.shape)) for n, i in sorted(infos.items()))
        out[module] = Undecodable(module, stored, why, keepable)
    return out


def refuse_undecodable(path: str, undecodable: dict, keep: bool) -> None:
    """Raises for the modules of ``undecodable`` that may not be kept (all of them unless
    ``keep``), naming the first, in one line."""
    bad = [u for u in undecodable.values() if not (keep and u.keepable)]
    if not bad:
        return
    first = bad[0]
    more = ""
    if len(bad) > 1:
        names = ", ".join(u.module for u in bad[1:4])
        more = f" (and {len(bad) - 1} more: {names}{', ...' if len(bad) > 4 else ''})"
    if first.keepable:
        fix = ("decoding the rest would give a half-decoded model: dequantize with "
               "--keep-undecodable (keep_undecodable=True) keeps such modules as stored, with "
               "their part of the config, or start from the unquantized checkpoint")
    else:
        fix = "the file is damaged or not in the layout its config says"
    raise CheckpointError(f"{path}: {first.describe()}{more}; {fix}")


# -- the checks of one quantized tensor, by layout ------------------------------------------
def _config_agrees(reader, name, spec, config: Optional[QuantConfig], methods,
                   scheme: Optional[str]) -> None:
    """Refuses a tensor stored in a layout the config does not say (``methods``: the
    ``quant_method`` values that describe it), or whose module the config ignores, gives no
    group, or gives another scheme than ``scheme`` (a :class:`~._qconfig.Group`'s)."""
    if config is None:
        return
    label = getattr(spec, "label", None) or f"{spec.format.name} ({spec.layout})"
    if config.method not in methods:
        raise CheckpointError(
            f"{reader.path}: {name} is stored as {label}, but {config.where} says quant_method "
            f"{config.method!r}; the config and the tensors disagree")
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    if config.ignored(module):
        raise CheckpointError(
            f"{reader.path}: {name} is stored as {label}, but {config.where} lists {module} "
            "as kept in high precision (ignore); the config and the tensors disagree")
    group = config.group_of(module)
    if group is None:
        raise CheckpointError(
            f"{reader.path}: {name} is stored as {label}, but no group of {config.where} "
            "targets it; the config and the tensors disagree")
    if group.scheme != scheme:
        says = group.scheme or "a scheme lowprec does not decode"
        raise CheckpointError(
            f"{reader.path}: {config.where} says group {group.label} is {says}, but {name} is "
            f"stored as {label}; the config and the tensors disagree")
    stored = getattr(spec, "inputs", None) == "static"
    if group.inputs == "static" and not stored:
        raise CheckpointError(
            f"{reader.path}: {config.where} gives {module} static input activations (group "
            f"{group.label}), but no input scale is stored beside {name}; an engine would run "
            "it with an uninitialized scale: the checkpoint is incomplete")
    if stored and group.inputs in (None, "dynamic"):
        raise CheckpointError(
            f"{reader.path}: {name} has a stored input scale, but {config.where} gives its "
            f"group {group.label} {group.inputs or 'no'} input activation quantization; the "
            "config and the tensors disagree")


def _e4m3_block_scales(reader, stored: str, where: str, factor) -> None:
    """Refuses negative E4M3 block scales (a set sign bit: the block's values would flip
    sign) and a largest block factor ``factor(s)`` (float32) that is not finite."""
    top, negative, first, seen = -1, 0, None, 0
    for chunk in reader.iter_raw(stored, _SCALE_CHUNK):
        codes = np.frombuffer(chunk, np.uint8)
        high = int(codes.max()) if codes.size else -1
        if high < 0x7F:  # all positive and none NaN (nearly always): one pass, no masks
            top = max(top, high)
            seen += codes.size
            continue
        neg = codes >= 0x80
        if neg.any():
            if first is None:
                first = (seen + int(np.argmax(neg)), int(codes[np.argmax(neg)]))
            negative += int(np.count_nonzero(neg))
        ok = codes[codes < 0x7F]  # positive, not NaN (0x7F: a block that held NaN or inf)
        if ok.size:
            top = max(top, int(ok.max()))
        seen += codes.size
    if negative:
        value = float(np.uint8(first[1]).view(ml_dtypes.float8_e4m3fn))
        raise CheckpointError(
            f"{where}: {negative} of {seen} block scale(s) negative (e.g. block {first[0]}: "
            f"code 0x{first[1]:02X} = {value!r}); an NVFP4 block scale is a positive E4M3 "
            "number, a negative one would flip the sign of its block: the file is damaged or "
            "not in the layout its names claim")
    if top >= 0:
        s = np.float32(np.uint8(top).view(ml_dtypes.float8_e4m3fn))
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            f = factor(s)
        if not np.isfinite(f):
            raise CheckpointError(
                f"{where}: block scale {float(s)!r} gives its block the factor {float(f)!r}: "
                "its values would decode to inf or NaN; the tensor and block scales do not "
                "fit together (the file is damaged)")


def _scale_data(reader, name, spec, parts) -> None:
    """The stored scales of one tensor (see the module docstring)."""
    roles = {role: stored for role, stored, _, _ in parts}
    for role in ("scale", "global_scale", "input_scale"):
        if role in roles:
            check_scales(reader.read(roles[role]), f"{reader.path}: {roles[role]} (the "
                                                   f"{role.replace('_', ' ')} of {name})")
    scheme = getattr(spec.format, "scheme", None)  # block formats only
    if scheme is not None and scheme.name == "nvfp4" and "scales" in roles:
        where = f"{reader.path}: {roles['scales']} (the block scales of {name})"
        if "global_scale" in roles:
            gs = np.float32(np.asarray(reader.read(roles["global_scale"])).reshape(-1)[0])
            _e4m3_block_scales(reader, roles["scales"], where, lambda s: s / gs)
        else:
            ts = np.float32(np.asarray(reader.read(roles["scale"]), np.float32).reshape(()))
            _e4m3_block_scales(reader, roles["scales"], where, lambda s: ts * s)


def check_lowprec(reader, name, spec, parts, config, data):
    if config is not None:
        raise CheckpointError(
            f"{reader.path}: {name} is stored in lowprec's layout, which has no "
            f"quantization_config, but {config.where} says quant_method {config.method!r}; "
            "the config and the tensors disagree")
    if data:
        _scale_data(reader, name, spec, parts)


def check_gpt_oss(reader, name, spec, parts, config, data):
    # transformers' Mxfp4Config (quant_method mxfp4), whose group :mod:`._qconfig` calls gpt-oss
    _config_agrees(reader, name, spec, config, ("mxfp4",), "gpt-oss")


def check_engine(reader, name, spec, parts, config, data, methods):
    """An engine layout's checks (its ``check``): the config is one of ``methods`` and gives
    the tensor's module its scheme; the stored scales."""
    _config_agrees(reader, name, spec, config, methods, spec.scheme)
    if data:
        _scale_data(reader, name, spec, parts)


def check_file(reader, specs: dict, config: Optional[QuantConfig], *, decode: bool,
               keep_undecodable: bool = False) -> dict:
    """Every check of one file (see the module docstring); returns its undecodable modules.

    Args:
      specs: ``{name: (spec, parts)}`` of its recognized quantized tensors; those of an
        undecodable module are taken out (they are kept, or refused, with their module).
      decode: the caller decodes (stored scales are read and checked, and undecodable
        modules are refused unless ``keep_undecodable``); False for ``inspect``.
    """
    if decode and config is not None and not config.readable:
        raise CheckpointError(
            f"{config.where}: quantization_config says quant_method {config.method!r}, a layout "
            f"lowprec does not read (it reads {_READS}); its weights would be copied as if they "
            "were plain ones")
    claimed = {stored for _, parts in specs.values() for _, stored, _, _ in parts}
    undecodable = undecodable_modules(reader, claimed, config)
    for name in [n for n in specs if _module(n) in undecodable]:
        # A layout lowprec reads, in a module with parts it does not (an AWQ pre_quant_scale):
        # not decoded either, but kept (or refused) with the rest of its module.
        _, parts = specs.pop(name)
        u = undecodable[_module(name)]
        more = tuple((stored, dt, tuple(shp)) for _, stored, dt, shp in parts)
        undecodable[u.module] = dataclasses.replace(u, stored=tuple(sorted(u.stored + more)))
        claimed -= {stored for _, stored, _, _ in parts}
    if decode:
        refuse_undecodable(reader.path, undecodable, keep_undecodable)
    for name, (spec, parts) in specs.items():
        get_layout(layout_of(spec)).check(reader, name, spec, parts, config, decode)
    if config is not None and config.readable:
        _targets_are_quantized(reader, claimed, undecodable, config)
    return undecodable


def _targets_are_quantized(reader, claimed, undecodable, config: QuantConfig) -> None:
    """Refuses a module that a group targets by name or pattern while its weight is stored
    in high precision: the config does not describe the tensors."""
    for name, info in reader.tensors.items():
        if (not name.endswith(".weight") or name in claimed or info.dtype not in FLOAT_DTYPES
                or len(info.shape) != 2):
            continue
        module = name[: -len(".weight")]
        if module in undecodable:
            continue
        group = config.group_of(module, classes=False)
        if group is not None:
            raise CheckpointError(
                f"{reader.path}: {config.where}'s group {group.label} targets {module}, but "
                f"{name} is stored as {info.dtype} {list(info.shape)}, not quantized; the config "
                "and the tensors disagree")
