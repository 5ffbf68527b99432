"""Training recipes: which formats a model's matmuls use, forward and backward.

A :class:`Recipe` is a small frozen (hashable, jit-static) description of one low-precision
matmul scheme, and the code that applies it to a ``lax.dot_general``-shaped call. It knows
nothing of Flax; :mod:`lowprec.flax` plugs it into Flax layers.

For ``y = dot(lhs, rhs)`` (activations x weights in a linear layer) a recipe fixes

* the forward operand formats (``forward``: one format for both, or ``(lhs, rhs)``),
* the backward pass: ``"ste"`` (exact float gradient of the quantized forward) or
  ``"quantized"``: both backward dots quantized, the cotangent in ``grad`` and the operands
  re-quantized in ``backward_operands`` (default: their forward formats), every operand
  blocked along the reduction axis of its own backward dot (see :func:`lowprec.dot_general`),
* the scale schemes' options of every block quantization (``scale_options``: E8M0's scale
  rule, NVFP4's element step) and the element rounding of every quantization,
* ``scaling``: MX formats carry their own block scales; element formats (``e4m3``, ...)
  are either rounded as they are (``"none"``) or scaled per tensor by a power of two
  (``"tensor"``: FP8 "current scaling"; the scale is the smallest power of two with
  amax / scale <= max_elem, rounded up from the float32 quotient as the MX ``rceil`` rule does,
  so multiplying by it is exact), or scaled by Transformer Engine's *delayed* scaling
  (``"delayed"``: the scale comes from an amax history, state that lives in the model; see
  ``delayed`` and :mod:`lowprec.flax`, which keeps it per layer),
* ``high_precision``: glob patterns of layer names (``"lm_head"``, ``"*/attn/*"``) that
  :mod:`lowprec.flax` leaves in their own precision.

:meth:`Recipe.ragged_dot` applies a recipe to a mixture-of-experts layer's
``lax.ragged_dot``, each group as its own dot (``_ragged.py``).

Ready-made recipes:

* :data:`OCP_MXFP8`: the OCP MX v1.0 scale rule (``floor``), MXFP8 E4M3 operands and MXFP8
  E5M2 gradients (the usual FP8 split: precision forward, range backward).
* :data:`NVIDIA_MXFP8`: NVIDIA's MXFP8 training recipe (Mishra et al., "Recipes for
  Pre-training LLMs with MXFP8", 2025; Transformer Engine ``MXFP8BlockScaling``): ``rceil``
  scales and E4M3 for every tensor, gradients included.
* :data:`FP8_HYBRID`: FP8 without blocks (Micikevicius et al., "FP8 Formats for Deep
  Learning", 2022; Transformer Engine ``Format.HYBRID``): E4M3 forward, E5M2 gradients,
  each tensor scaled by one power of two computed from its current amax.
* :data:`FP8_DELAYED`: the same formats with Transformer Engine's ``DelayedScaling`` (scales
  from the amax history of earlier steps, ``lowprec.DelayedScaling``'s defaults). A layer's
  dot needs its state, so this recipe is applied by :mod:`lowprec.flax`
  (``quantize_model``, Rules), not by :meth:`Recipe.dot_general`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._delayed import DelayedScaling
from ._deprecated import warn_deprecated
from ._format import ElementFormat, MXFormat, element_format
from ._nvfp4_train import TILE, check_layout, nvfp4_dot
from ._options import (BACKWARD_MODES, BACKWARD_OVERRIDES, RHT_DTYPES, BackwardMode, DotSpec,
                       NVFP4Training, operand_cast)
from ._rounding import Rounding
from ._scheme_e8m0 import E8M0Options
from ._scheme_nvfp4 import NVFP4Options, NVFP4Step
from ._qdot import dot_general_jit
from ._ragged import ragged_dot_jit
from ._scale_rules import DEFAULT_SCALE_RULE, ScaleRule
from ._rounding_key import next_key
from ._sharding import check_contraction, out_sharding_arg
from .kernels._dispatch import kernels_enabled

FormatLike = Union[None, str, ElementFormat, MXFormat]
_Format = Union[None, ElementFormat, MXFormat]

#: ``backward=`` choices of a :class:`Recipe` (as for :func:`lowprec.dot_general`).
RECIPE_BACKWARD_MODES: tuple[str, ...] = BACKWARD_MODES
#: ``scaling=`` choices: ``"none"``, ``"tensor"`` (power-of-two per-tensor, element formats) or
#: ``"delayed"`` (Transformer Engine's delayed scaling, state kept per layer by lowprec.flax).
SCALINGS: tuple[str, ...] = ("none", "tensor", "delayed")
#: Deterministic rounding modes a recipe accepts (matmul operands are rounded without a key).
RECIPE_ROUNDINGS: tuple[str, ...] = ("nearest_even", "nearest_away", "nearest_toward_zero",
                                      "toward_zero", "up", "down")
_OUTPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _resolve_format(fmt, what: str) -> _Format:
    """An operand format name/object → ElementFormat, MXFormat or None (dot_general's rules)."""
    cast = operand_cast(fmt, what, DEFAULT_SCALE_RULE, "nearest_even", "ieee")
    return None if cast is None else cast.fmt


def _pair(value, what: str) -> Tuple[_Format, _Format]:
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(
                f"{what} takes one format for both operands or a pair (lhs, rhs), got {value!r}"
            )
        return (_resolve_format(value[0], f"{what}[0]"), _resolve_format(value[1], f"{what}[1]"))
    fmt = _resolve_format(value, what)
    return (fmt, fmt)


def _name(fmt: _Format) -> str:
    return "-" if fmt is None else fmt.name


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A low-precision matmul recipe (frozen and hashable: usable as a static jit argument).

    Format arguments take a name (``"mxfp8_e4m3"``, ``"mxfp4"``, ``"e4m3"``, ``"bf16"`` ...),
    a format object or ``None`` (leave the operand as it is); after construction they hold
    format objects, so ``Recipe(forward="mxfp8") == Recipe(forward="mxfp8_e4m3")``.

    Attributes:
      forward: format of both forward operands, or a pair ``(lhs, rhs)``; stored as a pair.
      grad: format of the cotangent in the backward dots (``backward="quantized"`` only).
      backward: ``"quantized"`` or ``"ste"``; default ``"quantized"`` when ``grad`` or
        ``backward_operands`` is given, else ``"ste"``.
      backward_operands: formats the operands are re-quantized to in the backward dots (one
        format or a pair); default: the forward formats.
      scale_options: the scale schemes' options of every block quantization (as
        ``scale_options=`` of :func:`lowprec.dot_general`): a dict of option fields (E8M0's
        ``scale_rule``: ``"floor"``, ``"ceil"``, ``"even"``, ``"rceil"``; NVFP4's
        ``nvfp4_step``), each set on the options of the recipe's MX formats whose scheme
        takes it (a field none takes is refused), or a scheme's options value
        (``fmt.scheme.Options(...)``), or a tuple of them. Stored as a tuple of the values
        that differ from their scheme's defaults, one per scheme, so that equal recipes
        compare equal; a scheme with no value there casts with its defaults.
        ``scale_rule=`` and ``nvfp4_step=`` (and the attributes of those names) are its
        former spellings: they still work, with a DeprecationWarning.
      rounding: element rounding of every quantization (deterministic modes only).
      scaling: ``"none"``, ``"tensor"`` (per-tensor power-of-two scaling of element-format
        operands; not allowed with MX formats, which carry block scales) or ``"delayed"``
        (Transformer Engine's delayed scaling of an FP8 layer: ``forward`` one element
        format for both operands, ``grad`` the cotangent's, ``backward="quantized"``; the
        options in ``delayed``).
      delayed: the :class:`~lowprec.DelayedScaling` options of ``scaling="delayed"`` (margin,
        amax history length and algorithm; its formats must be the recipe's ``forward`` and
        ``grad``). Default: ``DelayedScaling`` with the recipe's formats.
      high_precision: glob patterns (:func:`fnmatch.fnmatchcase`, ``*`` also crosses ``/``)
        of layer paths such as ``"block_0/mlp/up"`` that stay in their own precision.
      high_precision_wgrad: compute the weight gradient (grad_rhs = lhsᵀ·g, the rhs being the
        layer's weight) as a float32 dot of the unquantized activations and cotangent
        (``precision=HIGHEST``), as recipes that keep wgrad in high precision do; grad_lhs
        stays as ``backward`` says.
      weight_block_2d, wgrad_rht, grad_rounding, seed: the NVFP4 training recipe's parts
        (Transformer Engine ``NVFP4BlockScaling``; see :data:`NVIDIA_NVFP4` and
        ``lowprec/_nvfp4_train.py``): one E4M3 scale per 16 x 16 weight tile; a random
        Hadamard transform (16 x 16 blocks, signs from ``seed``) of the weight-gradient
        operands along tokens; ``grad_rounding="stochastic"`` rounds cotangents to E2M1
        stochastically (random words from ``seed`` and the cotangent's bits). They need every
        format NVFP4 and apply to linear layers (lhs [..., K] x a 2-D weight).
        NVFP4's ``nvfp4_step="reciprocal"`` in ``scale_options`` (how every NVFP4
        quantization divides elements by their scales, see :func:`lowprec.quantize_mx`) is
        Transformer Engine's, and makes the recipe an NVFP4 training recipe as these parts do.
      rht_signs: the signs of ``wgrad_rht``'s transform: None (drawn from ``seed``),
        ``"transformer_engine"`` (TE's fixed vector) or 16 ints ±1.
      rht_dtype: ``"float32"`` or ``"bfloat16"`` (the transform's operands and result rounded
        to bfloat16, as TE's bfloat16 RHT GEMM); with ``wgrad_rht``.
        ``dataclasses.replace(NVIDIA_NVFP4, **lowprec.TE_NVFP4_OPTIONS)`` sets
        the three as TE does.
      four_over_six: Four over Six (Cook et al., arXiv 2512.02010) in the NVFP4 training
        recipe's forward product: every 16-element block of the forward operands (the
        activations along K, and the weight along K unless ``weight_block_2d`` gives it
        16 x 16 tiles, which keep their map-to-6 scales) scaled to 4 or to 6, whichever
        quantizes it with the smaller error, exactly as the ``nvfp4_4over6`` format's own
        quantizer (:func:`lowprec.quantize_mx`); the backward products are unchanged.
      backward_override: Transformer Engine's ``backward_override``: None (the backward
        products as ``backward`` says), ``"high_precision"`` (both backward products float32
        dots of the unquantized cotangent and operands) or ``"dequantized"`` (of the
        unquantized cotangent and the operands as the forward quantized them: the exact
        gradient of the quantized forward, as ``backward="ste"``). Any recipe but delayed
        scaling; the NVFP4 training recipe included.
      pad: zero-pad contractions whose length is not a multiple of 32 (exact: zeros add
        nothing). Default True, since a model's backward dots reduce over output features
        and vocabulary sizes rarely are multiples of 32.
      name: a label for tables and plots.

    Example:
        >>> r = Recipe(forward="mxfp8_e4m3", grad="mxfp8_e5m2", scale_options={"scale_rule": "rceil"})
        >>> r.backward, r.forward[1].name, r.grad.name
        (<BackwardMode.QUANTIZED: 'quantized'>, 'mxfp8_e4m3', 'mxfp8_e5m2')
        >>> r.scale_options
        (E8M0Options(scale_rule=<ScaleRule.RCEIL: 'rceil'>),)
        >>> r == Recipe(forward="mxfp8", grad="mxfp8_e5m2",
        ...             scale_options=r.forward[0].scheme.Options("rceil"))
        True
    """

    forward: Union[FormatLike, Tuple[FormatLike, FormatLike]] = None
    grad: FormatLike = None
    backward: Optional[str] = None
    backward_operands: Union[str, FormatLike, Tuple[FormatLike, FormatLike]] = "forward"
    scale_options: Union[None, dict, object, Tuple[object, ...]] = None
    rounding: str = "nearest_even"
    scaling: str = "none"
    high_precision: Tuple[str, ...] = ()
    pad: bool = True
    name: str = ""
    high_precision_wgrad: bool = False
    weight_block_2d: bool = False
    wgrad_rht: bool = False
    grad_rounding: str = "nearest_even"
    seed: int = 0
    delayed: Optional[DelayedScaling] = None
    rht_signs: Union[None, str, Tuple[int, ...]] = None
    rht_dtype: str = "float32"
    backward_override: Optional[str] = None
    four_over_six: bool = False

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        forward = _pair(self.forward, "forward")
        set_("forward", forward)
        set_("grad", _resolve_format(self.grad, "grad"))
        explicit_bwd = not (isinstance(self.backward_operands, str) and self.backward_operands == "forward")
        if explicit_bwd and self.backward == "ste" and _pair(self.backward_operands, "backward_operands") == forward:
            explicit_bwd = False  # what __post_init__ stores: dataclasses.replace passes it back
        backward = self.backward
        if backward is None:
            backward = "quantized" if (self.grad is not None or explicit_bwd) else "ste"
        if backward not in RECIPE_BACKWARD_MODES:
            raise ValueError(
                f"unknown backward mode {backward!r}; valid modes: {RECIPE_BACKWARD_MODES}"
            )
        backward = BackwardMode(backward)  # the vocabularies of lowprec._options
        if backward == "ste" and (self.grad is not None or explicit_bwd):
            raise ValueError(
                "grad and backward_operands describe quantized backward dots; they have no "
                "effect with backward='ste' (drop them, or use backward='quantized')"
            )
        set_("backward", backward)
        bwd = _pair(self.backward_operands, "backward_operands") if explicit_bwd else forward
        set_("backward_operands", bwd)
        set_("scale_options", _scale_options(self.scale_options, (*forward, *bwd, self.grad)))
        if self.rounding not in RECIPE_ROUNDINGS:
            hint = (
                " (stochastic rounding needs a key per call, which a layer's dot_general does "
                "not get; use it for weights through lowprec.optim)"
                if self.rounding == "stochastic" else ""
            )
            raise ValueError(
                f"unknown recipe rounding {self.rounding!r}; valid: {RECIPE_ROUNDINGS}{hint}"
            )
        set_("rounding", Rounding(self.rounding))
        if self.scaling not in SCALINGS:
            raise ValueError(f"unknown scaling {self.scaling!r}; valid: {SCALINGS}")
        if self.scaling == "tensor":
            used = (*forward, *(bwd if backward == "quantized" else ()), self.grad)
            mx = sorted({f.name for f in used if isinstance(f, MXFormat)})
            if mx:
                raise ValueError(
                    f"scaling='tensor' scales element-format operands; MX formats {mx} carry "
                    "their own block scales. Use scaling='none' with MX formats"
                )
        patterns = self.high_precision
        if isinstance(patterns, str):
            patterns = (patterns,)
        patterns = tuple(patterns)
        if not all(isinstance(p, str) for p in patterns):
            raise TypeError(f"high_precision takes glob pattern strings, got {self.high_precision!r}")
        set_("high_precision", patterns)
        set_("pad", bool(self.pad))
        if not isinstance(self.high_precision_wgrad, bool):
            raise TypeError(f"high_precision_wgrad must be a bool, got {self.high_precision_wgrad!r}")
        self._check_te_options(set_)
        self._check_nvfp4_training()
        self._check_delayed(set_)
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {self.name!r}")

    # -- scale options -----------------------------------------------------------------------

    def options_of(self, fmt: MXFormat):
        """The options of ``fmt``'s scale scheme in this recipe (its value in
        ``scale_options``, else the scheme's defaults).

        Example:
            >>> NVIDIA_MXFP8.options_of(NVIDIA_MXFP8.forward[0])
            E8M0Options(scale_rule=<ScaleRule.RCEIL: 'rceil'>)
        """
        cls = fmt.scheme.Options
        given = [o for o in self.scale_options if type(o) is cls]
        return given[0] if given else fmt.scheme.options()

    def _cast(self, fmt: _Format, overflow="ieee", role: str = "format"):
        """The cast of an operand in ``fmt`` (an MX format with :meth:`options_of`, an element
        format with ``overflow``; None: no cast) at this recipe's rounding."""
        opts = self.options_of(fmt) if isinstance(fmt, MXFormat) else None
        return operand_cast(fmt, role, None, self.rounding, overflow, opts)

    def _option(self, name: str, default):
        """The field ``name`` of the recipe's options (of the scheme that has it), else
        ``default``."""
        return next((getattr(o, name) for o in self.scale_options if hasattr(o, name)), default)

    @property
    def _scale_rule(self) -> ScaleRule:
        """E8M0's scale rule in ``scale_options`` (default ``"floor"``)."""
        return self._option("scale_rule", DEFAULT_SCALE_RULE)

    @property
    def _nvfp4_step(self) -> NVFP4Step:
        """NVFP4's step in ``scale_options`` (default ``"divide"``)."""
        return self._option("nvfp4_step", NVFP4Step.DIVIDE)

    @property
    def scale_rule(self) -> ScaleRule:
        """Deprecated: the E8M0 scale rule in ``scale_options`` (default ``"floor"``)."""
        warn_deprecated("Recipe.scale_rule", "Recipe.scale_options (recipe.options_of(fmt)"
                        ".scale_rule)", stacklevel=3)
        return self._scale_rule

    @property
    def nvfp4_step(self) -> NVFP4Step:
        """Deprecated: the NVFP4 step in ``scale_options`` (default ``"divide"``)."""
        warn_deprecated("Recipe.nvfp4_step", "Recipe.scale_options (recipe.options_of(fmt)"
                        ".nvfp4_step)", stacklevel=3)
        return self._nvfp4_step

    def _check_delayed(self, set_) -> None:
        """``scaling="delayed"``: an FP8 layer as Transformer Engine's DelayedScaling runs it;
        fills in ``delayed`` (the options, with the recipe's formats)."""
        if self.scaling != "delayed":
            if self.delayed is not None:
                raise ValueError("delayed holds the options of scaling='delayed'; got scaling="
                                 f"{self.scaling!r} (drop delayed, or set scaling='delayed')")
            return
        f, g = self.forward[0], self.grad
        if (not isinstance(f, ElementFormat) or self.forward[1] != f
                or not isinstance(g, ElementFormat) or self.backward != "quantized"
                or self.backward_operands != self.forward or self.high_precision_wgrad):
            raise ValueError(
                "scaling='delayed' scales an FP8 layer as Transformer Engine's DelayedScaling: "
                "forward one element format for both operands (e.g. 'e4m3'), grad the "
                "cotangent's (e.g. 'e5m2'), the backward operands as the forward ones and no "
                f"high_precision_wgrad; got {self.describe()}")
        cfg = self.delayed
        if cfg is None:
            cfg = DelayedScaling(fwd_format=f.name, bwd_format=g.name)
        if not isinstance(cfg, DelayedScaling):
            raise TypeError(f"delayed must be a lowprec.DelayedScaling, got {cfg!r}")
        formats = (element_format(cfg.fwd_format).name, element_format(cfg.bwd_format).name)
        if formats != (f.name, g.name):
            raise ValueError(
                f"delayed's formats {formats} differ from the recipe's forward {f.name!r} and "
                f"grad {g.name!r}; pass DelayedScaling(..., fwd_format={f.name!r}, "
                f"bwd_format={g.name!r})")
        set_("delayed", cfg)

    def _state_needed(self, what: str) -> None:
        """Refuses a call that a ``scaling="delayed"`` recipe cannot serve without a state."""
        if self.scaling == "delayed":
            raise ValueError(
                f"{self.name or 'this recipe'} uses delayed scaling: its scales come from the "
                f"amax history of earlier steps, which {what} has nowhere to keep. Apply it through "
                "lowprec.flax (quantize_model, or DelayedDotGeneral / DelayedDotGeneralNnx per "
                "layer), or call lowprec.delayed_dot_general with a DelayedState")

    def _check_te_options(self, set_) -> None:
        """rht_signs, rht_dtype and backward_override (Transformer Engine's)."""
        if self.rht_dtype not in RHT_DTYPES:
            raise ValueError(f"unknown rht_dtype {self.rht_dtype!r}; valid: {RHT_DTYPES}")
        signs = self.rht_signs
        if signs is not None and signs != "transformer_engine":
            if isinstance(signs, str) or not all(s in (1, -1) for s in np.ravel(signs)) \
                    or np.shape(signs) != (TILE,):
                raise ValueError(
                    f"rht_signs takes None (signs from seed), 'transformer_engine' or {TILE} "
                    f"ints ±1; got {signs!r}")
            set_("rht_signs", tuple(int(s) for s in signs))
        if (signs is not None or self.rht_dtype != "float32") and not self.wgrad_rht:
            raise ValueError("rht_signs and rht_dtype describe wgrad_rht's Hadamard transform; "
                             "set wgrad_rht=True (or drop them)")
        if self.backward_override not in BACKWARD_OVERRIDES:
            raise ValueError(f"unknown backward_override {self.backward_override!r}; valid: "
                             f"{BACKWARD_OVERRIDES}")
        if self.backward_override is not None and self.high_precision_wgrad:
            raise ValueError(
                "backward_override sets both backward products; high_precision_wgrad sets the "
                "weight gradient's: use one (backward_override='high_precision' includes it)")
        if self.backward_override is not None and self.scaling == "delayed":
            raise ValueError("delayed scaling takes no backward_override (as in Transformer "
                             "Engine, whose DelayedScaling only supports None)")

    def _nvfp4_training(self) -> bool:
        return (self.weight_block_2d or self.wgrad_rht or self.grad_rounding != "nearest_even"
                or self._nvfp4_step != "divide"
                or self.four_over_six)

    def _check_nvfp4_training(self) -> None:
        if self.grad_rounding not in (Rounding.NEAREST_EVEN, Rounding.STOCHASTIC):
            raise ValueError(
                f"unknown grad_rounding {self.grad_rounding!r}; valid: 'nearest_even', 'stochastic'"
            )
        object.__setattr__(self, "grad_rounding", Rounding(self.grad_rounding))
        if not isinstance(self.four_over_six, bool):
            raise TypeError(f"four_over_six must be a bool, got {self.four_over_six!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {self.seed!r}")
        if not self._nvfp4_training():
            return
        names = {_name(f) for f in (*self.forward, *self.backward_operands, self.grad)}
        if (names != {"nvfp4"} or self.backward != "quantized" or self.scaling != "none"
                or self.high_precision_wgrad):
            raise ValueError(
                "weight_block_2d, wgrad_rht, grad_rounding='stochastic', scale_options "
                "nvfp4_step='reciprocal' and four_over_six are parts of the NVFP4 training recipe: they need "
                "forward='nvfp4', "
                "grad='nvfp4' (backward 'quantized'), scaling='none' and no "
                "high_precision_wgrad (backward_override='high_precision' instead); got "
                f"{self.describe()} (start from lowprec.NVIDIA_NVFP4)"
            )

    # -- description -------------------------------------------------------------------------

    def __repr__(self) -> str:
        label = f"{self.name!r}: " if self.name else ""
        return f"Recipe({label}{self.describe()})"

    def describe(self) -> str:
        """One line: forward lhs x rhs, backward operands and gradient, scale rule.

        Example:
            >>> NVIDIA_MXFP8.describe()
            'fwd mxfp8_e4m3 x mxfp8_e4m3 | bwd mxfp8_e4m3 x mxfp8_e4m3, grad mxfp8_e4m3 | rceil'
        """
        fwd = f"fwd {_name(self.forward[0])} x {_name(self.forward[1])}"
        if self.backward == "ste":
            bwd = "bwd ste"
        else:
            l, r = self.backward_operands
            bwd = f"bwd {_name(l)} x {_name(r)}, grad {_name(self.grad)}"
        used = (*self.forward, *self.backward_operands, self.grad)
        scaled = [f for f in used if isinstance(f, MXFormat) and f.scheme.takes_scale_rule]
        # NVFP4 has its own scale recipe
        extra = [self._scale_rule.value] if scaled else []
        if self.scaling == "delayed" and self.delayed is not None:
            d = self.delayed
            extra.append(f"delayed scaling (history {d.amax_history_len}, "
                         f"{d.amax_compute_algo}, margin {d.margin})")
        elif self.scaling != "none":
            extra.append(f"{self.scaling} scaling")
        if self.high_precision_wgrad:
            extra.append("fp32 wgrad")
        if self.weight_block_2d:
            extra.append("16x16 weight scales")
        if self.wgrad_rht:
            extra.append("wgrad RHT")
        if self.rht_signs is not None:
            extra.append("RHT signs " + (self.rht_signs if isinstance(self.rht_signs, str)
                                         else "".join("+-"[s < 0] for s in self.rht_signs)))
        if self.rht_dtype != "float32":
            extra.append(f"{self.rht_dtype} RHT")
        if self.grad_rounding != "nearest_even":
            extra.append(f"{self.grad_rounding} grad rounding")
        step = self._nvfp4_step
        if step != "divide":
            extra.append(f"{step} NVFP4 step")
        if self.four_over_six:
            extra.append("4over6 forward")
        if self.backward_override is not None:
            extra.append(f"{self.backward_override} backward")
        if self.high_precision:
            extra.append("high precision: " + ", ".join(self.high_precision))
        return " | ".join([fwd, bwd] + ([", ".join(extra)] if extra else []))

    def keeps_high_precision(self, path: str) -> bool:
        """Whether the layer at ``path`` (names joined by ``/``) matches ``high_precision``.

        Example:
            >>> Recipe(forward="mxfp8", high_precision=("lm_head", "*/attn/*")).keeps_high_precision(
            ...     "block_0/attn/query")
            True
        """
        return any(fnmatch.fnmatchcase(path, p) for p in self.high_precision)

    # -- application -------------------------------------------------------------------------

    def dot_general(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        """``lax.dot_general`` with this recipe's formats; a drop-in for Flax's ``dot_general=``.

        Args:
          lhs, rhs: float32/bfloat16/float16 arrays.
          dimension_numbers: as for :func:`jax.lax.dot_general`.
          precision: accepted for compatibility and ignored: quantized operands are exact in
            the dtype the dot runs in, with float32 accumulation (see :func:`lowprec.dot_general`).
          preferred_element_type: output dtype; default: the operands' promoted dtype, as
            ``lax.dot_general`` gives.
          out_sharding: the output's sharding (a PartitionSpec on the mesh of
            ``jax.set_mesh``, or a NamedSharding), as for :func:`jax.lax.dot_general`: given to
            the inner dot, so a contraction sharded on both operands (a row-parallel layer)
            is reduced into it. Gradients are sharded as their operands.

        Example:
            >>> import jax.numpy as jnp
            >>> x, w = jnp.ones((2, 64)), jnp.full((64, 3), 0.1)
            >>> NVIDIA_MXFP8.dot_general(x, w, (((1,), (0,)), ((), ()))).tolist()[0]
            [6.5, 6.5, 6.5]
        """
        del precision
        self._state_needed("a recipe's dot_general")
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        out_dtype = _out_dtype(lhs, rhs, preferred_element_type, "recipe dot")
        dn = _normalize(dimension_numbers)
        out_sharding = out_sharding_arg(out_sharding)
        _check_forward_sharding(lhs, rhs, dn, self)
        spec = self.dot_spec(out_dtype)
        if spec.nvfp4 is not None:
            check_layout(lhs.shape, rhs.shape, dn)
            if self.weight_block_2d:
                _check_weight_tiles(rhs, dn, self)
            sr_key = None
            if self.grad_rounding == "stochastic" and self.backward_override is None:
                sr_key = next_key(lhs, rhs, what=f"{self.name or 'recipe'} dot_general")
            out = nvfp4_dot(lhs, rhs, dn, spec, out_sharding, sr_key)
        else:
            call = spec.check_call(lhs, rhs, dn, out_sharding)
            out = dot_general_jit(call.lhs, call.rhs, call.dn, call.spec, call.out_sharding)
        if self.backward == "quantized" and self.backward_override is None:
            try:
                _check_backward_sharding(lhs, rhs, dn, self)
            except ValueError as e:  # refuse the backward pass only: inference is fine
                out = _fails_in_backward(out, str(e))
        return out

    def einsum(
        self,
        subscripts: str,
        lhs,
        rhs,
        *,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ) -> jax.Array:
        """Two-operand ``jnp.einsum`` through :meth:`dot_general` (a drop-in ``einsum_op``).

        Indices in both operands and the output are batch dims, in both operands only are
        contracted (several are flattened in order, then blocked), in one operand and the
        output are free; an index in one operand only and not in the output is summed first.
        ``...`` is supported; repeated indices within one operand (diagonals) are not.

        Example:
            >>> import jax.numpy as jnp
            >>> x, w = jnp.ones((2, 5, 64)), jnp.full((64, 4, 3), 0.5)
            >>> OCP_MXFP8.einsum("btd,dnh->btnh", x, w).shape
            (2, 5, 4, 3)
        """
        self._state_needed("a recipe's einsum")
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        plan = _einsum_plan(subscripts, lhs.shape, rhs.shape)
        if plan.lhs_sum:
            lhs = jnp.sum(lhs, axis=plan.lhs_sum)
        if plan.rhs_sum:
            rhs = jnp.sum(rhs, axis=plan.rhs_sum)
        out_sharding = out_sharding_arg(out_sharding)
        dot_sharding = None
        if out_sharding is not None:  # the einsum output's spec, in dot_general's dim order
            spec = tuple(out_sharding.spec) + (None,) * (len(plan.out_perm) - len(out_sharding.spec))
            inverse = [0] * len(plan.out_perm)
            for i, p in enumerate(plan.out_perm):
                inverse[p] = i
            dot_sharding = jax.sharding.NamedSharding(
                out_sharding.mesh, jax.sharding.PartitionSpec(*(spec[inverse[d]] for d in range(len(spec)))))
        out = self.dot_general(
            lhs, rhs, plan.dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=dot_sharding,
        )
        if plan.out_perm != tuple(range(out.ndim)):
            out = jnp.transpose(out, plan.out_perm)
        return out

    def ragged_dot(
        self,
        lhs,
        rhs,
        group_sizes,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
        out_sharding=None,
    ) -> jax.Array:
        """``lax.ragged_dot`` (a mixture-of-experts layer's grouped matmul) in this recipe.

        Rows ``start_g .. start_g + group_sizes[g] - 1`` of ``lhs`` [M, K] are multiplied by
        ``rhs[g]`` (``rhs`` [G, K, N]); rows past the last group give zeros. Each group is
        its own matmul: group g's forward product and both gradients are those of
        :meth:`dot_general` for that group's tokens and weight alone (see
        ``lowprec/_ragged.py``), as Transformer Engine's ``GroupedLinear`` quantizes each
        group's split of tokens on its own:

        * forward: both operands quantized along K (lhs along its axis 1, rhs along axis 1
          of each expert);
        * ``backward="quantized"``: grad_lhs = Q(g along N) · Q(rhs along N)ᵀ; grad_rhs =
          Q(lhs along tokens)ᵀ · Q(g along tokens) per group, with token blocks formed within
          each group (its last block zero-padded, as ``pad`` pads a dense layer's token
          axis) — group boundaries are data, so blocks never straddle two groups;
        * ``high_precision_wgrad``: grad_rhs as a float32 ragged dot of the unquantized
          tokens and cotangent;
        * ``scaling="tensor"`` and NVFP4's tensor scale: one scale per group of tokens (lhs,
          cotangent) and per expert (rhs), from that group's values.

        Against :meth:`dot_general` applied to all tokens at once with each expert's weight,
        the E8M0 MX recipes (:data:`OCP_MXFP8`, :data:`NVIDIA_MXFP8`, any ``mxfp*``) differ
        only in the weight gradient, whose token blocks start at each group's first token
        instead of every 32 tokens of the batch (a batch-wide block would mix two experts'
        tokens under one scale); :data:`FP8_HYBRID` (``scaling="tensor"``) and NVFP4 formats
        also differ in the forward and input gradient, with one scale per group and per
        expert instead of one per operand (each expert's GEMM is scaled for its own
        values). :data:`NVIDIA_NVFP4` (its 16 x 16 weight tiles, per expert; the Hadamard
        transform of the weight-gradient operands and their 16-blocks along tokens, in the
        per-group layout, so a block never mixes two groups; stochastic rounding of the
        cotangent, its words as ``lowprec/_ragged.py`` states) is each group's
        :meth:`dot_general` too, but for the random words, which are drawn for the whole
        cotangent; ``four_over_six`` is refused.

        Args:
          lhs: [M, K] float32/bfloat16/float16 tokens, grouped by expert.
          rhs: [G, K, N] float32/bfloat16/float16 weights, one per group.
          group_sizes: [G] integers, the number of consecutive rows of each group.
          precision: accepted for compatibility with ``lax.ragged_dot`` and ignored (as in
            :meth:`dot_general`).
          preferred_element_type: output dtype; default: the operands' promoted dtype.
          group_offset: not supported (must be None).
          out_sharding: the output's sharding, given to the inner ragged dot.

        Example:
            >>> import jax.numpy as jnp
            >>> x = jnp.ones((5, 64))
            >>> w = jnp.stack([jnp.full((64, 2), 0.1), jnp.full((64, 2), 1.0)])
            >>> NVIDIA_MXFP8.ragged_dot(x, w, jnp.array([3, 2]))[:, 0].tolist()
            [6.5, 6.5, 6.5, 64.0, 64.0]
        """
        del precision
        self._state_needed("a ragged dot")
        if self.four_over_six:
            raise ValueError(
                "ragged_dot does not implement four_over_six (Four over Six in the NVFP4 "
                "recipe's forward); use dataclasses.replace(recipe, four_over_six=False) for "
                "the expert layers, or keep them in high precision")
        spec = self.dot_spec(np.dtype(np.float32))
        call = spec.check_ragged_call(lhs, rhs, group_sizes, group_offset, out_sharding,
                               f"{self.name or 'recipe'} ragged_dot")
        out_dtype = _out_dtype(call.lhs, call.rhs, preferred_element_type, "recipe ragged_dot")
        spec = dataclasses.replace(spec, out_dtype=out_dtype)
        sr_key = None
        if (spec.nvfp4 is not None and self.grad_rounding == "stochastic"
                and self.backward_override is None):
            sr_key = next_key(call.lhs, call.rhs, what=f"{self.name or 'recipe'} ragged_dot")
        return ragged_dot_jit(call.lhs, call.rhs, call.group_sizes, spec, call.out_sharding,
                              sr_key)

    def dot_spec(self, out_dtype=np.float32) -> DotSpec:
        """The options of this recipe's dots (the one options object of lowprec's training
        dot, :class:`~lowprec._options.DotSpec`), with output dtype ``out_dtype``.

        Example:
            >>> spec = FP8_HYBRID.dot_spec()
            >>> spec.lhs.fmt.name, spec.grad.fmt.name, spec.tensor_scaling, spec.lhs.overflow
            ('e4m3', 'e5m2', True, <Overflow.SATURATE: 'saturate'>)
        """
        override = self.backward_override
        # The scale keeps amax in range; element casts saturate its edge.
        overflow = "saturate" if self.scaling == "tensor" else "ieee"
        nvfp4 = None
        if self._nvfp4_training():
            nvfp4 = NVFP4Training(
                self.weight_block_2d, self.wgrad_rht, self.grad_rounding, self.seed,
                self._nvfp4_step, self.rht_signs, self.rht_dtype, override, self.four_over_six)
        # backward_override: both backward products from the forward's quantized values
        # ("ste"), or float32 products of the unquantized ones (except the NVFP4 recipe's,
        # whose "dequantized" products read its own 16 x 16 weight tiles).
        backward = self.backward if override is None or nvfp4 is not None else "ste"
        grad = self.grad if backward == "quantized" else None
        lfmt, rfmt = self.forward
        spec = DotSpec.create(lfmt, rfmt, grad, self._scale_rule, self.rounding, overflow,
                              self.pad, backward, out_dtype, kernels_enabled())
        # Every cast with the recipe's options of its own scheme (create gives the rule only).
        extra = {side: self._cast(fmt, overflow, f"{side}_format")
                 for side, fmt in (("lhs", lfmt), ("rhs", rfmt), ("grad", grad))}
        if backward == "quantized" and self.backward_operands != self.forward:
            for side, fmt in zip(("lhs", "rhs"), self.backward_operands):
                extra[f"backward_{side}"] = self._cast(fmt, overflow, f"backward_operands ({side})")
        hp = override == "high_precision" and nvfp4 is None
        return dataclasses.replace(
            spec, tensor_scaling=self.scaling == "tensor",
            high_precision_wgrad=self.high_precision_wgrad or hp, high_precision_dgrad=hp,
            nvfp4=nvfp4, delayed=self.delayed, **extra)


# -- scale options ------------------------------------------------------------------------------


def _scale_options(given, formats) -> tuple:
    """``scale_options=`` as a recipe stores it: the options values that differ from their
    scheme's defaults, one per scheme, ordered by class name. ``given``: None, an options
    value, a dict of fields (each set on the options of the recipe's MX ``formats`` whose
    scheme takes it) or a tuple/list of those (later ones override earlier ones)."""
    items = given if isinstance(given, (tuple, list)) else (() if given is None else (given,))
    schemes = {f.scheme.Options: f.scheme for f in formats if isinstance(f, MXFormat)}
    values = {}
    for item in items:
        if isinstance(item, dict):
            taken = set()
            for cls, scheme in schemes.items():
                fields = {k: v for k, v in item.items() if scheme.takes(k)}
                if fields:
                    values[cls] = scheme.options(values.get(cls), scheme.name, **fields)
                    taken.update(fields)
            if set(item) - taken:
                names = ", ".join(sorted(f"{s.name} ({', '.join(s.option_names()) or 'none'})"
                                         for s in schemes.values())) or "none"
                raise ValueError(
                    f"scale_options fields {sorted(set(item) - taken)} are options of no scale "
                    f"scheme of this recipe's MX formats (schemes and their options: {names}); "
                    "drop them")
        elif dataclasses.is_dataclass(item) and not isinstance(item, type):
            values[type(item)] = item
        else:
            raise TypeError(
                "scale_options takes a dict of option fields (e.g. {'scale_rule': 'rceil'}), "
                f"a scale scheme's options value (fmt.scheme.Options(...)) or a tuple of them, "
                f"got {item!r}")
    return tuple(sorted((v for cls, v in values.items() if v != cls()),
                        key=lambda v: type(v).__name__))


def _old_keywords(init):
    """``Recipe.__init__`` also taking the former spellings ``scale_rule=`` and
    ``nvfp4_step=`` (with a DeprecationWarning), as the options they set in
    ``scale_options`` (``dataclasses.replace(recipe, scale_rule=...)`` included)."""

    @functools.wraps(init)
    def __init__(self, *args, scale_rule=None, nvfp4_step=None, **kwargs):
        old = {}
        if scale_rule is not None:
            old["scale_rule"] = E8M0Options(scale_rule)
        if nvfp4_step is not None:
            old["nvfp4_step"] = NVFP4Options(nvfp4_step)
        if old:
            given = kwargs.get("scale_options")
            given = list(given) if isinstance(given, (tuple, list)) else (
                [] if given is None else [given])
            kwargs["scale_options"] = (*given, *old.values())
            # dataclasses.replace(recipe, scale_rule=...): point at replace's caller
            caller = inspect.currentframe().f_back
            replaced = caller is not None and caller.f_code is dataclasses.replace.__code__
            warn_deprecated(f"Recipe({'=, '.join(old)}=)",
                            "Recipe(scale_options={" + ", ".join(f"'{k}': ..." for k in old)
                            + "})", stacklevel=4 if replaced else 3)
        init(self, *args, **kwargs)

    return __init__


Recipe.__init__ = _old_keywords(Recipe.__init__)


# -- the dot ------------------------------------------------------------------------------------


def _out_dtype(lhs, rhs, preferred_element_type, what: str) -> np.dtype:
    """The output dtype of a recipe dot: ``preferred_element_type``, default the operands'
    promoted dtype (as ``lax.dot_general`` gives)."""
    if preferred_element_type is None:
        out_dtype = np.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
    else:
        out_dtype = np.dtype(preferred_element_type)
    if out_dtype not in _OUTPUT_DTYPES:
        raise TypeError(
            f"{what} output dtype must be float32, bfloat16 or float16, got {out_dtype} "
            "(from preferred_element_type or the operands' dtypes)"
        )
    return out_dtype


def _normalize(dimension_numbers):
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        return tuple(tuple(tuple(int(d) for d in dims) for dims in pair) for pair in ((lc, rc), (lb, rb)))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)) as in lax.dot_general, got {dimension_numbers!r}"
        ) from None


