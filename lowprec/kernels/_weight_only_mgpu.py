"""The decode-time weight-only product on Hopper: FP4 weight tiles as ``wgmma``'s left operand.

y[m, n] = Σ_k x[m, k] · W[n, k] for x [M ≤ 16, K] bfloat16 and a :class:`PreparedWeight` W
[N, K] (MXFP4 or NVFP4), as a Pallas Mosaic GPU kernel for sm_90a. The weight rows are the
M side of ``wgmma.mma_async.m64nNk16.f32.bf16.bf16`` and the tokens, padded to N = 8 or 16
(TMA fills rows past M with zeros), its N side, so 1 and 16 tokens issue the same
instructions per weight element and no lane exchanges anything with another.

A program (CTA) owns 64·G rows (G compute warpgroups, one 64-row tile each) and a
contiguous run of K; a memory warpgroup streams stages of ``tiles_per_step`` 64-column tiles
of the prepared words, their scales and the token tile into shared memory with TMA, in the
order they are stored (no relayout; the token tile is swizzled for the B operand). Per tile
a compute thread loads its 16 bytes of words (``ld.shared.v4``: its A fragments for four k16
slices) and 4 or 8 scale bytes, turns each word into four bfloat16 pairs (nine bit
operations, :data:`lowprec._prepared.DECODE_PROGRAM`), applies the block scales with one or
two ``mul.rn.bf16x2`` per pair (exact; ``lowprec/_prepared.py`` says how) and issues the
``wgmma``s. Each warpgroup stores its accumulator transposed into shared memory and TMA
writes the first M token rows of it to the partial sums [splits, M, N] (rows past M and
columns past N are clipped), which XLA adds, applying NVFP4's tensor scale and the NaN rows.

Arithmetic: every product of a bfloat16 weight value and a bfloat16 token is exact in
float32; the tensor core adds them in float32 (in an order of its own, possibly truncating),
and XLA adds the K splits: |y − exact| ≤ K·2^-23·Σ_k|w_k x_k| (plus K·2^-149 where float32
subnormal partial sums occur) — the bound of every lowprec product (docs/design.md §5). For
NVFP4 the tensor scale multiplies the float32 sum once more (one more rounding, 2^-24
relative) where the dequantized values carry it per element.

Compile-only checks (``tests/test_gpu_compile.py``, ``benchmarks/gpu_decode_ptx.py``) count
the PTX instructions of the compute loop per weight element and read ``ptxas -v``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _prepared as prep

#: Kernel name (in the HLO's custom call and the PTX entry point).
KERNEL_NAME = "lowprec_weight_only"
#: Most tokens one call serves (the token tile is 8 or 16 rows).
MAX_TOKENS = 16

# bfloat16 pairs (both halves the same) of the constants the multiplies use.
BF16X2_2P126 = 0x7E80_7E80  # 2^126: exponent field 126 + 127 = 0xFD, 0xFD << 7 = 0x7E80
BF16X2_2P120 = 0x7B80_7B80  # 2^120: exponent field 0xF7, 0xF7 << 7 = 0x7B80
BF16X2_SUBNORMAL_2PM127 = 0x0040_0040  # 2^-127: the subnormal with mantissa 0b1000000
# One multiply, MXFP4: factor 2^(s − 1) = 2^126 · 2^(s − 127), pattern (s − 1 + 127) << 7 =
# (s << 7) + (126 << 7); a lane's s << 7 ≤ 0x7F80, so adding 0x3F00 never carries out of it.
MX_ONE_MUL_ADDEND = 0x3F00_3F00  # 126 << 7 in each half
# One multiply, NVFP4: factor E4M3 value × 2^118. A positive normal E4M3 code c (exponent
# field f ≥ 1, value 2^(f − 7)·1.mmm) placed at bfloat16 bits 14..4 reads 2^(f − 127)·1.mmm,
# so its factor's pattern is (c << 4) + ((118 + 120) << 7) = (c << 4) + 0x7700.
NV_ONE_MUL_ADDEND = 0x7700_7700  # 238 << 7 in each half
#: The power of two the NVFP4 one-multiply products carry below their value (applied to the
#: output with the tensor scale): E2M1 × E4M3 × 2^-8 lies in [2^-18, 10.5], normal bfloat16.
NV_ONE_MUL_SHIFT = 8


# -- the PTX the kernel runs per word and per scale word (also run by the tests on CPU) ---------


def decode_asm(one_multiply: bool) -> str:
    """PTX turning one prepared word ($4) into four scaled bfloat16 pairs ($0..$3).

    $5: 2^126 in both halves (two-multiply form; unused otherwise); $6, $7: the bfloat16
    pair factors of rows g and g + 8 (registers a_0, a_2 and a_1, a_3).
    """
    lines = ["{", ".reg .b32 t0, t1, t2, t3, u;"]
    for j, (rot, keep) in enumerate(prep.DECODE_PROGRAM):
        if keep:
            lines += [f"and.b32 t{j}, $4, {keep:#010x};",
                      f"shf.r.wrap.b32 u, $4, $4, {rot};",
                      # lop3 0xF8 = a | (b & c)
                      f"lop3.b32 t{j}, t{j}, u, {prep.OUT_MASK & ~keep:#010x}, 0xF8;"]
        else:
            lines += [f"shf.r.wrap.b32 t{j}, $4, $4, {rot};",
                      f"and.b32 t{j}, t{j}, {prep.OUT_MASK:#010x};"]
    if not one_multiply:
        lines += [f"mul.rn.bf16x2 t{j}, t{j}, $5;" for j in range(4)]
    lines += [f"mul.rn.bf16x2 ${j}, t{j}, ${6 + j % 2};" for j in range(4)]
    lines.append("}")
    return "\n".join(lines)


def scale_asm(fmt_name: str, one_multiply: bool) -> str:
    """PTX turning two scale codes into bfloat16 pair factors: $0 for row g, $1 for g + 8.

    $2: a scale word (bytes 2·h + (b mod 2), ``lowprec/_prepared.py``); $3 (immediate): a
    prmt selector putting block b's two codes in the low bytes of the two 16-bit halves (the
    high bytes from the zero operand, so no half carries into the other below); $4: the
    constant :func:`scale_constant`. Each half becomes the factor's bfloat16 pattern, then
    is copied into both halves of its register.
    """
    if fmt_name == "mxfp4" and not one_multiply:
        # max(s << 7, 0x0040): the bfloat16 2^(s − 127), code 0 the subnormal 2^-127.
        body = ["shl.b32 p, p, 7;", "max.u16x2 p, p, $4;"]
    elif fmt_name == "mxfp4":
        body = ["mad.lo.u32 p, p, 128, $4;"]  # (s << 7) + (126 << 7): 2^(s − 1)
    elif one_multiply:
        body = ["mad.lo.u32 p, p, 16, $4;"]  # (c << 4) + (238 << 7): E4M3 value × 2^118
    else:
        # (c << 4) reads as E4M3 value × 2^-120 (subnormals included); × 2^120 is exact.
        body = ["shl.b32 p, p, 4;", "mul.rn.bf16x2 p, p, $4;"]
    return "\n".join(["{", ".reg .b32 p;", "prmt.b32 p, $2, 0, $3;", *body,
                      "prmt.b32 $0, p, p, 0x1010;", "prmt.b32 $1, p, p, 0x3232;", "}"])


def scale_constant(fmt_name: str, one_multiply: bool) -> int:
    """The constant operand ($4) of :func:`scale_asm`."""
    if fmt_name == "mxfp4":
        return MX_ONE_MUL_ADDEND if one_multiply else BF16X2_SUBNORMAL_2PM127
    return NV_ONE_MUL_ADDEND if one_multiply else BF16X2_2P120


def scale_selector(b: int) -> int:
    """The prmt selector of block b (mod 2) of a scale word: output bytes (b, zero, 2 + b,
    zero); selector nibble 4 picks byte 0 of the second (zero) operand."""
    return 0x4040 | (b % 2) | ((2 + b % 2) << 8)


def slice_scales(fmt_name: str, q: int) -> tuple[int, int]:
    """(scale word, block within it) of k16 slice q of a tile: MXFP4 blocks of 32 span two
    slices (one word per tile); NVFP4 blocks of 16 are one slice each (two words)."""
    if fmt_name == "mxfp4":
        return 0, q // 2
    return q // 2, q % 2


def register_of(q: int, j: int) -> tuple[int, int]:
    """Where output j of word q goes in the warpgroup's A operand of a 64×64 tile: (column
    group c, row half h), i.e. the bfloat16 pair of row g + 8h, columns 8c + 2t + (0, 1) —
    the PTX m64nNk16 A fragment's register j of k16 slice q. (Mosaic GPU's WGMMA layout
    holds register (c, h) at ``registers[0, c, 0, 0, h, ...]``.)"""
    return 2 * q + j // 2, j % 2


# -- launch parameters ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """Launch parameters of the kernel (static, hashable).

    Attributes:
      tokens: rows of the token tile, the ``wgmma`` N (8 or 16).
      groups: compute warpgroups per program; each owns one 64-row tile.
      tiles_per_step: 64-column tiles per pipeline stage (K per stage = 64 × this).
      stages: pipeline stages in flight (shared-memory buffers).
      splits: programs along K (their partial sums are added by XLA).
    """

    tokens: int
    groups: int = 2
    tiles_per_step: int = 4
    stages: int = 4
    splits: int = 1

    def __post_init__(self):
        if self.tokens not in (8, 16):
            raise ValueError(f"WeightOnlyConfig.tokens must be 8 or 16, got {self.tokens!r}")
        if self.groups not in (1, 2):
            raise ValueError(f"WeightOnlyConfig.groups must be 1 or 2, got {self.groups!r}")
        for name in ("tiles_per_step", "stages", "splits"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"WeightOnlyConfig.{name} must be a positive int, got {v!r}")

    def steps(self, col_tiles: int) -> int:
        """Pipeline steps of each program over ``col_tiles`` 64-column tiles."""
        return -(-(-(-col_tiles // self.tiles_per_step)) // self.splits)


#: Programs to aim for: one wave over an H100's 132 SMs (one program per SM is resident:
#: 168 registers × 384 threads). More K splits add partial sums to write and read (M × N
#: float32 per split); fewer leave SMs idle. To be tuned on a GPU (bench_gpu.py --tune).
_TARGET_PROGRAMS = 132


def default_config(m: int, shape) -> WeightOnlyConfig:
    """A starting point for ``m`` tokens × a weight of logical shape (N, K)."""
    tn, tk = prep.tile_counts(shape)
    cfg = WeightOnlyConfig(tokens=8 if m <= 8 else 16)
    programs = tn // cfg.groups
    col_steps = -(-tk // cfg.tiles_per_step)
    splits = max(1, min(col_steps, -(-_TARGET_PROGRAMS // programs)))
    # Equal runs of K per program: the smallest split count giving the same step count.
    steps = -(-col_steps // splits)
    splits = -(-col_steps // steps)
    return dataclasses.replace(cfg, splits=splits)


# -- the kernel ----------------------------------------------------------------------------------


def _c32(v: int):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith

    i32 = ir.IntegerType.get_signless(32)
    return arith.constant(i32, ir.IntegerAttr.get(i32, v - (1 << 32) if v >= 1 << 31 else v))


def _decode_tiles(w_ref, s_ref, *, tiles: int, fmt_name: str, one_multiply: bool):
    """Mosaic GPU code: the warpgroup's A operand (64, 64·tiles) bfloat16 in WGMMA layout,
    from shared-memory refs w [tiles, 128, 4] and s [tiles, 32 · scale words per quad]
    uint32."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, vector
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils as mu

    i32 = ir.IntegerType.get_signless(32)
    idx = ir.IndexType.get()
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    lane = arith.remui(mu.thread_idx(), _c32(prep.THREADS))
    lane_i = arith.index_cast(idx, lane)
    quad_i = arith.index_cast(idx, arith.divui(lane, _c32(4)))
    zero = arith.constant(idx, 0)
    two = llvm.StructType.get_literal([i32, i32])
    four = llvm.StructType.get_literal([i32] * 4)
    words_per_quad = prep.SCALE_BYTES_PER_QUAD[fmt_name] // 4
    dec = decode_asm(one_multiply)
    sc_asm = scale_asm(fmt_name, one_multiply)
    sc_const = _c32(scale_constant(fmt_name, one_multiply))
    bias = _c32(BF16X2_2P126)

    def extract(vec, i):
        return vector.extract(vec, dynamic_position=[],
                              static_position=ir.DenseI64ArrayAttr.get([i]))

    # registers[0, c, 0, 0, h, 0, 0, 0, 0]: columns 8c + 2t + (0, 1) of row g + 8h.
    regs = np.empty((1, 8 * tiles, 1, 1, 2, 1, 1, 1, 1), dtype=object)
    for tile in range(tiles):
        ti = arith.constant(idx, tile)
        words = vector.load(ir.VectorType.get((4,), i32), w_ref, [ti, lane_i, zero])
        first = quad_i if words_per_quad == 1 else arith.muli(
            quad_i, arith.constant(idx, words_per_quad))
        sw = vector.load(ir.VectorType.get((words_per_quad,), i32), s_ref, [ti, first])
        factors = {}
        for q in range(prep.WORDS_PER_THREAD):
            key = slice_scales(fmt_name, q)
            if key not in factors:
                res = llvm.inline_asm(two, [extract(sw, key[0]), _c32(scale_selector(key[1])),
                                            sc_const], sc_asm, "=r,=r,r,n,r")
                factors[key] = (llvm.extractvalue(i32, res, [0]),
                                llvm.extractvalue(i32, res, [1]))
            g_factor, g8_factor = factors[key]
            res = llvm.inline_asm(four, [extract(words, q), bias, g_factor, g8_factor], dec,
                                  "=r,=r,=r,=r,r,r,r,r")
            for j in range(4):
                c, h = register_of(q, j)
                out = llvm.extractvalue(i32, res, [j])
                regs[0, 8 * tile + c, 0, 0, h, 0, 0, 0, 0] = mu.bitcast(out, pair)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def _store_transposed(acc, ref):
    """Stores the warpgroup's accumulator (64 rows × tokens, WGMMA layout) into the shared
    ref [tokens, 64], transposed: each thread writes its own elements (a few per thread)."""
    from jax._src.lib.mlir.dialects import memref
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(ctx, values, out):
        del ctx
        values.foreach(lambda v, idx: memref.store(v, out, [idx[1], idx[0]]))

    store(acc, ref)


