"""Element-codec throughput: lowprec encode/decode vs XLA's native convert and ml_dtypes.

Run: ``python benchmarks/bench_codec.py`` (2^22 float32 elements, about a minute on a
2-core CPU; 2^26 on a GPU), ``--quick`` (2^18 elements, fewer rounds), ``--size N``, ``--reps R``,
``--formats e4m3 bf16``, ``--json PATH`` to save every timing.

For each element format, one interleaved timing group (see ``_timing.py``) holds:

* ``lowprec`` encode, jitted: ``jax.jit(lambda x: lowprec.encode(x, fmt, rounding=...,
  overflow=...))`` for every rounding mode with ``overflow="ieee"``, plus the default
  rounding with ``overflow="saturate"``. ``stochastic`` draws its random words inside the
  call from the key passed in (16-bit words of the keyed counter hash,
  ``lowprec.random_bits``), as encode does.
* ``XLA native`` encode: ``jax.jit(lambda x: lax.bitcast_convert_type(x.astype(dtype),
  uint))``; the bitcast keeps the output an integer array like lowprec's codes. TF32 has no
  dtype: ``lax.reduce_precision(x, 8, 10)`` bitcast to uint32. E2M1 returns the
  ``float4_e2m1fn`` array itself (no same-width unsigned type to bitcast to). XLA only
  rounds to nearest-even, so the native column of every encode row of a format is that one
  measurement: for the other modes the ratio says what the mode costs relative to the
  native RNE cast (the 2x target applies to the default mode only).
* ``ml_dtypes`` encode: ``x_np.astype(ml_dtypes.<dtype>)`` in NumPy (``np.float16`` for
  fp16; TF32 has no ml_dtypes type: n/a). Single-threaded, like all NumPy casts.
* ``decode`` rows: ``lowprec.decode(codes, fmt)`` (codes → float32) vs
  ``jax.jit(lambda c: c.astype(jnp.float32))`` on the codes as the native dtype and
  ``codes_np.view(dtype).astype(np.float32)``.

Throughput is elements per second (input elements / median seconds per call); the ratio
columns are the median over rounds of the per-round throughput ratio (peers timed in the
same round share the same background load), so they can differ a little from the ratio of
the two throughput columns. lowprec's
encode is branch-free, so its speed does not depend on the values; NumPy's and ml_dtypes'
casts do (their overflow / subnormal paths are slower), so the input distribution matters
for the ml_dtypes column. ``--dist normal`` (default): standard normal float32, like
weights and activations, the distribution most favourable to ml_dtypes. ``--dist wide``:
``±m·2^e``, m uniform in [1, 2) and e uniform over the format's exponent range widened by a
couple of binades each way (subnormals, underflow and some overflow occur), within
float32's normal range. e8m0 (unsigned) gets absolute values in both.

Also in each group: a streaming kernel (``x ^ c`` over uint32, read once, written once) over
the same number of bytes as the float32 input, the memory-bandwidth peer of the ``roof``
column: lowprec's effective bandwidth (bytes read + written per second) as a fraction of
that kernel's. ``x default`` divides each lowprec mode's throughput by the format's default
mode, measured in the same rounds. ``faults`` is lowprec's median minor page faults per
call (see ``_timing.py``).

Targets: default-mode encode and decode ≥ 0.8x XLA's native convert,
stochastic rounding ≥ 0.3x the default mode (random words included), and every mode ≥ 10x
ml_dtypes. Rows that miss are flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import (  # noqa: E402
    Timing,
    environment,
    fmt_faults,
    fmt_num,
    fmt_ratio,
    header_line,
    json_safe,
    rate,
    render_table,
    speed_ratio,
    stream_case,
    time_interleaved,
    write_atomic,
)

import lowprec  # noqa: E402

FORMATS = tuple(lowprec.ELEMENT_FORMAT_NAMES) + ("p3109_k8p3se",)  # and one P3109 format
MODES = ("nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic")
DEFAULT_MODE = "nearest_even/ieee"

XLA_TARGET = 0.8  # lowprec / XLA native, default mode encode and decode
STOCHASTIC_TARGET = 0.3  # lowprec stochastic / lowprec default mode
ML_DTYPES_TARGET = 10.0  # lowprec / ml_dtypes, every mode
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def native_dtype(fmt_name: str):
    """The dtype a format's native peers cast to (its ml_dtypes/NumPy type), or None."""
    return lowprec.element_format(fmt_name).storage_dtype


