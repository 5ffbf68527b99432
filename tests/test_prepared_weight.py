"""Prepared FP4 weights (``lowprec.prepare_weight``) and the decode kernel's arithmetic, on CPU.

The Mosaic GPU kernel itself needs a Hopper GPU; what it computes is checked here piece by
piece, never against lowprec's own decoder:

* the layout: ``prepare_weight`` then ``to_mxarray`` gives back every code bit for bit (codes
  drawn at random, every scale code included), also for gpt-oss blocks and [K, N] weights;
* the decode: the kernel's PTX text (``decode_asm``, ``scale_asm``), run by a NumPy model of
  its instructions (``helpers/ptx.py``, semantics from the PTX ISA), turns the prepared words
  of every thread into the values the PTX ``wgmma`` A fragment (m64nNk16, bfloat16: register
  a_j of thread 32w + 4g + t holds row 16w + g + 8(j mod 2), columns 8(j div 2) + 2t + e)
  must hold — the OCP / gpt-oss table FP4_VALUES[nibble] × 2^(s − 127), or × the E4M3 value
  (reference/), exactly;
* the sums: a NumPy statement of the kernel's tile order (products summed per k16 slice, 64
  columns per tile, stages, K splits, then the tensor scale) is within the documented bound
  K·2^-23·Σ|w x| of the exact product computed in fractions-free float64 from those values;
* ``weight_only_matmul`` off the GPU (the generic route) within the same bound, 1-D to 3-D
  tokens, eager and jit, and NaN blocks giving NaN rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
from helpers import ptx
from helpers.kernels import cuda_branches  # noqa: F401  (a fixture)
from helpers.kernels import lower_for_cuda
from lowprec import _prepared as prep
from lowprec.kernels import _weight_only_mgpu as kern
from lowprec_reference import element as ref_element
from lowprec_reference import mx as ref_mx

FP4 = ref_mx.FP4_VALUES  # the OCP / gpt-oss E2M1 table (docs/design.md §4)
FORMATS = ("mxfp4", "nvfp4")
# (N, K): one tile; rows not a multiple of 128 and columns not of 64; several tiles.
SHAPES = [(64, 64), (200, 96), (130, 320)]


def _e4m3(codes) -> np.ndarray:
    return np.asarray(ref_element.decode("e4m3", np.asarray(codes, np.uint8)), np.float64)


def _random_weight(fmt: str, n: int, k: int, seed: int, *, scales=None) -> lowprec.MXArray:
    """An MXArray [N, K] of random codes: every nibble; scale codes over the whole range the
    format's product serves (E8M0 0..254 and NaN; E4M3 positive, zero and NaN)."""
    rng = np.random.default_rng(seed)
    block = lowprec.mx_format(fmt).block_size
    kp = -(-k // block) * block
    el = rng.integers(0, 256, (n, kp // 2), dtype=np.uint8)
    if scales is None:
        if fmt == "mxfp4":
            scales = rng.integers(0, 256, (n, kp // block), dtype=np.uint8)
        else:
            scales = rng.integers(0, 0x80, (n, kp // block), dtype=np.uint8)
            scales[rng.random(scales.shape) < 0.02] = 0xFF
    ts = jnp.float32(0.375) if fmt == "nvfp4" else None
    return lowprec.MXArray(jnp.asarray(el), jnp.asarray(scales), fmt, 1, (n, k), None, ts)


def _values(w: lowprec.MXArray, *, with_tensor_scale: bool = True) -> np.ndarray:
    """float64 [N, Kp] values of an axis-1 weight: FP4 table × block scale (× tensor scale),
    the block scale NaN for 0xFF (E8M0) / 0x7F, 0xFF (E4M3)."""
    el = np.asarray(w.elements)
    codes = np.stack([el & 0xF, el >> 4], axis=-1).reshape(el.shape[0], -1)
    block = w.fmt.block_size
    s = np.asarray(w.scales).astype(np.int64)
    if w.fmt.name == "mxfp4":
        scale = np.where(s == 0xFF, np.nan, np.exp2(s.astype(np.float64) - 127))
    else:
        scale = _e4m3(s)
        if with_tensor_scale:
            scale = scale * float(w.tensor_scale)
    with np.errstate(invalid="ignore"):
        return FP4[codes] * np.repeat(scale, block, axis=1)


# -- the layout: a lossless rearrangement ------------------------------------------------------------


# Every shape for a [N, K] weight; one for the same weight stored as [K, N] (axis 0).
ROUND_TRIPS = [(s, 1) for s in SHAPES] + [(SHAPES[1], 0)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,axis", ROUND_TRIPS, ids=lambda v: str(v))
def test_prepare_then_to_mxarray_gives_back_every_bit(fmt, shape, axis):
    w = _random_weight(fmt, *shape, seed=sum(shape) + axis)
    if axis == 0:  # the same weight as [K, N] blocked along axis 0
        codes = np.stack([np.asarray(w.elements) & 0xF, np.asarray(w.elements) >> 4], -1)
        codes = codes.reshape(shape[0], -1).T  # [Kp, N]
        el = codes[0::2] | (codes[1::2] << 4)
        w = lowprec.MXArray(jnp.asarray(el), w.scales.T, fmt, 0, (shape[1], shape[0]), None,
                            w.tensor_scale)
    pw = lowprec.prepare_weight(w)
    assert pw.shape == shape and pw.axis == axis
    for back in (pw.to_mxarray(), jax.jit(lambda p: p.to_mxarray())(pw)):
        assert back.shape == w.shape and back.axis == w.axis and back.fmt == w.fmt
        np.testing.assert_array_equal(np.asarray(back.elements), np.asarray(w.elements))
        np.testing.assert_array_equal(np.asarray(back.scales), np.asarray(w.scales))
        if fmt == "nvfp4":
            assert float(back.tensor_scale) == float(w.tensor_scale)
    # NaN blocks mark their rows.
    nan_code = 0xFF if fmt == "mxfp4" else 0x7F
    s = np.asarray(w.scales) if axis == 1 else np.asarray(w.scales).T
    want_rows = ((s & (0xFF if fmt == "mxfp4" else 0x7F)) == nan_code).any(axis=1)
    np.testing.assert_array_equal(np.asarray(pw.nan_rows), want_rows)


def test_gpt_oss_blocks_and_scales_round_trip():
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (96, 3, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, (96, 3), dtype=np.uint8)
    pw = lowprec.prepare_weight((blocks, scales))
    assert pw.shape == (96, 96) and pw.fmt.name == "mxfp4"
    b2, s2 = lowprec.to_gpt_oss(pw.to_mxarray())
    np.testing.assert_array_equal(np.asarray(b2), blocks)
    np.testing.assert_array_equal(np.asarray(s2), scales)


def test_the_layout_is_stored_per_tile_and_thread():
    """Shapes and the byte budget: 4 bits per element and a byte per block, plus padding."""
    w = _random_weight("mxfp4", 256, 512, seed=1)
    pw = lowprec.prepare_weight(w)
    assert pw.words.shape == (4, 8, 128, 4) and pw.words.dtype == jnp.uint32
    assert pw.scales.shape == (4, 8, 128) and pw.scales.dtype == jnp.uint8
    assert pw.nbytes == w.nbytes  # no padding at this shape
    nv = lowprec.prepare_weight(_random_weight("nvfp4", 256, 512, seed=1))
    assert nv.scales.shape == (4, 8, 256)


# -- the kernel's decode, run from its PTX text --------------------------------------------------


def _fragment_position(tid, q, j, e):
    """(row, column) in a 64×64 tile of element e of register a_j of k16 slice q for thread
    tid, from the PTX ISA's wgmma m64nNk16 A-fragment figure (bfloat16): warp w = tid // 32
    owns rows 16w..16w+15; lane 4g + t holds rows g and g + 8, columns 2t, 2t + 1 and 2t + 8,
    2t + 9 of the slice, registers a_0..a_3 = (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8)."""
    w, lane = tid // 32, tid % 32
    g, t = lane // 4, lane % 4
    row = 16 * w + g + 8 * (j % 2)
    col = 16 * q + 8 * (j // 2) + 2 * t + e
    return row, col


def _emulate_tiles(pw: prep.PreparedWeight) -> np.ndarray:
    """Runs the kernel's decode for every tile and thread: float64 A-operand values
    [Tn·64, Tk·64], placed where the kernel's registers put them (``register_of``)."""
    fmt = pw.fmt.name
    words = np.asarray(pw.words)  # [Tn, Tk, 128, 4]
    tn, tk = words.shape[:2]
    per_quad = prep.SCALE_BYTES_PER_QUAD[fmt] // 4
    sw = np.asarray(pw.scales).reshape(tn, tk, 32, per_quad, 4).astype(np.uint32)
    sw = sw[..., 0] | sw[..., 1] << 8 | sw[..., 2] << 16 | sw[..., 3] << 24  # little-endian
    tids = np.arange(128)
    out = np.full((tn * 64, tk * 64), np.nan)
    dec, sc = kern.decode_asm(pw.one_multiply), kern.scale_asm(fmt, pw.one_multiply)
    const = kern.scale_constant(fmt, pw.one_multiply)
    for q in range(4):
        word_index, block = kern.slice_scales(fmt, q)
        scale_words = sw[:, :, tids // 4, word_index]  # [Tn, Tk, 128]
        f = ptx.run(sc, {2: scale_words, 3: kern.scale_selector(block), 4: const})
        r = ptx.run(dec, {4: words[..., q], 5: kern.BF16X2_2P126, 6: f["$0"], 7: f["$1"]})
        for j in range(4):
            c, h = kern.register_of(q, j)
            assert (c, h) == (2 * q + j // 2, j % 2)  # the fragment's register a_j
            for e in range(2):
                bits = (r[f"${j}"] >> np.uint32(16 * e)) & np.uint32(0xFFFF)
                vals = (bits << np.uint32(16)).view(np.float32).astype(np.float64)
                row, col = _fragment_position(tids, q, j, e)
                for a in range(tn):
                    for b in range(tk):
                        out[a * 64 + row, b * 64 + col] = vals[a, b]
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("one", [False, True], ids=["two-multiply", "one-multiply"])
def test_kernel_decode_gives_the_fragments_values(fmt, one):
    rng = np.random.default_rng(11)
    n, k = 128, 128
    block = lowprec.mx_format(fmt).block_size
    shape = (n, k // block)
    if fmt == "mxfp4":  # every code; the one-multiply form serves codes <= 128 and NaN
        s = rng.integers(0, 129 if one else 256, shape, dtype=np.uint8)
        s.flat[:129 if one else 256] = np.arange(129 if one else 256)
        s[5, 1] = 0xFF
    else:  # every positive E4M3 code (normal ones for the one-multiply form) and NaN
        lo = 0x08 if one else 0
        s = rng.integers(lo, 0x7F, shape, dtype=np.uint8)
        s.flat[:0x7F - lo] = np.arange(lo, 0x7F)
        s[5, 1] = 0x7F
    w = _random_weight(fmt, n, k, seed=3, scales=s)
    pw = lowprec.prepare_weight(w)
    assert pw.one_multiply == one
    got = _emulate_tiles(pw)
    want = _values(w, with_tensor_scale=False)
    if fmt == "nvfp4" and one:
        want = want * 2.0**-kern.NV_ONE_MUL_SHIFT
    with np.errstate(over="ignore"):  # E8M0 254 × 2 overflows, as in float32
        want = want.astype(np.float32).astype(np.float64)
    finite_block = ~np.isnan(want)
    np.testing.assert_array_equal(got[finite_block], want[finite_block])
    assert np.array_equal(np.signbit(got[finite_block]), np.signbit(want[finite_block]))
    # NaN blocks: whatever the registers hold, their rows are marked NaN.
    nan_rows = np.isnan(want).any(axis=1)
    np.testing.assert_array_equal(np.asarray(pw.nan_rows), nan_rows)


def test_one_multiply_is_chosen_from_the_codes():
    base = np.full((64, 2), 127, np.uint8)
    ones = np.full((64, 32), 0x22, np.uint8)  # every element 1.0
    zero = np.zeros((64, 32), np.uint8)

    def pw(scales, elements=ones, fmt="mxfp4"):
        block = lowprec.mx_format(fmt).block_size
        el = np.tile(elements[:, :1], (1, 64 // 2))
        ts = jnp.float32(1.0) if fmt == "nvfp4" else None
        del block
        return lowprec.prepare_weight(lowprec.MXArray(jnp.asarray(el), jnp.asarray(scales), fmt,
                                                      1, (64, 64), None, ts))

    assert pw(base).one_multiply
    big = base.copy()
    big[3, 1] = 129  # a block of values >= 2^2: 2^(129 - 1) is no bfloat16
    assert not pw(big).one_multiply
    assert pw(big, zero).one_multiply  # ... unless its codes are all zero
    nan = base.copy()
    nan[3, 1] = 0xFF
    assert pw(nan).one_multiply
    nv = np.full((64, 4), 0x38, np.uint8)  # E4M3 1.0
    assert pw(nv, fmt="nvfp4").one_multiply
    sub = nv.copy()
    sub[0, 0] = 0x03  # an E4M3 subnormal
    assert not pw(sub, fmt="nvfp4").one_multiply


# -- the kernel's sums, stated in NumPy in its tile order ---------------------------------------------


def _kernel_order_product(pw: prep.PreparedWeight, x: np.ndarray, cfg) -> np.ndarray:
    """The kernel's arithmetic in its order, float32 after every addition: per program and
    split, per stage, per 64-column tile, per k16 slice the 16 exact products are added to
    the float32 accumulator one by one (a model: the tensor core's internal order is its
    own); XLA adds the splits, then applies the tensor scale and the NaN rows."""
    a = _emulate_tiles(pw)  # bfloat16 values as float64
    n, k = pw.shape
    m = x.shape[0]
    tk = pw.words.shape[1]
    xp = np.zeros((m, tk * 64))
    xp[:, :k] = x
    steps = cfg.steps(tk)
    partial = np.zeros((cfg.splits, m, a.shape[0]), np.float32)
    for split in range(cfg.splits):
        acc = np.zeros((m, a.shape[0]), np.float32)
        for step in range(steps):
            for tile in range(cfg.tiles_per_step):
                c0 = ((split * steps + step) * cfg.tiles_per_step + tile) * 64
                if c0 >= tk * 64:  # past the weight: TMA fills zeros
                    continue
                for s0 in range(c0, c0 + 64, 16):
                    for kk in range(s0, s0 + 16):
                        with np.errstate(invalid="ignore", over="ignore"):  # NaN rows
                            prod = (xp[:, kk:kk + 1] * a[None, :, kk]).astype(np.float32)
                            acc = (acc + prod).astype(np.float32)
        partial[split] = acc
    y = partial.sum(axis=0, dtype=np.float32)[:, :n]
    if pw.tensor_scale is not None:
        shift = kern.NV_ONE_MUL_SHIFT if pw.one_multiply else 0
        y = (y * np.float32(float(pw.tensor_scale) * 2.0**shift)).astype(np.float32)
    return np.where(np.asarray(pw.nan_rows)[None, :], np.nan, y)


def _bound(x, values):
    """K·2^-23·Σ|w x| (+ K·2^-149) per output: the float32 summation bound."""
    k = x.shape[1]
    return k * 2.0**-23 * (np.abs(x) @ np.abs(np.nan_to_num(values)).T) + k * 2.0**-149


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 16])
def test_kernel_order_sums_are_within_the_bound(fmt, m):
    rng = np.random.default_rng(m)
    n, k = 128, 640
    block = lowprec.mx_format(fmt).block_size
    if fmt == "mxfp4":
        s = rng.integers(118, 130, (n, k // block), dtype=np.uint8)
    else:
        s = rng.integers(0x20, 0x7F, (n, k // block), dtype=np.uint8)
    s[7, 3] = 0xFF if fmt == "mxfp4" else 0x7F
    w = _random_weight(fmt, n, k, seed=m, scales=s)
    pw = lowprec.prepare_weight(w)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
    values = _values(w)
    exact = x @ np.nan_to_num(values).T
    cfg = kern.WeightOnlyConfig(tokens=8 if m <= 8 else 16, tiles_per_step=2, splits=3)
    got = _kernel_order_product(pw, x, cfg)
    nan_rows = np.isnan(values).any(axis=1)
    assert np.isnan(got[:, nan_rows]).all()
    err = np.abs(got[:, ~nan_rows] - exact[:, ~nan_rows])
    bound = _bound(x, values)[:, ~nan_rows]
    if fmt == "nvfp4":  # the tensor scale rounds the float32 sum once more
        bound = bound + 2.0**-24 * np.abs(exact[:, ~nan_rows])
    assert (err <= bound).all(), float((err / bound).max())


# -- weight_only_matmul off the GPU ------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lead", [(), (2, 4)], ids=["vector", "batch-seq"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.quick_cases(lead=[(2, 4)])  # the [batch, seq, d] cases run the vector's code too
def test_weight_only_matmul_is_within_the_bound(fmt, lead, mode):
    n, k = 200, 96
    rng = np.random.default_rng(len(lead))
    block = lowprec.mx_format(fmt).block_size
    if fmt == "mxfp4":
        s = rng.integers(110, 140, (n, k // block), dtype=np.uint8)
        s[9, 0] = 0xFF
    else:
        s = rng.integers(0x10, 0x7F, (n, k // block), dtype=np.uint8)
        s[9, 0] = 0x7F
    w = _random_weight(fmt, n, k, seed=5, scales=s)
    pw = lowprec.prepare_weight(w)
    x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.bfloat16)
    f = lowprec.weight_only_matmul if mode == "eager" else jax.jit(lowprec.weight_only_matmul)
    y = np.asarray(f(x, pw), np.float64)
    assert y.shape == (*lead, n) and y.dtype == np.float64
    values = _values(w)
    xs = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, k)
    exact = (xs @ np.nan_to_num(values).T).reshape(*lead, n)
    nan_rows = np.isnan(values).any(axis=1)
    assert np.isnan(y[..., nan_rows]).all() and not np.isnan(y[..., ~nan_rows]).any()
    bound = _bound(xs, values).reshape(*lead, n) + 2.0**-23 * np.abs(exact)
    assert (np.abs(y - exact)[..., ~nan_rows] <= bound[..., ~nan_rows]).all()


def test_weight_only_matmul_of_no_tokens():
    pw = lowprec.prepare_weight(_random_weight("mxfp4", 64, 64, seed=0))
    y = lowprec.weight_only_matmul(jnp.zeros((0, 64), jnp.bfloat16), pw)
    assert y.shape == (0, 64) and y.dtype == jnp.float32


# -- refusals ----------------------------------------------------------------------------------------


def test_prepare_refuses_what_it_cannot_hold():
    x = jnp.ones((64, 64))
    with pytest.raises(ValueError, match="mxfp8_e4m3"):
        lowprec.prepare_weight(lowprec.quantize_mx(x, "mxfp8"))
    with pytest.raises(ValueError, match="2-D"):
        lowprec.prepare_weight(lowprec.quantize_mx(jnp.ones((2, 64, 64)), "mxfp4"))
    with pytest.raises(TypeError, match="MXArray"):
        lowprec.prepare_weight(np.ones((64, 64)))
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lowprec.prepare_weight)(lowprec.quantize_mx(x, "mxfp4"))


def test_prepare_refuses_negative_nvfp4_block_scales_and_names_them():
    s = np.full((64, 4), 0x38, np.uint8)
    s[2, 3] = 0xB8  # E4M3 -1.0
    w = lowprec.MXArray(jnp.full((64, 32), 0x22, jnp.uint8), jnp.asarray(s), "nvfp4", 1,
                        (64, 64), None, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"row 2, block 3, code 0xb8"):
        lowprec.prepare_weight(w)


def test_weight_only_matmul_refuses_bad_operands():
    pw = lowprec.prepare_weight(_random_weight("mxfp4", 64, 64, seed=0))
    with pytest.raises(TypeError, match="bfloat16"):
        lowprec.weight_only_matmul(jnp.ones((2, 64), jnp.float32), pw)
    with pytest.raises(TypeError, match=r"\(\.\.\., 64\)"):
        lowprec.weight_only_matmul(jnp.ones((2, 32), jnp.bfloat16), pw)
    with pytest.raises(TypeError, match="PreparedWeight"):
        lowprec.weight_only_matmul(jnp.ones((2, 64), jnp.bfloat16), pw.to_mxarray())


def test_prepared_weight_checks_its_leaves():
    pw = lowprec.prepare_weight(_random_weight("mxfp4", 64, 64, seed=0))
    with pytest.raises(ValueError, match="words: expected uint32"):
        prep.PreparedWeight(pw.words[:, :, :64], pw.scales, pw.nan_rows, pw.fmt, pw.shape)
    with pytest.raises(ValueError, match="tensor_scale"):
        prep.PreparedWeight(pw.words, pw.scales, pw.nan_rows, pw.fmt, pw.shape,
                            tensor_scale=jnp.float32(1))


def test_the_decode_program_reads_every_bit_once_and_has_nine_instructions():
    positions = prep.BIT_POSITIONS.ravel().tolist()
    assert sorted(positions) == list(range(32))
    body = [ln for ln in ptx.instructions(kern.decode_asm(True)) if not ln.startswith("mul")]
    assert len(body) == 9, body
    assert math.isclose(len(ptx.instructions(kern.decode_asm(True))) / 8, 13 / 8)


# -- the CUDA branch, lowered without a GPU --------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.quick_first(1)  # ~2 s a format of CUDA lowerings; NVFP4's in the default run
def test_on_cuda_the_product_is_the_mosaic_gpu_kernel(fmt, cuda_branches):
    """Lowered for "cuda" (no GPU needed), up to 16 tokens take the kernel — its custom call
    holds the decode PTX — and more take the generic dot; the policy "xla" turns it off."""
    if not kern.mosaic_gpu_available():
        pytest.skip("this JAX has no Pallas Mosaic GPU backend")
    pw = lowprec.prepare_weight(_random_weight(fmt, 128, 128, seed=0, scales=np.full(
        (128, 128 // lowprec.mx_format(fmt).block_size), 0x7F if fmt == "mxfp4" else 0x38,
        np.uint8)))

    def lowered(m):
        return lower_for_cuda(lowprec.weight_only_matmul,
                              jax.ShapeDtypeStruct((m, 128), jnp.bfloat16), pw)

    assert "mosaic_gpu_v2" in lowered(1) and "mosaic_gpu_v2" in lowered(16)
    assert "mosaic_gpu_v2" not in lowered(17)
    previous = lowprec.kernels.set_policy("xla")
    try:
        assert "mosaic_gpu_v2" not in lowered(1)
    finally:
        lowprec.kernels.set_policy(previous)


# -- on a GPU: the compiled kernel ----------------------------------------------------------------

ON_HOPPER = jax.default_backend() == "gpu" and all(
    str(getattr(d, "compute_capability", "")).startswith("9") for d in jax.devices())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU (the Mosaic GPU kernel's wgmma)")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("one", [True, False], ids=["one-multiply", "two-multiply"])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_the_kernel_on_a_hopper_gpu_is_within_the_bound(fmt, one, m):
    """The compiled kernel (weight_only_matmul on the GPU) at a gpt-oss shape against the
    exact product of the weight's values (table × scales, float64): within the bound, NaN
    rows NaN, and the same result for the same call twice (no atomics)."""
    n, k = 2880, 2880
    rng = np.random.default_rng(m)
    block = lowprec.mx_format(fmt).block_size
    if fmt == "mxfp4":
        s = rng.integers(100, 129 if one else 200, (n, k // block), dtype=np.uint8)
        s[17, 5] = 0xFF
    else:
        s = rng.integers(0x08 if one else 0x01, 0x7F, (n, k // block), dtype=np.uint8)
        s[17, 5] = 0x7F
    w = _random_weight(fmt, n, k, seed=m, scales=s)
    pw = lowprec.prepare_weight(w)
    assert pw.one_multiply == one
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    y = np.asarray(lowprec.weight_only_matmul(x, pw), np.float64)
    assert np.array_equal(y, np.asarray(lowprec.weight_only_matmul(x, pw)), equal_nan=True)
    values = _values(w)
    xs = np.asarray(x.astype(jnp.float32), np.float64)
    exact = xs @ np.nan_to_num(values).T
    nan_rows = np.isnan(values).any(axis=1)
    assert np.isnan(y[:, nan_rows]).all() and not np.isnan(y[:, ~nan_rows]).any()
    bound = _bound(xs, values) + 2.0**-23 * np.abs(exact)
    err = np.abs(y - exact)[:, ~nan_rows]
    assert (err <= bound[:, ~nan_rows]).all(), float((err / bound[:, ~nan_rows]).max())
