"""sha256 of the outputs of lowprec's public entry points on fixed inputs, for a refactor's
"same bits" check (the checkpoint layouts' counterpart is ``scripts/layout_hashes.py``).

Covers: ``quantize`` for every element format, rounding mode and overflow policy, and
``decode`` of every code; ``quantize_mx`` / ``dequantize`` (float32 and bfloat16 output) /
``fake_quantize_mx`` for every block format, scale rule and block axis, nearest-even and
stochastic rounding, both NVFP4 steps; ``quantize_mx_plus``; the quantized ``dot_general``
(forward and gradients, both backward modes), ``matmul``, ``ragged_dot`` and every named
``Recipe``'s dot with its gradients; ``pack_fp4`` /
``pack_fp6`` and their inverses on every code and byte. Every input is float32 and bfloat16,
holding NaN, ±Inf, ±0, float32/bfloat16 subnormals, ties of every format's grid and values
past each format's range. Prints one line per output (``case sha256``); a refused case prints
the exception's type in place of the hash (its message may be reworded). Run it in two trees,
and with ``LOWPREC_KERNELS=xla``, and diff::

    .venv/bin/python scripts/output_hashes.py > /tmp/new.txt
    LOWPREC_KERNELS=xla .venv/bin/python scripts/output_hashes.py > /tmp/new_xla.txt
    diff /tmp/new.txt /tmp/new_xla.txt

The first lines (``#``) say which files lowprec, lowprec_formats and lowprec_reference were
imported from and whether the native kernels run, so that a run against another tree (its
folder on ``PYTHONPATH`` under those package names) can be told apart. Options added after
the run being compared against (``scale_options=``) are left out: only what both trees take.

Not a test: the suite checks properties against peers and the reference; this checks a
refactor moved no bit. ``--match WORD`` (repeatable) keeps only the cases whose name holds
WORD (``output_hashes.py dot recipe ragged --match nvfp4``: a change's own cases).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings

import numpy as np

warnings.simplefilter("ignore", DeprecationWarning)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import lowprec  # noqa: E402
import lowprec.kernels  # noqa: E402
import lowprec_formats  # noqa: E402
import lowprec_reference  # noqa: E402


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        if a is None:
            h.update(b"none")
            continue
        a = np.asarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


#: ``--match WORD`` (repeatable): only the cases whose name holds one of these words (the
#: sections are slow on a shared machine; a change's own cases are what it must compare).
_MATCH: list = []


def _emit(case: str, fn) -> None:
    if _MATCH and not any(m in case for m in _MATCH):
        return
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a refusal is an output too
        print(f"{case} refused:{type(e).__name__}", flush=True)
        return
    if isinstance(out, lowprec.MXArray):
        out = (out.elements, out.scales, getattr(out, "tensor_scale", None))
    elif not isinstance(out, tuple):
        out = (out,)
    print(f"{case} {_digest(*out)}", flush=True)


def _inputs() -> np.ndarray:
    """float32 values: specials, subnormals, a grid of ties at every scale, values past every
    format's range, random normals at several scales (shuffled with a fixed seed)."""
    f32 = np.float32
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0], f32)
    tiny = np.array([1, 2, 3, 0x7FFFFF, 0x400000, 0x10000, 0x800000], np.uint32).view(f32)
    # k/8 * 2^e for odd and even k: midpoints of every 1-, 2- and 3-bit mantissa grid
    ties = np.array([k / 8 * 2.0 ** e for e in range(-20, 20, 3) for k in range(1, 17)], f32)
    big = np.array([2.0 ** e * m for e in (8, 15, 16, 17, 64, 127) for m in (1.0, 1.5, 1.75)],
                   f32)
    rng = np.random.default_rng(0)
    normal = np.concatenate([rng.standard_normal(1024) * s for s in (1e-3, 1.0, 300.0)])
    vals = np.concatenate([specials, tiny, ties, big, normal.astype(f32)])
    vals = np.concatenate([vals, -vals])
    vals = np.resize(vals, 64 * 128)
    return rng.permutation(vals).astype(f32).reshape(64, 128)


