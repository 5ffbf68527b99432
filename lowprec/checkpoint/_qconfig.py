"""What a checkpoint's config says about its quantization, read and checked.

A Hugging Face checkpoint folder describes its quantized weights in ``config.json``'s
``quantization_config`` (and NVIDIA ModelOpt also in ``hf_quant_config.json``); engines load
the tensors as it says. :func:`read_quant_config` reads it from the checkpoint folder (the
folder given, or the model folder holding a single shard: :func:`~lowprec.checkpoint._source.
open_source`) into a :class:`QuantConfig`, which says for each module which group claims it
and which lowprec scheme that group's weights decode as, or why none (an int4 group, an AWQ
algorithm, a ``quant_method`` lowprec does not read). The readers check the tensors against
it (:mod:`lowprec.checkpoint._validate`).

How a module is matched, as compressed-tensors 0.20 does (``utils/match.py``): a target is an
exact module name, ``re:REGEX`` (``re.match``), or a class name (``"Linear"``); an exact name
beats a regex, which beats a class. A checkpoint has no classes, so a class target is taken
to mean every module stored with quantized parts (a weight of any other class stored in high
precision is not checked against it). ModelOpt's ``exclude_modules`` / ``ignore`` are module
names or ``fnmatch`` patterns (``model.layers.*.mlp.gate``); its ``MIXED_PRECISION`` lists
each quantized layer under ``quantized_layers``. transformers' gpt-oss MXFP4
(``quant_method: "mxfp4"``) is the gpt-oss layout.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
from typing import Optional

from ._engine_schemes import WEIGHT_SCHEMES
from ._errors import CheckpointError
from ._layouts import layouts

CONFIG_NAME = "config.json"
MODELOPT_CONFIG_NAME = "hf_quant_config.json"
_MAX_CONFIG_BYTES = 64 * 1024 * 1024

#: compressed-tensors formats (a group's ``format``) of each scheme lowprec decodes; FP8's
#: ``naive-quantized`` stores the same F8_E4M3 codes and scale as ``float-quantized``.
CT_FORMATS = {
    "nvfp4": ("nvfp4-pack-quantized",),
    "mxfp4": ("mxfp4-pack-quantized",),
    "mxfp6": ("mxfp6-pack-quantized",),
    "mxfp8": ("mxfp8-quantized",),
    "fp8": ("float-quantized", "naive-quantized"),
    "fp8_channel": ("float-quantized", "naive-quantized"),
}
#: ModelOpt ``quant_algo`` values lowprec decodes, and their schemes (NVFP4 with group 16).
MODELOPT_ALGOS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8",
                  "FP8_PER_CHANNEL_PER_TOKEN": "fp8_channel"}
#: What each ModelOpt algorithm does to activations (see :attr:`Group.inputs`).
MODELOPT_INPUTS = {"NVFP4": "static", "W4A16_NVFP4": None, "FP8": "static",
                   "FP8_PER_CHANNEL_PER_TOKEN": "dynamic"}


@dataclasses.dataclass(frozen=True)
class Group:
    """One group of a quantization config: what it targets and what its weights are.

    ``scheme`` is the lowprec scheme its weights decode as (``"nvfp4"``, ``"mxfp4"``,
    ``"mxfp6"``, ``"mxfp8"``, ``"fp8"``, ``"fp8_channel"``; ``"gpt-oss"`` for transformers'
    MXFP4), or None when lowprec does not decode them; ``what`` says what they are, in the
    config's words. ``inputs``: what the engine does to the modules' input: None (nothing),
    ``"dynamic"`` (a scale computed at run time), ``"static"`` (a stored scale: FP8's per-tensor
    ``input_scale``, NVFP4's ``input_global_scale``, ModelOpt's ``input_scale``) or
    ``"other"`` (anything else, e.g. integer activations)."""

    name: str
    targets: tuple
    scheme: Optional[str]
    what: str
    inputs: Optional[str] = None

    @property
    def label(self) -> str:
        return f"{self.name!r} (targets {', '.join(self.targets) or 'nothing'}: {self.what})"


@dataclasses.dataclass
class QuantConfig:
    """A checkpoint's quantization config (see the module docstring)."""

    method: str  # quant_method: "compressed-tensors", "modelopt", "mxfp4", or another
    where: str  # the file(s) it was read from, for messages
    groups: list
    ignore: tuple  # module patterns kept in high precision
    raw: dict  # config.json's quantization_config (or the ModelOpt file's section)
    modelopt: Optional[dict] = None  # hf_quant_config.json, when there is one
    globs: bool = False  # module patterns are shell globs (ModelOpt's), not ``re:`` ones

    @property
    def readable(self) -> bool:
        """Whether the quant_method is a layout lowprec reads (a registered layout's)."""
        return config_layout(self.method) is not None

    def _match(self, module: str, pattern: str, *, classes: bool = True) -> Optional[int]:
        """0 (exact name), 1 (regex) or 2 (class) if ``pattern`` matches ``module``."""
        if self.globs:
            if classes and _is_class_name(pattern):
                return 2
            return 0 if module == pattern or fnmatch.fnmatchcase(module, pattern) else None
        if pattern.startswith("re:"):
            return 1 if re.match(pattern[3:], module) else None
        if module == pattern:
            return 0
        if classes and _is_class_name(pattern):
            return 2
        return None

    def ignored(self, module: str) -> bool:
        """Whether the config keeps ``module`` in high precision (by name or pattern)."""
        return any(self._match(module, p, classes=False) is not None for p in self.ignore)

    def group_of(self, module: str, *, classes: bool = True) -> Optional[Group]:
        """The group that claims ``module`` (None if none does, or the config ignores it);
        ``classes=False`` leaves out class targets. Two groups matching equally and
        disagreeing are refused: which one an engine applies is not defined."""
        if self.ignored(module):
            return None
        best = {}
        for g in self.groups:
            ranks = [r for r in (self._match(module, t, classes=classes) for t in g.targets)
                     if r is not None]
            if ranks:
                best.setdefault(min(ranks), []).append(g)
        if not best:
            return None
        found = best[min(best)]
        if len({(g.scheme, g.what) for g in found}) > 1:
            raise CheckpointError(
                f"{self.where}: groups {', '.join(g.label for g in found)} all target {module}; "
                "which one applies is not defined: the config is ambiguous")
        return found[0]


