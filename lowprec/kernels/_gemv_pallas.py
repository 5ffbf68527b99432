"""A split-K Pallas kernel for MXFP4 weight × bfloat16 activations with few tokens.

y[m, n] = Σ_k x[m, k] · W[n, k] for W an MXFP4 weight [N, K] in the gpt-oss layout (codes
packed two per byte along K, one E8M0 scale per 32 elements) and x [M, K] bfloat16: the
memory-bound matmul of decoding, where the weight is read once and should stay packed
(4.25 bits per element) on its way from memory into registers.

Grid: (N tiles, K splits, M tiles). A program owns ``block_n`` rows of W and a contiguous
run of K; it walks that run ``block_groups`` MX blocks (of 32) at a time, decodes the
nibbles and scales of a [block_n, block_groups, 16]-byte tile in registers and adds its
products into float32 sums. The K splits give the GPU enough programs when N is small;
their partial sums [splits, M, N] are added by XLA.

Arithmetic (the accuracy claim of :func:`lowprec.kernels.mxfp4_gemv`): an E2M1 value has at most
2 significant bits and a bfloat16 value 8, so each product v·x is exact in float32; each
block's 32 products are summed in float32 and the sum is multiplied by the block's
2^(scale − 127), exact unless the result falls below 2^-126; blocks and splits are then
summed in float32. Only the additions round, in an order that differs from the generic
dot's, so both are within K·2^-23·Σ|w_i x_i| of the exact product (plus K·2^-149 when
scales near 2^-127 push a block sum into float32's subnormal range).

Triton's tensors must have power-of-two sizes, so any K (a multiple of 32 or not) and any
N are handled with masked loads: out-of-range bytes, scales and activations read as zero
(scale: 1) and out-of-range outputs are not stored. Nothing is padded in memory.

Two inner products, chosen by the number of tokens: ``"fma"`` multiplies on the CUDA cores
(every token reuses the decoded tile from registers), ``"dot"`` feeds 16-token tiles and
the decoded block (bfloat16, exact: values are 0, ±0.5 … ±6) to the tensor cores, one MX
block per dot, and scales the [16, block_n] result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from typing import Optional

from .._bits import E8M0_BIAS, E8M0_NAN, F32_QNAN
from .._format import mx_format
from .._mxarray import MXArray

MX_BLOCK = 32  # elements per E8M0 scale
_BYTES_PER_BLOCK = MX_BLOCK // 2  # packed E2M1: two elements per byte
INNER_PRODUCTS = ("fma", "dot")
# Programs to aim for when choosing the K splits: a few waves over an H100's 132 SMs.
_TARGET_PROGRAMS = 512
# Largest product tile the "fma" path keeps in registers (elements of block_m·block_n·bk).
_FMA_TILE = 8192


def _is_pow2(v: int) -> bool:
    return v >= 1 and (v & (v - 1)) == 0


def _next_pow2(v: int) -> int:
    return 1 << max(0, (int(v) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of the kernel (static, hashable).

    Attributes:
      block_n: weight rows per program (power of two; ≥ 16 for ``"dot"``).
      block_groups: MX blocks (of 32 elements) per step along K (power of two).
      splits: programs along K; each walks ``ceil(K/32 / (block_groups · splits))`` steps.
      inner: ``"fma"`` (CUDA cores) or ``"dot"`` (tensor cores, 16 tokens per tile).
      block_m: tokens per program (power of two; 16 for ``"dot"``).
      num_warps, num_stages: Triton launch parameters (GPU only).
    """

    block_n: int
    block_groups: int
    splits: int
    inner: str
    block_m: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_n", "block_groups", "block_m"):
            v = getattr(self, name)
            if not (isinstance(v, int) and _is_pow2(v)):
                raise ValueError(f"KernelConfig.{name} must be a power of two, got {v!r}")
        if not (isinstance(self.splits, int) and self.splits >= 1):
            raise ValueError(f"KernelConfig.splits must be a positive int, got {self.splits!r}")
        if self.inner not in INNER_PRODUCTS:
            raise ValueError(f"KernelConfig.inner must be one of {INNER_PRODUCTS}, got {self.inner!r}")
        if self.inner == "dot" and (self.block_m != 16 or self.block_n < 16):
            raise ValueError(
                "KernelConfig: inner='dot' needs block_m == 16 and block_n >= 16 (the smallest "
                f"tensor-core tile), got block_m={self.block_m}, block_n={self.block_n}"
            )