def _kernel_call(m: int, k: int, tile_rows: int, tile_cols: int, fmt_name: str,
                 one_multiply: bool, cfg: WeightOnlyConfig):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    g, kb, nt = cfg.groups, cfg.tiles_per_step, cfg.tokens
    programs = tile_rows // g
    steps = cfg.steps(tile_cols)
    bk = prep.TILE_COLS * kb
    per_quad = prep.SCALE_BYTES_PER_QUAD[fmt_name] // 4
    scale_block = (1, g, kb, prep.THREADS // 4 * per_quad)
    x_transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem):
        i = lax.axis_index("rows")
        j = lax.axis_index("split")
        wg = lax.axis_index("wg")

        def compute_context(run):
            @functools.partial(pl.run_scoped, acc=plgpu.ACC((prep.TILE_ROWS, nt), jnp.float32))
            def _(acc):
                run(acc)
                _store_transposed(acc[...], o_smem.at[wg])
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg], o_gmem.at[j, pl.ds(0, nt), pl.ds((i * g + wg) * prep.TILE_ROWS,
                                                                    prep.TILE_ROWS)])
                plgpu.wait_smem_to_gmem(0)

        def body(_, x_smem, w_smem, s_smem, acc):
            @plgpu.inline_mgpu(
                arg_types=(plgpu.RefType(), plgpu.RefType()),
                return_type=plgpu.ShapeDtypeStruct((prep.TILE_ROWS, bk), jnp.bfloat16,
                                                   layout=plgpu.Layout.WGMMA))
            def decode(ctx, w_ref, s_ref):
                del ctx
                return _decode_tiles(w_ref, s_ref, tiles=kb, fmt_name=fmt_name,
                                     one_multiply=one_multiply)

            a = decode(w_smem.at[0, wg], s_smem.at[0, wg])
            plgpu.wgmma(acc, a, x_smem.T)
            plgpu.wgmma_wait(0)
            return acc

        def stage(s):
            return j * steps + s

        pipeline = plgpu.emit_pipeline_warp_specialized(
            body, grid=(steps,), memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((nt, bk), lambda s: (0, stage(s)), transforms=x_transforms),
                plgpu.BlockSpec((1, g, kb, prep.THREADS, prep.WORDS_PER_THREAD),
                                lambda s: (i, 0, stage(s), 0, 0)),
                plgpu.BlockSpec(scale_block, lambda s: (i, 0, stage(s), 0)),
            ],
            wg_axis="wg", num_compute_wgs=g, max_concurrent_steps=min(cfg.stages, steps),
            compute_context=compute_context)
        pipeline(x_gmem, w_gmem, s_gmem)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((cfg.splits, m, tile_rows * prep.TILE_ROWS), jnp.float32),
        grid=(programs, cfg.splits), grid_names=("rows", "split"),
        num_threads=g + 1, thread_name="wg",
        scratch_types=dict(o_smem=plgpu.SMEM((g, nt, prep.TILE_ROWS), jnp.float32)),
        compiler_params=plgpu.CompilerParams(), kernel_name=KERNEL_NAME)