def _check_forward_sharding(lhs, rhs, dn, recipe: Recipe) -> None:
    """MX blocks of the forward dot must not straddle shards (see lowprec._sharding); checked
    here too so that the error names the recipe."""
    (lc, rc), _ = dn
    name = recipe.name or "recipe"
    for x, fmt, contract, role in ((lhs, recipe.forward[0], lc, "lhs"), (rhs, recipe.forward[1], rc, "rhs")):
        if isinstance(fmt, MXFormat):
            check_contraction(x, contract, fmt.block_size, f"{name} forward dot, {role} contraction")


def _check_weight_tiles(rhs, dn, recipe: Recipe) -> None:
    """16 x 16 weight tiles (``weight_block_2d``) also run along the weight's output axes
    (N, flattened): they must not straddle shards there either (K is checked with the
    forward blocks)."""
    (_, rc), _ = dn
    free = tuple(d for d in range(rhs.ndim) if d not in rc)
    check_contraction(rhs, free, TILE, f"{recipe.name or 'recipe'} 16 x 16 weight tiles along "
                      f"the weight's output axes {free}")


def _check_backward_sharding(lhs, rhs, dn, recipe: Recipe) -> None:
    """The backward dots block each operand along its *free* dims (grad_rhs reduces over
    lhs's free dims, e.g. tokens; grad_lhs over rhs's, e.g. output features)."""
    (lc, rc), (lb, rb) = dn
    name = recipe.name or "recipe"
    for x, fmt, contract, batch, role, grad in (
        (lhs, recipe.backward_operands[0], lc, lb, "lhs", "rhs"),
        (rhs, recipe.backward_operands[1], rc, rb, "rhs", "lhs"),
    ):
        free = tuple(d for d in range(x.ndim) if d not in contract and d not in batch)
        blocks = [f.block_size for f in (fmt, recipe.grad) if isinstance(f, MXFormat)]
        if blocks and free:
            what = (f"{name} backward dot for grad_{grad}, which reduces over {role}'s free dims "
                    f"{free} (e.g. tokens for the weight gradient)")
            check_contraction(x, free, max(blocks), what)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _fails_in_backward(y, message: str):
    """Identity whose backward pass raises ``ValueError(message)`` (at trace time)."""
    return y


