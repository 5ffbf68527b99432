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

Transformer Engine's own choices, as recipe fields (:data:`TE_NVFP4_OPTIONS` names the set
that reproduces its quantized operands): ``nvfp4_step="reciprocal"`` in ``scale_options``
(every quantization, the 16 x 16 tiles included, multiplies by float32(float32(1 / ts) / s) instead of dividing
by float32(ts · s), as TE's and torchao >= 0.17's kernels do; the default ``"divide"``
differs from TE in about 1 code in 10^6), ``rht_signs="transformer_engine"`` (TE's fixed
sign vector, :data:`TE_RHT_SIGN_MASK`, instead of one drawn from ``seed``),
``rht_dtype="bfloat16"`` (the transform's operands and result rounded to bfloat16, nearest
even, as TE's bfloat16 GEMM with the bfloat16 Hadamard matrix gives wherever its float32
accumulation is exact, i.e. wherever the butterfly's float32 sums are) and
``backward_override`` (TE's ``NVTE_BACKWARD_OVERRIDE``): ``"high_precision"`` makes both
backward products float32 dots (``precision=HIGHEST``) of the unquantized cotangent and
operands, ``"dequantized"`` of the unquantized cotangent and the forward's quantized
operands (Q(x) along K, the weight as the forward read it), so the gradient of the
quantized forward. What stays different from TE: the stochastic-rounding words (TE draws
them from its own generator state) and the GEMMs' accumulation order (float32 dots here).

Sharding (tests/sharded_cases.py): data, tensor (column- and row-parallel) and FSDP layouts
on ``Explicit`` and ``Auto`` mesh axes, as for the other recipes: ``out_sharding`` goes to the
forward dot (a row-parallel layer's partial sums are reduced there), each gradient comes out
laid out as its operand, and the reshapes (leading dims into tokens, 16 x 16 tiles, a
DenseGeneral's weight into 2-D) are given their layouts on ``Explicit`` axes. An axis split
across devices must hold whole 16-blocks per device (tokens, for the Hadamard transform and
the weight gradient; K and N, for the blocks and weight tiles), so it is never padded;
:meth:`~lowprec.Recipe.dot_general` refuses other layouts with an error naming the axis.

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
a DenseGeneral-style weight ([D, heads, head_dim], or [heads, head_dim, D] contracted on
its first two axes) is the 2-D matrix of its contracting axes (K) by its other axes (N),
each flattened in order, and x's contracting axes are flattened alike; every axis
zero-padded to a multiple of 16 first (zeros add nothing, and (M 0) = 0 rows do not change a
block's amax):

1. forward: ``y = Q(x, along K) · Q2(w)``, Q = 16-element blocks, Q2 = 16 x 16 tiles;
2. grad_x: ``Q(g, along N, SR words w_d) · Q2(w)ᵀ``;
3. grad_w: ``Q(M x, along T)ᵀ · Q(M g, along T, SR words w_w)`` (without RHT: M = I).

Random-word contract (stochastic rounding of g; ``lowprec.random_bits``' comparison rule):
the dot's key k is, inside :func:`lowprec.stochastic_rounding_key` (``key``), fold_in(key, i)
for the i-th such dot traced in the block; elsewhere k = fold_in(key(seed), h) with h the
uint32 wrapping sum of g's float32 bit patterns (padded). w_d = random_bits(fold_in(k, 0),
padded g.shape) and w_w = random_bits(fold_in(k, 1), padded g.shape) (for step 3 indexed as
M g, i.e. the same [T, N] layout). The RHT signs are s_i = 1 - 2 (random_bits(key(seed),
(16,))[i] & 1). ``seed`` is a recipe field. Either way a step is reproducible and steps
differ. Keyed words do not depend on the data, as Transformer Engine's come from its random
state: a data-parallel run on any number of devices then tracks the one-device run. Words
from h depend on every bit of the cotangent, which float32 summation order changes from one
device count to another (after the first update), so such runs drift apart by the rounding
noise itself (docs/design.md §14).
"""

from __future__ import annotations

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _nvfp4
from ._bits import F32_ABS, F32_INF, bits_to_bf16_bits, bits_to_f32, f32_bits
from ._decode import decode_bits, decode_f32
from ._dtypes import bits_to_dtype, input_bits
from ._encode import encode_bits
from ._format import mx_format
from ._gpu_gemm import apply_tensor_scales, block_values_bf16
from ._mx import dequantize, quantize_mx
from ._mx_encode import nvfp4_values
from ._options import BACKWARD_OVERRIDES, NVFP4_TILE, RHT_DTYPES, DotSpec  # noqa: F401 (re-exported)
from ._options import MXCast
from ._qdot import register_family, training_dot
from ._random import check_size, element_index, element_words, random_bits
from ._scheme_nvfp4 import NVFP4Options, NVFP4Step
from ._sharding import (dot_out_sharding, explicit_sharding, merge_dims, merged_sharding,
                        split_dims, split_out_sharding)
from .kernels import _nvfp4_cpu, _rht_cpu
from .kernels._dispatch import (cpu_nvfp4_fake_quantize, gpu_gemm_routes, kernels_enabled,
                                on_cpu, on_cuda)

TILE = NVFP4_TILE  # NVFP4 block length, and the side of weight tiles and of the Hadamard blocks

#: Transformer Engine's fixed RHT sign vector for NVFP4 weight gradients, as a mask: bit i set
#: where sign i is -1 (TE's ``get_sign_from_vector``). TE's vector (``get_wgrad_sign_vector``)
#: is (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1): -1 at 3, 5-10, 12, 14, 15.
TE_RHT_SIGN_MASK = 0b1101_0111_1110_1000
#: The Recipe fields that make :data:`~lowprec.NVIDIA_NVFP4` quantize as Transformer Engine's
#: ``NVFP4BlockScaling`` does: ``dataclasses.replace(lowprec.NVIDIA_NVFP4, **TE_NVFP4_OPTIONS)``
#: (NVFP4's options ``nvfp4_step="reciprocal"``, TE's RHT signs and bfloat16 RHT).
TE_NVFP4_OPTIONS = types.MappingProxyType(
    {"scale_options": NVFP4Options(NVFP4Step.RECIPROCAL), "rht_signs": "transformer_engine",
     "rht_dtype": "bfloat16"})


def rht_signs(seed: int, n: int = TILE) -> jax.Array:
    """The RHT sign vector s (float32 ±1, length ``n``, 16 for the recipe) of ``seed``
    (module docstring; the first 16 signs of any length are the recipe's)."""
    words = random_bits(jax.random.key(seed), (n,))
    return 1.0 - 2.0 * (words & 1).astype(jnp.float32)


def mask_signs(mask: int, n: int = TILE) -> jax.Array:
    """The float32 ±1 sign vector of a bit mask (bit i set: sign i is -1)."""
    return jnp.asarray([-1.0 if (mask >> i) & 1 else 1.0 for i in range(n)], jnp.float32)


def recipe_rht_signs(recipe) -> jax.Array:
    """The signs of ``recipe``'s Hadamard transform: ``rht_signs`` (None: from ``seed``;
    ``"transformer_engine"``: TE's fixed vector; or 16 ints ±1)."""
    if recipe.rht_signs is None:
        return rht_signs(recipe.seed)
    if recipe.rht_signs == "transformer_engine":
        return mask_signs(TE_RHT_SIGN_MASK)
    return jnp.asarray(recipe.rht_signs, jnp.float32)


def _round_bf16(v):
    """float32 ``v`` rounded to bfloat16 (nearest even), as float32 values."""
    return bits_to_f32(lax.shift_left(bits_to_bf16_bits(f32_bits(v)), jnp.uint32(16)))


def recipe_rht(v, recipe, signs, axis: int = 0):
    """The recipe's transform M v along ``axis``: :func:`rht`, its operand and result rounded
    to bfloat16 for ``rht_dtype="bfloat16"``."""
    if recipe.rht_dtype == "bfloat16":
        return _round_bf16(rht(_round_bf16(v), signs, axis))
    return rht(v, signs, axis)


def rht(v, signs, axis: int = 0):
    """M v along ``axis`` (0 or 1 of a 2-D ``v``) in blocks of n = len(signs) (16 for the
    recipe; any power of two, the axis a multiple of n): each block multiplied by the signs,
    then the Walsh-Hadamard butterfly (for h = 1, 2, 4, ..., n/2: (a, b) -> (a + b, a - b) on
    elements h apart), then by 1/√n (1/4 for 16, exact; for n an odd power of two 1/√n
    rounded to float32). Each step is one float32 operation per element, the same in every
    backend and along either axis (the NumPy statement in tests/test_nvfp4_train.py does
    them). The butterfly pairs elements by reshaping the axis of n within each block, never
    the axis of blocks, so a sharded block axis (whole blocks per device) is not reshaped
    across shards (on Explicit axes each view is given the block axes' layout). The weight
    gradient takes it transposed (:func:`_tokens_last`): on CPU from the native kernel
    (``kernels/_rht_cpu``, the same bits in one pass), elsewhere as ``rht(v, signs, 0).T``."""
    n = signs.shape[0]
    if n < 2 or n & (n - 1):
        raise ValueError(f"a Hadamard block is a power of two of at least 2, got {n}")
    r, c = v.shape
    if axis == 0:
        pre, post = (r // n,), (c,)
        b = v.reshape(r // n, n, c) * signs[None, :, None]
    else:
        pre, post = (r, c // n), ()
        b = v.reshape(r, c // n, n) * signs
    at = len(pre) + 1  # the pair axis of each stage's (n / 2h, 2, h) view of the block
    sb = explicit_sharding(b)  # on Explicit axes each view keeps the block axes' layout
    h = 1
    while h < n:
        shape = (*pre, n // (2 * h), 2, h, *post)
        view = None
        if sb is not None:  # sb: the 3-D view's (pre..., n, post...)
            spec = tuple(sb.spec) + (None,) * (3 - len(sb.spec))
            kept = spec[:len(pre)] + (None,) * 3 + (spec[-1:] if post else ())
            view = jax.sharding.NamedSharding(sb.mesh, jax.sharding.PartitionSpec(*kept))
        b = jnp.reshape(b, shape, out_sharding=view)
        lo, hi = lax.index_in_dim(b, 0, at, False), lax.index_in_dim(b, 1, at, False)
        b = jnp.stack([lo + hi, lo - hi], axis=at)
        h *= 2
    return b.reshape(r, c) * jnp.float32(1 / np.sqrt(n))


def quantize_1d(v, axis: int, words=None, gemm: bool = False, step=None,
                four_over_six: bool = False, native: bool = True):
    """float32 values of NVFP4 ``v`` blocked along ``axis`` (words: stochastic rounding;
    ``step``: the ``nvfp4_step``); ``gemm``: instead the GPU GEMM's operand, (bfloat16 block
    values, tensor scale). ``four_over_six``: the blocks scaled to 4 or to 6 by the
    ``nvfp4_4over6`` format's own quantizer (round to nearest; its own element step)."""
    if four_over_six:
        return dequantize(quantize_mx(v, "nvfp4_4over6", axis=axis))

    def portable(v, words):
        if words is None:
            mx = quantize_mx(v, "nvfp4", axis=axis, nvfp4_step=step)
        else:
            mx = quantize_mx(v, "nvfp4", axis=axis, rounding="stochastic", random_bits=words,
                             nvfp4_step=step)
        return block_values_bf16(mx) if gemm else dequantize(mx)

    if native and not gemm and cpu_nvfp4_fake_quantize(v, step, words is not None):  # on CPU
        # The kernel on CPU; elsewhere the portable path (what the platform split below
        # would choose off CPU, without tracing its CPU branch as well).
        return on_cpu(functools.partial(_nvfp4_cpu.fake_quantize, cast=_cast(step, words),
                                        axis=axis, words=words),
                      lambda v: portable(v, words), v)

    if gemm or v.shape[axis] % TILE:
        return portable(v, words)
    # On CPU the values straight from the encoder's branch (_mx_encode.encode_values: the
    # same bits, one branch instead of the encode's and the decode's, no codes packed and
    # unpacked).
    return on_cpu(lambda v, w: nvfp4_values(v, w, axis, step), portable, v, words)


def quantize_2d(w, gemm: bool = False, step=None, native: bool = True):
    """float32 values of NVFP4 ``w`` [R, C] (multiples of 16) with one scale per 16 x 16
    tile, from the tile's finite amax (a tile holding NaN/inf dequantizes to NaN); ``step``:
    the ``nvfp4_step`` (None: ``"divide"``); ``gemm``: instead the GPU GEMM's operand,
    (bfloat16 values of element x tile scale, tensor scale)."""
    if native and not gemm and cpu_nvfp4_fake_quantize(w, step, False):  # on CPU
        return on_cpu(functools.partial(_quantize_2d_cpu, step=step),
                      functools.partial(quantize_2d, step=step, native=False), w)
    fmt = mx_format("nvfp4")
    r, c = w.shape
    bits = f32_bits(w)  # w: float32
    ts = _nvfp4.clamp_tensor_scale_bits(_nvfp4.tensor_scale_bits(_nvfp4.finite_amax_bits(bits)))
    if step == "reciprocal":  # (1 / ts) / s stays finite (_nvfp4.MIN_RECIPROCAL_...)
        ts = jnp.maximum(ts, jnp.uint32(_nvfp4.MIN_RECIPROCAL_TENSOR_SCALE_BITS))
    mag = split_dims(bits & F32_ABS, (r // TILE, TILE, c // TILE, TILE), [[0, 1], [2, 3]])
    finite = mag < F32_INF
    tile_amax = jnp.max(jnp.where(finite, mag, jnp.uint32(0)), axis=(1, 3))
    special = _tile_rows(~jnp.all(finite, axis=(1, 3)))  # [R, C/16]
    codes_s = _tile_rows(_nvfp4.block_scale_codes(tile_amax, ts, fmt.scale))
    blocks = bits.reshape(r, c // TILE, TILE)
    if step == "reciprocal":
        factor = _nvfp4.reciprocal_factor_bits(codes_s, ts, fmt.scale)  # [R, C/16]
        quotient = _nvfp4.f32_mul(blocks, factor[..., None])
    else:
        total = _nvfp4.total_scale_bits(codes_s, ts, fmt.scale)  # [R, C/16]
        quotient = _nvfp4.element_quotient_bits(blocks, total[..., None])
    codes = encode_bits(fmt.element, quotient, "nearest_even", "saturate", None,
                        assume_finite=True)
    if gemm:  # element x tile scale: <= 6 significant bits, an exact bfloat16 (_gpu_gemm)
        block = decode_f32(fmt.element, codes) * decode_f32(fmt.scale, codes_s)[..., None]
        block = jnp.where(special[..., None], jnp.float32(jnp.nan), block)
        return block.reshape(r, c).astype(jnp.bfloat16), bits_to_f32(ts)
    # Each block's product exact by itself (route PER_BLOCK: _nvfp4.lifted_product, a few
    # float operations), the same bits as dequantize's branch on the factors, without it.
    values = _nvfp4.dequantize_bits(decode_bits(fmt.element, codes), codes_s[..., None], ts,
                                    fmt.scale, (_nvfp4.PER_BLOCK, None))
    values = jnp.where(special[..., None], jnp.uint32(0x7FC0_0000), values)
    return bits_to_f32(values.reshape(r, c))


def _cast(step, words):
    """The NVFP4 cast of :func:`quantize_1d`'s quantization (what the native kernel reads)."""
    return MXCast(mx_format("nvfp4"), None, "nearest_even" if words is None else "stochastic",
                  step)


def _quantize_2d_cpu(w, step):
    """:func:`quantize_2d`'s values by the native fake-quantize call: each row's block takes
    its tile's finite maximum (+inf for a tile holding a NaN or an infinity, which the kernel
    decodes to NaN), computed here as quantize_2d computes it."""
    r, c = w.shape
    mag = split_dims(f32_bits(w) & F32_ABS, (r // TILE, TILE, c // TILE, TILE), [[0, 1], [2, 3]])
    finite = mag < F32_INF
    tile_amax = jnp.where(jnp.all(finite, axis=(1, 3)),
                          jnp.max(jnp.where(finite, mag, jnp.uint32(0)), axis=(1, 3)),
                          jnp.uint32(F32_INF))
    return _nvfp4_cpu.fake_quantize(w, _cast(step, None), 1, tile_amax=_tile_rows(tile_amax))


def _tile_rows(a):
    """[R/16, ...] -> [R, ...], each row repeated for the 16 rows of its tile (laid out as
    ``a`` on Explicit axes, where jnp.repeat must be told)."""
    return jnp.repeat(a, TILE, axis=0, out_sharding=explicit_sharding(a))


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


def _unpad(v, rows: int, cols: int):
    """``v[:rows, :cols]``, written only where padding is dropped (an axis split across
    devices holds whole 16-blocks, so it is never padded, and is not sliced)."""
    if v.shape[0] != rows:
        v = v[:rows]
    return v if v.shape[1] == cols else v[:, :cols]


def _tokens(v):
    """``v`` [..., C] as [T, C] (leading dims merged; on Explicit axes sharded by theirs)."""
    nd = v.ndim
    return merge_dims(v, (math.prod(v.shape[:-1]), v.shape[-1]), [range(nd - 1), [nd - 1]])


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


def grad_words(g_padded, seed: int, key=None, transposed: bool = False):
    """The random words (w_d, w_w) of a padded cotangent (module docstring): from ``key``
    (the dot's key from :func:`lowprec.stochastic_rounding_key`), else from the seed and a
    hash of the cotangent's bits. ``transposed``: w_w laid out as the transposed cotangent,
    [N, T] (``w_w.T``, each element's word drawn from its [T, N] index: no transpose)."""
    if key is None:
        h = jnp.sum(f32_bits(g_padded), dtype=jnp.uint32)
        key = jax.random.fold_in(jax.random.key(seed), h)
    index = element_index(check_size(g_padded.shape))
    if transposed:  # index[n, t] = t * N + n
        t, n = g_padded.shape
        index_t = (lax.broadcasted_iota(jnp.uint32, (n, t), 1) * jnp.uint32(n)
                   + lax.broadcasted_iota(jnp.uint32, (n, t), 0))
    # random_bits(fold_in(key, i), shape) for i = 0, 1, with the two fold_ins and the two
    # keys' words each one threefry call (vmapped over i; threefry is elementwise in its
    # counters, so the same words): XLA:CPU compiles every threefry call to a loop of ~100
    # instructions, and these had been 4 of a training step's 5 per layer (~20% of its HLO).
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(2, dtype=jnp.uint32))
    k = jax.vmap(lambda kk: jax.random.bits(kk, (2,), jnp.uint32))(keys)  # [i, (k0, k1)]
    return tuple(element_words((k[i, 0], k[i, 1]), index_t if transposed and i else index)
                 .astype(jnp.uint16) for i in (0, 1))


def check_layout(lhs_shape, rhs_shape, dn) -> None:
    """The recipe's dot is a linear layer's (``Dense``, ``DenseGeneral``, ``nnx.Linear``,
    ``nnx.LinearGeneral``): lhs [..., K1, .., Kc] contracted on its last c axes, in order,
    with a weight whose contracting axes are its first c ([K.., N..]) or its last c
    ([N.., K..]), in the same order, and which has other (output) axes; no batch dims."""
    (lc, rc), (lb, rb) = dn
    nl, nr, c = len(lhs_shape), len(rhs_shape), len(lc)
    ok = (not lb and not rb and c >= 1 and len(rc) == c and nr > c
          and tuple(lc) == tuple(range(nl - c, nl))
          and tuple(rc) in (tuple(range(c)), tuple(range(nr - c, nr))))
    if not ok:
        raise ValueError(
            "the NVFP4 training recipe (weight_block_2d / wgrad_rht / stochastic grad_rounding) "
            "applies to linear layers: lhs [..., K..] contracted on its last axes with a weight "
            "[K.., N..] or [N.., K..] (the same contracting axes, in order), no batch dims; got "
            f"shapes {tuple(lhs_shape)}, {tuple(rhs_shape)} and dimension numbers {dn}. Keep "
            "this layer in another recipe (Rules/high_precision)"
        )


def nvfp4_dot(lhs, rhs, dn, spec: DotSpec, out_sharding=None, sr_key=None):
    """The recipe's dot of a linear layer (layouts of :func:`check_layout`): the weight seen
    as 2-D, [K, N] or [N, K], its contracting axes flattened into K and its output axes into
    N (a DenseGeneral's [D, heads, head_dim] is [D, heads * head_dim]; its 16 x 16 tiles are
    tiles of that matrix), and lhs's contracting axes into K, in the order given (as the MX
    dots block a flattened contraction); the result is reshaped back to [..., N..].

    Called outside any trace (eagerly), the whole dot runs as one compiled program: op by op
    it compiled ~270 small programs on a first call (the same bits either way)."""
    if not any(isinstance(v, jax.core.Tracer) for v in (lhs, rhs, sr_key)):
        return _nvfp4_dot_program(lhs, rhs, dn, spec, out_sharding, sr_key)
    return _nvfp4_dot(lhs, rhs, dn, spec, out_sharding, sr_key)


def _nvfp4_dot(lhs, rhs, dn, spec: DotSpec, out_sharding=None, sr_key=None):
    (lc, rc), _ = dn
    c, nl, nr = len(lc), len(lhs.shape), len(rhs.shape)
    if c == 1 and nr == 2:  # already a 2-D weight: no reshape
        return nvfp4_train_dot(lhs, rhs, dn, spec, out_sharding, sr_key)
    nlead = nl - c
    k = math.prod(lhs.shape[nlead:])
    k_first = tuple(rc) == tuple(range(c))
    free = tuple(rhs.shape[c:] if k_first else rhs.shape[:nr - c])
    n = math.prod(free)
    x = merge_dims(lhs, (*lhs.shape[:nlead], k), [*([d] for d in range(nlead)), range(nlead, nl)])
    if k_first:
        w = merge_dims(rhs, (k, n), [range(c), range(c, nr)])
    else:
        w = merge_dims(rhs, (n, k), [range(nr - c), range(nr - c, nr)])
    inner, constraint = split_out_sharding(out_sharding)
    final = inner if inner is not None else dot_out_sharding(lhs, rhs, dn)
    groups = [*([d] for d in range(nlead)), range(nlead, nlead + len(free))]
    y = nvfp4_train_dot(x, w, (((nlead,), (0 if k_first else 1,)), ((), ())), spec,
                        merged_sharding(inner, groups), sr_key)
    y = jnp.reshape(y, (*lhs.shape[:nlead], *free), out_sharding=final)
    return y if constraint is None else lax.with_sharding_constraint(y, constraint)


_nvfp4_dot_program = jax.jit(_nvfp4_dot, static_argnums=(2, 3, 4))


def nvfp4_train_dot(x, w, dn, spec: DotSpec, out_sharding=None, sr_key=None):
    """The recipe's dot (lowprec's training dot in the "nvfp4" layout family: x [..., K] and a
    2-D weight); ``sr_key``: the key of the gradients' stochastic rounding (None: words from
    the seed and the cotangent's bits)."""
    return training_dot(x, w, sr_key, spec, ("nvfp4", dn, out_sharding))


def _weight_nk(w, dn):
    """The weight as [N, K] (its contraction last), padded to multiples of 16."""
    (_, rc), _ = dn
    wt = w if rc[0] == 1 else w.T
    return _pad_to(_pad_to(_f32(wt), 0), 1)


def _quantized_weight(wt, recipe, gemm: bool = False, forward: bool = False):
    """The quantized weight [N, K] (from :func:`_weight_nk`), as :func:`_gemm` takes it;
    ``forward``: as the forward product reads it (Four over Six's 16-element blocks where the
    recipe asks for them; 16 x 16 tiles keep their map-to-6 scales)."""
    step = recipe.nvfp4_step
    if recipe.weight_block_2d:
        return quantize_2d(wt, gemm, step)
    return quantize_1d(wt, 1, gemm=gemm, step=step,
                       four_over_six=forward and recipe.four_over_six)


def _forward(x, w, dn, recipe, out_dtype, out_sharding):
    n = w.shape[1 - dn[0][1][0]]
    x2 = _pad_to(_f32(_tokens(x)), 1)
    # On Explicit axes: the [T, N] dot takes out_sharding with the leading dims merged (a
    # row-parallel layer's partial sums are reduced there), and the result is laid out as
    # asked, or as lax.dot_general lays out these operands.
    inner, constraint = split_out_sharding(out_sharding)
    final = inner if inner is not None else dot_out_sharding(x, w, dn)
    sy = merged_sharding(inner, [range(x.ndim - 1), [x.ndim - 1]])

    def product(gemm, x2, wt):
        xq = quantize_1d(x2, 1, gemm=gemm, step=recipe.nvfp4_step,
                         four_over_six=recipe.four_over_six)
        return _gemm(gemm, xq, _quantized_weight(wt, recipe, gemm, forward=True),
                     (((1,), (1,)), ((), ())), sy)

    if recipe.four_over_six:  # its values are not the GPU GEMM's (bfloat16 values, scale)
        y = product(False, x2, _weight_nk(w, dn))
    else:
        y = _routed(product, x2, _weight_nk(w, dn))
    y = _unpad(y, y.shape[0], n)
    y = jnp.reshape(y, (*x.shape[:-1], n), out_sharding=final)
    y = y if constraint is None else lax.with_sharding_constraint(y, constraint)
    return bits_to_dtype(f32_bits(y), out_dtype)


def _fwd(x, w, sr_key, spec: DotSpec, layout: tuple):
    _, dn, out_sharding = layout
    return _forward(x, w, dn, spec.nvfp4, spec.out_dtype, out_sharding), (x, w, sr_key)


def _bwd(spec: DotSpec, layout: tuple, residuals, g):
    _, dn, _ = layout
    recipe = spec.nvfp4
    x, w, sr_key = residuals
    k = x.shape[-1]
    (_, rc), _ = dn
    n = w.shape[1 - rc[0]]
    t = x.size // k
    x2 = _pad_to(_pad_to(_f32(_tokens(x)), 0), 1)  # [T16, K16]
    g2 = _pad_to(_pad_to(_f32(_tokens(g)), 0), 1)  # [T16, N16]
    # Each gradient is laid out as its operand on Explicit axes (lax.dot_general's transpose
    # rule): a contraction split across devices (N for a column-parallel layer's grad_x,
    # tokens for a data-parallel grad_w) is reduced into that layout. Axes split across
    # devices hold whole 16-blocks (checked in Recipe.dot_general), so are never padded.
    sx = explicit_sharding(x)
    sx2 = None if sx is None else merged_sharding(sx, [range(x.ndim - 1), [x.ndim - 1]])
    # grad_w [K16, N16] in the weight's layout (transposed for a weight stored [N, K]).
    sw = explicit_sharding(w)
    if sw is not None and rc[0] == 1:
        axes = (tuple(sw.spec) + (None, None))[:2]
        sw = jax.sharding.NamedSharding(sw.mesh, jax.sharding.PartitionSpec(*axes[::-1]))
    wt = _weight_nk(w, dn)
    override = recipe.backward_override
    if override is None:
        gx, gw = _quantized_grads(recipe, x2, g2, wt, sx2, sw, sr_key)
    else:  # float32 dots of g and the operands, unquantized or as the forward read them
        if override == "dequantized":
            x2 = quantize_1d(x2, 1, step=recipe.nvfp4_step, four_over_six=recipe.four_over_six)
            wt = _quantized_weight(wt, recipe, forward=True)
        gx = _f32dot(g2, wt, (((1,), (0,)), ((), ())), sx2)
        gw = _f32dot(x2, g2, (((0,), (0,)), ((), ())), sw)
    gx = _unpad(gx, t, k)
    gw = _unpad(gw, k, n)
    gw = gw if rc[0] == 0 else gw.T
    gx = jnp.reshape(gx, x.shape, out_sharding=sx)
    return (bits_to_dtype(f32_bits(gx), x.dtype), bits_to_dtype(f32_bits(gw), w.dtype), None)


def _quantized_grads(recipe, x2, g2, wt, sx2, sw, sr_key):
    """The recipe's two quantized backward products of padded x2 [T16, K16], g2 [T16, N16]
    and the weight wt [N16, K16]: grad_x [T16, K16] and grad_w [K16, N16] (laid out by sx2,
    sw; ``sr_key``: the stochastic rounding's key, or None)."""
    stochastic = recipe.grad_rounding == "stochastic"
    wd, ww = grad_words(g2, recipe.seed, sr_key, transposed=True) if stochastic else (None, None)
    step = recipe.nvfp4_step

    # grad_x = Q(g along N) · Q2(w): [T, N] x [N, K].
    def grad_x(gemm, g2, wt, wd):
        return _gemm(gemm, quantize_1d(g2, 1, wd, gemm, step), _quantized_weight(wt, recipe, gemm),
                     (((1,), (0,)), ((), ())), sx2)

    gx = _routed(grad_x, g2, wt, wd)
    # grad_w = Q(M x along T)ᵀ · Q(M g along T): [K, N]. Both operands are transposed to
    # [C16, T16] (the cotangent's words drawn in that layout: each element keeps its word),
    # so that their transform and quantization run along the last axis (a stochastic
    # quantization along axis 0 took ~7x the CPU time), and the dot contracts the last axes.
    x2t, g2t = _tokens_last(x2, recipe), _tokens_last(g2, recipe)

    def grad_w(gemm, x2t, g2t, wwt):
        return _gemm(gemm, quantize_1d(x2t, 1, gemm=gemm, step=step),
                     quantize_1d(g2t, 1, wwt, gemm, step), (((1,), (1,)), ((), ())), sw)

    return gx, _routed(grad_w, x2t, g2t, ww)


def _tokens_last(v, recipe):
    """(M v).T, [C16, T16], for padded v [T16, C16] (v.T without ``wgrad_rht``): on CPU the
    native kernel's one pass (``_rht_cpu``: the transform and the transpose, the same bits),
    elsewhere v transformed along axis 0, then transposed (XLA:CPU runs the butterfly along
    axis 0 ~2-4x faster than along the last axis after a transpose)."""
    if not recipe.wgrad_rht:
        return v.T
    signs = recipe_rht_signs(recipe)
    bf16 = recipe.rht_dtype == "bfloat16"
    generic = lambda v: recipe_rht(v, recipe, signs, 0).T
    if not (_rht_cpu.serves(v, signs) and cpu_nvfp4_fake_quantize(v, None, False)):
        return generic(v)

    def native(v):  # rounding to bfloat16 is elementwise: it commutes with the transpose
        out = _rht_cpu.rht_transposed(_round_bf16(v) if bf16 else v, signs)
        return _round_bf16(out) if bf16 else out

    return on_cpu(native, generic, v)


register_family("nvfp4", _fwd, _bwd)
