"""Recipes: validation, the ready-made recipes, and the dots they compute, forward and backward.

Expected values come from the independent reference (``lowprec_reference``: exact rational
MX and element quantizers) and float64 NumPy matmuls: a recipe dot must equal the exact dot of
the reference-quantized operands up to float32 accumulation, |err| <= K 2^-23 sum|a_i b_i|
(the bound of lowprec.dot_general), and each gradient likewise with the operands quantized
along that backward dot's own reduction axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import lowprec
import lowprec_reference as ref
from lowprec import FP8_HYBRID, NVIDIA_MXFP8, OCP_MXFP8, Recipe

from helpers.asserts import assert_bits_equal

DN = (((1,), (0,)), ((), ()))  # x [T, K] . w [K, N]


def _ref_mx(x, fmt, axis, rule):
    """Reference MX fake quantization (float64) along ``axis``, zero-padding to 32."""
    x = np.asarray(x, np.float32)
    n = x.shape[axis]
    el, sc = ref.quantize_mx(x, fmt, axis=axis, scale_rule=rule, pad=True)
    out = ref.dequantize_mx(el, sc, fmt, axis=axis).astype(np.float64)
    return np.take(out, np.arange(n), axis=axis)


def _ref_elem(x, fmt, overflow="ieee"):
    return ref.decode(fmt, ref.encode(fmt, np.asarray(x, np.float32), overflow=overflow)).astype(np.float64)


def _ref_q(x, fmt, axis, rule):
    """Reference quantization in a lowprec format object (MX along ``axis``) or None."""
    if fmt is None:
        return np.asarray(x, np.float64)
    if isinstance(fmt, lowprec.MXFormat):
        return _ref_mx(x, fmt.name, axis, rule)
    return _ref_elem(x, fmt.name)


def _rule(recipe):
    """The recipe's E8M0 scale rule (of its scale_options)."""
    return recipe.options_of(lowprec.mx_format("mxfp8")).scale_rule


def _ref_pow2_scale(x, elem_name):
    """Per-tensor power of two for scaling='tensor', derived independently: the E8M0 code of
    float32(amax / max_elem) rounded up to a power of two (reference MX 'rceil' rule)."""
    amax = float(np.max(np.abs(np.asarray(x, np.float32))))
    e = ref.shared_exponent(amax, elem_name, "rceil")  # the MX rceil rule applied to the tensor
    return 2.0 ** min(max(e, -126), 127)


def _assert_close(got, want, a, b, contract_len):
    """|got - want| <= K 2^-23 sum|a_i b_i| (+ a relative ulp of the output)."""
    got = np.asarray(got, np.float64)
    bound = contract_len * 2.0**-23 * (np.abs(a) @ np.abs(b)) + 2.0**-24 * np.abs(want)
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{bad.sum()} entries off; max err {np.max(np.abs(got - want))}"