def code_bytes(fmt_name: str) -> int:
    return lowprec.element_format(fmt_name).code_dtype.itemsize


def parse_size(s: str) -> int:
    """``4194304``, ``2**22`` or ``2^22``."""
    s = s.replace("^", "**")
    if "**" in s:
        base, exp = s.split("**")
        return int(base) ** int(exp)
    return int(s)


def make_input(fmt_name: str, n: int, dist: str = "normal", seed: int = 0) -> np.ndarray:
    fmt = lowprec.element_format(fmt_name)
    rng = np.random.default_rng(seed)
    if dist == "normal":
        x = rng.standard_normal(n, dtype=np.float32)
        return x if fmt.signed else np.abs(x)
    lo = max(fmt.emin - fmt.mantissa_bits - 2, -126)
    hi = min(fmt.emax + 1, 127)
    m = rng.uniform(1.0, 2.0, n)
    e = rng.integers(lo, hi + 1, n)
    x = np.ldexp(m, e).astype(np.float32)  # m < 2 and e ≤ 127 can still round up to inf
    x = np.minimum(x, np.finfo(np.float32).max)
    if fmt.signed:
        x = np.where(rng.random(n) < 0.5, -x, x)
    return x.astype(np.float32)


def _no_xla(fmt_name: str) -> bool:
    """No XLA type to cast to: the float6 formats (XLA has no 6-bit floats) and the formats
    without an ml_dtypes type other than TF32 (MX INT8, P3109)."""
    f = lowprec.element_format(fmt_name)
    return f.code_bits == 6 or (f.storage_dtype is None and fmt_name != "tf32")


def native_encode_fn(fmt_name: str):
    dt = native_dtype(fmt_name)
    if _no_xla(fmt_name):
        return None
    if dt is None:  # tf32
        return jax.jit(lambda x: lax.bitcast_convert_type(lax.reduce_precision(x, 8, 10), jnp.uint32))
    if lowprec.element_format(fmt_name).code_bits < 8:  # float4: no unsigned type to bitcast to
        return jax.jit(lambda x: x.astype(dt))
    return jax.jit(lambda x: lax.bitcast_convert_type(x.astype(dt), _UINT[dt.itemsize]))


def lowprec_encode_fn(fmt_name: str, rounding: str, overflow: str):
    if rounding == "stochastic":
        return jax.jit(
            lambda x, k: lowprec.encode(x, fmt_name, rounding=rounding, overflow=overflow, key=k)
        )
    return jax.jit(lambda x: lowprec.encode(x, fmt_name, rounding=rounding, overflow=overflow))


def bit_check(fmt_name: str, x_np: np.ndarray, codes: np.ndarray, native_out) -> dict:
    """Default-mode codes vs ml_dtypes (and XLA native) bit for bit, NaN outputs as 'is NaN'."""
    dt = native_dtype(fmt_name)
    if dt is None and fmt_name != "tf32":  # MX INT8, P3109: the test suite's reference
        return {"reference": "none", "mismatches": 0}
    if dt is None and native_out is None:
        return {"reference": "none", "mismatches": 0}
    if dt is None:  # tf32: lax.reduce_precision is the reference (docs/design.md §2)
        ref = np.asarray(native_out).astype(np.uint32) >> 13
        ref_nan = np.isnan(np.asarray(native_out).view(np.float32))
        ours_nan = np.isnan((codes.astype(np.uint32) << 13).view(np.float32))
        bad = (ref != codes) & ~(ref_nan & ours_nan)
        return {"reference": "lax.reduce_precision", "mismatches": int(bad.sum())}
    ref = x_np.astype(dt)
    ref_codes = ref.view(_UINT[dt.itemsize])
    ours = codes.astype(ref_codes.dtype)
    nan_ref = np.isnan(ref.astype(np.float32))
    nan_ours = np.isnan(ours.view(dt).astype(np.float32))
    bad = (ours != ref_codes) & ~(nan_ref & nan_ours)
    out = {"reference": "ml_dtypes astype", "mismatches": int(bad.sum())}
    if lowprec.element_format(fmt_name).code_bits >= 8 and native_out is not None:
        nat = np.asarray(native_out).astype(ref_codes.dtype)
        nan_nat = np.isnan(nat.view(dt).astype(np.float32))
        out["xla_native_vs_ml_dtypes_mismatches"] = int(((nat != ref_codes) & ~(nan_ref & nan_nat)).sum())
    return out


