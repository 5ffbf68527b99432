"""Validated options: what every public function checks, checked once.

A public function turns its keyword arguments into one of these frozen, hashable objects
(construction validates and canonicalizes every field, with messages that name the value and
the fix), then calls the object's ``check_call`` once with the call's arrays: every entry
check of the call runs there (array dtype, axis, padding, blocks straddling shard
boundaries, key and random words, tensor scale, operand layout, ...) and it returns what the
core needs. The core takes the object as a static argument of ``jax.jit`` and never
validates again; public functions never call each other for their work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

import lowprec_formats as _data

from ._blocks import normalize_axis
from ._format import (
    ElementFormat,
    FormatLike,
    MXFormat,
    MXFormatLike,
    element_format,
    mx_format,
    resolve_format,
)
from ._dtypes import check_input_dtype, host_decode
from ._mxarray import MXArray
from ._rounding import DocumentedStr, Rounding, check_overflow, check_rounding
from ._scale_rules import DEFAULT_SCALE_RULE, ScaleRule, check_scale_rule
from ._scheme_nvfp4 import NVFP4Step
from ._sharding import check_block_axis, check_contraction, out_sharding_arg


def _check_key(rounding: str, key, random_bits=None) -> None:
    if rounding == "stochastic" and key is None and random_bits is None:
        raise ValueError(
            "rounding='stochastic' needs a PRNG key: pass key=jax.random.key(seed) "
            "(or a split of your training key), or your own words as random_bits="
        )
    if rounding == "stochastic" and key is not None and random_bits is not None:
        raise ValueError(
            "rounding='stochastic' takes a key or random_bits, not both: random_bits= "
            "replaces the words lowprec.random_bits(key, shape) would draw"
        )
    if rounding != "stochastic" and key is not None:
        raise ValueError(
            f"key is only used by rounding='stochastic', but rounding={str(rounding)!r}; "
            "drop the key or choose rounding='stochastic'"
        )
    if key is not None:
        check_prng_key(key)
    if rounding != "stochastic" and random_bits is not None:
        raise ValueError(
            f"random_bits is only used by rounding='stochastic', but rounding={str(rounding)!r}; "
            "drop random_bits or choose rounding='stochastic'"
        )


@functools.lru_cache(maxsize=None)
def _raw_key_shape(impl: str) -> tuple:
    """The shape of a legacy raw key of PRNG implementation ``impl`` (traced, not run)."""
    return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def check_prng_key(key) -> None:
    """TypeError unless ``key`` is one PRNG key: a typed key of shape () (``jax.random.key``;
    a traced one under jit or vmap too), or a legacy raw key of the default implementation
    (``jax.random.PRNGKey``: uint32 of shape (2,) for threefry). Anything else (``key=0``, a
    batch of keys) would otherwise surface as JAX's internal PRNG message."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if tuple(shape) == ():
            return
    elif dtype is not None and np.dtype(dtype) == np.dtype(np.uint32):
        if tuple(shape) == _raw_key_shape(jax.config.jax_default_prng_impl):
            return
    got = (f"{dtype} array of shape {tuple(shape)}" if dtype is not None
           else f"{type(key).__name__} {key!r}")
    raise TypeError(
        f"key must be one PRNG key (jax.random.key(seed), or a legacy "
        f"jax.random.PRNGKey(seed)), got {got}; for several arrays split it "
        "(jax.random.split) and pass one key per call"
    )


def check_random_bits(random_bits, shape: tuple, what: str = "x's shape") -> None:
    """Caller-supplied stochastic-rounding words: a uint16 or uint32 array of ``shape``
    (one word per element), or a clear error."""
    if random_bits is None:
        return
    dtype = getattr(random_bits, "dtype", None)
    if dtype is None or np.dtype(dtype) not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        got = f"dtype {np.dtype(dtype)}" if dtype is not None else type(random_bits).__name__
        raise TypeError(
            f"random_bits must be a uint16 or uint32 array (one word per element), got {got}; "
            "draw them with lowprec.random_bits(key, shape) or jax.random.bits(key, shape, "
            "jnp.uint32)"
        )
    if tuple(random_bits.shape) != tuple(shape):
        raise ValueError(
            f"random_bits has shape {tuple(random_bits.shape)} but needs {what} {tuple(shape)}: "
            "one word per element"
        )


