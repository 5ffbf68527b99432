"""lowprec in one minute: element formats, rounding modes, MX block quantization.

Run: python examples/quickstart.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import lowprec
import lowprec.analysis


def main() -> None:
    print(f"lowprec {lowprec.__version__}, JAX {jax.__version__} on {jax.devices()[0].platform}\n")

    print("Element formats (from formats/elements.json):")
    print(f"  {'name':6} {'bits':>4} {'max finite':>12} {'min normal':>11} {'min subnormal':>13} {'eps':>9}")
    for name in lowprec.ELEMENT_FORMAT_NAMES:
        f = lowprec.element_format(name)
        print(
            f"  {name:6} {f.code_bits:>4} {f.max_finite:>12.5g} {f.min_normal:>11.4g} "
            f"{f.min_subnormal:>13.4g} {f.eps:>9.4g}"
        )

    x = jnp.array([0.1, 1.0 / 3.0, 300.0, 464.0, 500.0, -1e-3], jnp.float32)
    print(f"\nx = {np.asarray(x).tolist()}")
    for rounding in ("nearest_even", "toward_zero", "up", "down"):
        for overflow in ("ieee", "saturate"):
            q = lowprec.quantize(x, "e4m3", rounding=rounding, overflow=overflow)
            print(f"  e4m3 {rounding:>12} {overflow:>8}: {np.asarray(q).tolist()}")
    key = jax.random.key(0)
    q = lowprec.quantize(jnp.full((100_000,), 0.1), "e4m3", rounding="stochastic", key=key)
    print(f"  e4m3 stochastic mean of 100000 copies of 0.1: {float(q.mean()):.6f}")

    w = jax.random.normal(jax.random.key(1), (256, 1024), jnp.float32)

    def report(label, mx):
        sqnr = float(lowprec.analysis.sqnr_db(w, lowprec.dequantize(mx)))
        print(f"  {label:17}: {mx.nbytes:>7} bytes ({mx.fmt.bits_per_element} bits/elem), SQNR {sqnr:5.1f} dB")

    print("\nMX block quantization of a 256x1024 Gaussian matrix (blocks along the last axis):")
    # The OCP MX v1.0 formats (blocks of 32, E8M0 scales) and NVFP4 (blocks of 16, E4M3 scales
    # under a float32 tensor scale), each with its default scales.
    for fmt in ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8", "nvfp4"):
        report(fmt, lowprec.quantize_mx(w, fmt))
    # An OCP MX format takes a scale rule: how the shared exponent follows from the block max.
    for rule in lowprec.ScaleRule:
        report(f"mxfp4 {rule.value}", lowprec.quantize_mx(w, "mxfp4", scale_rule=rule))
    shown = {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4", "mxint8", "nvfp4"}
    more = [f for f in lowprec.MX_FORMAT_NAMES if f not in shown]
    print(f"  more block formats: {', '.join(more)} (notebooks/08_four_bit_2026.ipynb compares the 4-bit ones)")

if __name__ == "__main__":
    main()
