"""A Pallas kernel for the MXFP4-weight × bfloat16-vector product (decode-time GEMV).

The weight stays packed (4.25 bits per element) all the way into the kernel, which decodes
nibbles and scales in registers. :func:`lowprec.mxfp4_gemv` validates and calls it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _fp4_values(c):
    """E2M1 codes (int32 0..15) -> float32 values, with float arithmetic only (no tables,
    no bitcasts, so it lowers anywhere): e = 0 is the subnormal 0.5*m, else (1 + m/2) 2^(e-1)."""
    e = (c >> 1) & 3
    m = (c & 1).astype(jnp.float32)
    pow2 = jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return jnp.where(c >= 8, -mag, mag)


def _e8m0_values(s):
    """E8M0 codes (int32 0..255) -> float32 2^(s - 127); 0 -> 2^-127, 255 -> NaN."""
    normal = lax.bitcast_convert_type(s << 23, jnp.float32)
    tiny = jnp.float32(2.0**-127)
    return jnp.where(s == 0, tiny, jnp.where(s == 255, jnp.float32(jnp.nan), normal))


def _mxfp4_gemv_kernel(w_ref, s_ref, xe_ref, xo_ref, o_ref):
    # w_ref: (bn, G, 16) packed bytes; byte j of block g holds elements 32g+2j (low nibble)
    # and 32g+2j+1 (high nibble), which meet x's even/odd halves xe/xo: (G, 16) float32.
    p = w_ref[...].astype(jnp.int32)
    lo, hi = _fp4_values(p & 0xF), _fp4_values(p >> 4)
    # Products of an FP4 value (2 significant bits) and a bfloat16 value (8) are exact in
    # float32; the per-block partial sums are float32 sums, then scaled by 2^(s-127) (exact).
    partial = jnp.sum(lo * xe_ref[...][None] + hi * xo_ref[...][None], axis=-1)  # (bn, G)
    scales = _e8m0_values(s_ref[...].astype(jnp.int32))
    o_ref[...] = jnp.sum(partial * scales, axis=-1)


def mxfp4_gemv_pallas(elements, scales, x, n: int, k: int, block_rows: int, interpret: bool):
    """y[N] = W x for packed MXFP4 codes ``elements`` [N, K/2] and ``scales`` [N, K/32] (float32)."""
    from jax.experimental import pallas as pl

    groups = scales.shape[1]
    kp = groups * 32
    xf = jnp.pad(x.astype(jnp.float32), (0, kp - k))  # exact; padded elements are code 0
    xe, xo = xf[0::2].reshape(groups, 16), xf[1::2].reshape(groups, 16)
    rows = -(-n // block_rows) * block_rows
    w3 = jnp.pad(elements, ((0, rows - n), (0, 0))).reshape(rows, groups, 16)
    sc = jnp.pad(scales, ((0, rows - n), (0, 0)))
    y = pl.pallas_call(
        _mxfp4_gemv_kernel,
        out_shape=jax.ShapeDtypeStruct((rows,), jnp.float32),
        grid=(rows // block_rows,),
        in_specs=[
            pl.BlockSpec((block_rows, groups, 16), lambda i: (i, 0, 0)),
            pl.BlockSpec((block_rows, groups), lambda i: (i, 0)),
            pl.BlockSpec((groups, 16), lambda i: (0, 0)),
            pl.BlockSpec((groups, 16), lambda i: (0, 0)),
        ],
        out_specs=pl.BlockSpec((block_rows,), lambda i: (i,)),
        interpret=interpret,
    )(w3, sc, xe, xo)
    return y[:n]
