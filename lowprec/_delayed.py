"""Delayed scaling of FP8 casts, with Transformer Engine's semantics (``DelayedScaling``).

An FP8 tensor is cast as ``q = fp8(x * scale)`` (saturating at the format's max) and read as
``q / scale``. With *delayed* scaling, ``scale`` is not computed from ``x`` itself but from a
history of the amax (largest finite magnitude) of that tensor over the previous steps, as in
Transformer Engine (``transformer_engine.common.recipe.DelayedScaling(margin,
amax_history_len, amax_compute_algo)``):

* at each step the tensor's current amax is recorded;
* after the step, ``amax = max(history)`` (``"max"``) or the latest entry (``"most_recent"``),
  and ``scale = (fp8_max / amax) / 2^margin``; where that amax is 0 or not finite the
  previous scale is kept;
* the history is a window of the last ``amax_history_len`` amaxes (newest first).

So step t uses the scale computed from the amaxes of steps t-1, t-2, ... (1.0 at the first
step: the state starts with an empty history and scale 1). lowprec computes every step in
float32 with IEEE operations (``x * scale``, the cast by exact rounding, ``q / scale``), so a
NumPy statement of the same steps gives the same bits (tests/test_delayed.py).

The GEMMs (forward, and both backward products, which reuse the forward's codes): on CPU
(and with the kernel policy ``"xla"``) a float32 dot (``precision=HIGHEST``) of the values
``q / scale``; on a CUDA GPU cuBLASLt's FP8 GEMM (``_gpu_gemm.py``) of the codes q themselves,
read as float8, with the exact reciprocals ``1 / scale`` as its ``scale_a``/``scale_b``
(applied to the float32 accumulator): E4M3 x E4M3 forward, E5M2 cotangent x E4M3 backward,
as Transformer Engine computes them (docs/design.md §13 states the accumulation's bound).

The state of one matmul is a :class:`DelayedState` (lhs, rhs and cotangent histories and
scales). :func:`delayed_dot_general` takes it as an argument and returns the updated state as
its *gradient* (the cotangent's amax is only known in the backward pass): differentiate with
respect to the state and use that gradient as the next step's state, as Flax's
``Fp8DotGeneralOp`` does with its overwrite-with-gradient collection.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ._bits import bits_to_f32, f32_bits
from ._decode import decode_f32
from ._dtypes import bits_to_dtype, input_bits
from ._encode import encode_bits
from ._format import ElementFormat, element_format
from ._gpu_gemm import fp8_dot_general, fp8_pair, fp8_values
from ._nvfp4 import f32_div_hwfloat
from ._options import DotSpec
from ._qdot import register_family, training_dot
from ._scale_rules import DEFAULT_SCALE_RULE
from ._sharding import out_sharding_arg
from .kernels._dispatch import gpu_gemm_routes, kernels_enabled, on_cuda

__all__ = ["DelayedScaling", "DelayedState", "delayed_dot_general"]

AMAX_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's ``DelayedScaling`` options (same names and defaults).

    Attributes:
      margin: the scale is divided by 2^margin.
      amax_history_len: length of the amax window.
      amax_compute_algo: ``"max"`` (largest amax in the window) or ``"most_recent"``.
      fwd_format, bwd_format: FP8 formats of the operands and of the cotangent (TE's
        ``Format.HYBRID``: E4M3 forward, E5M2 backward).

    Example:
        >>> DelayedScaling().amax_history_len
        1024
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fwd_format: str = "e4m3"
    bwd_format: str = "e5m2"

    def __post_init__(self):
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"unknown amax_compute_algo {self.amax_compute_algo!r}; valid: {AMAX_ALGOS}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be a positive int, got {self.amax_history_len!r}")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool):
            raise TypeError(f"margin must be an int, got {self.margin!r}")
        if abs(self.margin) > 126:
            # 2^-margin must be a float32 normal: past that the scale is 0 or inf.
            raise ValueError(f"margin must lie in [-126, 126] (the scale is divided by "
                             f"2^margin), got {self.margin}")
        for f in (self.fwd_format, self.bwd_format):
            element_format(f)  # validates the name

    def init(self) -> "DelayedState":
        """The state before the first step: empty histories, scales 1."""
        hist = jnp.zeros((3, self.amax_history_len), jnp.float32)
        return DelayedState(hist, jnp.ones((3,), jnp.float32))


class DelayedState(NamedTuple):
    """Histories (row 0: lhs, 1: rhs, 2: cotangent; column 0 the newest) and scales."""

    amax_history: jax.Array
    scale: jax.Array


def _f32(x):
    """float32 values, widened on the bits (no float convert: docs/design.md §8)."""
    return bits_to_f32(input_bits(x))


def _amax(x):
    a = jnp.abs(_f32(x))
    return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0)


def _divide(a, b):
    """IEEE float32 a / b (a finite; b nonzero, not NaN: a scale that overflowed to inf, for
    an amax below ~2^-112, divides to zero) on every backend: XLA:GPU's float32 division is
    not correctly rounded (``_nvfp4.f32_div_hwfloat``)."""
    return bits_to_f32(f32_div_hwfloat(*jnp.broadcast_arrays(f32_bits(a), f32_bits(b))))


def _reciprocal(scale):
    """1 / scale, rounded once (IEEE) on every backend: the FP8 GEMM's output factor."""
    return _divide(jnp.float32(1.0), scale)