def _is_class_name(target: str) -> bool:
    return target[:1].isupper() and target.isidentifier()


def load_json(path: str) -> dict:
    """The JSON object of a checkpoint's config file; a file too large, not UTF-8 JSON or
    not an object is a :class:`CheckpointError` naming it."""
    try:
        if os.path.getsize(path) > _MAX_CONFIG_BYTES:
            raise CheckpointError(f"{path}: too large for a config file")
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: cannot read it as JSON (nested too deeply)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: is not a JSON object")
    return data


def _strings(value, where: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CheckpointError(f"{where} is not a list of module names or patterns: {value!r}")
    return tuple(value)


def ct_scheme(weights, fmt) -> tuple:
    """``(scheme or None, description)`` of a compressed-tensors group's weight arguments
    (``QuantizationArgs`` as JSON) stored in ``fmt``: the scheme lowprec decodes them as, or
    None and what they are.

    Example:
        >>> ct_scheme({"type": "float", "num_bits": 4, "strategy": "tensor_group",
        ...            "group_size": 16}, "nvfp4-pack-quantized")[0]
        'nvfp4'
        >>> ct_scheme({"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128},
        ...           "pack-quantized")
        (None, 'weights int 4-bit, strategy group, group 128, format pack-quantized')
    """
    if not isinstance(weights, dict):
        return None, "no weight quantization"
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy, group = weights.get("strategy"), weights.get("group_size")
    what = (f"weights {kind} {bits}-bit, strategy {strategy}"
            + (f", group {group}" if group is not None else "")
            + ("" if weights.get("symmetric", True) else ", asymmetric")
            + (", dynamic" if weights.get("dynamic") else "")
            + (f", format {fmt}" if fmt else ""))
    scheme = None
    if kind == "float" and weights.get("symmetric", True) and not weights.get("dynamic"):
        for w in WEIGHT_SCHEMES.values():  # the arguments lowprec writes for each
            a = w.ct_weight_args()
            if (bits, strategy) == (a["num_bits"], a["strategy"]) and (
                    not w.blocks or group == w.block_size) and (
                    w.packed or not w.blocks or fmt == w.ct_format):  # MXFP8 vs int8 groups
                scheme = w.name
                break
    if scheme is not None and fmt is not None and fmt not in CT_FORMATS[scheme]:
        scheme = None  # e.g. an int-style packing of float values
    return scheme, what


def ct_inputs(args) -> Optional[str]:
    """What a compressed-tensors group's ``input_activations`` do (see :attr:`Group.inputs`).

    Example:
        >>> ct_inputs(None), ct_inputs({"type": "float", "num_bits": 8, "dynamic": True})
        (None, 'dynamic')
        >>> ct_inputs({"type": "float", "num_bits": 4, "dynamic": "local",
        ...            "strategy": "tensor_group", "group_size": 16})
        'static'
    """
    if args is None:
        return None
    if not isinstance(args, dict) or args.get("type") != "float":
        return "other"
    bits, dynamic, strategy = args.get("num_bits"), args.get("dynamic"), args.get("strategy")
    if dynamic is True:
        return "dynamic"
    if bits == 8 and dynamic is False and strategy in ("tensor", None):
        return "static"  # FP8's input_scale
    nvfp4 = next(w for w in WEIGHT_SCHEMES.values() if w.global_scale)
    if bits == nvfp4.code_bits and dynamic == "local" \
            and args.get("group_size") == nvfp4.block_size:
        return "static"  # NVFP4's input_global_scale (its block scales are dynamic)
    return "other"


def ct_config(q: dict, where: str) -> QuantConfig:
    groups_raw = q.get("config_groups") or {}
    if not isinstance(groups_raw, dict):
        raise CheckpointError(f"{where}: quantization_config.config_groups is not an object")
    top = q.get("format")
    groups = []
    for name, g in groups_raw.items():
        if not isinstance(g, dict):
            raise CheckpointError(f"{where}: config group {name!r} is not an object")
        targets = _strings(g.get("targets"), f"{where}: config group {name!r}'s targets")
        fmt = g.get("format") or (top if top != "mixed-precision" else None)
        scheme, what = ct_scheme(g.get("weights"), fmt)
        inputs = ct_inputs(g.get("input_activations"))
        if inputs is not None:
            what += f"; input activations {inputs}"
        groups.append(Group(str(name), targets, scheme, what, inputs))
    ignore = _strings(q.get("ignore"), f"{where}: quantization_config.ignore")
    return QuantConfig("compressed-tensors", where, groups, ignore, q)


def modelopt_config(q: Optional[dict], hf: Optional[dict], where: str) -> QuantConfig:
    section = {}
    if hf is not None:
        section = hf.get("quantization")
        if not isinstance(section, dict):
            raise CheckpointError(f"{where}: hf_quant_config.json has no \"quantization\" object")
    algos = {k: v for k, v in (("config.json", (q or {}).get("quant_algo")),
                                (MODELOPT_CONFIG_NAME, section.get("quant_algo")))
             if v is not None}
    if len(set(algos.values())) > 1:
        raise CheckpointError(
            f"{where}: the quantization algorithm is {algos['config.json']!r} in config.json "
            f"but {algos[MODELOPT_CONFIG_NAME]!r} in {MODELOPT_CONFIG_NAME}: which one is right?")
    algo = next(iter(algos.values()), None)
    group_size = section.get("group_size", (q or {}).get("group_size"))
    ignore = _strings(section.get("exclude_modules", (q or {}).get("ignore",
                                                                    (q or {}).get("exclude_modules"))),
                      f"{where}: exclude_modules")

    def group(name, targets, algo, size):
        scheme = MODELOPT_ALGOS.get(algo)
        if scheme is not None and WEIGHT_SCHEMES[scheme].blocks \
                and size not in (None, WEIGHT_SCHEMES[scheme].block_size):
            scheme = None
        what = f"quant_algo {algo}" + (f", group_size {size}" if size is not None else "")
        return Group(name, targets, scheme, what, MODELOPT_INPUTS.get(algo, "other"))

    if algo == "MIXED_PRECISION":
        layers = section.get("quantized_layers", (q or {}).get("quantized_layers")) or {}
        if not isinstance(layers, dict):
            raise CheckpointError(f"{where}: quantized_layers is not an object")
        groups = [group(name, (name,), (cfg or {}).get("quant_algo"), (cfg or {}).get("group_size"))
                  for name, cfg in layers.items()]
    else:
        groups = [group(f"quant_algo {algo}", ("Linear",), algo, group_size)]
    return QuantConfig("modelopt", where, groups, ignore, q or section, hf, globs=True)


def read_quant_config(folder: Optional[str]) -> Optional[QuantConfig]:
    """The quantization config of the checkpoint in ``folder`` (None: no folder, or no
    ``quantization_config`` in its config.json and no ``hf_quant_config.json``).

    Raises:
      CheckpointError: a config that cannot be read, or contradicts itself.
    """
    if folder is None:
        return None
    cfg_path = os.path.join(folder, CONFIG_NAME)
    q = None
    if os.path.isfile(cfg_path):
        q = load_json(cfg_path).get("quantization_config")
        if q is not None and not isinstance(q, dict):
            raise CheckpointError(f"{cfg_path}: quantization_config is not an object")
    # a layout's own config file beside config.json (ModelOpt's hf_quant_config.json)
    side = next((l for l in layouts() if l.config_file is not None
                 and os.path.isfile(os.path.join(folder, l.config_file))), None)
    hf_path = os.path.join(folder, side.config_file) if side is not None else None
    hf = load_json(hf_path) if side is not None else None
    if q is None and hf is None:
        return None
    method = (q or {}).get("quant_method", side.quant_method if side is not None else None)
    if not isinstance(method, str):
        raise CheckpointError(f"{cfg_path}: quantization_config has no quant_method")
    if side is not None and method != side.quant_method:
        raise CheckpointError(
            f"{folder}: {side.config_file} is {side.title}'s, but config.json's "
            f"quantization_config says quant_method {method!r}: which one is right?")
    where = cfg_path if hf is None else f"{cfg_path} / {hf_path}" if q is not None else hf_path
    layout = config_layout(method)
    if layout is not None:  # its layout reads it (read_config)
        return layout.read_config(q, hf, where)
    return QuantConfig(method, where, [], (), q)


def config_layout(method: str):
    """The registered layout whose config says ``quant_method`` ``method`` (None: none)."""
    return next((l for l in layouts() if l.quant_method == method), None)


def gpt_oss_config(q: dict, where: str) -> QuantConfig:
    """transformers' Mxfp4Config (quant_method ``mxfp4``): gpt-oss blocks / scales."""
    return QuantConfig("mxfp4", where, [Group("mxfp4", ("Linear",), "gpt-oss",
                                              "gpt-oss MXFP4")], (), q)


def config_keeping(config: QuantConfig, kept, decoded) -> tuple:
    """``(quantization_config, hf_quant_config)`` of a checkpoint in which the modules
    ``decoded`` were decoded while the modules ``kept`` stay quantized as stored: the groups
    claiming kept modules, intact, and every decoded module listed as kept in high precision
    (compressed-tensors' ``ignore``, ModelOpt's ``exclude_modules`` and ``ignore``; ModelOpt's
    ``quantized_layers`` lose them), so that no group can claim a decoded module. None where
    no group claims a kept module (nothing of the config is true any more).
    """
    groups = {g.name for g in (config.group_of(m) for m in kept) if g is not None}
    if not groups or not config.readable:
        return None, None
    return config_layout(config.method).keep_config(config, groups, sorted(set(decoded)))


def ct_keeping(config: QuantConfig, groups, decoded) -> tuple:
    """:func:`config_keeping` of a compressed-tensors config: the ``groups`` claiming kept
    modules, the ``decoded`` ones added to ``ignore``."""
    q = json.loads(json.dumps(config.raw))
    q["config_groups"] = {k: v for k, v in (q.get("config_groups") or {}).items()
                          if k in groups}
    formats = {g.get("format") for g in q["config_groups"].values()}
    if len(formats) == 1 and None not in formats:
        q["format"] = formats.pop()
    q["ignore"] = sorted(set(q.get("ignore") or ()) | set(decoded))
    return q, None


def modelopt_keeping(config: QuantConfig, groups, decoded) -> tuple:
    """:func:`config_keeping` of a ModelOpt (or transformers MXFP4) config: the ``decoded``
    modules added to ``exclude_modules`` / ``ignore`` and taken out of ``quantized_layers``
    and group targets."""
    q = json.loads(json.dumps(config.raw))
    hf = json.loads(json.dumps(config.modelopt)) if config.modelopt is not None else None
    for section in (q, (hf or {}).get("quantization")):
        if not isinstance(section, dict):
            continue
        for key in ("exclude_modules", "ignore"):
            if key in section or section is q and key == "ignore":
                section[key] = sorted(set(section.get(key) or ()) | set(decoded))
        if isinstance(section.get("quantized_layers"), dict):
            section["quantized_layers"] = {k: v for k, v in section["quantized_layers"].items()
                                           if k not in decoded}
        if isinstance(section.get("config_groups"), dict):
            for g in section["config_groups"].values():
                if isinstance(g, dict) and isinstance(g.get("targets"), list):
                    g["targets"] = [t for t in g["targets"] if t not in decoded]
    return q, hf