def default_config(m: int, n: int, k: int) -> KernelConfig:
    """A starting point for M tokens × an [N, K] weight (tune with benchmarks/bench_gpu.py)."""
    groups = -(-k // MX_BLOCK)
    if m <= 4:
        block_m = _next_pow2(m)
        block_groups = 4 if block_m == 1 else 2
        block_n = max(16, min(64, _FMA_TILE // (block_m * block_groups * MX_BLOCK)))
        inner = "fma"
    else:
        block_m, block_groups, block_n, inner = 16, 4, 64, "dot"
    block_n = min(block_n, max(16, _next_pow2(n)))
    block_groups = min(block_groups, _next_pow2(groups))
    tiles = -(-n // block_n) * -(-m // block_m)
    steps = -(-groups // block_groups)
    splits = max(1, min(steps, -(-_TARGET_PROGRAMS // tiles)))
    return KernelConfig(block_n, block_groups, splits, inner, block_m)


# -- decoding, on values the kernel holds in registers -------------------------------------------


def _fp4_f32(c):
    """E2M1 codes (int32, 0..15) → float32 values, built from bits.

    For a magnitude code 2..7 (e ≥ 1) the value (1 + m/2)·2^(e−1) has the float32 pattern
    ((e + 126) << 23) | (m << 22) = (mag << 22) + (126 << 23); code 1 is 0.5 and 0 is 0.
    """
    mag = c & 7
    normal = lax.shift_left(mag, 22) + (126 << 23)
    bits = jnp.where(mag > 1, normal, jnp.where(mag == 1, 0x3F00_0000, 0))
    bits = bits | lax.shift_left(c & 8, 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _fp4_bf16(c):
    """E2M1 codes (int32) → bfloat16 values (exact: the low 16 bits of each float32 are 0)."""
    bits = lax.bitcast_convert_type(_fp4_f32(c), jnp.int32)
    return lax.bitcast_convert_type(lax.shift_right_logical(bits, 16).astype(jnp.uint16), jnp.bfloat16)


def _bf16_f32(v):
    """bfloat16 → float32 by moving the bits (exact; NaN keeps its sign, docs/design.md §8)."""
    wide = lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(lax.shift_left(wide, jnp.uint32(16)), jnp.float32)


def _e8m0_f32(s):
    """E8M0 codes (int32, 0..255) → float32 2^(s − 127); 0 → 2^-127, 255 → NaN."""
    bits = jnp.where(s == 0, 0x0040_0000, lax.shift_left(s, 23))
    bits = jnp.where(s == E8M0_NAN, F32_QNAN, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _blocks_of(v):
    """The slices ``v[..., b]`` of a value held in registers (last axis a power of two), by
    halving it with size-2 unstacks, which Triton lowers (a strided slice it does not).
    After each halving, part k holds the indices ≡ k modulo the number of parts (the
    part of residue q splits into residues q and q + len), so the list stays in order."""
    parts = [v]
    while parts[0].shape[-1] > 1:
        halves = [jnp.unstack(p.reshape(*p.shape[:-1], p.shape[-1] // 2, 2), axis=-1)
                  for p in parts]
        parts = [h[r] for r in range(2) for h in halves]
    return [p.reshape(p.shape[:-1]) for p in parts]


# -- the kernel ----------------------------------------------------------------------------------


def _kernel(x_ref, w_ref, s_ref, o_ref, *, m, n, k, steps, cfg: KernelConfig):
    from jax.experimental.pallas import triton as plt
    from jax.experimental import pallas as pl

    bn, gb, bm = cfg.block_n, cfg.block_groups, cfg.block_m
    groups = -(-k // MX_BLOCK)
    i, j, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = i * bn + lax.iota(jnp.int32, bn)
    row_ok = rows < n
    toks = t * bm + lax.iota(jnp.int32, bm)
    tok_ok = toks < m

    def load_x(g0, nblocks):
        """Activations [bm, nblocks·32] from column g0·32, zero outside [M, K]."""
        cols = g0 * MX_BLOCK + lax.iota(jnp.int32, nblocks * MX_BLOCK)
        mask = tok_ok[:, None] & (cols < k)[None, :]
        return plt.load(
            x_ref.at[pl.ds(t * bm, bm), pl.ds(g0 * MX_BLOCK, nblocks * MX_BLOCK)],
            mask=mask, other=jnp.zeros((), x_ref.dtype),
        )

    def fma_step(step, acc):
        g0 = (j * steps + step) * gb
        g_ok = (g0 + lax.iota(jnp.int32, gb)) < groups
        ok = row_ok[:, None] & g_ok[None, :]
        w = plt.load(w_ref.at[pl.ds(i * bn, bn), pl.ds(g0, gb), :], mask=ok[:, :, None], other=0)
        s = plt.load(s_ref.at[pl.ds(i * bn, bn), pl.ds(g0, gb)], mask=ok, other=E8M0_BIAS)
        w = w.astype(jnp.int32)
        lo, hi = _fp4_f32(w & 0xF), _fp4_f32(lax.shift_right_logical(w, 4))  # [bn, gb, 16]
        # Element 2b of a block sits in the low nibble of byte b, element 2b+1 in the high one.
        xe, xo = jnp.unstack(load_x(g0, gb).reshape(bm, gb, _BYTES_PER_BLOCK, 2), axis=-1)
        xe, xo = _bf16_f32(xe), _bf16_f32(xo)  # [bm, gb, 16]
        prod = lo[None] * xe[:, None] + hi[None] * xo[:, None]  # [bm, bn, gb, 16], exact
        block_sums = jnp.sum(prod, axis=-1)  # [bm, bn, gb]
        return acc + jnp.sum(block_sums * _e8m0_f32(s.astype(jnp.int32))[None], axis=-1)

    def dot_step(step, acc):
        g0 = (j * steps + step) * gb
        g_ok = (g0 + lax.iota(jnp.int32, gb)) < groups
        ok = row_ok[:, None] & g_ok[None, :]
        # The step's whole tile in one load per row (gb·16 contiguous bytes: 128-bit
        # loads), not one 16-byte block at a time (which compiled to byte loads).
        w_all = plt.load(w_ref.at[pl.ds(i * bn, bn), pl.ds(g0, gb), :], mask=ok[:, :, None],
                         other=0)
        s_all = plt.load(s_ref.at[pl.ds(i * bn, bn), pl.ds(g0, gb)], mask=ok, other=E8M0_BIAS)
        w_blocks = _blocks_of(jnp.transpose(w_all, (0, 2, 1)))  # gb × [bn, 16]
        s_blocks = _blocks_of(s_all)  # gb × [bn]
        for b in range(gb):  # one tensor-core dot per MX block, then its scale
            g = g0 + b
            w, s = w_blocks[b].astype(jnp.int32), s_blocks[b]
            lo, hi = _fp4_bf16(w & 0xF), _fp4_bf16(lax.shift_right_logical(w, 4))  # [bn, 16]
            xe, xo = jnp.unstack(load_x(g, 1).reshape(bm, _BYTES_PER_BLOCK, 2), axis=-1)
            dn = (((1,), (1,)), ((), ()))
            part = lax.dot_general(xe, lo, dn, preferred_element_type=jnp.float32)
            part = part + lax.dot_general(xo, hi, dn, preferred_element_type=jnp.float32)
            acc = acc + part * _e8m0_f32(s.astype(jnp.int32))[None, :]  # [bm, bn]
        return acc

    step_fn = fma_step if cfg.inner == "fma" else dot_step
    acc = lax.fori_loop(0, steps, step_fn, jnp.zeros((bm, bn), jnp.float32))
    plt.store(
        o_ref.at[j, pl.ds(t * bm, bm), pl.ds(i * bn, bn)], acc,
        mask=tok_ok[:, None] & row_ok[None, :],
    )


@functools.partial(jax.jit, static_argnames=("k", "cfg", "interpret"))
def mxfp4_matmul_pallas(x, elements, scales, *, k: int, cfg: KernelConfig, interpret: bool):
    """x [M, K] bfloat16 times the MXFP4 weight (``elements`` uint8 [N, G·16], ``scales``
    uint8 [N, G], G = ceil(K/32)) transposed: float32 [M, N]."""
    from jax.experimental import pallas as pl

    m = x.shape[0]
    n, groups = scales.shape
    w3 = elements.reshape(n, groups, _BYTES_PER_BLOCK)  # a view: same bytes, blocks explicit
    steps = -(-groups // (cfg.block_groups * cfg.splits))
    grid = (-(-n // cfg.block_n), cfg.splits, -(-m // cfg.block_m))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plt

        params["compiler_params"] = plt.CompilerParams(
            num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
    partial = pl.pallas_call(
        functools.partial(_kernel, m=m, n=n, k=k, steps=steps, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((cfg.splits, m, n), jnp.float32),
        grid=grid,
        interpret=interpret,
        name="lowprec_mxfp4_matmul",
        **params,
    )(x, w3, scales)
    return partial[0] if cfg.splits == 1 else jnp.sum(partial, axis=0)


# -- the explicit entry point (lowprec.kernels.mxfp4_gemv) ---------------------------------------


def mxfp4_gemv(
    w: MXArray, x, *, block_rows: Optional[int] = None, interpret: Optional[bool] = None
) -> jax.Array:
    """``x @ W.T`` for an MXFP4 weight W [N, K] and bfloat16 activations x [..., K], as a
    Pallas kernel (the decode-time product: a vector or a few tokens).

    The weight stays packed (4.25 bits per element) all the way into a split-K kernel that
    decodes nibbles and scales in registers; any K works (tiles are masked, nothing is
    padded in memory). On a CUDA GPU, :func:`lowprec.dot_general` and
    :func:`lowprec.matmul` take this route by themselves for up to 16 tokens of bfloat16 activations without a format.
    Accuracy is that of :func:`lowprec.dot_general` (exact products, float32 sums):
    |y − exact| ≤ K·2^-23·Σ|w_i x_i|, plus K·2^-149 for scales near 2^-127.

    Args:
      w: MXFP4 :class:`~lowprec.MXArray` of shape [N, K], blocked along axis 1 (the gpt-oss
        layout: ``quantize_mx(w, "mxfp4", axis=-1)`` or ``from_gpt_oss``).
      x: bfloat16 array of shape [K] (a vector: W x) or [..., K] (tokens).
      block_rows: weight rows per program (a power of two); default: chosen from the shape.
      interpret: run the kernel in the Pallas interpreter. Default: on unless the default
        backend is a GPU (the interpreter is slow; on CPU :func:`lowprec.dot_general` is
        faster).

    Returns:
      float32 array [N] for a vector x, else [..., N].

    Example:
        >>> import jax.numpy as jnp
        >>> import lowprec
        >>> w = lowprec.quantize_mx(jnp.ones((4, 64)), "mxfp4")
        >>> lowprec.kernels.mxfp4_gemv(w, jnp.full((64,), 0.5, jnp.bfloat16)).tolist()
        [32.0, 32.0, 32.0, 32.0]
        >>> lowprec.kernels.mxfp4_gemv(w, jnp.ones((2, 64), jnp.bfloat16)).shape
        (2, 4)
    """
    if not isinstance(w, MXArray) or w.fmt != mx_format("mxfp4") or w.ndim != 2 or w.axis != 1:
        raise ValueError(
            "mxfp4_gemv takes an MXFP4 MXArray of shape [N, K] blocked along axis 1 "
            "(quantize_mx(w, 'mxfp4', axis=-1)); use dot_general for other operands"
        )
    x = jnp.asarray(x)
    n, k = w.shape
    if x.dtype != jnp.bfloat16 or x.ndim == 0 or x.shape[-1] != k:
        raise TypeError(
            f"x must be a bfloat16 array of shape ({k},) or (..., {k}), got "
            f"{x.dtype}{list(x.shape)}"
        )
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    x2 = x.reshape(-1, k)
    cfg = default_config(x2.shape[0], n, k)
    if block_rows is not None:
        try:
            cfg = dataclasses.replace(cfg, block_n=block_rows)
        except ValueError as e:
            raise ValueError(f"block_rows: {e}") from None
    y = mxfp4_matmul_pallas(x2, w.elements, w.scales, k=k, cfg=cfg,
                            interpret=bool(interpret))
    return y.reshape(*x.shape[:-1], n)
