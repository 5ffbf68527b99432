"""MXFP4 weight-only products for decode-time shapes: the routes and the dispatch.

Decoding a model multiplies a few tokens (M ≤ 16) of bfloat16 activations by an MXFP4
weight [N, K] quantized along K. The product is memory-bound: the weight is read once, so
the time is its size, 4.25 bits per element when it stays packed. Two routes compute it:

* ``"pallas"``: the split-K kernel of ``_gemv_pallas.py`` (Triton on GPU), which decodes
  nibbles and scales in registers;
* ``"xla"``: one elementwise decode of the codes into bfloat16 — exact for MXFP4, see
  :func:`mxfp4_matmul_xla` — feeding a bfloat16 dot, leaving it to XLA to fuse the decode
  into the dot's operand load.

:func:`lowprec.dot_general` (and so :func:`lowprec.matmul`) sends such products to
``GPU_ROUTE`` when it runs on a CUDA GPU (``lax.platform_dependent``, decided when XLA
lowers the program); every other backend, and every other shape, takes the generic
quantized dot of ``_qdot.py``. All of them compute exact products with float32 sums, so
they agree to within K·2^-23·Σ|w_i x_i| (docs/design.md §5).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from ._bits import bits_to_bf16_truncating
from ._format import mx_format
from ._gemv_pallas import KernelConfig, default_config, mxfp4_matmul_pallas
from ._mx_decode import mx_value_bits
from ._mxarray import MXArray

ROUTES = ("pallas", "xla")
#: The route dot_general takes on a CUDA GPU. "pallas" until benchmarks/bench_gpu.py has
#: measured both on a GPU (the issue's figures); switch if "xla" wins there.
GPU_ROUTE = "pallas"
#: Most tokens (product of the activation's free dims) sent to the decode-time route.
MAX_TOKENS = 16


def pallas_available() -> bool:
    """Whether this JAX has Pallas with its Triton backend (lowering happens on GPU only)."""
    try:
        from jax.experimental import pallas  # noqa: F401
        from jax.experimental.pallas import triton  # noqa: F401
    except ImportError:
        return False
    return True


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


def _is_weight(op) -> bool:
    return (isinstance(op, MXArray) and op.fmt.name == "mxfp4" and op.shape[0] == 1
            and min(op.shape) > 0)


def _is_activation(op, cast) -> bool:
    return (
        not isinstance(op, MXArray) and cast is None and op.dtype == jnp.bfloat16
        and op.shape[0] == 1 and 1 <= op.shape[1] <= MAX_TOKENS
    )


def decode_time_route(lhs, rhs, lcast, rcast):
    """For canonical operands (B, M, K) × (B, N, K) of a quantized dot: a function of
    ``(lhs, rhs)`` computing the (1, M, N) float32 product by ``GPU_ROUTE``, or None when
    the shapes are not the decode-time MXFP4 weight-only case.

    The case: no batch (B = 1), one side a packed MXFP4 MXArray (blocked along K, as every
    canonical MXArray is), the other a bfloat16 array used as it is (no format) with at
    most ``MAX_TOKENS`` rows.
    """
    if GPU_ROUTE == "pallas" and not pallas_available():
        return None
    if _is_activation(lhs, lcast) and _is_weight(rhs):
        def fast(a, w):
            return mxfp4_matmul(a[0], _as_2d(w), GPU_ROUTE)[None]
        return fast
    if _is_weight(lhs) and _is_activation(rhs, rcast):
        def fast_t(w, a):
            return mxfp4_matmul(a[0], _as_2d(w), GPU_ROUTE).T[None]
        return fast_t
    return None


def _as_2d(w: MXArray) -> MXArray:
    """A canonical (1, N, K) MXArray as the [N, K] weight the routes take."""
    n, k = w.shape[1], w.shape[2]
    return MXArray(w.elements[0], w.scales[0], w.fmt, 1, (n, k), w.scale_rule)


@functools.lru_cache(maxsize=None)
def cuda_kernels_possible() -> bool:
    """Whether JAX here can compile for CUDA: a GPU backend, or the CUDA plugin installed
    (which also compiles for a GPU without one, benchmarks/gpu_hlo_report.py). Elsewhere
    the CUDA branches of ``lax.platform_dependent`` holding Pallas kernels are left out,
    so CPU-only installs do not trace kernels they can never run."""
    for version in (12, 13):
        try:
            if importlib.util.find_spec(f"jax_plugins.xla_cuda{version}") is not None:
                return True
        except ImportError:
            pass
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


def on_cuda(fast, generic, *args):
    """``fast(*args)`` where XLA lowers for a CUDA GPU, ``generic(*args)`` everywhere else."""
    return lax.platform_dependent(*args, cuda=fast, default=generic)