def _normal(seed, shape):
    """Standard normal float32 values drawn by NumPy: jax.random run op by op compiles its
    programs anew for every shape (~0.75 CPU s each)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _operands(t=48, k=64, n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * np.exp2(rng.integers(-6, 6, (t, k)))
    w = rng.standard_normal((k, n)) * 0.1
    return x.astype(np.float32), w.astype(np.float32)


# -- construction and validation ------------------------------------------------------------------


def test_formats_are_normalized_and_recipes_hashable():
    a = Recipe(forward="mxfp8", grad="mxfp8_e5m2", scale_options={"scale_rule": "rceil"})
    b = Recipe(forward=("mxfp8_e4m3", lowprec.mx_format("mxfp8_e4m3")), grad="MXFP8_E5M2",
               scale_options={"scale_rule": "rceil"})
    assert a == b and hash(a) == hash(b)
    assert a.forward == (lowprec.mx_format("mxfp8_e4m3"),) * 2
    assert a.backward_operands == a.forward and a.backward == "quantized"
    assert Recipe(forward="e4m3").backward == "ste"
    assert Recipe(forward="mxfp4", backward_operands="mxfp8").backward == "quantized"
    # Usable as a static argument: equal recipes share one trace.
    traces = []
    g = jax.jit(lambda x, r: (traces.append(r), r.dot_general(x, x.T, DN))[1], static_argnums=1)
    g(jnp.ones((2, 32)), a)
    g(jnp.ones((2, 32)), b)
    assert len(traces) == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(forward="mxfp9"), "unknown forward 'mxfp9'; valid formats: None, 'mxfp8_e4m3'"),
    (dict(forward=("e4m3",)), r"forward takes one format for both operands or a pair"),
    (dict(forward="e8m0"), "e8m0.* scale format, not an operand format"),
    (dict(forward="mxfp8", grad="e5m2", backward="ste"), "no effect with backward='ste'"),
    (dict(forward="mxfp8", backward="exact"), "unknown backward mode 'exact'"),
    (dict(forward="mxfp8", rounding="stochastic"), "needs a key per call.*lowprec.optim"),
    (dict(forward="mxfp8", scaling="tensor"), r"MX formats \['mxfp8_e4m3'\] carry their own"),
    (dict(forward="e4m3", scaling="block"), "unknown scaling 'block'"),
    (dict(forward="mxfp8", scale_options={"scale_rule": "round"}), "unknown scale_rule 'round'"),
    (dict(forward="mxfp8", scale_options={"nvfp4_step": "reciprocal"}),
     r"fields \['nvfp4_step'\] are options of no scale scheme of this recipe's MX formats "
     r"\(schemes and their options: e8m0 \(scale_rule\)\)"),
    (dict(forward="e4m3", scale_options={"scale_rule": "rceil"}), "options: none"),
    (dict(forward="mxfp8", backward_override="fp32"), "unknown backward_override 'fp32'"),
    (dict(forward="mxfp8", backward_override="dequantized", high_precision_wgrad=True),
     "use one"),
    (dict(forward="e4m3", grad="e5m2", scaling="delayed", backward_override="dequantized"),
     "delayed scaling takes no backward_override"),
    (dict(forward="mxfp8", scale_options=lowprec.mx_format("nvfp4").scheme.Options("reciprocal")),
     "parts of the NVFP4 training recipe"),
    (dict(forward="nvfp4", grad="nvfp4", rht_signs="transformer_engine"), "set wgrad_rht=True"),
    (dict(forward="nvfp4", grad="nvfp4", wgrad_rht=True, rht_signs=(1, -1)), "16 ints"),
    (dict(forward="nvfp4", grad="nvfp4", wgrad_rht=True, rht_dtype="fp16"), "unknown rht_dtype"),
])
def test_bad_recipes_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Recipe(**kwargs)


def test_high_precision_patterns():
    r = Recipe(forward="mxfp8", high_precision="lm_head")  # a lone string is one pattern
    assert r.high_precision == ("lm_head",)
    r = Recipe(forward="mxfp8", high_precision=("lm_head", "*/attn/*", "block_[01]/up"))
    assert r.keeps_high_precision("lm_head")
    assert r.keeps_high_precision("model/block_3/attn/query")  # * crosses '/'
    assert r.keeps_high_precision("block_1/up")
    assert not r.keeps_high_precision("block_2/up")
    assert not r.keeps_high_precision("lm_head_2")  # globs match the whole path
    with pytest.raises(TypeError, match="glob pattern strings"):
        Recipe(forward="mxfp8", high_precision=(3,))


def test_scale_options_take_one_spelling_and_store_one_value():
    e8m0 = lowprec.mx_format("mxfp8").scheme.Options
    rceil = Recipe(forward="mxfp8", scale_options={"scale_rule": "rceil"})
    assert rceil.scale_options == (e8m0("rceil"),)
    assert rceil == Recipe(forward="mxfp8", scale_options=e8m0("rceil"))
    assert rceil == Recipe(forward="mxfp8", scale_options=[{"scale_rule": "floor"}, e8m0("rceil")])
    # Defaults are not stored: a recipe that sets none equals one that spells them out.
    assert Recipe(forward="mxfp8", scale_options={"scale_rule": "floor"}).scale_options == ()
    assert Recipe(forward="mxfp8", scale_options={"scale_rule": "floor"}) == Recipe(forward="mxfp8")
    # Each field goes to the schemes that take it; a format of another scheme keeps its own.
    mixed = Recipe(forward=("mxfp8", "nvfp4"), scale_options={"scale_rule": "rceil"})
    assert mixed.options_of(mixed.forward[0]) == e8m0("rceil")
    assert mixed.options_of(mixed.forward[1]) == mixed.forward[1].scheme.Options()
    with pytest.raises(TypeError, match="scale_options takes a dict of option fields"):
        Recipe(forward="mxfp8", scale_options="rceil")


RULE_RECIPES = [
    Recipe(forward="mxfp8", grad="mxfp8_e5m2", backward_operands=("mxfp4", "mxfp8"),
           scale_options={"scale_rule": "rceil"}),
    Recipe(forward=("mxfp8", "nvfp4"), grad="mxfp8", scale_options={"scale_rule": "even"}),
    dataclasses.replace(lowprec.NVIDIA_NVFP4, **lowprec.TE_NVFP4_OPTIONS),
]


@pytest.mark.parametrize("recipe", RULE_RECIPES, ids=lambda r: r.describe())
def test_scale_options_reach_every_quantization_of_the_recipe(recipe):
    """Every MX cast of the recipe's dots (forward, cotangent, backward operands) carries the
    recipe's options of its scheme, as do the NVFP4 training recipe's own quantizations;
    what each cast computes is checked against the reference by the dot tests."""
    spec = recipe.dot_spec()
    casts = {"lhs": spec.lhs, "rhs": spec.rhs, "grad": spec.grad, "bwd_lhs": spec.bwd_lhs,
             "bwd_rhs": spec.bwd_rhs}
    mx = {k: c for k, c in casts.items() if isinstance(getattr(c, "fmt", None), lowprec.MXFormat)}
    assert len(mx) == 5, casts
    for role, cast in mx.items():
        assert cast.scale_options == recipe.options_of(cast.fmt), role
    if spec.nvfp4 is not None:
        assert spec.nvfp4.nvfp4_step == recipe.options_of(recipe.forward[0]).nvfp4_step
        assert spec.nvfp4.nvfp4_step == "reciprocal"


@pytest.mark.parametrize("old, new", [
    (dict(scale_rule="rceil"), dict(scale_options={"scale_rule": "rceil"})),
    (dict(scale_rule="floor"), dict(scale_options={"scale_rule": "floor"})),
    (dict(nvfp4_step="reciprocal"), dict(scale_options={"nvfp4_step": "reciprocal"})),
], ids=lambda d: str(d))
def test_old_scale_keywords_warn_and_give_the_same_recipe_and_bits(old, new):
    base = NVIDIA_MXFP8 if "scale_rule" in old else lowprec.NVIDIA_NVFP4
    (name, value), = old.items()
    with pytest.warns(DeprecationWarning, match=rf"Recipe\({name}=\) is deprecated; use "
                                                rf"Recipe\(scale_options={{'{name}': ...}}\)"):
        built = Recipe(forward=base.forward, grad=base.grad, weight_block_2d=base.weight_block_2d,
                       **old)
    with pytest.warns(DeprecationWarning, match=rf"Recipe\({name}=\) is deprecated") as rec:
        replaced = dataclasses.replace(base, **old)
    assert rec[0].filename == __file__  # the warning points at the caller of replace
    assert built == Recipe(forward=base.forward, grad=base.grad,
                           weight_block_2d=base.weight_block_2d, **new)
    assert replaced == dataclasses.replace(base, **new)
    with pytest.warns(DeprecationWarning, match=rf"Recipe.{name} is deprecated; use "
                                                r"Recipe.scale_options"):
        assert getattr(replaced, name) == value
    # The same bits: the dot and both gradients of the old and the new spelling.
    x, w = _operands(seed=5)
    g = _normal(6, (x.shape[0], w.shape[1]))
    want = dataclasses.replace(base, **new)
    for a, b in zip((replaced.dot_general(x, w, DN), *_grads(replaced, x, w, g)),
                    (want.dot_general(x, w, DN), *_grads(want, x, w, g))):
        assert_bits_equal(a, b)


def test_ready_made_recipes_are_the_published_ones():
    e4m3, e5m2 = lowprec.mx_format("mxfp8_e4m3"), lowprec.mx_format("mxfp8_e5m2")
    # NVIDIA (Mishra et al. 2025 / Transformer Engine MXFP8BlockScaling): E4M3 for every
    # tensor, gradients included; scales rounded up (rceil).
    assert NVIDIA_MXFP8.forward == (e4m3, e4m3) and NVIDIA_MXFP8.grad == e4m3
    assert NVIDIA_MXFP8.backward_operands == (e4m3, e4m3)
    assert (_rule(NVIDIA_MXFP8), NVIDIA_MXFP8.backward) == ("rceil", "quantized")
    # OCP MX v1.0 scale rule (floor), E4M3 data, E5M2 gradients.
    assert OCP_MXFP8.forward == (e4m3, e4m3) and OCP_MXFP8.grad == e5m2
    assert _rule(OCP_MXFP8) == "floor"
    # FP8 hybrid (Micikevicius et al. 2022): E4M3 forward, E5M2 gradients, per-tensor scales.
    assert FP8_HYBRID.forward == (lowprec.element_format("e4m3"),) * 2
    assert FP8_HYBRID.grad == lowprec.element_format("e5m2") and FP8_HYBRID.scaling == "tensor"
    nv4 = lowprec.NVIDIA_NVFP4  # TE NVFP4BlockScaling: 2-D weight scales, RHT, SR (its own tests)
    assert nv4.forward == (lowprec.mx_format("nvfp4"),) * 2 and nv4.grad == lowprec.mx_format("nvfp4")
    assert (nv4.weight_block_2d, nv4.wgrad_rht, nv4.grad_rounding) == (True, True, "stochastic")
    # FP8 with Transformer Engine's delayed scaling (E4M3 forward, E5M2 gradients; tests in
    # test_delayed.py: it needs a per-layer state).
    delayed = lowprec.FP8_DELAYED
    assert delayed.forward == FP8_HYBRID.forward and delayed.grad == FP8_HYBRID.grad
    assert delayed.scaling == "delayed" and delayed.delayed == lowprec.DelayedScaling()
    assert lowprec.RECIPES == {"ocp_mxfp8": OCP_MXFP8, "nvidia_mxfp8": NVIDIA_MXFP8,
                               "fp8_hybrid": FP8_HYBRID, "fp8_delayed": delayed,
                               "nvidia_nvfp4": nv4}


# -- forward ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", [
    NVIDIA_MXFP8, OCP_MXFP8,
    Recipe(forward=("mxfp8_e4m3", "mxfp4"), scale_options={"scale_rule": "even"}),
    Recipe(forward="e4m3"),  # no scaling: each value rounded on its own
    Recipe(forward="bf16"),
], ids=lambda r: r.describe())
@pytest.mark.quick_first(1)
def test_forward_is_the_dot_of_reference_quantized_operands(recipe):
    # Eager here; jit == eager bit for bit is checked below for every kind of recipe dot.
    x, w = _operands()
    got = recipe.dot_general(x, w, DN)
    qx = _ref_q(x, recipe.forward[0], 1, _rule(recipe))
    qw = _ref_q(w, recipe.forward[1], 0, _rule(recipe))
    _assert_close(got, qx @ qw, qx, qw, x.shape[1])


def test_tensor_scaling_forward():
    x, w = _operands(seed=1)
    x = x * 1e-5  # far below E4M3's range: without a scale most values would flush to zero
    got = FP8_HYBRID.dot_general(x, w, DN)
    sx, sw = _ref_pow2_scale(x, "e4m3"), _ref_pow2_scale(w, "e4m3")
    qx = _ref_elem(np.asarray(x) / sx, "e4m3", "saturate") * sx
    qw = _ref_elem(np.asarray(w) / sw, "e4m3", "saturate") * sw
    _assert_close(got, qx @ qw, qx, qw, x.shape[1])
    # The scale puts the tensor's amax at the top of E4M3: relative error ~ 2^-4, not ~1.
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.median(np.abs(np.asarray(got) - exact) / np.abs(exact)) < 0.1


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_output_dtype_follows_lax_dot_general():
    x, w = _operands()
    r = NVIDIA_MXFP8

    @jax.jit  # one program for every call below (each alone compiles its own)
    def run(x, w):
        xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        return (r.dot_general(x, w, DN), r.dot_general(xb, wb, DN), r.dot_general(xb, w, DN),
                r.dot_general(xb, wb, DN, precision=jax.lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32))

    y, yb, mixed, out = run(x, w)
    assert y.dtype == jnp.float32 and yb.dtype == jnp.bfloat16
    assert mixed.dtype == jnp.float32  # promoted, as lax does
    assert out.dtype == jnp.float32
    # bf16 output = the float32 result rounded once.
    np.testing.assert_array_equal(np.asarray(yb), np.asarray(out.astype(jnp.bfloat16)))
    with pytest.raises(TypeError, match="output dtype must be float32, bfloat16 or float16"):
        r.dot_general(x, w, DN, preferred_element_type=jnp.int32)


# -- backward ---------------------------------------------------------------------------------------


def _grads(recipe, x, w, g):
    _, vjp = jax.vjp(lambda a, b: recipe.dot_general(a, b, DN), x, w)
    return vjp(g)


@pytest.mark.parametrize("recipe", [
    OCP_MXFP8,  # lowprec.dot_general's own quantized VJP
    Recipe(forward="mxfp4", backward_operands="mxfp8_e4m3", grad="mxfp8_e4m3",
           scale_options={"scale_rule": "rceil"}),  # the recipe's own VJP: other bwd formats
    Recipe(forward="mxfp4", backward_operands=(None, "mxfp8_e5m2"), grad=None),
], ids=lambda r: r.describe())
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_quantized_backward_blocks_along_each_reduction(recipe):
    # grad_x [T,K] = Q(g)[T,N] . Q(w)^T: g and w blocked along N (axis 1 of g, 1 of w);
    # grad_w [K,N] = Q(x)^T . Q(g): x and g blocked along T (axis 0 of both).
    x, w = _operands(seed=2)
    g = _normal(9, (x.shape[0], w.shape[1]))
    gx, gw = _grads(recipe, x, w, g)
    bl, br = recipe.backward_operands
    rule = _rule(recipe)
    qg_n, qw_n = _ref_q(g, recipe.grad, 1, rule), _ref_q(w, br, 1, rule)
    qx_t, qg_t = _ref_q(x, bl, 0, rule), _ref_q(g, recipe.grad, 0, rule)
    _assert_close(gx, qg_n @ qw_n.T, qg_n, qw_n.T, w.shape[1])
    _assert_close(gw, qx_t.T @ qg_t, qx_t.T, qg_t, x.shape[0])


def test_ste_backward_is_the_float_gradient_of_the_quantized_forward():
    r = Recipe(forward="mxfp8_e4m3", scale_options={"scale_rule": "rceil"})
    x, w = _operands(seed=3)
    g = _normal(4, (x.shape[0], w.shape[1]))
    gx, gw = _grads(r, x, w, g)
    qx, qw = _ref_mx(x, "mxfp8_e4m3", 1, "rceil"), _ref_mx(w, "mxfp8_e4m3", 0, "rceil")
    g64 = np.asarray(g, np.float64)
    _assert_close(gx, g64 @ qw.T, g64, qw.T, w.shape[1])
    _assert_close(gw, qx.T @ g64, qx.T, g64, x.shape[0])


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_tensor_scaled_backward():
    x, w = _operands(seed=5)
    g = _normal(6, (x.shape[0], w.shape[1])) * np.float32(1e-7)  # tiny grads
    gx, gw = _grads(FP8_HYBRID, x, w, g)
    sx, sw, sg = (_ref_pow2_scale(a, e) for a, e in ((x, "e4m3"), (w, "e4m3"), (g, "e5m2")))
    qx = _ref_elem(np.asarray(x) / sx, "e4m3", "saturate") * sx
    qw = _ref_elem(np.asarray(w) / sw, "e4m3", "saturate") * sw
    qg = _ref_elem(np.asarray(g) / sg, "e5m2", "saturate") * sg
    assert np.count_nonzero(qg) > 0.99 * qg.size  # unscaled E5M2 would flush these to 0
    _assert_close(gx, qg @ qw.T, qg, qw.T, w.shape[1])
    _assert_close(gw, qx.T @ qg, qx.T, qg, x.shape[0])


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_gradient_dtypes_follow_the_operands():
    x, w = _operands()
    xb = x.astype(jnp.bfloat16)
    for r in (FP8_HYBRID, Recipe(forward="mxfp4", backward_operands="mxfp8")):  # own VJP
        # Dtypes are decided as the backward is traced (eval_shape: nothing compiled).
        gx, gw = jax.eval_shape(jax.grad(
            lambda a, b: r.dot_general(a, b, DN).astype(jnp.float32).sum(), argnums=(0, 1)),
            xb, w)
        assert (gx.dtype, gw.dtype) == (jnp.bfloat16, jnp.float32)


# -- transformations ------------------------------------------------------------------------------

# lowprec.dot_general's own VJP (NVIDIA) and the recipe's own VJP with per-tensor scales.
TRANSFORM_RECIPES = [NVIDIA_MXFP8, FP8_HYBRID]


def _loss(recipe):
    # Linear in the output, so the cotangent is the fixed array c in every mode (a nonlinearity
    # could round differently eagerly and fused under jit, before the gradient is quantized).
    def loss(x, w):
        y = recipe.dot_general(x, w, DN)
        c = _normal(11, y.shape[-2:])  # a constant of the trace
        return jnp.sum(y * c)

    return loss


@pytest.mark.parametrize("recipe", TRANSFORM_RECIPES, ids=lambda r: r.describe())
@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_jit_grad_and_checkpoint_agree_bitwise(recipe):
    x, w = _operands(seed=7)
    eager = jax.grad(_loss(recipe), argnums=(0, 1))(x, w)
    jitted, remat = jax.jit(lambda a, b: (  # one program for both
        jax.grad(_loss(recipe), argnums=(0, 1))(a, b),
        jax.grad(jax.checkpoint(_loss(recipe)), argnums=(0, 1))(a, b)))(x, w)
    for a, b, c in zip(eager, jitted, remat):
        assert_bits_equal(a, b)
        assert_bits_equal(a, c)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TRANSFORM_RECIPES, ids=lambda r: r.describe())
def test_vmap_is_the_per_example_map(recipe):
    # vmap over a leading axis means "one recipe dot per example": per-tensor scales become
    # per-example scales, MX blocks never mix examples. Loss and gradients, vs one at a time.
    xs = np.stack([_operands(t=32, seed=s)[0] for s in range(2)])
    w = _operands()[1]
    one = jax.jit(jax.value_and_grad(_loss(recipe)))
    ls, gs = jax.jit(jax.vmap(jax.value_and_grad(_loss(recipe)), in_axes=(0, None)))(xs, w)
    for i in range(xs.shape[0]):
        li, gi = one(xs[i], w)
        assert_bits_equal(ls[i], li)
        assert_bits_equal(gs[i], gi)


# -- einsum -----------------------------------------------------------------------------------------


@pytest.mark.quick_cases(spec=["...d,df->...f"])
@pytest.mark.parametrize("spec,ls,rs", [
    ("bqhd,bkhd->bhqk", (2, 4, 3, 8), (2, 6, 3, 8)),  # batch dims, transposed output
    ("...d,df->...f", (2, 3, 8), (8, 5)),  # ellipsis
    ("ijx,jk", (3, 8, 2), (8, 5)),  # implicit output; x is summed out first
    ("btnh,nhd->btd", (2, 3, 4, 8), (4, 8, 6)),  # two contracting dims, flattened
])
def test_einsum_matches_jnp_einsum(spec, ls, rs):
    # Integer-valued operands: every sum is exact, so any correct plan gives the same bits.
    # (Quantization along the plan's contraction: test_einsum_quantizes_like_dot_general.)
    rng = np.random.default_rng(0)
    a = rng.integers(-4, 5, ls).astype(np.float32)
    b = rng.integers(-4, 5, rs).astype(np.float32)
    want = jnp.einsum(spec, a, b)
    got = Recipe().einsum(spec, a, b)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow  # left out of the quick tier (seconds; its paths run in other quick tests)
def test_einsum_quantizes_like_dot_general():
    x, w = _operands(t=10, k=64, n=12)
    w3 = w.reshape(64, 3, 4)
    got = NVIDIA_MXFP8.einsum("td,dnh->tnh", x, w3)
    want = NVIDIA_MXFP8.dot_general(x, w3, (((1,), (0,)), ((), ())))
    assert_bits_equal(got, want)


@pytest.mark.parametrize("spec,lshape,match", [
    ("ab,bc,cd->ad", (4, 32), "exactly two operands"),
    ("aab,bc->ac", (4, 4, 32), "repeated index"),
    ("ab,bc->az", (4, 32), r"output indices \['z'\] appear in no operand"),
    ("a1,1c->ac", (4, 32), "invalid index characters"),
    ("abc,cd->ad", (4, 32), "has 3 indices for rank 2"),
    ("ab,bc->ac", (4, 16), "has sizes 16 and 32"),
])
def test_einsum_errors(spec, lshape, match):
    with pytest.raises(ValueError, match=match):
        Recipe().einsum(spec, jnp.ones(lshape), jnp.ones((32, 4)))


def test_einsum_sums_indices_of_one_operand_only():
    a, b = jnp.arange(8.0).reshape(2, 4), jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(Recipe().einsum("ab,cd->a", a, b), jnp.einsum("ab,cd->a", a, b))


@pytest.mark.slow
def test_high_precision_wgrad_is_the_float32_weight_gradient():
    # grad_rhs = x^T g from the unquantized operands (a float32 HIGHEST dot: compared with
    # float64 within the accumulation bound); grad_lhs is the recipe's own, bit for bit.
    x, w, c = _normal(21, (64, 96)), _normal(22, (96, 32)), _normal(23, (64, 32))
    for base in (NVIDIA_MXFP8, Recipe(forward="mxfp4")):  # quantized and STE backward
        hp = dataclasses.replace(base, high_precision_wgrad=True)
        assert "fp32 wgrad" in hp.describe()
        loss = lambda r: (lambda a, b: jnp.sum(r.dot_general(a, b, DN) * c))
        (gx, gw), (gx0, gwq) = jax.jit(lambda a, b: [  # one program for both recipes
            jax.grad(loss(r), argnums=(0, 1))(a, b) for r in (hp, base)])(x, w)
        np.testing.assert_array_equal(np.asarray(gx), np.asarray(gx0))
        x64, c64 = np.asarray(x, np.float64), np.asarray(c, np.float64)
        bound = 64 * 2.0**-23 * (np.abs(x64).T @ np.abs(c64))
        assert np.all(np.abs(np.asarray(gw, np.float64) - x64.T @ c64) <= bound)
        # and it differs from the quantized weight gradient (the option did something)
        if base.backward == "quantized":
            assert not np.array_equal(np.asarray(gw), np.asarray(gwq))


_OVERRIDE_RECIPES = [NVIDIA_MXFP8, FP8_HYBRID, lowprec.NVIDIA_NVFP4]


@pytest.fixture(scope="module")
def override_data():
    x = _normal(23, (2, 16, 64))  # [batch, seq, d] activations
    w = _normal(24, (64, 32)) / 8
    c = _normal(25, (2, 16, 32))
    return x, w, c


def _override_grads(recipe, x, w, c):
    dn = (((2,), (0,)), ((), ()))
    loss = lambda a, b: jnp.sum(recipe.dot_general(a, b, dn) * c)
    return [np.asarray(v) for v in jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)]


@pytest.mark.parametrize("recipe", _OVERRIDE_RECIPES, ids=lambda r: r.name)
@pytest.mark.quick_first(1)
def test_backward_override_high_precision_is_the_float_layers_gradient(recipe, override_data):
    # Transformer Engine's backward_override="high_precision": both backward products from
    # the unquantized cotangent and operands (float32 dots, within the accumulation bound of
    # the float64 products), whatever the recipe's backward formats.
    x, w, c = override_data
    hp = dataclasses.replace(recipe, backward_override="high_precision")
    assert "high_precision backward" in hp.describe()
    gx, gw = _override_grads(hp, x, w, c)
    x64 = np.asarray(x, np.float64).reshape(32, 64)
    w64, c64 = np.asarray(w, np.float64), np.asarray(c, np.float64).reshape(32, 32)
    _assert_close(gx.reshape(32, 64), c64 @ w64.T, c64, w64.T, 32)
    _assert_close(gw, x64.T @ c64, x64.T, c64, 32)


@pytest.mark.parametrize("recipe", [NVIDIA_MXFP8, FP8_HYBRID], ids=lambda r: r.name)
@pytest.mark.quick_first(1)
def test_backward_override_dequantized_is_the_straight_through_gradient(recipe, override_data):
    # "dequantized": the backward products read the operands as the forward quantized them
    # and the cotangent unquantized: the exact gradient of the quantized forward, which is
    # what lowprec's backward="ste" computes: the same program, bit for bit. (The NVFP4
    # recipe's is held to its NumPy statement in test_nvfp4_train.)
    x, w, c = override_data
    dq = dataclasses.replace(recipe, backward_override="dequantized")
    ste = dataclasses.replace(recipe, grad=None, backward="ste", backward_operands="forward")
    got = _override_grads(dq, x, w, c)
    for g, want in zip(got, _override_grads(ste, x, w, c)):
        assert_bits_equal(g, want)
    # ... and not the recipe's quantized backward (the option did something)
    assert not np.array_equal(_override_grads(recipe, x, w, c)[1], got[1])


@pytest.mark.slow  # seconds; the ragged backward runs in test_ragged.py's quick case
def test_ragged_dot_backward_override(override_data):
    # Each group's gradients as its own dot's: float32 ragged products of the unquantized
    # values ("high_precision"), or the straight-through ragged gradient ("dequantized").
    x, w, c = override_data
    x2, c2 = x.reshape(32, 64), c.reshape(32, 32)
    ws = np.stack([w, -2 * w])
    sizes = jnp.array([20, 12])

    def grads(r):
        loss = lambda a, b: jnp.sum(r.ragged_dot(a, b, sizes) * c2)
        return [np.asarray(v) for v in jax.jit(jax.grad(loss, argnums=(0, 1)))(x2, ws)]

    gx, gw = grads(dataclasses.replace(NVIDIA_MXFP8, backward_override="high_precision"))
    x64, c64, w64 = (np.asarray(v, np.float64) for v in (x2, c2, ws))
    for g, rows in enumerate((slice(0, 20), slice(20, 32))):
        _assert_close(gx[rows], c64[rows] @ w64[g].T, c64[rows], w64[g].T, 32)
        _assert_close(gw[g], x64[rows].T @ c64[rows], x64[rows].T, c64[rows], 32)
    ste = Recipe(forward="mxfp8_e4m3", scale_options={"scale_rule": "rceil"})
    for got, want in zip(grads(dataclasses.replace(NVIDIA_MXFP8, backward_override="dequantized")),
                         grads(ste)):
        assert_bits_equal(got, want)


def _custom_vjp_calls(jaxpr):
    """The custom-VJP calls of a jaxpr and its sub-jaxprs (jit, cond, ...), each as the
    name of its backward rule."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("custom_vjp_call"):
            found.append(str(eqn.params.get("bwd")))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _custom_vjp_calls(sub)
    return found