def _codes(x, scale, fmt: ElementFormat):
    """The codes of q = fmt(x * scale), rounded to nearest even and saturating (uint8)."""
    bits = f32_bits(_f32(x) * scale)
    return encode_bits(fmt, bits, "nearest_even", "saturate", None).astype(jnp.uint8)


def _values(codes, scale, fmt: ElementFormat):
    """q / scale in float32 (IEEE), for the codes of q."""
    return _divide(decode_f32(fmt, codes), scale)


def _update(cfg: DelayedScaling, hist, scale, amax, fmax):
    """Records ``amax`` (newest first), then the new scale from the window."""
    hist = jnp.concatenate([amax[None], hist[:-1]])
    chosen = jnp.max(hist) if cfg.amax_compute_algo == "max" else hist[0]
    ok = (chosen > 0) & jnp.isfinite(chosen)
    # The exact quotient (a scalar: the long division costs nothing here), then / 2^margin as
    # the product with 2^-margin (exact, |margin| <= 126): one rounding of the same value.
    new = _divide(fmax, jnp.where(ok, chosen, 1.0)) * jnp.float32(2.0**-cfg.margin)
    return hist, jnp.where(ok, new, scale)


def delayed_dot_general(lhs, rhs, state: DelayedState, dimension_numbers, cfg: DelayedScaling,
                        out_sharding=None):
    """``lax.dot_general`` of FP8 operands cast with delayed scales; differentiable.

    Returns the float32 dot of ``lhs`` and ``rhs`` cast with ``state.scale[0]`` and
    ``state.scale[1]`` (``cfg.fwd_format``); the backward dots cast the cotangent with
    ``state.scale[2]`` (``cfg.bwd_format``) and reuse the cast operands. The gradient with
    respect to ``state`` is the next step's state (module docstring). On a CUDA GPU each
    product is cuBLASLt's FP8 GEMM (module docstring; the kernel policy ``"xla"`` keeps the
    float32 dots of the cast values there too).

    Args:
      lhs, rhs: float32/bfloat16/float16 arrays.
      state: the :class:`DelayedState` of this matmul (``cfg.init()`` at the first step).
      dimension_numbers: as for :func:`jax.lax.dot_general`.
      cfg: the :class:`DelayedScaling` options.
      out_sharding: the output's sharding (a PartitionSpec on the mesh of ``jax.set_mesh``,
        or a NamedSharding), as for :func:`jax.lax.dot_general`: given to the forward dot,
        so a contraction sharded on both operands (a row-parallel layer) is reduced into it.
        Gradients are sharded as their operands (JAX's transpose of the dot).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cfg = DelayedScaling(amax_history_len=4)
        >>> st = cfg.init()
        >>> x, w = jnp.ones((2, 8)), jnp.full((8, 3), 0.5)
        >>> f = lambda a, b, s: delayed_dot_general(a, b, s, (((1,), (0,)), ((), ())), cfg).sum()
        >>> st = jax.jit(jax.grad(f, argnums=2))(x, w, st)
        >>> st.scale.tolist()  # 448 / 1, 448 / 0.5, 57344 / 1 (the cotangent of sum is 1)
        [448.0, 896.0, 57344.0]
    """
    if not isinstance(cfg, DelayedScaling):
        raise TypeError(f"cfg must be a lowprec.DelayedScaling, got {cfg!r}")
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        dn = tuple(tuple(tuple(int(d) for d in dims) for dims in pair)
                   for pair in ((lc, rc), (lb, rb)))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)) as in lax.dot_general, got {dimension_numbers!r}"
        ) from None
    return training_dot(lhs, rhs, state, delayed_spec(cfg), ("delayed", dn,
                                                            out_sharding_arg(out_sharding)))


def delayed_spec(cfg: DelayedScaling) -> DotSpec:
    """The training dot's options of delayed scaling ``cfg``: FP8 casts of the operands
    (``fwd_format``) and of the cotangent (``bwd_format``), saturating, both backward dots
    quantized (``DotSpec.delayed`` holds ``cfg``; the scales come from the state)."""
    spec = DotSpec.create(cfg.fwd_format, cfg.fwd_format, cfg.bwd_format, DEFAULT_SCALE_RULE,
                          "nearest_even", "saturate", False, "quantized", jnp.float32)
    return dataclasses.replace(spec, delayed=cfg)