def element_cases(xs) -> None:
    key = jax.random.PRNGKey(1)
    for fmt in lowprec.ELEMENT_FORMAT_NAMES:
        info = lowprec.element_format(fmt)
        bits = info.code_bits if hasattr(info, "code_bits") else None
        if bits is not None and bits <= 16:
            codes = np.arange(2 ** bits, dtype=np.uint32)
            _emit(f"decode/{fmt}", lambda: lowprec.decode(jnp.asarray(codes).astype(
                jnp.uint8 if bits <= 8 else jnp.uint16), fmt))
        for dt, x in xs.items():
            for r in lowprec.Rounding:
                for o in lowprec.Overflow:
                    k = key if r.value == "stochastic" else None
                    _emit(f"quantize/{fmt}/{dt}/{r.value}/{o.value}",
                          lambda: lowprec.quantize(x, fmt, rounding=r.value, overflow=o.value,
                                                   key=k))
                    _emit(f"encode/{fmt}/{dt}/{r.value}/{o.value}",
                          lambda: lowprec.encode(x, fmt, rounding=r.value, overflow=o.value,
                                                 key=k))


def block_cases(xs) -> None:
    key = jax.random.PRNGKey(2)
    for fmt in lowprec.MX_FORMAT_NAMES:
        for dt, x in xs.items():
            for axis in (-1, 0):
                for rule in [None] + [s.value for s in lowprec.ScaleRule]:
                    case = f"{fmt}/{dt}/axis{axis}/rule={rule}"
                    kw = dict(axis=axis, scale_rule=rule)

                    def q(kw=kw):
                        return lowprec.quantize_mx(x, fmt, **kw)
                    _emit(f"quantize_mx/{case}", q)
                    _emit(f"dequantize/{case}/f32", lambda: lowprec.dequantize(q()))
                    _emit(f"dequantize/{case}/bf16",
                          lambda: lowprec.dequantize(q(), jnp.bfloat16))
                    _emit(f"fake_quantize_mx/{case}",
                          lambda kw=kw: lowprec.fake_quantize_mx(x, fmt, **kw))
                sr = dict(axis=axis, rounding="stochastic", key=key)
                _emit(f"quantize_mx/{fmt}/{dt}/axis{axis}/stochastic",
                      lambda: lowprec.quantize_mx(x, fmt, **sr))
                _emit(f"fake_quantize_mx/{fmt}/{dt}/axis{axis}/stochastic",
                      lambda: lowprec.fake_quantize_mx(x, fmt, **sr))
                if fmt.startswith("nvfp4"):
                    for step in [s.value for s in lowprec.NVFP4Step] if hasattr(
                            lowprec, "NVFP4Step") else ("divide", "reciprocal"):
                        for rnd, k in (("nearest_even", None), ("stochastic", key)):
                            st = dict(axis=axis, nvfp4_step=step, rounding=rnd, key=k)
                            c = f"{fmt}/{dt}/axis{axis}/step={step}/{rnd}"
                            _emit(f"quantize_mx/{c}", lambda: lowprec.quantize_mx(x, fmt, **st))
                            _emit(f"fake_quantize_mx/{c}",
                                  lambda: lowprec.fake_quantize_mx(x, fmt, **st))
                            _emit(f"quantize_mx/{c}/ts=0.37", lambda: lowprec.quantize_mx(
                                x, fmt, tensor_scale=jnp.float32(0.37), **st))
            _emit(f"quantize_mx/{fmt}/{dt}/pad", lambda: lowprec.quantize_mx(
                x[:, :100], fmt, pad=True))
        for dt, x in xs.items():
            _emit(f"quantize_mx_plus/{fmt}/{dt}", lambda: _plus(x, fmt))


def _plus(x, fmt):
    a = lowprec.quantize_mx_plus(x, fmt)
    return tuple(jax.tree_util.tree_leaves(a)) + (lowprec.dequantize_mx_plus(a),)


