"""sha256 of the outputs of lowprec's public entry points on fixed inputs, for a refactor's
"same bits" check (the checkpoint layouts' counterpart is ``scripts/layout_hashes.py``).

Covers: ``quantize`` for every element format, rounding mode and overflow policy, and
``decode`` of every code; ``quantize_mx`` / ``dequantize`` (float32 and bfloat16 output) /
``fake_quantize_mx`` for every block format, scale rule and block axis, nearest-even and
stochastic rounding, both NVFP4 steps; ``quantize_mx_plus``; the quantized ``dot_general``
(forward and gradients, both backward modes), ``matmul``, ``ragged_dot`` (and, in ``ragged_grad``, its gradients and the recipes') and every named
``Recipe``'s dot with its gradients; ``pack_fp4`` /
``pack_fp6`` and their inverses on every code and byte. Every input is float32 and bfloat16,
holding NaN, ±Inf, ±0, float32/bfloat16 subnormals, ties of every format's grid and values
past each format's range. Prints one line per output (``case sha256``); a refused case prints
the exception's type in place of the hash (its message may be reworded). Run it in two trees,
and with ``LOWPREC_KERNELS=xla``, and diff::

    .venv/bin/python scripts/output_hashes.py > /tmp/new.txt
    LOWPREC_KERNELS=xla .venv/bin/python scripts/output_hashes.py > /tmp/new_xla.txt
    diff /tmp/new.txt /tmp/new_xla.txt
    .venv/bin/python scripts/output_hashes.py --tree /tmp/old_pp --out /tmp/old.txt --cache /tmp/jc

The first lines (``#``) say which files lowprec, lowprec_formats and lowprec_reference were
imported from and whether the native kernels run, so that a run against another tree can be
told apart. ``--tree DIR`` imports the three from DIR (a folder holding those names, e.g.
symlinks to another checkout's ``lowprec/``, ``formats/`` and ``reference/``, with its
``liblowprec_cpu.so`` built): ``PYTHONPATH`` alone does not do it where lowprec is an
editable install, whose import hook maps ``lowprec`` to its own checkout ahead of the path.
Options added after the run being compared against (``scale_options=``) are left out: only
what both trees take.

Speed: the cases of one format and input (one operand pair for the dots) run as one jitted
program, their arrays passed as arguments (never folded in as constants), so that the ~3,200
outputs compile ~200 programs instead of one or more per output; a case refused while that
program is traced runs again on its own, eagerly, so that its refusal is the eager call's.
``--sections pack,element,...`` runs some sections; ``--out FILE`` appends to FILE and skips
the sections FILE already ends (a ``# done SECTION`` line), so a stopped run resumes;
``--match WORD`` (repeatable) keeps the cases whose name holds WORD (``--sections
dot,ragged_grad,recipe --match nvfp4``: a change's own cases); ``--cache DIR`` keeps the compiled programs in JAX's persistent cache (a second tree whose
programs are the same, location metadata aside, reuses them).

Not a test: the suite checks properties against peers and the reference; this checks a
refactor moved no bit.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import warnings

import numpy as np

warnings.simplefilter("ignore", DeprecationWarning)


def _use_tree(argv) -> None:
    """``--tree DIR``: DIR first on ``sys.path`` and no editable install's import hook (see
    the module docstring), before lowprec is imported."""
    if "--tree" not in argv:
        return
    tree = os.path.abspath(argv[argv.index("--tree") + 1])
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                        and "editable" not in getattr(type(f), "__module__", "").lower()]
    sys.path.insert(0, tree)


_use_tree(sys.argv)

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


_OUT = sys.stdout


def _arrays(out) -> tuple:
    if isinstance(out, lowprec.MXArray):
        return (out.elements, out.scales, getattr(out, "tensor_scale", None))
    return out if isinstance(out, tuple) else (out,)


#: ``--match WORD`` (repeatable): only the cases whose name holds one of these words (a
#: change's own cases, where a whole section is long on a shared machine).
_MATCH: list = []


def _wanted(case: str) -> bool:
    return not _MATCH or any(m in case for m in _MATCH)


def _emit(case: str, fn) -> None:
    """One case, eagerly."""
    if not _wanted(case):
        return
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a refusal is an output too
        print(f"{case} refused:{type(e).__name__}", file=_OUT, flush=True)
        return
    print(f"{case} {_digest(*_arrays(out))}", file=_OUT, flush=True)


def _group(cases: dict, *args) -> None:
    """The cases (``case -> fn(*args)``) as one jitted program of ``args``; a case refused
    while it is traced (or a program that fails) runs again eagerly, alone."""
    cases = {case: fn for case, fn in cases.items() if _wanted(case)}
    if not cases:
        return
    refused = []

    def program(*a):
        outs = {}
        for case, fn in cases.items():
            try:
                outs[case] = _arrays(fn(*a))
            except Exception:  # noqa: BLE001 - retried eagerly below
                refused.append(case)
        return outs

    try:
        outs = jax.block_until_ready(jax.jit(program)(*args))
    except Exception:  # noqa: BLE001 - every case alone
        outs, refused = {}, list(cases)
    for case, fn in cases.items():
        if case in refused:
            _emit(case, lambda: fn(*args))
        else:
            print(f"{case} {_digest(*outs[case])}", file=_OUT, flush=True)


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
            cases = {}
            for r in lowprec.Rounding:
                for o in lowprec.Overflow:
                    sr = r.value == "stochastic"
                    kw = dict(rounding=r.value, overflow=o.value)
                    for name, f in (("quantize", lowprec.quantize), ("encode", lowprec.encode)):
                        cases[f"{name}/{fmt}/{dt}/{r.value}/{o.value}"] = (
                            lambda x, k, f=f, kw=kw, sr=sr: f(x, fmt, key=k if sr else None,
                                                              **kw))
            _group(cases, x, key)


def block_cases(xs) -> None:
    key = jax.random.PRNGKey(2)
    ts = jnp.float32(0.37)
    for fmt in lowprec.MX_FORMAT_NAMES:
        for dt, x in xs.items():
            for axis in (-1, 0):
                cases = {}
                for rule in [None] + [s.value for s in lowprec.ScaleRule]:
                    case = f"{fmt}/{dt}/axis{axis}/rule={rule}"
                    kw = dict(axis=axis, scale_rule=rule)

                    def q(x, kw=kw):
                        return lowprec.quantize_mx(x, fmt, **kw)
                    cases[f"quantize_mx/{case}"] = lambda x, k, t, q=q: q(x)
                    cases[f"dequantize/{case}/f32"] = lambda x, k, t, q=q: lowprec.dequantize(
                        q(x))
                    cases[f"dequantize/{case}/bf16"] = lambda x, k, t, q=q: lowprec.dequantize(
                        q(x), jnp.bfloat16)
                    cases[f"fake_quantize_mx/{case}"] = (
                        lambda x, k, t, kw=kw: lowprec.fake_quantize_mx(x, fmt, **kw))
                sr = dict(axis=axis, rounding="stochastic")
                cases[f"quantize_mx/{fmt}/{dt}/axis{axis}/stochastic"] = (
                    lambda x, k, t, sr=sr: lowprec.quantize_mx(x, fmt, key=k, **sr))
                cases[f"fake_quantize_mx/{fmt}/{dt}/axis{axis}/stochastic"] = (
                    lambda x, k, t, sr=sr: lowprec.fake_quantize_mx(x, fmt, key=k, **sr))
                if fmt.startswith("nvfp4"):
                    for step in [s.value for s in lowprec.NVFP4Step] if hasattr(
                            lowprec, "NVFP4Step") else ("divide", "reciprocal"):
                        for rnd in ("nearest_even", "stochastic"):
                            st = dict(axis=axis, nvfp4_step=step, rounding=rnd)
                            sk = rnd == "stochastic"
                            c = f"{fmt}/{dt}/axis{axis}/step={step}/{rnd}"
                            cases[f"quantize_mx/{c}"] = (
                                lambda x, k, t, st=st, sk=sk: lowprec.quantize_mx(
                                    x, fmt, key=k if sk else None, **st))
                            cases[f"fake_quantize_mx/{c}"] = (
                                lambda x, k, t, st=st, sk=sk: lowprec.fake_quantize_mx(
                                    x, fmt, key=k if sk else None, **st))
                            cases[f"quantize_mx/{c}/ts=0.37"] = (
                                lambda x, k, t, st=st, sk=sk: lowprec.quantize_mx(
                                    x, fmt, tensor_scale=t, key=k if sk else None, **st))
                _group(cases, x, key, ts)
        cases = {f"quantize_mx/{fmt}/{dt}/pad": (
            lambda xf, xb, dt=dt: lowprec.quantize_mx((xf, xb)[dt == "bf16"][:, :100], fmt,
                                                      pad=True)) for dt in xs}
        cases.update({f"quantize_mx_plus/{fmt}/{dt}": (
            lambda xf, xb, dt=dt: _plus((xf, xb)[dt == "bf16"], fmt)) for dt in xs})
        _group(cases, xs["f32"], xs["bf16"])


def _plus(x, fmt):
    a = lowprec.quantize_mx_plus(x, fmt)
    return tuple(jax.tree_util.tree_leaves(a)) + (lowprec.dequantize_mx_plus(a),)


_PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("mxfp8_e4m3", "mxfp8_e4m3"),
          ("mxfp8_e5m2", "mxfp4"), ("mxfp4", "mxfp4"), ("mxfp6_e2m3", "mxfp6_e3m2"),
          ("nvfp4", "nvfp4"), ("mxint8", "mxint8"), (None, "mxfp4"), ("if4", "mixfp4")]


def dot_cases(xs) -> None:
    pairs = _PAIRS
    dims = (((1,), (1,)), ((), ()))
    for dt, x in xs.items():
        a = jnp.nan_to_num(x[:16], posinf=3.0, neginf=-3.0)
        b = jnp.nan_to_num(x[16:48], posinf=2.0, neginf=-2.0)
        for lf, rf in pairs:
            cases = {}
            for rule in ("floor", "rceil"):
                for bw in ("ste", "quantized"):
                    kw = dict(lhs_format=lf, rhs_format=rf, scale_rule=rule, backward=bw)
                    case = f"{lf}x{rf}/{dt}/{rule}/{bw}"
                    cases[f"dot_general/{case}"] = (
                        lambda a, b, kw=kw: lowprec.dot_general(a, b, dims, **kw))

                    def grads(a, b, kw=kw):
                        f = lambda p, q: lowprec.dot_general(p, q, dims, **kw).sum()  # noqa: E731
                        return jax.grad(f, argnums=(0, 1))(a.astype(jnp.float32),
                                                           b.astype(jnp.float32))
                    cases[f"dot_general_grad/{case}"] = grads
            cases[f"matmul/{lf}x{rf}/{dt}"] = lambda a, b, lf=lf, rf=rf: lowprec.matmul(
                a, b.T, lhs_format=lf, rhs_format=rf)
            cases[f"dot_general_jit/{lf}x{rf}/{dt}"] = lambda a, b, lf=lf, rf=rf: jax.jit(
                lambda p, q: lowprec.dot_general(p, q, dims, lhs_format=lf,
                                                 rhs_format=rf))(a, b)
            _group(cases, a, b)


def ragged_cases(xs) -> None:
    """``ragged_dot`` of the first 8 operand pairs of the dots: 3 groups (one empty) over the
    64 rows of lhs [64, 128] by rhs [3, 128, 32]."""
    for dt, x in xs.items():
        lhs = jnp.nan_to_num(x, posinf=1.0, neginf=-1.0)
        rhs = jnp.nan_to_num(x.reshape(64, 128)[:48], posinf=1.0, neginf=-1.0)
        rhs = jnp.stack([rhs[:32].T, rhs[16:48].T, -rhs[:32].T])
        groups = jnp.array([20, 0, 44], jnp.int32)
        _group({f"ragged_dot/{lf}x{rf}/{dt}": (
            lambda p, q, g, lf=lf, rf=rf: lowprec.ragged_dot(p, q, g, lhs_format=lf,
                                                             rhs_format=rf))
                for lf, rf in _PAIRS[:8]}, lhs, rhs, groups)


def ragged_grad_cases(xs) -> None:
    """The ragged dot's forward and both gradients (jitted): NVFP4 and MXFP8 x MXFP4 operands,
    the NVFP4 recipe (per-group tensor scales) and the named NVFP4 and MXFP8 recipes, on
    magnitudes clipped to 2^16 so that sums and gradients stay finite (an all-NaN result
    would hash alike for any recipe; each result's finite share is printed)."""
    for dt, x in xs.items():
        v = jnp.clip(jnp.nan_to_num(x, posinf=1.0, neginf=-1.0).astype(jnp.float32),
                     -65536.0, 65536.0)
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
            def run(f=f):
                out, vjp = jax.vjp(jax.jit(f), v, rhs)
                res = (out,) + vjp(jnp.cos(out))
                print("# finite " + ", ".join(f"{float(jnp.mean(jnp.isfinite(a))):.2f}"
                                              for a in res), file=_OUT, flush=True)
                return res
            _emit(f"ragged_grad/{case}/{dt}", run)


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


SECTIONS = {"pack": lambda xs: pack_cases(), "element": element_cases, "block": block_cases,
            "dot": dot_cases, "ragged": ragged_cases, "ragged_grad": ragged_grad_cases,
            "recipe": recipe_cases}


def main() -> None:
    global _OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sections", nargs="*", help="old spelling of --sections")
    parser.add_argument("--sections", dest="only", default=None,
                        help=f"comma-separated, of: {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--out", default=None, help="append to this file; skip its done sections")
    parser.add_argument("--cache", default=None, help="JAX persistent compilation cache folder")
    parser.add_argument("--tree", default=None, help="import lowprec from this folder (see above)")
    parser.add_argument("--match", action="append", default=[], metavar="WORD",
                        help="only the cases whose name holds WORD (repeatable)")
    args = parser.parse_args()
    _MATCH.extend(args.match)
    parts = (args.only.split(",") if args.only else args.sections) or list(SECTIONS)
    unknown = sorted(set(parts) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; valid: {', '.join(SECTIONS)}")
    if args.cache:
        jax.config.update("jax_compilation_cache_dir", args.cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    done = set()
    if args.out:
        if os.path.exists(args.out):
            with open(args.out) as f:
                done = {line.split()[2] for line in f if line.startswith("# done ")}
        _OUT = open(args.out, "a")
    if not done:
        for mod in (lowprec, lowprec_formats, lowprec_reference):
            print(f"# {mod.__name__} from {os.path.dirname(os.path.realpath(mod.__file__))}",
                  file=_OUT)
        print(f"# {lowprec.kernels.native_status()}", file=_OUT)
        print(f"# LOWPREC_KERNELS={os.environ.get('LOWPREC_KERNELS', '')}", file=_OUT, flush=True)
    x = _inputs()
    xs = {"f32": jnp.asarray(x), "bf16": jnp.asarray(x).astype(jnp.bfloat16)}
    for name in SECTIONS:
        if name in parts and name not in done:
            t = time.process_time()
            SECTIONS[name](xs)
            print(f"# done {name} {time.process_time() - t:.1f} CPU s", file=_OUT, flush=True)


if __name__ == "__main__":
    main()