def _fp8_route(cfg: DelayedScaling) -> bool:
    """Whether the products are built for cuBLASLt's FP8 GEMM where XLA lowers for CUDA
    (static, read while tracing: the kernel policy, and a pair of formats cuBLASLt has)."""
    f, b = element_format(cfg.fwd_format), element_format(cfg.bwd_format)
    return gpu_gemm_routes(kernels_enabled()) and fp8_pair(f, f) and fp8_pair(b, f)


def _routed(cfg, gpu, portable, *args):
    return on_cuda(gpu, portable, *args) if _fp8_route(cfg) else portable(*args)


def _f32dot(a, b, dn, out_sharding=None):
    return lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32, out_sharding=out_sharding)


# -- the delayed layout family of the training dot --------------------------------------------------


def _fwd(lhs, rhs, state, spec: DotSpec, layout: tuple):
    _, dn, out_sharding = layout
    cfg = spec.delayed
    f = element_format(cfg.fwd_format)
    cl, cr = _codes(lhs, state.scale[0], f), _codes(rhs, state.scale[1], f)

    def portable(cl, cr, sl, sr):
        return _f32dot(_values(cl, sl, f), _values(cr, sr, f), dn, out_sharding)

    def gpu(cl, cr, sl, sr):  # the scales' reciprocals on the output: cuBLASLt's epilogue
        out = fp8_dot_general(fp8_values(cl, f), fp8_values(cr, f), dn, out_sharding)
        # One factor, as cuBLASLt forms scale_a · scale_b: XLA folds it whole (of two
        # multiplies it may fold one and leave a pass over the output).
        return out * (_reciprocal(sl) * _reciprocal(sr))

    out = _routed(cfg, gpu, portable, cl, cr, state.scale[0], state.scale[1])
    # Residuals: the codes (a byte per element), the amaxes, the state, and the operands'
    # dtypes (as zero scalars) for the gradients.
    dtypes = (jnp.zeros((), lhs.dtype), jnp.zeros((), rhs.dtype))
    return out, (cl, cr, _amax(lhs), _amax(rhs), state, dtypes)


def _bwd(spec: DotSpec, layout: tuple, res, g):
    _, dn, out_sharding = layout
    cfg = spec.delayed
    cl, cr, al, ar, state, (lhs_t, rhs_t) = res
    ff, fb = element_format(cfg.fwd_format), element_format(cfg.bwd_format)
    cg = _codes(g, state.scale[2], fb)  # g: the float32 output's cotangent

    def portable(cl, cr, cg, scales):
        return _transposed_with(lambda c, f, s: _values(c, s, f),
                                lambda a, b: _f32dot(a, b, dn, out_sharding), cl, cr, cg,
                                scales, ff, fb)

    def gpu(cl, cr, cg, scales):  # as the forward product: the scales on each output
        gl, gr = _transposed_with(lambda c, f, s: fp8_values(c, f),
                                  lambda a, b: fp8_dot_general(a, b, dn, out_sharding), cl, cr,
                                  cg, scales, ff, fb)
        rl, rr, rg = (_reciprocal(s) for s in scales)
        return gl * (rg * rr), gr * (rl * rg)

    gl, gr = _routed(cfg, gpu, portable, cl, cr, cg, tuple(state.scale))
    rows, scales = [], []
    for i, (amax, fmt) in enumerate(((al, ff), (ar, ff), (_amax(g), fb))):
        h, s = _update(cfg, state.amax_history[i], state.scale[i], amax,
                       jnp.float32(fmt.max_finite))
        rows.append(h)
        scales.append(s)
    new_state = DelayedState(jnp.stack(rows), jnp.stack(scales))
    return (bits_to_dtype(f32_bits(gl), lhs_t.dtype), bits_to_dtype(f32_bits(gr), rhs_t.dtype),
            new_state)


def _transposed_with(operand, dot, cl, cr, cg, scales, ff, fb):
    """Both backward products: the transposes of ``dot`` (the forward product) at the cast
    operands, applied to the cast cotangent (JAX's transpose rule: each gradient in its
    operand's layout and, on Explicit mesh axes, sharding); ``operand(codes, fmt, scale)``
    builds each operand from its codes."""
    sl, sr, sg = scales
    _, vjp = jax.vjp(dot, operand(cl, ff, sl), operand(cr, ff, sr))
    return vjp(operand(cg, fb, sg))


register_family("delayed", _fwd, _bwd)