class _Randomness:
    """What an options object with a ``rounding`` field answers about random words."""

    rounding: str

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def check_key(self, key, random_bits=None) -> None:
        """Stochastic rounding needs a key or random words (one of them); every other mode
        refuses both."""
        _check_key(self.rounding, key, random_bits)


@dataclasses.dataclass(frozen=True)
class ElementCast(_Randomness):
    """How values are rounded to an element format (the options of ``encode``/``quantize``).

    Example:
        >>> ElementCast("e8m0", rounding="floor")
        ElementCast(fmt=ElementFormat('e8m0'), rounding=<Rounding.DOWN: 'down'>,
                    overflow=<Overflow.IEEE: 'ieee'>)
    """

    fmt: ElementFormat
    rounding: str = "nearest_even"
    overflow: str = "ieee"

    def __post_init__(self):
        fmt = element_format(self.fmt)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "rounding", check_rounding(fmt, self.rounding))
        object.__setattr__(self, "overflow", check_overflow(self.overflow))

    def check_call(self, x, *, key=None, random_bits=None) -> "ElementInput":
        """Every entry check of a call rounding ``x`` with this cast: the key or random words
        the rounding needs (one per element of ``x``), and ``x``'s dtype (a NumPy float6
        array is decoded on the host first). Returns the call's input for the core."""
        self.check_key(key, random_bits)
        x = jnp.asarray(host_decode(x))
        check_input_dtype(x.dtype)
        check_random_bits(random_bits, x.shape)
        return ElementInput(x, (key, random_bits))


class ElementInput(NamedTuple):
    """A validated call of an element cast: the array (a JAX array) and ``(key,
    random_bits)``."""

    x: jax.Array
    rng: tuple


@dataclasses.dataclass(frozen=True, init=False)
class MXCast(_Randomness):
    """How an array is block-quantized (the options of ``quantize_mx``/``fake_quantize_mx``).

    Elements always saturate to ± the element maximum (OCP MX v1.0). ``scale_options`` is
    the format's scale scheme's options value (``fmt.scheme.Options``: E8M0's
    :class:`~lowprec.ScaleRule`, NVFP4's :class:`~lowprec.NVFP4Step`, none for others),
    built from ``scale_options=`` (that value, or a dict of its fields) and the public
    keywords that are its fields (``scale_rule=``, ``nvfp4_step=``; None: the default).
    ``scale_rule`` is the one keyword a format whose scheme has no such field ignores (so
    that one rule can be given for all the operands of a dot; the public quantizers refuse
    an explicit rule for such a format, :meth:`check_call`); any other refuses it.

    Example:
        >>> MXCast("mxfp8", scale_rule="rceil")
        MXCast(fmt=MXFormat('mxfp8_e4m3'), rounding=<Rounding.NEAREST_EVEN: 'nearest_even'>,
               scale_options=E8M0Options(scale_rule=<ScaleRule.RCEIL: 'rceil'>))
        >>> c = MXCast("nvfp4")
        >>> c.scale_rule is None, c.nvfp4_step
        (True, <NVFP4Step.DIVIDE: 'divide'>)
    """

    fmt: MXFormat
    rounding: str
    scale_options: object

    def __init__(self, fmt: MXFormatLike, scale_rule: Union[str, ScaleRule, None] = None,
                 rounding: str = "nearest_even", nvfp4_step: Optional[str] = None, *,
                 scale_options=None):
        fmt = mx_format(fmt)
        scheme = fmt.scheme
        # A rule given to a scheme that takes none is dropped: one rule for every operand of
        # a dot (see the docstring).
        options = scheme.cast_options(scale_options, fmt.name, scale_rule=scale_rule,
                                      nvfp4_step=nvfp4_step)
        rounding = check_rounding(fmt.element, rounding)
        if scheme.roundings is not None and rounding not in scheme.roundings:
            raise ValueError(
                f"{fmt.name} elements round {' or '.join(map(str, scheme.roundings))} "
                f"({scheme.recipe}); got rounding={str(rounding)!r}")
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "rounding", rounding)
        object.__setattr__(self, "scale_options", options)

    @property
    def scale_rule(self) -> Optional[ScaleRule]:
        """The cast's scale rule (``scale_options.scale_rule``), None where the scheme
        takes none."""
        return getattr(self.scale_options, "scale_rule", None)

    @property
    def nvfp4_step(self):
        """The cast's NVFP4 step (``scale_options.nvfp4_step``), None where the scheme
        takes none."""
        return getattr(self.scale_options, "nvfp4_step", None)

    def check_call(self, x, func: str, *, axis=-1, pad: bool = False, key=None,
                   random_bits=None, tensor_scale=None, scale_rule=None,
                   exponents: bool = False) -> "BlockInput":
        """Every entry check of ``func`` block-quantizing ``x`` with this cast; returns the
        call's input for the core.

        Checks, in order: ``exponents``: that the scheme's scales are shared exponents (for
        ``shared_exponents``); ``scale_rule`` (as the caller gave it) where the format's
        scale scheme takes none; the key or random words of the rounding; ``tensor_scale`` as
        the scheme accepts it; ``x``'s dtype, rank, axis and length (whole blocks or
        ``pad``); that no block straddles a shard boundary of ``x``'s layout (see
        ``_sharding.py``); the random words' shape (the padded shape).
        """
        fmt = self.fmt
        scheme = fmt.scheme
        if exponents and not scheme.exponent_scales:
            raise ValueError(
                f"{func}: {fmt.name} block scales are {scheme.scale.name.upper()} values"
                + (" under a tensor scale" if scheme.tensor_scale else "")
                + ", not shared exponents; quantize_mx(x, ...).scales holds them"
            )
        if scale_rule is not None and not scheme.takes("scale_rule"):
            raise ValueError(
                f"{func}: {fmt.name} block scales follow {scheme.recipe}, so scale_rule does "
                f"not apply; got scale_rule={str(scale_rule)!r}. Drop it (scale rules choose "
                "E8M0 scales)"
            )
        self.check_key(key, random_bits)
        ts = scheme.tensor_scale_option(tensor_scale, fmt.name, func)
        x = jnp.asarray(host_decode(x))
        axis, n, padded = check_block_input(x.shape, x.dtype, fmt, axis, pad, func)
        check_block_axis(x, axis, fmt.block_size, func)  # blocks must not straddle shards
        padded_shape = tuple(x.shape[:axis]) + (padded,) + tuple(x.shape[axis + 1:])
        check_random_bits(random_bits, padded_shape, "the padded shape")
        return BlockInput(x, axis, n, padded, (key, random_bits), ts)


