"""Weight-only products of a prepared FP4 weight: :func:`weight_only_matmul`.

A weight prepared once by :func:`lowprec.prepare_weight` (``_prepared.py``) is multiplied by
:func:`weight_only_matmul`: on a Hopper GPU, up to 16 tokens, the kernel of
``kernels/_weight_only_mgpu.py`` (``kernels._dispatch.weight_only_kernel`` decides;
``lax.platform_dependent`` picks it where XLA lowers for CUDA); elsewhere the generic dot of
the same codes (:func:`lowprec.dot_general`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._matmul import dot_general
from ._prepared import PreparedWeight, row_mxarray
from .kernels import _weight_only_mgpu
from .kernels._dispatch import kernels_enabled, on_cuda, weight_only_kernel

_ROW_DN = (((1,), (1,)), ((), ()))


def _generic_weight_only(x, w: PreparedWeight):
    """x [M, K] @ W.T by lowprec's quantized dot of the weight as an MXArray (exact products,
    float32 sums; NVFP4 values with their tensor scale, docs/design.md §5)."""
    return dot_general(x, row_mxarray(w), _ROW_DN)


@jax.jit(static_argnames=("kernel", "cfg"))
def _weight_only_2d(x, w: PreparedWeight, kernel: bool, cfg):
    if not kernel:
        return _generic_weight_only(x, w)
    return on_cuda(lambda a, b: _weight_only_mgpu.weight_only_mgpu(a, b, cfg),
                   _generic_weight_only, x, w)


def weight_only_matmul(x, w: PreparedWeight, *, config=None) -> jax.Array:
    """``x @ W.T`` for bfloat16 tokens x [..., K] and a prepared FP4 weight W [N, K]: the
    decode-time product (float32 [..., N]).

    On a Hopper GPU, up to 16 tokens take the Mosaic GPU kernel of
    ``lowprec/kernels/_weight_only_mgpu.py``: the weight, stored once by
    :func:`prepare_weight` in the layout of the tensor-core product's left operand, is
    streamed once and decoded in registers (docs/design.md §15). Elsewhere, and for more
    tokens, the product is lowprec's quantized dot of the same codes (:func:`dot_general`).
    Both compute exact products of the weight's values and the tokens with float32 sums:
    |y − exact| ≤ K·2^-23·Σ_k|w_k x_k| (plus K·2^-149 where partial sums are float32
    subnormals); on the kernel, an NVFP4 weight's tensor scale multiplies the float32 sum
    (one rounding more, 2^-24 relative), where :func:`dequantize` rounds it into each value.
    Rows holding a NaN block (scale code 0xFF; NVFP4 0x7F) give NaN.

    Args:
      x: bfloat16 array [..., K] (the leading dimensions are the tokens).
      w: a :class:`PreparedWeight` of logical shape (N, K).
      config: kernel launch parameters (``kernels._weight_only_mgpu.WeightOnlyConfig``;
        default: chosen from the shape). Ignored where the kernel does not run.

    Returns:
      float32 array [..., N].

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> w = lowprec.prepare_weight(lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp4"))
        >>> weight_only_matmul(jnp.full((2, 64), 0.5, jnp.bfloat16), w).tolist()
        [[32.0, 32.0, 32.0, 32.0], [32.0, 32.0, 32.0, 32.0]]
    """
    if not isinstance(w, PreparedWeight):
        raise TypeError(f"weight_only_matmul takes a PreparedWeight (lowprec.prepare_weight), "
                        f"got {type(w).__name__}")
    x = jnp.asarray(x)
    n, k = w.shape
    if x.dtype != jnp.bfloat16 or x.ndim == 0 or x.shape[-1] != k:
        raise TypeError(f"x must be a bfloat16 array of shape (..., {k}), got "
                        f"{x.dtype}{list(x.shape)} (cast with x.astype(jnp.bfloat16))")
    lead = x.shape[:-1]
    m = math.prod(lead)
    if m == 0:
        return jnp.zeros((*lead, n), jnp.float32)
    x2 = x.reshape(m, k)
    kernel = weight_only_kernel(x2, w, kernels_enabled())
    cfg = None
    if kernel:
        cfg = config or _weight_only_mgpu.default_config(m, w.shape)
        if cfg.tokens < m:
            raise ValueError(f"config.tokens = {cfg.tokens} is fewer than the {m} tokens of x")
    return _weight_only_2d(x2, w, kernel, cfg).reshape(*lead, n)
