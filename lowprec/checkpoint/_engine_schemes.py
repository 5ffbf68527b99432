"""The schemes of the engine layouts: which weights, and which activation quantization, a
module carries — llm-compressor's preset names, and what each writes into a config.

A scheme is a weight format (:data:`WEIGHTS`: how the weight is stored, in
:mod:`lowprec.checkpoint._engine_layouts`) plus what the engine does to the Linear's input:
nothing (weight-only, ``A16``: vLLM runs Marlin-style weight-only kernels), a *dynamic*
quantization computed at run time from the activations themselves (data-free: FP8 per token,
MX per block of 32), or a *static* one whose scale is stored in the checkpoint and so needs
activation statistics (FP8's ``input_scale``, NVFP4's ``input_global_scale``, ModelOpt's
``input_scale``). The names are llm-compressor's presets (compressed-tensors 0.20's
``PRESET_SCHEMES``), matched without regard to case as llm-compressor matches them — so
``NVFP4`` is W4A4 with a static input global scale and ``NVFP4A16`` weight-only — plus
``FP8A16`` and ``FP8A16_CHANNEL`` for weight-only FP8, which has no preset.

Each scheme's ``QuantizationArgs`` are written field for field as llm-compressor 0.14.0.1
writes them (compressed-tensors 0.19 serializes every field, nulls included; 0.20 reads
them), and its ModelOpt ``quant_algo`` as ModelOpt 0.47 exports it.

vLLM loads the projections that read one input as one fused layer (q/k/v, gate/up, DeepSeek's
q_a/kv_a, an MoE expert's w1/w3: :data:`FUSED_LAYERS`, llm-compressor's ``FUSED_LAYER_NAMES``)
and refuses different schemes within one; NVFP4's global (tensor) scale and the input scales
must be one number for the whole fused layer, since vLLM keeps the largest of the stored ones
(``weight_global_scale.max()``) for all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .._format import element_format, mx_format
from ._errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How an engine layout stores one weight format: data every layout reads instead of
    branching on the format's name (:data:`WEIGHT_SCHEMES`).

    Attributes:
      name: the key (``"nvfp4"``, ``"mxfp4"``, ``"mxfp6"``, ``"mxfp8"``, ``"fp8"``,
        ``"fp8_channel"``).
      format: the lowprec format of the stored codes (its object).
      ct_format: compressed-tensors' ``format`` of a group of it.
      packed: codes packed into U8 bytes (``weight_packed``; E2M1, E2M3), else stored as
        F8_E4M3 values under the weight's own name.
      per_channel: FP8 with one scale per output row (else one per tensor).
    """

    name: str
    format: object
    ct_format: str
    packed: bool
    per_channel: bool = False

    @property
    def blocks(self) -> bool:
        """A block format (block scales stored beside the codes)."""
        return hasattr(self.format, "block_size")

    @property
    def block_size(self) -> int:
        """Elements per block scale (1 for FP8: a whole row or tensor shares it)."""
        return self.format.block_size if self.blocks else 1

    @property
    def global_scale(self) -> bool:
        """A block format with a float32 tensor scale over its block scales (NVFP4): the
        number compressed-tensors stores as its reciprocal (``weight_global_scale``)."""
        return self.blocks and bool(self.format.tensor_scale)

    @property
    def mx(self) -> bool:
        """An OCP MX format (E8M0 block scales, no tensor scale)."""
        return self.blocks and not self.format.tensor_scale

    @property
    def tensor_scale(self) -> bool:
        """One float32 scale for the whole tensor (NVFP4's, per-tensor FP8's)."""
        return self.global_scale or not (self.blocks or self.per_channel)

    @property
    def code_role(self) -> str:
        """The role of the stored codes: ``"elements"`` (packed) or ``"values"``."""
        return "elements" if self.packed else "values"

    @property
    def scales_dtype(self) -> str:
        """The safetensors dtype of the block scales (E8M0 as U8, or E4M3)."""
        return "U8" if self.mx else "F8_E4M3"

    @property
    def code_bits(self) -> int:
        """Bits of one element code."""
        return (self.format.element if self.blocks else self.format).code_bits

    @property
    def ct_strategy(self) -> str:
        """compressed-tensors' ``strategy`` of its scales."""
        if self.blocks:
            return "tensor_group" if self.global_scale else "group"
        return "channel" if self.per_channel else "tensor"

    def ct_weight_args(self) -> dict:
        """compressed-tensors ``weights`` ``QuantizationArgs`` (as llm-compressor writes)."""
        return _args(self.code_bits, self.ct_strategy,
                     group_size=self.block_size if self.blocks else None,
                     scale_dtype=(_U8 if self.mx else _E4M3) if self.blocks else None)

    def packed_length(self, k: int) -> int:
        """Bytes of ``k`` packed codes."""
        return k * self.code_bits // 8


