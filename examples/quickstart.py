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
    print("\nMX block quantization of a 256x1024 Gaussian matrix (blocks of 32 along the last axis):")
    for fmt in lowprec.MX_FORMAT_NAMES:
        # NVFP4 has its own scale recipe (E4M3 block scales under a tensor scale): no rule.
        rules = (None,) if lowprec.mx_format(fmt).tensor_scale else tuple(lowprec.ScaleRule)
        for rule in rules:
            mx = lowprec.quantize_mx(w, fmt, scale_rule=rule)
            sqnr = float(lowprec.analysis.sqnr_db(w, lowprec.dequantize(mx)))
            print(
                f"  {fmt:11} {rule or fmt:5}: {mx.nbytes:>7} bytes ({mx.fmt.bits_per_element} bits/elem), "
                f"SQNR {sqnr:5.1f} dB"
            )


if __name__ == "__main__":
    main()