class BlockInput(NamedTuple):
    """A validated call of a block cast: the array (a JAX array), the block axis (normalized),
    its length and its length padded to whole blocks, ``(key, random_bits)``, and the
    tensor scale (a float32 scalar, or None: computed where the scheme has one)."""

    x: jax.Array
    axis: int
    n: int
    padded: int
    rng: tuple
    tensor_scale: Optional[jax.Array]


def check_block_input(shape, dtype, fmt: MXFormat, axis, pad: bool, func: str):
    """Validates an array of ``shape`` and ``dtype`` to be split into blocks of ``fmt``
    along ``axis``; returns ``(axis, n, padded_n)``.

    Block formats read float32 or narrower floats (float16, bfloat16, the ml_dtypes floats,
    all widened exactly); float64 would need its own block maximum.
    """
    dtype = np.dtype(dtype)
    try:
        accepted = dtype != np.dtype(np.float64) and check_input_dtype(dtype) is not None
    except TypeError:
        accepted = False
    if not accepted:
        raise TypeError(
            f"{func} takes float32, bfloat16, float16 or ml_dtypes float input, got dtype "
            f"{dtype}; convert with x.astype(jnp.float32)"
        )
    if len(shape) == 0:
        raise ValueError(f"{func} needs at least a 1-D array (blocks run along an axis)")
    axis = normalize_axis(axis, len(shape))
    n = shape[axis]
    block = fmt.block_size
    padded = -(-n // block) * block
    if n % block and not pad:
        raise ValueError(
            f"axis {axis} has length {n}, not a multiple of the {fmt.name} block size {block}; "
            f"pass pad=True to zero-pad it to {padded} (dequantize drops the padding), or "
            "choose another axis"
        )
    return axis, n, padded

# -- the quantized dot ---------------------------------------------------------------------

#: Element formats an operand can be rounded to (E8M0 is a scale format, not an operand),
#: besides any P3109 name.
OPERAND_ELEMENT_FORMATS: tuple[str, ...] = tuple(
    n for n in _data.ELEMENT_FORMATS if _data.ELEMENT_FORMATS[n]["zero"]
)
#: Every accepted operand format name (``None`` = leave the operand as it is).
OPERAND_FORMAT_NAMES: tuple[str, ...] = tuple(_data.MX_FORMATS) + OPERAND_ELEMENT_FORMATS


class BackwardMode(DocumentedStr):
    """What the backward pass of a quantized product computes (``backward=`` of
    :func:`lowprec.dot_general`, :func:`lowprec.matmul` and :class:`lowprec.Recipe`).

    Members are strings, so ``"ste"`` and ``BackwardMode.STE`` are interchangeable.

    Example:
        >>> BackwardMode("quantized") is BackwardMode.QUANTIZED, BackwardMode.STE == "ste"
        (True, True)
    """

    STE = (
        "ste",
        "The straight-through estimator: the exact float gradient of the quantized forward "
        "(quantization has derivative one), from the float operands.",
    )
    QUANTIZED = (
        "quantized",
        "Both backward dots quantized: the cotangent in the grad format and the operands "
        "re-quantized, each blocked along the reduction axis of its own backward dot.",
    )


#: The values of :class:`BackwardMode` (``lowprec.BACKWARD_MODES``, deprecated).
BACKWARD_MODES: tuple[str, ...] = tuple(m.value for m in BackwardMode)
OUTPUT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))
INPUT_DTYPES = OUTPUT_DTYPES