def _fails_fwd(y, message):
    return y, None


def _fails_bwd(message, _, g):
    raise ValueError(message)


_fails_in_backward.defvjp(_fails_fwd, _fails_bwd)


# -- einsum -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _EinsumPlan:
    dimension_numbers: tuple
    lhs_sum: tuple
    rhs_sum: tuple
    out_perm: tuple


def _expand_ellipsis(term: str, ndim: int, letters: str, what: str) -> str:
    if "..." not in term:
        if len(term) != ndim:
            raise ValueError(f"einsum {what} {term!r} has {len(term)} indices for rank {ndim}")
        return term
    if term.count("...") > 1:
        raise ValueError(f"einsum {what} {term!r} has more than one ellipsis")
    n = ndim - (len(term) - 3)
    if n < 0:
        raise ValueError(f"einsum {what} {term!r} has more indices than rank {ndim}")
    return term.replace("...", letters[len(letters) - n:] if n else "")


@functools.lru_cache(maxsize=256)
def _einsum_plan(subscripts: str, lhs_shape: tuple, rhs_shape: tuple) -> _EinsumPlan:
    if not isinstance(subscripts, str):
        raise TypeError(f"einsum subscripts must be a string, got {subscripts!r}")
    spec = subscripts.replace(" ", "")
    inputs, arrow, output = spec.partition("->")
    terms = inputs.split(",")
    if len(terms) != 2:
        raise ValueError(
            f"a recipe einsum takes exactly two operands (input, kernel), got {subscripts!r}"
        )
    used = set(spec) - set(".,->")
    bad = sorted(c for c in used if not c.isalpha())
    if bad:
        raise ValueError(f"einsum {subscripts!r}: invalid index characters {bad}")
    # Ellipsis dims get fresh letters, aligned from the right (NumPy's broadcasting order).
    pool = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used)
    n_ell = max(
        (len(shape) - (len(t) - 3)) if "..." in t else 0
        for t, shape in zip(terms, (lhs_shape, rhs_shape))
    )
    ell = pool[:n_ell]
    lt = _expand_ellipsis(terms[0], len(lhs_shape), ell, "lhs")
    rt = _expand_ellipsis(terms[1], len(rhs_shape), ell, "rhs")
    if not arrow:
        once = sorted(c for c in set(lt + rt) if (lt + rt).count(c) == 1 and c not in ell)
        output = ell + "".join(once)
    else:
        output = output.replace("...", ell)
    for t, what in ((lt, "lhs"), (rt, "rhs"), (output, "output")):
        if len(set(t)) != len(t):
            raise ValueError(
                f"einsum {subscripts!r}: repeated index in the {what} (diagonals/traces) is not "
                "supported by a recipe einsum; use jnp.einsum for that"
            )
    extra = sorted(set(output) - set(lt) - set(rt))
    if extra:
        raise ValueError(f"einsum {subscripts!r}: output indices {extra} appear in no operand")
    size = {}
    for t, shape in ((lt, lhs_shape), (rt, rhs_shape)):
        for c, n in zip(t, shape):
            if size.setdefault(c, n) != n:
                raise ValueError(
                    f"einsum {subscripts!r}: index {c!r} has sizes {size[c]} and {n} "
                    f"(shapes {tuple(lhs_shape)}, {tuple(rhs_shape)}); broadcasting is not supported"
                )
    lhs_sum = tuple(i for i, c in enumerate(lt) if c not in rt and c not in output)
    rhs_sum = tuple(i for i, c in enumerate(rt) if c not in lt and c not in output)
    lt2 = "".join(c for i, c in enumerate(lt) if i not in lhs_sum)
    rt2 = "".join(c for i, c in enumerate(rt) if i not in rhs_sum)
    batch = [c for c in lt2 if c in rt2 and c in output]
    contract = [c for c in lt2 if c in rt2 and c not in output]
    lfree = [c for c in lt2 if c not in rt2]
    rfree = [c for c in rt2 if c not in lt2]
    dn = (
        (tuple(lt2.index(c) for c in contract), tuple(rt2.index(c) for c in contract)),
        (tuple(lt2.index(c) for c in batch), tuple(rt2.index(c) for c in batch)),
    )
    produced = batch + lfree + rfree
    out_perm = tuple(produced.index(c) for c in output)
    return _EinsumPlan(dn, lhs_sum, rhs_sum, out_perm)