def bench_format(fmt_name: str, n: int, reps: int, key, dist: str = "normal") -> tuple[list, dict]:
    dt = native_dtype(fmt_name)
    x_np = make_input(fmt_name, n, dist)
    x = jax.device_put(x_np)
    cases, encoders = {}, {}
    variants = [(m, "ieee") for m in MODES] + [("nearest_even", "saturate")]
    for rounding, overflow in variants:
        label = f"{rounding}/{overflow}" if rounding == "nearest_even" else rounding
        f = lowprec_encode_fn(fmt_name, rounding, overflow)
        encoders[label] = f
        cases[f"lowprec {label}"] = (lambda f=f: f(x, key)) if rounding == "stochastic" else (lambda f=f: f(x))
    native = native_encode_fn(fmt_name)
    if native is not None:
        cases["native encode"] = lambda: native(x)
    if dt is not None:
        cases["ml_dtypes encode"] = lambda: x_np.astype(dt)

    # Decode: codes from lowprec's default encode.
    codes = jax.block_until_ready(encoders[DEFAULT_MODE](x))
    codes_np = np.asarray(codes)
    dec = jax.jit(lambda c: lowprec.decode(c, fmt_name))
    cases["lowprec decode"] = lambda: dec(codes)
    if dt is not None:
        typed_np = codes_np.astype(_UINT[dt.itemsize]).view(dt)
        if not _no_xla(fmt_name):
            typed = jax.device_put(typed_np)
            native_dec = jax.jit(lambda c: c.astype(jnp.float32))
            cases["native decode"] = lambda: native_dec(typed)
        cases["ml_dtypes decode"] = lambda: typed_np.astype(np.float32)

    stream, stream_bytes = stream_case(4 * n)
    cases["stream"] = stream
    try:
        native_out = None if native is None else native(x)
    except Exception:  # noqa: BLE001 - no native cast here: the timing row says n/a
        native_out = None
    check = bit_check(fmt_name, x_np, codes_np, native_out)
    timings = time_interleaved(cases, reps=reps)
    stream_t = timings["stream"]
    cb = code_bytes(fmt_name)

    def row(mode, lp, nat, ml, xla_target, io_bytes):
        lp_t, nat_t, ml_t = timings[lp], timings.get(nat), timings.get(ml)
        default_t = timings[f"lowprec {DEFAULT_MODE}"]
        roof = (speed_ratio(lp_t, stream_t) * (n * io_bytes) / stream_bytes
                if isinstance(stream_t, Timing) else float("nan"))
        return _row(fmt_name, mode, rate(n, lp_t), rate(n, nat_t), rate(n, ml_t),
                    speed_ratio(lp_t, nat_t), speed_ratio(lp_t, ml_t), xla_target,
                    speed_ratio(lp_t, default_t) if lp != f"lowprec {DEFAULT_MODE}" and
                    mode != "decode" else float("nan"),
                    roof, lp_t)

    rows = []
    for rounding, overflow in variants:
        label = f"{rounding}/{overflow}" if rounding == "nearest_even" else rounding
        rows.append(row(label, f"lowprec {label}", "native encode", "ml_dtypes encode",
                        xla_target=(label == DEFAULT_MODE), io_bytes=4 + cb))
    rows.append(row("decode", "lowprec decode", "native decode", "ml_dtypes decode",
                    xla_target=True, io_bytes=4 + cb))
    raw = {name: (t.as_dict() if not isinstance(t, str) else t) for name, t in timings.items()}
    return rows, {"timings": raw, "bit_check": check}


def _row(fmt_name, mode, lp, nat, ml, r_nat, r_ml, xla_target, r_default, roof, lp_t):
    flags = []
    if xla_target and r_nat == r_nat and r_nat < XLA_TARGET:
        flags.append(f"MISS <{XLA_TARGET}x XLA")
    if mode == "stochastic" and r_default == r_default and r_default < STOCHASTIC_TARGET:
        flags.append(f"MISS <{STOCHASTIC_TARGET}x default")
    if r_ml == r_ml and r_ml < ML_DTYPES_TARGET:
        flags.append(f"MISS <{ML_DTYPES_TARGET:g}x ml_dtypes")
    return {
        "format": fmt_name,
        "mode": mode,
        "lowprec_melem_s": lp / 1e6,
        "xla_native_melem_s": nat / 1e6,
        "ml_dtypes_melem_s": ml / 1e6,
        "ratio_lowprec_xla": r_nat,
        "ratio_lowprec_ml_dtypes": r_ml,
        "ratio_to_default_mode": r_default,
        "roofline_fraction": roof,
        "minor_faults_per_call": lp_t.faults_per_call if isinstance(lp_t, Timing) else None,
        "faults_cell": fmt_faults(lp_t),
        "xla_target_applies": xla_target,
        "flags": flags,
    }