OperandCast = Union[None, MXCast, ElementCast]


def _valid_formats() -> str:
    return "valid formats: None, " + ", ".join(repr(n) for n in OPERAND_FORMAT_NAMES)


def operand_cast(fmt: FormatLike, role: str, scale_rule: ScaleRule, rounding: str,
                 overflow: str, scale_options=None) -> OperandCast:
    """A dot operand's format (name or object) → its MXCast / ElementCast, or None (the
    operand is used as it is); ``role`` names the argument in messages; ``scale_options``
    as :class:`MXCast` takes it (for an MX format)."""
    if fmt is None:
        return None
    if not isinstance(fmt, (str, ElementFormat, MXFormat)):
        raise TypeError(f"{role} must be a format name, a format object or None, got {fmt!r}")
    try:
        resolved = resolve_format(fmt)
    except ValueError:
        raise ValueError(f"unknown {role} {fmt!r}; {_valid_formats()}") from None
    if isinstance(resolved, MXFormat):
        return MXCast(resolved, scale_rule, rounding, scale_options=scale_options)
    if not resolved.zero:
        raise ValueError(
            f"{role}: {resolved.name} is a scale format, not an operand format; {_valid_formats()}"
        )
    return ElementCast(resolved, rounding, overflow)


def normalize_dn(dimension_numbers, lhs_shape, rhs_shape):
    """Validates ``((lc, rc), (lb, rb))`` against the shapes; returns it as tuples of ints."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(int(d) for d in dims) for dims in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)) as in lax.dot_general, got {dimension_numbers!r}"
        ) from None
    for side, shape, contract, batch in (("lhs", lhs_shape, lc, lb), ("rhs", rhs_shape, rc, rb)):
        nd = len(shape)
        dims = contract + batch
        if any(not 0 <= d < nd for d in dims):
            raise ValueError(
                f"{side} dimension numbers {dims} out of range for {side} of shape {shape} "
                "(use non-negative axes)"
            )
        if len(set(dims)) != len(dims):
            raise ValueError(
                f"{side} contracting {contract} and batch {batch} dims must be distinct"
            )
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"lhs and rhs need as many contracting ({len(lc)} vs {len(rc)}) and batch "
            f"({len(lb)} vs {len(rb)}) dimensions"
        )
    for kind, ld, rd in (("contracting", lc, rc), ("batch", lb, rb)):
        for a, b in zip(ld, rd):
            if lhs_shape[a] != rhs_shape[b]:
                raise ValueError(
                    f"mismatched shapes: lhs {kind} axis {a} has length {lhs_shape[a]} but rhs "
                    f"{kind} axis {b} has length {rhs_shape[b]} (lhs {lhs_shape}, rhs {rhs_shape})"
                )
    return (lc, rc), (lb, rb)


def _blocks_fit(cast: OperandCast, length: int, pad: bool, what: str) -> None:
    """An operand quantized to a block format along a contraction of ``length``: whole
    blocks, or ``pad``."""
    if isinstance(cast, MXCast) and length % cast.fmt.block_size and not pad:
        raise ValueError(
            f"{what}: contraction length {length} is not a multiple of the MX block size "
            f"{cast.fmt.block_size}; pass pad=True to zero-pad the blocks (zeros add nothing "
            "to the dot), or use a multiple of 32"
        )


#: ``backward_override=`` choices (Transformer Engine's ``NVTE_BACKWARD_OVERRIDE``): None (the
#: backward products as ``backward`` says), ``"high_precision"`` (float32 dots of the
#: unquantized cotangent and operands) or ``"dequantized"`` (of the unquantized cotangent and
#: the operands as the forward quantized them).
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
#: ``rht_dtype=`` choices: the dtype the Hadamard transform's operands and result are rounded to.
RHT_DTYPES = ("float32", "bfloat16")
#: The side of NVFP4's blocks, weight tiles and Hadamard blocks.
NVFP4_TILE = 16


@dataclasses.dataclass(frozen=True)
class NVFP4Training:
    """The parts of NVIDIA's NVFP4 training recipe a dot applies (``DotSpec.nvfp4``): the
    :class:`~lowprec.Recipe` fields of the same names, validated there
    (``lowprec/_nvfp4_train.py`` states the steps).

    Example:
        >>> NVFP4Training(weight_block_2d=True).nvfp4_step
        <NVFP4Step.DIVIDE: 'divide'>
    """

    weight_block_2d: bool = False
    wgrad_rht: bool = False
    grad_rounding: Rounding = Rounding.NEAREST_EVEN
    seed: int = 0
    nvfp4_step: NVFP4Step = NVFP4Step.DIVIDE
    rht_signs: Union[None, str, tuple] = None
    rht_dtype: str = "float32"
    backward_override: Optional[str] = None
    four_over_six: bool = False

    def __post_init__(self):
        object.__setattr__(self, "grad_rounding", Rounding(self.grad_rounding))
        object.__setattr__(self, "nvfp4_step", NVFP4Step(self.nvfp4_step))


#: A ``DotSpec`` field default: the backward dots re-quantize an operand in its forward cast.
FORWARD = "forward"


@dataclasses.dataclass(frozen=True)
class DotSpec:
    """Static, validated description of one quantized training dot: the one options object
    of :func:`lowprec.dot_general`, :func:`lowprec.ragged_dot`, the :class:`~lowprec.Recipe`
    dots, delayed scaling and the NVFP4 training recipe (all differentiated by the one
    custom VJP of ``_qdot.py``, :func:`~lowprec._qdot.training_dot`).

    ``lhs``/``rhs``/``grad`` are the operand casts (None: the operand is used as it is),
    built from the formats with ``scale_rule``/``rounding``/``overflow``; those three are
    kept for MXArray operands, whose casts are filled in from their own format
    (:meth:`check_call`). ``kernels``: whether the kernel policy of the call
    (``lowprec.kernels``) lets Pallas kernels serve it, a static part of the dot.

    What the recipes add (defaults: a plain ``dot_general``):

    * ``backward_lhs``/``backward_rhs``: the operands' casts in the ``backward="quantized"``
      dots (default ``"forward"``: their forward casts, :attr:`bwd_lhs`/:attr:`bwd_rhs`);
    * ``tensor_scaling``: each operand (and the cotangent) divided by its own power of two
      before an element cast (a recipe's ``scaling="tensor"``; the casts then saturate);
      a ragged dot's per group of tokens and per expert;
    * ``high_precision_wgrad``/``high_precision_dgrad``: the weight (rhs) / input (lhs)
      gradient as a float32 dot of the unquantized operand and cotangent (both: a recipe's
      ``backward_override="high_precision"``);
    * ``nvfp4``: the NVFP4 training recipe's parts (:class:`NVFP4Training`), or None;
    * ``delayed``: Transformer Engine's delayed scaling (a ``lowprec.DelayedScaling``), or
      None; the dot then takes a ``DelayedState`` and returns the next one as its gradient.

    A ragged dot takes the same object (``RaggedSpec`` is its former name).

    Example:
        >>> spec = DotSpec.create("mxfp8", None, None, "rceil", "nearest_even", "ieee", False,
        ...                       "ste", "float32")
        >>> spec.lhs.fmt, spec.rhs, spec.out_dtype
        (MXFormat('mxfp8_e4m3'), None, dtype('float32'))
    """

    lhs: OperandCast
    rhs: OperandCast
    grad: OperandCast
    scale_rule: ScaleRule
    rounding: str
    overflow: str
    pad: bool
    backward: str
    out_dtype: np.dtype
    kernels: bool = True
    backward_lhs: Union[OperandCast, str] = FORWARD
    backward_rhs: Union[OperandCast, str] = FORWARD
    tensor_scaling: bool = False
    high_precision_wgrad: bool = False
    high_precision_dgrad: bool = False
    nvfp4: Optional[NVFP4Training] = None
    delayed: Optional[object] = None

    @property
    def bwd_lhs(self) -> OperandCast:
        """The lhs cast of the ``backward="quantized"`` dots."""
        return self.lhs if isinstance(self.backward_lhs, str) else self.backward_lhs

    @property
    def bwd_rhs(self) -> OperandCast:
        """The rhs cast of the ``backward="quantized"`` dots."""
        return self.rhs if isinstance(self.backward_rhs, str) else self.backward_rhs

    @classmethod
    def create(
        cls, lhs_format, rhs_format, grad_format, scale_rule, rounding, overflow, pad,
        backward, preferred_element_type, kernels: bool = True, *, scale_options=None,
    ) -> "DotSpec":
        """Validates every keyword of :func:`lowprec.dot_general`, once (``kernels``: the
        kernel policy read by the caller). ``scale_rule`` None: ``scale_options``' rule
        where it gives one, else ``"floor"``."""
        if scale_rule is None:
            given = (scale_options.get("scale_rule") if isinstance(scale_options, dict)
                     else getattr(scale_options, "scale_rule", None))
            scale_rule = DEFAULT_SCALE_RULE if given is None else given
        rule = check_scale_rule(scale_rule)
        overflow = check_overflow(overflow)
        if rounding == "stochastic":
            raise ValueError(
                "dot_general rounds deterministically; for stochastic rounding quantize the "
                "operand with quantize_mx(x, fmt, rounding='stochastic', key=...) and pass the "
                "MXArray"
            )
        if rounding not in _data.ROUNDING_MODES:
            raise ValueError(
                f"unknown rounding mode {rounding!r}; valid modes: {_data.ROUNDING_MODES}"
            )
        if backward not in BACKWARD_MODES:
            raise ValueError(f"unknown backward mode {backward!r}; valid modes: {BACKWARD_MODES}")
        if grad_format is not None and backward != "quantized":
            raise ValueError("grad_format is only used with backward='quantized'")
        out_dtype = np.dtype(preferred_element_type)
        if out_dtype not in OUTPUT_DTYPES:
            raise TypeError(
                f"preferred_element_type must be float32, bfloat16 or float16, got {out_dtype}"
            )
        lhs, rhs, grad = (
            operand_cast(f, role, rule, rounding, overflow, scale_options)
            for f, role in ((lhs_format, "lhs_format"), (rhs_format, "rhs_format"),
                            (grad_format, "grad_format"))
        )
        if scale_options is not None and not any(isinstance(c, MXCast) for c in (lhs, rhs, grad)):
            raise ValueError(
                f"scale_options={scale_options!r} sets how MX blocks are scaled, but no operand "
                "is quantized to an MX format here (lhs_format, rhs_format, grad_format); drop "
                "it, or quantize an operand to an MX format")
        return cls(lhs, rhs, grad, rule, rounding, overflow, bool(pad), backward, out_dtype,
                   bool(kernels))

    def with_mx_operand(self, side: str, fmt: MXFormat) -> "DotSpec":
        """The spec with a pre-quantized operand's own format as ``side``'s cast."""
        return dataclasses.replace(self, **{side: MXCast(fmt, self.scale_rule, self.rounding)})

    def check_call(self, lhs, rhs, dimension_numbers, out_sharding=None) -> "DotInput":
        """Every entry check of a dot of ``lhs`` and ``rhs`` with this spec; returns the
        call's input for the core (an MXArray operand's own format filled in as its cast).

        Checks: the dimension numbers against the shapes; each operand (a float32, bfloat16
        or float16 array, or an MXArray blocked along its single contracting axis, whose
        format agrees with the one given); that no MX block straddles a shard boundary of an
        operand's layout; whole blocks along the contraction (or ``pad``); ``out_sharding``.
        """
        lhs_shape = tuple(lhs.shape) if isinstance(lhs, MXArray) else tuple(jnp.shape(lhs))
        rhs_shape = tuple(rhs.shape) if isinstance(rhs, MXArray) else tuple(jnp.shape(rhs))
        dn = normalize_dn(dimension_numbers, lhs_shape, rhs_shape)
        (lc, rc), _ = dn
        spec = self
        lhs, spec = spec._check_operand(lhs, "lhs", lc)
        rhs, spec = spec._check_operand(rhs, "rhs", rc)
        k = math.prod(lhs_shape[d] for d in lc)
        for role, x, contract in (("lhs", lhs, lc), ("rhs", rhs, rc)):
            cast = getattr(spec, role)
            what = f"dot_general {role}"
            if isinstance(x, MXArray):
                # Its codes are blocked along its contracting axis (FP4: half a byte per
                # code; FP6: 3/4): a block must lie in one shard.
                check_block_axis(x.elements, x.axis, x.fmt.bytes_per_block, what)
            elif isinstance(cast, MXCast):
                check_contraction(x, contract, cast.fmt.block_size, what)
                _blocks_fit(cast, k, spec.pad, role)
        return DotInput(spec, lhs, rhs, dn, out_sharding_arg(out_sharding))

    def _check_operand(self, x, role: str, contract):
        """``(x, spec)``: one operand validated, an MXArray's own format filled in."""
        cast = getattr(self, role)
        if isinstance(x, MXArray):
            fmt = None if cast is None else cast.fmt
            if fmt is not None and fmt != x.fmt:
                raise ValueError(
                    f"{role} is an MXArray in {x.fmt.name!r} but {role}_format={fmt.name!r} was "
                    f"given; pass {role}_format=None (or {x.fmt.name!r}) for a pre-quantized "
                    "operand"
                )
            if len(contract) != 1:
                raise ValueError(
                    f"{role} is an MXArray and must contract over exactly one axis (its block "
                    f"axis {x.axis}), got contracting dims {contract}"
                )
            if contract[0] != x.axis:
                raise ValueError(
                    f"{role} is an MXArray blocked along axis {x.axis}, which is not its "
                    f"contracting axis {contract[0]}: MX blocks must run along the contraction. "
                    f"Quantize it with quantize_mx(..., axis={contract[0]})"
                )
            return x, self.with_mx_operand(role, x.fmt)
        x = jnp.asarray(x)
        if np.dtype(x.dtype) not in INPUT_DTYPES:
            raise TypeError(
                f"{role} must be a float32, bfloat16 or float16 array or an MXArray, got dtype "
                f"{x.dtype}; convert it with .astype(jnp.float32)"
            )
        return x, self

    def check_backward(self, m: int, n: int) -> None:
        """The entry check of the ``backward="quantized"`` dots (run when the backward pass
        is traced) of a dot whose free dims have ``m`` (lhs) and ``n`` (rhs) elements:
        grad_lhs blocks the cotangent and the rhs along n, grad_rhs the cotangent and the
        lhs along m, so each quantized one needs whole blocks there (or ``pad``)."""
        for cast, length, what in (
            (self.grad, n, "backward grad_lhs (reduces over rhs's free dims), cotangent"),
            (self.bwd_rhs, n, "backward grad_lhs (reduces over rhs's free dims), rhs"),
            (self.grad, m, "backward grad_rhs (reduces over lhs's free dims), cotangent"),
            (self.bwd_lhs, m, "backward grad_rhs (reduces over lhs's free dims), lhs"),
        ):
            _blocks_fit(cast, length, self.pad, what)


    def check_ragged_call(self, lhs, rhs, group_sizes, group_offset=None, out_sharding=None,
                          func: str = "ragged_dot") -> "RaggedInput":
        """Every entry check of a ragged dot of ``lhs`` [M, K] and ``rhs`` [G, K, N] with
        ``group_sizes`` [G] with this spec; returns the call's input for the core.

        Checks: no ``group_offset``; float operands (no MXArray) of ranks 2 and 3 sharing K;
        integer group sizes of shape [G] (non-negative, where they are concrete); whole
        blocks along K (or ``pad``); that no MX block along K straddles a shard boundary;
        ``out_sharding``.
        """
        if group_offset is not None:
            raise NotImplementedError(
                f"{func}: group_offset (computing only some of the groups, for experts sharded "
                "across devices) is not supported; call it without group_offset on the groups "
                "this device holds"
            )
        for role, x in (("lhs", lhs), ("rhs", rhs)):
            if isinstance(x, MXArray):
                raise TypeError(
                    f"{func}: {role} is an MXArray; a ragged dot takes float arrays and "
                    f"quantizes them itself (pass the float values, or dequantize({role}))"
                )
        lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
        for role, x in (("lhs", lhs), ("rhs", rhs)):
            if np.dtype(x.dtype) not in INPUT_DTYPES:
                raise TypeError(
                    f"{func}: {role} must be a float32, bfloat16 or float16 array, got dtype "
                    f"{x.dtype}; convert it with .astype(jnp.float32)"
                )
        if lhs.ndim != 2 or rhs.ndim != 3:
            raise ValueError(
                f"{func} takes lhs [M, K] (tokens x features) and rhs [G, K, N] (one [K, N] "
                f"weight per group), as lax.ragged_dot; got shapes {tuple(lhs.shape)} and "
                f"{tuple(rhs.shape)}"
            )
        if lhs.shape[1] != rhs.shape[1]:
            raise ValueError(
                f"{func}: lhs has K = {lhs.shape[1]} features but rhs has K = {rhs.shape[1]} "
                f"(shapes {tuple(lhs.shape)} and {tuple(rhs.shape)})"
            )
        groups = rhs.shape[0]
        if groups == 0:
            raise ValueError(f"{func}: rhs holds no groups (shape {tuple(rhs.shape)})")
        group_sizes = _check_group_sizes(group_sizes, groups, func)
        k = lhs.shape[1]
        for role, x, cast in (("lhs", lhs, self.lhs), ("rhs", rhs, self.rhs)):
            if isinstance(cast, MXCast):
                check_contraction(x, (1,), cast.fmt.block_size, f"{func} {role} contraction")
                _ragged_blocks_fit(cast, k, self.pad, f"{func} {role}", "K")
        return RaggedInput(lhs, rhs, group_sizes, out_sharding_arg(out_sharding))

    def check_ragged_backward(self, n: int) -> None:
        """The entry check of a ragged dot's ``backward="quantized"`` (run when the backward
        pass is traced): grad_lhs blocks the cotangent and rhs along N, so each quantized one
        needs whole blocks there (or ``pad``). Token blocks are padded per group anyway."""
        for cast, what in ((self.grad, "cotangent"), (self.bwd_rhs, "rhs")):
            _ragged_blocks_fit(cast, n, self.pad,
                               f"ragged_dot backward grad_lhs (reduces over N), {what}", "N")


