"""Weight-only products for decode-time shapes: MXFP4 MXArrays' two routes.

Decoding a model multiplies a few tokens (M ≤ 16) of bfloat16 activations by an MXFP4
weight [N, K] quantized along K. The product is memory-bound: the weight is read once, so
the time is its size, 4.25 bits per element when it stays packed. Two routes compute it:

* ``"pallas"``: the split-K kernel of ``kernels/_gemv_pallas.py`` (Triton on GPU), which
  decodes nibbles and scales in registers;
* ``"xla"``: one elementwise decode of the codes into bfloat16 — exact for MXFP4, see
  :func:`mxfp4_matmul_xla` — feeding a bfloat16 dot, leaving it to XLA to fuse the decode
  into the dot's operand load.

:func:`lowprec.dot_general` (and so :func:`lowprec.matmul`) sends such products to the
policy's ``gpu_route`` (``lowprec.kernels.set_policy(gpu_route=...)``) when it
runs on a CUDA GPU (``lax.platform_dependent``, decided when XLA lowers the program);
``kernels._dispatch.gemv_route`` says which calls qualify and by which route (the kernel
policy may turn the Pallas route off). Every other backend,
and every other shape, takes the generic quantized dot of ``_qdot.py``. All of them
compute exact products with float32 sums, so they agree to within K·2^-23·Σ|w_i x_i|
(docs/design.md §5).

:func:`lowprec.weight_only_matmul` of a prepared weight is ``_weight_only.py``.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from ._bits import bits_to_bf16_truncating
from ._format import mx_format
from ._mx_decode import mx_value_bits
from ._mxarray import MXArray
from .kernels._dispatch import gemv_route
from .kernels._gemv_pallas import KernelConfig, default_config, mxfp4_matmul_pallas

ROUTES = ("pallas", "xla")


def mxfp4_matmul_xla(x, elements, scales, k: int):
    """x [M, K] bfloat16 × the MXFP4 weight [N, K] transposed → float32 [M, N], in XLA.

    Every MXFP4 value v·2^(s−127) is a bfloat16 value: v has at most 2 significant bits
    and is a multiple of 0.5, so with s ≥ 0 the value is a multiple of 2^-128, which
    bfloat16 holds exactly down to its subnormals (multiples of 2^-133); values past
    bfloat16's (= float32's) range are ±inf in both. The decode therefore needs no range
    check, and the bfloat16 dot with float32 accumulation sums exact products — on a
    backend that keeps bfloat16 subnormals in dots (GPUs; XLA:CPU flushes them, which
    only matters for blocks with scale codes below 2).
    """
    bits = mx_value_bits(elements, scales, mx_format("mxfp4"), 1, k)  # [N, K] float32 patterns
    w = bits_to_bf16_truncating(bits)
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def mxfp4_matmul(x, w: MXArray, route: str, *, cfg: Optional[KernelConfig] = None,
                 interpret: bool = False):
    """x [M, K] bfloat16 @ W.T for an MXFP4 MXArray W [N, K] blocked along axis 1 (checked
    by the caller), by ``route``: float32 [M, N]."""
    m, k = x.shape
    n = w.shape[0]
    if route == "pallas":
        cfg = cfg or default_config(m, n, k)
        return mxfp4_matmul_pallas(x, w.elements, w.scales, k=k, cfg=cfg, interpret=interpret)
    if route == "xla":
        return mxfp4_matmul_xla(x, w.elements, w.scales, k)
    raise ValueError(f"unknown route {route!r}; valid routes: {ROUTES}")


def decode_time_route(lhs, rhs, lcast, rcast, kernels: bool):
    """For canonical operands (B, M, K) × (B, N, K) of a quantized dot: a function of
    ``(lhs, rhs)`` computing the (1, M, N) float32 product by the route the dispatch gives
    on CUDA (``kernels._dispatch.gemv_route``: the decode-time MXFP4 weight-only case, the
    policy's ``gpu_route`` and kernel policy ``kernels``), or None (the generic dot).
    """
    chosen = gemv_route(lhs, rhs, lcast, rcast, kernels)
    if chosen is None:
        return None
    side, route = chosen
    if side == "rhs":
        def fast(a, w):
            return mxfp4_matmul(a[0], _as_2d(w), route)[None]
        return fast

    def fast_t(w, a):
        return mxfp4_matmul(a[0], _as_2d(w), route).T[None]
    return fast_t


def _as_2d(w: MXArray) -> MXArray:
    """A canonical (1, N, K) MXArray as the [N, K] weight the routes take."""
    n, k = w.shape[1], w.shape[2]
    return MXArray(w.elements[0], w.scales[0], w.fmt, 1, (n, k), w.scale_rule)