@dataclasses.dataclass(frozen=True)
class EngineScheme:
    """A named scheme: ``weights`` (a key of :data:`WEIGHTS`) and ``inputs``: None
    (weight-only), ``"dynamic"`` or ``"static"`` (a stored input scale, from activation
    statistics); ``modelopt``: its ModelOpt ``quant_algo`` (None: not in that layout)."""

    name: str
    weights: str
    inputs: Optional[str]
    modelopt: Optional[str]
    what: str

    @property
    def w(self) -> WeightScheme:
        """Its weight format (:data:`WEIGHT_SCHEMES`)."""
        return WEIGHT_SCHEMES[self.weights]

    @property
    def weight_only(self) -> bool:
        return self.inputs is None

    def ct_input_args(self) -> Optional[dict]:
        """compressed-tensors ``input_activations`` (None for a weight-only scheme)."""
        return None if self.inputs is None else dict(_CT_INPUTS[self.name])

    def ct_weight_args(self) -> dict:
        """compressed-tensors ``weights`` ``QuantizationArgs``."""
        return self.w.ct_weight_args()


def _args(num_bits, strategy, *, group_size=None, scale_dtype=None, dynamic=False,
          observer="memoryless_minmax") -> dict:
    """A ``QuantizationArgs`` of symmetric floats, every field as compressed-tensors 0.19
    serializes it (llm-compressor 0.14.0.1's output)."""
    return {"actorder": None, "block_structure": None, "dynamic": dynamic,
            "group_size": group_size, "num_bits": num_bits, "observer": observer,
            "observer_kwargs": {}, "scale_dtype": scale_dtype, "strategy": strategy,
            "symmetric": True, "type": "float", "zp_dtype": None}


_E4M3 = "torch.float8_e4m3fn"
_U8 = "torch.uint8"
#: Weight formats: name -> (its compressed-tensors format, weights' QuantizationArgs).
WEIGHTS = {
    "nvfp4": "nvfp4-pack-quantized",
    "mxfp4": "mxfp4-pack-quantized",
    "mxfp6": "mxfp6-pack-quantized",
    "mxfp8": "mxfp8-quantized",
    "fp8": "float-quantized",
    "fp8_channel": "float-quantized",
}
#: The weight formats of the engine layouts, by name.
WEIGHT_SCHEMES = {w.name: w for w in (
    WeightScheme("nvfp4", mx_format("nvfp4"), WEIGHTS["nvfp4"], packed=True),
    WeightScheme("mxfp4", mx_format("mxfp4"), WEIGHTS["mxfp4"], packed=True),
    WeightScheme("mxfp6", mx_format("mxfp6_e2m3"), WEIGHTS["mxfp6"], packed=True),
    WeightScheme("mxfp8", mx_format("mxfp8_e4m3"), WEIGHTS["mxfp8"], packed=False),
    WeightScheme("fp8", element_format("e4m3"), WEIGHTS["fp8"], packed=False),
    WeightScheme("fp8_channel", element_format("e4m3"), WEIGHTS["fp8_channel"], packed=False,
                 per_channel=True),
)}


_SCHEMES = (
    # name, weights, inputs, ModelOpt quant_algo, what
    ("NVFP4A16", "nvfp4", None, "W4A16_NVFP4", "NVFP4 weights, weight-only"),
    ("NVFP4", "nvfp4", "static", "NVFP4",
     "NVFP4 weights and activations (static input global scale, dynamic block scales)"),
    ("MXFP4A16", "mxfp4", None, None, "MXFP4 weights, weight-only"),
    ("MXFP4", "mxfp4", "dynamic", None, "MXFP4 weights and dynamic MXFP4 activations"),
    ("MXFP6A16", "mxfp6", None, None, "MXFP6 (E2M3) weights, weight-only"),
    ("MXFP8A16", "mxfp8", None, None, "MXFP8 weights, weight-only"),
    ("MXFP8", "mxfp8", "dynamic", None, "MXFP8 weights and dynamic MXFP8 activations"),
    ("FP8", "fp8", "static", "FP8",
     "FP8 weights (one scale per tensor) and activations (static input scale)"),
    ("FP8_DYNAMIC", "fp8_channel", "dynamic", "FP8_PER_CHANNEL_PER_TOKEN",
     "FP8 weights (one scale per output channel) and dynamic per-token FP8 activations"),
    ("FP8A16", "fp8", None, None, "FP8 weights (one scale per tensor), weight-only"),
    ("FP8A16_CHANNEL", "fp8_channel", None, None,
     "FP8 weights (one scale per output channel), weight-only"),
)
#: The schemes by name (upper case).
SCHEMES = {n: EngineScheme(n, w, i, m, what) for n, w, i, m, what in _SCHEMES}