class RaggedInput(NamedTuple):
    """A validated ragged dot: the operands (JAX arrays), int32 group sizes and the output
    sharding (a NamedSharding or None)."""

    lhs: jax.Array
    rhs: jax.Array
    group_sizes: jax.Array
    out_sharding: object


def _check_group_sizes(group_sizes, groups: int, func: str):
    gs = jnp.asarray(group_sizes)
    if not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(
            f"{func}: group_sizes must be an integer array (tokens per group), got dtype "
            f"{gs.dtype}"
        )
    if gs.shape != (groups,):
        raise ValueError(
            f"{func}: group_sizes must have shape ({groups},), one size per group of rhs, got "
            f"shape {tuple(gs.shape)}"
        )
    if not isinstance(gs, jax.core.Tracer):
        sizes = np.asarray(gs)
        if np.any(sizes < 0):
            raise ValueError(f"{func}: group_sizes must be non-negative, got {sizes.tolist()}")
    return gs.astype(jnp.int32)


def _ragged_blocks_fit(cast: OperandCast, length: int, pad: bool, what: str, axis: str) -> None:
    if isinstance(cast, MXCast) and length % cast.fmt.block_size and not pad:
        raise ValueError(
            f"{what}: {axis} = {length} is not a multiple of the {cast.fmt.name} block size "
            f"{cast.fmt.block_size}; pass pad=True to zero-pad the blocks (zeros add nothing to "
            "the dot)"
        )


class DotInput(NamedTuple):
    """A validated dot: the spec (MXArray operands' formats filled in), the operands (float
    arrays as JAX arrays), the normalized dimension numbers and the output sharding (a
    NamedSharding or None)."""

    spec: DotSpec
    lhs: object
    rhs: object
    dn: tuple
    out_sharding: object