def dot_cases(xs) -> None:
    pairs = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("mxfp8_e4m3", "mxfp8_e4m3"),
             ("mxfp8_e5m2", "mxfp4"), ("mxfp4", "mxfp4"), ("mxfp6_e2m3", "mxfp6_e3m2"),
             ("nvfp4", "nvfp4"), ("mxint8", "mxint8"), (None, "mxfp4"), ("if4", "mixfp4")]
    dims = (((1,), (1,)), ((), ()))
    for dt, x in xs.items():
        a = jnp.nan_to_num(x[:16], posinf=3.0, neginf=-3.0)
        b = jnp.nan_to_num(x[16:48], posinf=2.0, neginf=-2.0)
        for lf, rf in pairs:
            for rule in ("floor", "rceil"):
                for bw in ("ste", "quantized"):
                    kw = dict(lhs_format=lf, rhs_format=rf, scale_rule=rule, backward=bw)
                    case = f"{lf}x{rf}/{dt}/{rule}/{bw}"
                    _emit(f"dot_general/{case}",
                          lambda kw=kw: lowprec.dot_general(a, b, dims, **kw))

                    def grads(kw=kw):
                        f = lambda p, q: lowprec.dot_general(p, q, dims, **kw).sum()  # noqa: E731
                        return jax.grad(f, argnums=(0, 1))(a.astype(jnp.float32),
                                                           b.astype(jnp.float32))
                    _emit(f"dot_general_grad/{case}", grads)
            _emit(f"matmul/{lf}x{rf}/{dt}", lambda: lowprec.matmul(
                a, b.T, lhs_format=lf, rhs_format=rf))
            _emit(f"dot_general_jit/{lf}x{rf}/{dt}", lambda: jax.jit(
                lambda p, q: lowprec.dot_general(p, q, dims, lhs_format=lf,
                                                 rhs_format=rf))(a, b))
        # ragged: 3 groups over 64 rows of lhs [64, 128] by rhs [3, 128, 32]
        lhs = jnp.nan_to_num(x, posinf=1.0, neginf=-1.0)
        rhs = jnp.nan_to_num(x.reshape(64, 128)[:48], posinf=1.0, neginf=-1.0)
        rhs = jnp.stack([rhs[:32].T, rhs[16:48].T, -rhs[:32].T])
        groups = jnp.array([20, 0, 44], jnp.int32)
        for lf, rf in pairs[:8]:
            _emit(f"ragged_dot/{lf}x{rf}/{dt}", lambda: lowprec.ragged_dot(
                lhs, rhs, groups, lhs_format=lf, rhs_format=rf))


def recipe_cases(xs) -> None:
    """Every named recipe's dot (forward and both gradients, jitted; fp8_delayed is a
    stateful recipe and refused here); the NVFP4 recipe's 2-D weight tiles, Hadamard
    transform and stochastically rounded gradients included."""
    dims = (((1,), (0,)), ((), ()))
    for dt, x in xs.items():
        a = jnp.nan_to_num(x[:32], posinf=3.0, neginf=-3.0).astype(jnp.float32)
        b = jnp.nan_to_num(x[32:64].T, posinf=2.0, neginf=-2.0).astype(jnp.float32)
        for name, recipe in lowprec.RECIPES.items():
            def run(recipe=recipe):
                f = lambda p, q: recipe.dot_general(p, q, dims)  # noqa: E731
                out, vjp = jax.vjp(jax.jit(f), a, b)
                return (out,) + vjp(jnp.cos(out))
            _emit(f"recipe/{name}/{dt}", run)


