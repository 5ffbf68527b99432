"""A Pallas (Triton) kernel for the product of two MX operands with 8-bit codes, decoded in
the dot's operand load.

y[m, n] = Σ_k A[m, k] · B[n, k] for MXArrays A [M, K] and B [N, K] blocked along K, with
E8M0 scales and one code per byte (MXFP8 E4M3/E5M2). XLA compiles the generic path
(``_qdot``: decode to bfloat16, then a bfloat16 dot) into one kernel per operand that
writes the decoded bfloat16 operand to memory, then the GEMM reading it back
(benchmarks/gpu_hlo_report.py --target h100); its GEMM fusion does not take the decode
in as an operand prologue. This kernel reads the codes and scales of each [block, bk] tile,
decodes them in registers (element value × 2^(scale − 127) in float32, then bfloat16) and
feeds the tensor cores, so each operand crosses memory once, at 1 + 1/32 bytes per element.

Arithmetic: the same as the generic bfloat16 path, which this replaces only where that
path is taken (``_qdot``'s run-time check that bfloat16 holds every value exactly): the
decoded values are exact, products are exact in float32 and only the float32 sums round
(in the tensor cores' order), within K·2^-23·Σ|a_i b_i| of the exact product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._blocks import merge_blocks, split_blocks
from .._decode import decode_f32
from .._format import MXFormat
from .._scheme_e8m0 import E8M0Scheme

MX_BLOCK = 32


def pallas_mxdot_applies(fa: MXFormat, fb: MXFormat) -> bool:
    """Whether the kernel serves these operand formats (static): E8M0 scales over blocks of
    32, one element code per byte, values with at most bfloat16's 7 mantissa bits."""
    def ok(f):
        return (f.block_size == MX_BLOCK and isinstance(f.scheme, E8M0Scheme)
                and f.element.code_bits == 8 and f.element.encoding != "twos_complement"
                and f.element.mantissa_bits <= 7)
    return ok(fa) and ok(fb)


def _e8m0_factor(s):
    """float32 2^(s − 127) of E8M0 codes (int32): 0 → 2^-127, 255 → NaN (from the bits)."""
    bits = jnp.where(s == 0, 0x0040_0000, lax.shift_left(s, 23))
    bits = jnp.where(s == 255, 0x7FC0_0000, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _decode_tile(codes, scales, fmt: MXFormat):
    """[rows, bk] codes and [rows, bk/32] scales → bfloat16 values (exact where the caller
    runs this: every value a bfloat16 normal or zero)."""
    v = split_blocks(decode_f32(fmt.element, codes), 1, MX_BLOCK)
    v = v * _e8m0_factor(scales.astype(jnp.int32))[:, :, None]
    return merge_blocks(v, 1).astype(jnp.bfloat16)


def _kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, m, n, k, bm, bn, bk, fa, fb):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    i, j = pl.program_id(0), pl.program_id(1)
    rows_a = (i * bm + lax.iota(jnp.int32, bm)) < m
    rows_b = (j * bn + lax.iota(jnp.int32, bn)) < n
    nb = bk // MX_BLOCK

    def step(t, acc):
        k0 = t * bk
        cols = (k0 + lax.iota(jnp.int32, bk)) < k
        groups = (k0 // MX_BLOCK + lax.iota(jnp.int32, nb)) < k // MX_BLOCK
        a = plt.load(a_ref.at[pl.ds(i * bm, bm), pl.ds(k0, bk)],
                     mask=rows_a[:, None] & cols[None, :], other=0)
        sa = plt.load(sa_ref.at[pl.ds(i * bm, bm), pl.ds(k0 // MX_BLOCK, nb)],
                      mask=rows_a[:, None] & groups[None, :], other=127)
        b = plt.load(b_ref.at[pl.ds(j * bn, bn), pl.ds(k0, bk)],
                     mask=rows_b[:, None] & cols[None, :], other=0)
        sb = plt.load(sb_ref.at[pl.ds(j * bn, bn), pl.ds(k0 // MX_BLOCK, nb)],
                      mask=rows_b[:, None] & groups[None, :], other=127)
        va, vb = _decode_tile(a, sa, fa), _decode_tile(b, sb, fb)
        return acc + lax.dot_general(va, vb, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, -(-k // bk), step, jnp.zeros((bm, bn), jnp.float32))
    plt.store(o_ref.at[pl.ds(i * bm, bm), pl.ds(j * bn, bn)], acc,
              mask=rows_a[:, None] & rows_b[None, :])


@functools.partial(jax.jit, static_argnames=("fa", "fb", "block_m", "block_n", "block_k",
                                             "num_warps", "num_stages", "interpret"))
def mxdot_pallas(a_el, a_sc, b_el, b_sc, *, fa: MXFormat, fb: MXFormat, block_m: int = 128,
                 block_n: int = 128, block_k: int = 64, num_warps: int = 8,
                 num_stages: int = 3, interpret: bool = False):
    """float32 [M, N] = A @ B.T for MX codes ``a_el`` uint8 [M, K] with scales ``a_sc``
    uint8 [M, K/32] and ``b_el`` [N, K] with ``b_sc`` [N, K/32] (K a multiple of 32)."""
    from jax.experimental import pallas as pl

    m, k = a_el.shape
    n = b_el.shape[0]
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_kernel, m=m, n=n, k=k, bm=block_m, bn=block_n, bk=block_k,
                          fa=fa, fb=fb),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        grid=(-(-m // block_m), -(-n // block_n)),
        interpret=interpret,
        name="lowprec_mxdot",
        **params,
    )(a_el, a_sc, b_el, b_sc)