# -- ready-made recipes -------------------------------------------------------------------------

#: OCP MX v1.0: ``floor`` scales, MXFP8 E4M3 operands, MXFP8 E5M2 gradients.
OCP_MXFP8 = Recipe(
    forward="mxfp8_e4m3", grad="mxfp8_e5m2", scale_options={"scale_rule": "floor"},
    name="ocp_mxfp8"
)
#: NVIDIA MXFP8 (Mishra et al. 2025, Transformer Engine): ``rceil`` scales, E4M3 everywhere.
NVIDIA_MXFP8 = Recipe(
    forward="mxfp8_e4m3", grad="mxfp8_e4m3", scale_options={"scale_rule": "rceil"},
    name="nvidia_mxfp8"
)
#: FP8 E4M3 forward / E5M2 backward with power-of-two per-tensor current scaling.
FP8_HYBRID = Recipe(forward="e4m3", grad="e5m2", scaling="tensor", name="fp8_hybrid")

#: FP8 E4M3 forward / E5M2 backward with Transformer Engine's delayed scaling (state per layer:
#: applied by lowprec.flax, e.g. ``quantize_model(model, FP8_DELAYED)``).
FP8_DELAYED = Recipe(forward="e4m3", grad="e5m2", scaling="delayed", name="fp8_delayed")

#: NVIDIA's NVFP4 training recipe (arXiv 2509.25149; Transformer Engine ``NVFP4BlockScaling``):
#: NVFP4 operands, 16 x 16 weight scales, RHT on the weight-gradient operands, stochastic
#: rounding of gradients. Keep the last layers in high precision with ``high_precision``/Rules.
NVIDIA_NVFP4 = Recipe(
    forward="nvfp4", grad="nvfp4", weight_block_2d=True, wgrad_rht=True,
    grad_rounding="stochastic", name="nvidia_nvfp4",
)

#: The ready-made recipes by name.
RECIPES = {r.name: r for r in (OCP_MXFP8, NVIDIA_MXFP8, FP8_HYBRID, FP8_DELAYED, NVIDIA_NVFP4)}

__all__ = [
    "FP8_DELAYED",
    "FP8_HYBRID",
    "NVIDIA_MXFP8",
    "NVIDIA_NVFP4",
    "OCP_MXFP8",
    "RECIPES",
    "Recipe",
]