def ragged_cases(xs) -> None:
    """The ragged dot's forward and both gradients (jitted), per-group tensor scales included:
    ``lowprec.ragged_dot`` of block formats and the quantized recipes' ``ragged_dot``."""
    for dt, x in xs.items():
        # Magnitudes up to 2^16 (the values past every format's range clipped), so that sums
        # and gradients stay finite: an all-NaN result would hash the same for any recipe.
        v = jnp.clip(jnp.nan_to_num(x, posinf=1.0, neginf=-1.0).astype(jnp.float32),
                     -65536.0, 65536.0)
        lhs = v
        rhs = v.reshape(64, 128)[:48]
        rhs = jnp.stack([rhs[:32].T, rhs[16:48].T, -rhs[:32].T])
        groups = jnp.array([20, 0, 37], jnp.int32)  # 7 rows in no group
        fns = {f"{lf}x{rf}": lambda p, q, lf=lf, rf=rf: lowprec.ragged_dot(
            p, q, groups, lhs_format=lf, rhs_format=rf)
            for lf, rf in (("nvfp4", "nvfp4"), ("mxfp8_e4m3", "mxfp4"))}
        fns["recipe_nvfp4"] = lambda p, q: lowprec.Recipe(
            forward="nvfp4", grad="nvfp4").ragged_dot(p, q, groups)
        for name in ("nvidia_nvfp4", "nvidia_mxfp8"):
            if name in lowprec.RECIPES:
                fns[f"recipe/{name}"] = lambda p, q, r=lowprec.RECIPES[name]: r.ragged_dot(
                    p, q, groups)
        for case, f in fns.items():
            def run(f=f, case=case, dt=dt):
                out, vjp = jax.vjp(jax.jit(f), lhs, rhs)
                res = (out,) + vjp(jnp.cos(out))
                # How much of each result is finite (an all-NaN one hashes alike for any recipe).
                print("# finite " + ", ".join(f"{float(jnp.mean(jnp.isfinite(a))):.2f}"
                                              for a in res), flush=True)
                return res
            _emit(f"ragged_grad/{case}/{dt}", run)


def pack_cases() -> None:
    fp4 = jnp.asarray(np.arange(64, dtype=np.uint8).reshape(4, 16) % 16)
    fp6 = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(4, 64) % 64)
    byts = jnp.asarray(np.arange(768, dtype=np.uint32).astype(np.uint8).reshape(4, 192))
    for axis in (-1, 0):
        _emit(f"pack_fp4/axis{axis}", lambda: lowprec.pack_fp4(fp4, axis=axis))
        _emit(f"pack_fp6/axis{axis}", lambda: lowprec.pack_fp6(fp6, axis=axis))
        _emit(f"unpack_fp4/axis{axis}", lambda: lowprec.unpack_fp4(byts, axis=axis))
    _emit("unpack_fp6/axis-1", lambda: lowprec.unpack_fp6(byts, axis=-1))
    _emit("unpack_fp6/axis0", lambda: lowprec.unpack_fp6(byts.reshape(12, 64), axis=0))


def main() -> None:
    for mod in (lowprec, lowprec_formats, lowprec_reference):
        print(f"# {mod.__name__} from {os.path.dirname(os.path.realpath(mod.__file__))}")
    print(f"# {lowprec.kernels.native_status()}")
    print(f"# LOWPREC_KERNELS={os.environ.get('LOWPREC_KERNELS', '')}", flush=True)
    x = _inputs()
    xs = {"f32": jnp.asarray(x), "bf16": jnp.asarray(x).astype(jnp.bfloat16)}
    # Sections named on the command line (pack element block dot recipe ragged), else the
    # first five; --match WORD keeps the cases whose name holds WORD.
    args = sys.argv[1:]
    while "--match" in args:
        i = args.index("--match")
        _MATCH.append(args[i + 1])
        del args[i:i + 2]
    parts = args or ["pack", "element", "block", "dot", "recipe"]
    if "pack" in parts:
        pack_cases()
    if "element" in parts:
        element_cases(xs)
    if "block" in parts:
        block_cases(xs)
    if "dot" in parts:
        dot_cases(xs)
    if "recipe" in parts:
        recipe_cases(xs)
    if "ragged" in parts:  # not in the default run: an addition (compare trees with it named)
        ragged_cases(xs)


if __name__ == "__main__":
    main()