_CT_INPUTS = {  # the activations' arguments: the weights' blocks, computed at run time
    "NVFP4": dict(WEIGHT_SCHEMES["nvfp4"].ct_weight_args(), dynamic="local",
                  observer="static_minmax"),
    "MXFP4": dict(WEIGHT_SCHEMES["mxfp4"].ct_weight_args(), dynamic=True, observer=None),
    "MXFP8": dict(WEIGHT_SCHEMES["mxfp8"].ct_weight_args(), dynamic=True, observer=None),
    "FP8": _args(8, "tensor", observer="static_minmax"),
    "FP8_DYNAMIC": _args(8, "token", dynamic=True, observer=None),
}

#: Names of the projections vLLM loads as one layer, per parent module (llm-compressor's
#: ``FUSED_LAYER_NAMES``).
FUSED_LAYERS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
                ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"))

# lowprec's format names, which the engine layouts do not take (a scheme says more): the
# scheme an llm-compressor user would pick for each, for the error message.
_HINTS = {
    "nvfp4": "NVFP4 (W4A4) or NVFP4A16 (weight-only)",
    "mxfp4": "MXFP4 (W4A4, dynamic activations) or MXFP4A16",
    "mxfp6": "MXFP6A16", "mxfp6_e2m3": "MXFP6A16",
    "mxfp8": "MXFP8 (W8A8, dynamic activations) or MXFP8A16", "mxfp8_e4m3": "MXFP8 or MXFP8A16",
    "e4m3": "FP8 (W8A8, static), FP8_DYNAMIC, FP8A16 or FP8A16_CHANNEL",
    "fp8_channel": "FP8_DYNAMIC (dynamic per-token activations) or FP8A16_CHANNEL (weight-only)",
}


def engine_scheme(name) -> EngineScheme:
    """The scheme called ``name`` (an :class:`EngineScheme` passes through): an llm-compressor
    preset, any case, or ``FP8A16`` / ``FP8A16_CHANNEL``.

    Example:
        >>> s = engine_scheme("nvfp4a16")
        >>> s.name, s.weights, s.inputs, s.modelopt
        ('NVFP4A16', 'nvfp4', None, 'W4A16_NVFP4')
        >>> engine_scheme("FP8_DYNAMIC").inputs
        'dynamic'
    """
    if isinstance(name, EngineScheme):
        return name
    if isinstance(name, str) and name.upper() in SCHEMES:
        return SCHEMES[name.upper()]
    hint = _HINTS.get(name.lower()) if isinstance(name, str) else None
    raise CheckpointError(
        f"unknown scheme {name!r} for the engine layouts; choose one of: {', '.join(SCHEMES)} "
        "(llm-compressor's preset names: A16 = weight-only)"
        + (f"; for lowprec's format {name!r}: {hint}" if hint else ""))


def fused_partners(module: str, modules) -> tuple:
    """The modules of ``modules`` that vLLM fuses with ``module`` (``module`` included, sorted;
    ``(module,)`` if it fuses with none)."""
    parent, _, leaf = module.rpartition(".")
    for names in FUSED_LAYERS:
        if leaf in names:
            found = [f"{parent}.{n}" if parent else n for n in names]
            return tuple(sorted(m for m in found if m in modules or m == module))
    return (module,)


def fused_groups(modules) -> list:
    """The fused layers among ``modules`` with more than one member, each sorted."""
    modules = set(modules)
    seen, out = set(), []
    for m in sorted(modules):
        group = fused_partners(m, modules)
        if len(group) > 1 and group not in seen:
            seen.add(group)
            out.append(group)
    return out