HEADERS = ["format", "mode", "lowprec Melem/s", "XLA native Melem/s", "ml_dtypes Melem/s",
           "lowprec/XLA", "lowprec/ml_dtypes", "x default", "roof", "faults", "flag"]


def table(rows) -> str:
    body = [
        [
            r["format"],
            r["mode"],
            fmt_num(r["lowprec_melem_s"], 0),
            fmt_num(r["xla_native_melem_s"], 0),
            fmt_num(r["ml_dtypes_melem_s"], 0),
            fmt_ratio(r["ratio_lowprec_xla"]) + ("" if r["xla_target_applies"] else "*"),
            fmt_ratio(r["ratio_lowprec_ml_dtypes"]),
            "" if r["ratio_to_default_mode"] != r["ratio_to_default_mode"]
            else fmt_ratio(r["ratio_to_default_mode"]),
            fmt_num(100 * r["roofline_fraction"], 0) + "%",
            r["faults_cell"],
            "; ".join(r["flags"]) or "ok",
        ]
        for r in rows
    ]
    return render_table(HEADERS, body, right=(2, 3, 4, 5, 6, 7, 8, 9))


FOOTNOTE = (
    "* XLA and ml_dtypes only round to nearest-even: the peer columns of the other modes "
    "repeat the format's RNE cast; the {xla}x-of-XLA target applies to the default mode "
    "({mode}) and decode, the {sto}x-of-default target to stochastic (random words included), "
    "the {ml:g}x-of-ml_dtypes target to every row. x default: throughput over the format's "
    "default mode in the same rounds. roof: lowprec's bytes moved per second over a streaming "
    "kernel's (uint32 x ^ c, same input size). faults: minor page faults per call (median)."
).format(xla=XLA_TARGET, mode=DEFAULT_MODE, sto=STOCHASTIC_TARGET, ml=ML_DTYPES_TARGET)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=None,
                   help="elements (default 2**22 on CPU, 2**26 on GPU; 2**18 / 2**22 with --quick)")
    p.add_argument("--quick", action="store_true", help="2^18 elements and 5 rounds")
    p.add_argument("--reps", type=int, default=None, help="interleaved rounds (default 9; 5 with --quick)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--dist", choices=("normal", "wide"), default="normal",
                   help="input values (see the module docstring); default normal")
    p.add_argument("--json", metavar="PATH", help="write every timing and the table rows here")
    p.add_argument("--markdown", metavar="PATH", help="write the table (Markdown) here")
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    n = args.size or ((2**22 if on_gpu else 2**18) if args.quick else (2**26 if on_gpu else 2**22))
    reps = args.reps or (5 if args.quick else 9)
    env = environment()
    title = (f"`python benchmarks/bench_codec.py` ({n:,} float32 elements, {args.dist}, "
             f"{reps} interleaved rounds, medians)")
    print(title + "\n" + header_line(env), flush=True)
    key = jax.random.key(0)
    rows, details = [], {}
    for fmt_name in args.formats:
        r, d = bench_format(fmt_name, n, reps, key, args.dist)
        rows += r
        details[fmt_name] = d
        print(f"  {fmt_name}: done (default-mode bit check vs {d['bit_check']['reference']}: "
              f"{d['bit_check']['mismatches']} mismatches)", flush=True)
    misses = [r for r in rows if r["flags"]]
    text = "\n".join([table(rows), "", FOOTNOTE, f"{len(misses)} of {len(rows)} rows miss a target."])
    print()
    print(text)
    if args.markdown:
        write_atomic(args.markdown, f"{title}\n\n{header_line(env)}\n\n{text}\n")
    if args.json:
        payload = {"benchmark": "codec", "size": n, "reps": reps, "dist": args.dist,
                   "env": env, "rows": rows, "details": details}
        write_atomic(args.json, json.dumps(json_safe(payload), indent=1))
        print(f"saved {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