def test_every_training_dot_is_the_one_custom_vjp():
    # Issue 35 item 10: lowprec.dot_general, lowprec.ragged_dot, every recipe's dot_general
    # and ragged_dot (FP8_HYBRID's per-tensor scales, high-precision wgrad, backward
    # overrides, NVIDIA_NVFP4) and delayed scaling trace to exactly one custom VJP, the
    # training dot of lowprec/_qdot.py (its backward rule _training_bwd); no other rule
    # (a recipe's backward calling jax.vjp of the public function traced two).
    x, w = jnp.ones((2, 8, 32)), jnp.ones((32, 16))
    xr, wr, gs = jnp.ones((8, 32)), jnp.ones((2, 32, 16)), jnp.array([3, 5])
    dn = (((2,), (0,)), ((), ()))
    recipes = [OCP_MXFP8, NVIDIA_MXFP8, FP8_HYBRID, lowprec.NVIDIA_NVFP4,
               dataclasses.replace(FP8_HYBRID, high_precision_wgrad=True),
               dataclasses.replace(NVIDIA_MXFP8, backward_override="high_precision"),
               Recipe(forward="mxfp8", grad="mxfp8_e5m2", backward_operands="mxfp4")]
    calls = [lambda: lowprec.dot_general(x, w, dn, lhs_format="mxfp8", rhs_format="mxfp8"),
             lambda: lowprec.ragged_dot(xr, wr, gs, lhs_format="mxfp8", rhs_format="e4m3")]
    calls += [functools.partial(r.dot_general, x, w, dn) for r in recipes]
    calls += [functools.partial(r.ragged_dot, xr, wr, gs) for r in recipes[:3]]
    cfg = lowprec.DelayedScaling(amax_history_len=2)
    calls.append(lambda: lowprec.delayed_dot_general(x, w, cfg.init(), dn, cfg))
    for call in calls:
        rules = _custom_vjp_calls(jax.make_jaxpr(call)().jaxpr)
        assert len(rules) == 1 and "_training_bwd" in rules[0], rules


def test_ragged_spec_is_the_dot_spec():
    # RaggedSpec's fields live in the one options object (its old name is kept as an alias).
    from lowprec import _options, _ragged
    assert _ragged.RaggedSpec is _options.DotSpec
    spec = FP8_HYBRID.dot_spec()
    assert spec.tensor_scaling and spec.bwd_lhs == spec.lhs and spec.grad.fmt.name == "e5m2"
    spec = Recipe(forward="mxfp8", grad="mxfp8", backward_operands=("mxfp4", None)).dot_spec()
    assert spec.bwd_lhs.fmt.name == "mxfp4" and spec.bwd_rhs is None
    hp = dataclasses.replace(NVIDIA_MXFP8, backward_override="high_precision").dot_spec()
    assert hp.high_precision_wgrad and hp.high_precision_dgrad and hp.backward == "ste"
    nv = lowprec.NVIDIA_NVFP4.dot_spec()
    assert nv.nvfp4.weight_block_2d and nv.nvfp4.grad_rounding == "stochastic"
