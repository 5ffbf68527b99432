"""The NVFP4 training recipe of Transformer Engine, for a linear layer ``y = x · w``.

NVIDIA's NVFP4 pretraining recipe (NVIDIA, "Pretraining Large Language Models with NVFP4",
arXiv 2509.25149, 2025; Transformer Engine ``recipe.NVFP4BlockScaling``, whose flags
``disable_rht``, ``disable_stochastic_rounding`` and ``disable_2d_quantization`` name its
three parts) quantizes every GEMM operand to NVFP4 (E2M1 elements, an E4M3 scale per 16
elements, a float32 scale per tensor) and adds three things, which :class:`~lowprec.Recipe`
fields switch on (:data:`~lowprec.NVIDIA_NVFP4` has all three):

* ``weight_block_2d``: weights get one E4M3 scale per 16 x 16 tile (from the tile's amax), so
  the quantized weight is the same whether it is read along K (forward) or along N (the
  gradient of the input): the forward and backward passes see one weight;
* ``wgrad_rht``: the two operands of the weight-gradient GEMM, activations x [T, K] and
  cotangent g [T, N], are multiplied along their contraction T (tokens) by the same random
  Hadamard transform in 16 x 16 blocks, M = H16 · diag(s) / 4 (H16 the Sylvester Hadamard
  matrix, s a random ±1 vector): Mᵀ M = I, so (M x)ᵀ (M g) = xᵀ g, while the rotation
  spreads outliers over each block before the 16-element quantization along T;
* ``grad_rounding="stochastic"``: cotangents are rounded to E2M1 stochastically (both
  backward GEMMs), activations and weights to nearest even.

Sharding: data parallel on ``Explicit`` and ``Auto`` mesh axes works (tokens split in whole
16-token blocks; the weight gradient is reduced into the weight's layout;
tests/sharded_cases.py). Not yet: a contraction split across devices (row-parallel; the
forward dot takes no ``out_sharding`` here).

Layers to keep in high precision (the paper keeps the last few blocks in BF16) are chosen
with the recipe's ``high_precision`` patterns or per-layer :class:`~lowprec.Rules`.

Every quantization here is lowprec's NVFP4 (torchao's two-level recipe, bit-exact: see
``_nvfp4.py``): tensor scale float32(amax / 2688), block scale e4m3((block_amax / 6) /
tensor_scale), element e2m1(x / float32(tensor_scale * block_scale)), value element *
float32(tensor_scale * block_scale); a 16 x 16 tile uses its own amax as every one of its
rows' block amax. The products are float32 dots (``precision=HIGHEST``) of those values, so
each GEMM is within K·2^-23·Σ|a b| plus one float32 product rounding per term of the exact
dot of the quantized operands.

Steps, for x [T, K] (leading dims flattened), w [K, N] (or [N, K]), cotangent g [T, N];
every axis zero-padded to a multiple of 16 first (zeros add nothing, and (M 0) = 0 rows do
not change a block's amax):

1. forward: ``y = Q(x, along K) · Q2(w)``, Q = 16-element blocks, Q2 = 16 x 16 tiles;
2. grad_x: ``Q(g, along N, SR words w_d) · Q2(w)ᵀ``;
3. grad_w: ``Q(M x, along T)ᵀ · Q(M g, along T, SR words w_w)`` (without RHT: M = I).

Random-word contract (stochastic rounding of g; ``lowprec.random_bits``' comparison rule):
h = the uint32 wrapping sum of g's float32 bit patterns (padded), k = fold_in(key(seed), h);
w_d = random_bits(fold_in(k, 0), padded g.shape) and w_w = random_bits(fold_in(k, 1),
padded g.shape) (for step 3 indexed as M g, i.e. the same [T, N] layout). The RHT signs are
s_i = 1 - 2 (random_bits(key(seed), (16,))[i] & 1). ``seed`` is a recipe field. Words
depend on the data only through h, so a step is reproducible and steps differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _nvfp4
from ._bits import F32_ABS, F32_INF, bits_to_f32, f32_bits
from ._decode import decode_bits, decode_f32
from ._dtypes import bits_to_dtype, input_bits
from ._encode import encode_bits
from ._format import mx_format
from ._gpu_gemm import apply_tensor_scales, block_values_bf16
from ._mx import dequantize, quantize_mx
from ._random import random_bits
from ._sharding import explicit_sharding
from .kernels._dispatch import gpu_gemm_routes, kernels_enabled, on_cuda

TILE = 16  # NVFP4 block length, and the side of weight tiles and of the Hadamard blocks


def rht_signs(seed: int, n: int = TILE) -> jax.Array:
    """The RHT sign vector s (float32 ±1, length ``n``, 16 for the recipe) of ``seed``
    (module docstring; the first 16 signs of any length are the recipe's)."""
    words = random_bits(jax.random.key(seed), (n,))
    return 1.0 - 2.0 * (words & 1).astype(jnp.float32)


def rht(v, signs):
    """M v along axis 0 in blocks of n = len(signs) (16 for the recipe; any power of two,
    axis 0 a multiple of n): each block multiplied by the signs, then the Walsh-Hadamard
    butterfly (for h = 1, 2, 4, ..., n/2: (a, b) -> (a + b, a - b) on elements h apart),
    then by 1/√n (1/4 for 16, exact; for n an odd power of two 1/√n rounded to float32).
    Each step is one float32 operation per element, the same in every backend (the NumPy
    statement in tests/test_nvfp4_train.py does them). The butterfly reads partners with a
    static gather inside each block, so a sharded token axis (whole blocks per device) needs
    no reshape across shards."""
    t, c = v.shape
    n = signs.shape[0]
    if n < 2 or n & (n - 1):
        raise ValueError(f"a Hadamard block is a power of two of at least 2, got {n}")
    b = v.reshape(t // n, n, c) * signs[None, :, None]
    pos = np.arange(n)
    h = 1
    while h < n:
        partner = jnp.take(b, pos ^ h, axis=1)  # element p's partner p xor h
        low = jnp.asarray((pos & h) == 0)[None, :, None]  # p is the "a" of its pair
        b = jnp.where(low, b + partner, partner - b)
        h *= 2
    return b.reshape(t, c) * jnp.float32(1 / np.sqrt(n))


def quantize_1d(v, axis: int, words=None, gemm: bool = False):
    """float32 values of NVFP4 ``v`` blocked along ``axis`` (words: stochastic rounding);
    ``gemm``: instead the GPU GEMM's operand, (bfloat16 block values, tensor scale)."""
    if words is None:
        mx = quantize_mx(v, "nvfp4", axis=axis)
    else:
        mx = quantize_mx(v, "nvfp4", axis=axis, rounding="stochastic", random_bits=words)
    return block_values_bf16(mx) if gemm else dequantize(mx)


def quantize_2d(w, gemm: bool = False):
    """float32 values of NVFP4 ``w`` [R, C] (multiples of 16) with one scale per 16 x 16
    tile, from the tile's finite amax (a tile holding NaN/inf dequantizes to NaN); ``gemm``:
    instead the GPU GEMM's operand, (bfloat16 values of element x tile scale, tensor
    scale)."""
    fmt = mx_format("nvfp4")
    r, c = w.shape
    bits = f32_bits(w)  # w: float32
    ts = _nvfp4.clamp_tensor_scale_bits(_nvfp4.tensor_scale_bits(_nvfp4.finite_amax_bits(bits)))
    mag = (bits & F32_ABS).reshape(r // TILE, TILE, c // TILE, TILE)
    finite = mag < F32_INF
    tile_amax = jnp.max(jnp.where(finite, mag, jnp.uint32(0)), axis=(1, 3))
    special = jnp.repeat(~jnp.all(finite, axis=(1, 3)), TILE, axis=0)  # [R, C/16]
    codes_s = jnp.repeat(_nvfp4.block_scale_codes(tile_amax, ts, fmt.scale), TILE, axis=0)
    total = _nvfp4.total_scale_bits(codes_s, ts, fmt.scale)  # [R, C/16]
    quotient = _nvfp4.element_quotient_bits(bits.reshape(r, c // TILE, TILE), total[..., None])
    codes = encode_bits(fmt.element, quotient, "nearest_even", "saturate", None,
                        assume_finite=True)
    if gemm:  # element x tile scale: <= 6 significant bits, an exact bfloat16 (_gpu_gemm)
        block = decode_f32(fmt.element, codes) * decode_f32(fmt.scale, codes_s)[..., None]
        block = jnp.where(special[..., None], jnp.float32(jnp.nan), block)
        return block.reshape(r, c).astype(jnp.bfloat16), bits_to_f32(ts)
    values = _nvfp4.dequantize_bits(decode_bits(fmt.element, codes), codes_s[..., None], ts,
                                    fmt.scale)
    values = jnp.where(special[..., None], jnp.uint32(0x7FC0_0000), values)
    return bits_to_f32(values.reshape(r, c))


def _f32(v):
    """float32 values of a float array, widened on the bits (no float convert: docs/design.md
    §8, XLA on GPU canonicalizes half-precision NaNs in converts)."""
    return bits_to_f32(input_bits(v))


def _pad_to(v, axis: int):
    n = v.shape[axis]
    extra = -n % TILE
    if not extra:
        return v
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, extra)
    return jnp.pad(v, widths)


def _f32dot(a, b, dn, out_sharding=None):
    return lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32, out_sharding=out_sharding)


def _gemm(gemm: bool, a, b, dn, out_sharding=None):
    """The product of two quantized operands: float32 values (a float32 dot) or, for the GPU
    (``gemm``), (bfloat16 block values, tensor scale) pairs: a bfloat16 GEMM whose float32
    output is multiplied by the two tensor scales (``_gpu_gemm``)."""
    if not gemm:
        return _f32dot(a, b, dn, out_sharding)
    (av, at), (bv, bt) = a, b
    out = lax.dot_general(av, bv, dn, preferred_element_type=jnp.float32,
                          out_sharding=out_sharding)
    return apply_tensor_scales(out, at, bt)


def _routed(compute, *args):
    """``compute(gemm, *args)``: on CUDA with ``gemm=True`` (bfloat16 GEMMs, no float32 one)
    unless the kernel policy is ``"xla"``; elsewhere with ``gemm=False``."""
    portable = functools.partial(compute, False)
    if not gpu_gemm_routes(kernels_enabled()):
        return portable(*args)
    return on_cuda(functools.partial(compute, True), portable, *args)


def grad_words(g_padded, seed: int):
    """The random words (w_d, w_w) of a padded cotangent (module docstring)."""
    h = jnp.sum(f32_bits(g_padded), dtype=jnp.uint32)
    k = jax.random.fold_in(jax.random.key(seed), h)
    shape = g_padded.shape
    return (random_bits(jax.random.fold_in(k, 0), shape),
            random_bits(jax.random.fold_in(k, 1), shape))


def check_layout(lhs_shape, rhs_shape, dn) -> None:
    """The recipe's dot is a linear layer's: lhs [..., K] contracted on its last axis with a
    2-D rhs (weight), no batch dims."""
    (lc, rc), (lb, rb) = dn
    if lb or rb or len(rhs_shape) != 2 or tuple(lc) != (len(lhs_shape) - 1,) or len(rc) != 1:
        raise ValueError(
            "the NVFP4 training recipe (weight_block_2d / wgrad_rht / stochastic grad_rounding) "
            "applies to linear layers: lhs [..., K] contracted on its last axis with a 2-D "
            f"weight, no batch dims; got shapes {tuple(lhs_shape)}, {tuple(rhs_shape)} and "
            f"dimension numbers {dn}. Keep this layer in another recipe (Rules/high_precision)"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def nvfp4_train_dot(x, w, dn, recipe, out_dtype, out_sharding=None):
    return _forward(x, w, dn, recipe, out_dtype, out_sharding)


def _weight_nk(w, dn):
    """The weight as [N, K] (its contraction last), padded to multiples of 16."""
    (_, rc), _ = dn
    wt = w if rc[0] == 1 else w.T
    return _pad_to(_pad_to(_f32(wt), 0), 1)


def _quantized_weight(wt, recipe, gemm: bool = False):
    """The quantized weight [N, K] (from :func:`_weight_nk`), as :func:`_gemm` takes it."""
    return quantize_2d(wt, gemm) if recipe.weight_block_2d else quantize_1d(wt, 1, gemm=gemm)


def _forward(x, w, dn, recipe, out_dtype, out_sharding):
    k = x.shape[-1]
    n = w.shape[1 - dn[0][1][0]]
    x2 = _pad_to(_f32(x.reshape(-1, k)), 1)

    def product(gemm, x2, wt):
        return _gemm(gemm, quantize_1d(x2, 1, gemm=gemm), _quantized_weight(wt, recipe, gemm),
                     (((1,), (1,)), ((), ())))

    y = _routed(product, x2, _weight_nk(w, dn))[:, :n]
    return bits_to_dtype(f32_bits(y.reshape(*x.shape[:-1], n)), out_dtype)


def _fwd(x, w, dn, recipe, out_dtype, out_sharding):
    return nvfp4_train_dot(x, w, dn, recipe, out_dtype, out_sharding), (x, w)


def _bwd(dn, recipe, out_dtype, out_sharding, residuals, g):
    x, w = residuals
    k = x.shape[-1]
    (_, rc), _ = dn
    n = w.shape[1 - rc[0]]
    t = x.size // k
    x2 = _pad_to(_pad_to(_f32(x.reshape(t, k)), 0), 1)  # [T16, K16]
    g2 = _pad_to(_pad_to(_f32(g.reshape(t, n)), 0), 1)  # [T16, N16]
    stochastic = recipe.grad_rounding == "stochastic"
    wd, ww = grad_words(g2, recipe.seed) if stochastic else (None, None)

    # grad_x = Q(g along N) · Q2(w): [T, N] x [N, K].
    def grad_x(gemm, g2, wt, wd):
        return _gemm(gemm, quantize_1d(g2, 1, wd, gemm), _quantized_weight(wt, recipe, gemm),
                     (((1,), (0,)), ((), ())))

    gx = _routed(grad_x, g2, _weight_nk(w, dn), wd)[:t, :k]
    # grad_w = Q(M x along T)ᵀ · Q(M g along T): [K, N].
    if recipe.wgrad_rht:
        signs = rht_signs(recipe.seed)
        x2, g2 = rht(x2, signs), rht(g2, signs)
    # Tokens sharded (data parallel, Explicit axes): the sum over them is reduced into the
    # weight's layout, as lax.dot_general's transpose does (unpadded weights only).
    sw = explicit_sharding(w) if (k % TILE == 0 and n % TILE == 0) else None
    if sw is not None and rc[0] == 1:
        spec = (tuple(sw.spec) + (None, None))[:2]
        sw = jax.sharding.NamedSharding(sw.mesh, jax.sharding.PartitionSpec(*spec[::-1]))

    def grad_w(gemm, x2, g2, ww):
        return _gemm(gemm, quantize_1d(x2, 0, gemm=gemm), quantize_1d(g2, 0, ww, gemm),
                     (((0,), (0,)), ((), ())), sw)

    gw = _routed(grad_w, x2, g2, ww)[:k, :n]
    gw = gw if rc[0] == 0 else gw.T
    return (bits_to_dtype(f32_bits(gx.reshape(x.shape)), x.dtype),
            bits_to_dtype(f32_bits(gw), w.dtype))


nvfp4_train_dot.defvjp(_fwd, _bwd)