@functools.partial(jax.jit, static_argnames=("cfg",))
def weight_only_mgpu(x, w: prep.PreparedWeight, cfg: WeightOnlyConfig):
    """x [M, K] bfloat16 (M ≤ cfg.tokens) @ W.T for a PreparedWeight W [N, K]: float32 [M, N].

    Lowers for CUDA (sm_90a) only; callers pick it with ``lax.platform_dependent``."""
    m, k = x.shape
    n = w.shape[0]
    tile_rows, tile_cols = w.words.shape[:2]
    # x's tiled TMA copies take each dimension whole tiles of (8, 64) or below one tile
    # (Mosaic GPU refuses K = 96 at 8 tokens, seen on an H200): zero columns meet the
    # weight's padded zero codes, and zero token rows are cut from the result.
    m_pad = m if m <= 8 else -(-m // 8) * 8
    k_pad = k if k <= 64 else -(-k // 64) * 64
    k_pad = -(-k_pad // 8) * 8  # TMA needs 16-byte rows
    if (m_pad, k_pad) != (m, k):
        x = jnp.pad(x, ((0, m_pad - m), (0, k_pad - k)))
    g = cfg.groups
    words = w.words.reshape(tile_rows // g, g, tile_cols, prep.THREADS, prep.WORDS_PER_THREAD)
    per_quad = prep.SCALE_BYTES_PER_QUAD[w.fmt.name] // 4
    scales = lax.bitcast_convert_type(
        w.scales.reshape(tile_rows // g, g, tile_cols, prep.THREADS // 4 * per_quad, 4),
        jnp.uint32)
    call = _kernel_call(m_pad, k_pad, tile_rows, tile_cols, w.fmt.name, w.one_multiply, cfg)
    partial = call(x, words, scales)  # [splits, tokens, rows]
    y = jnp.sum(partial, axis=0)[:m, :n]
    if w.tensor_scale is not None:
        shift = NV_ONE_MUL_SHIFT if w.one_multiply else 0
        y = y * (w.tensor_scale * jnp.float32(2.0**shift))
    return jnp.where(w.nan_rows[None, :], jnp.float32(jnp.nan), y)


def mosaic_gpu_available() -> bool:
    """Whether this JAX has Pallas' Mosaic GPU backend (lowering happens on CUDA only)."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
        from jax.experimental.mosaic.gpu import fragmented_array  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: not here
        return False
    return True
