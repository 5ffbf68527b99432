"""The suite compiles with XLA:CPU's cheapest code generation: backend optimization level 0
and the classic elemental emitters instead of the MLIR fusion emitters.

Compiling dominates the suite's CPU time (thousands of small programs, each run a few times;
84% of the in-process CPU seconds in a profiled run were JAX's trace, lowering and XLA
compile events), and most of a CPU compile is code generation for a program the test then
runs once. Measured on this project's machine:

* Level 0: a file's CPU seconds fell by 24% (tests/test_mx.py: 56.7 -> 43.0 s) and a
  notebook's by 10% (03_mx_block_scaling, whose arrays are larger).
* ``--xla_cpu_use_fusion_emitters=false`` on top: XLA's backend compile of 34
  representative programs (every element format's quantize, every MX format's
  quantize-dequantize, the MXFP8 and NVFP4 recipes' gradients) fell from 26.3-28.8 to
  15.7 CPU s (-45%); tests/test_mx.py from 44-49 to 33-42 CPU s.

The bits do not depend on either: XLA:CPU emits float operations without fast-math flags,
so LLVM may not reassociate, contract into FMAs or otherwise change a float result at any
level, and both emitters lower an HLO operation to the same arithmetic; integer code (the
encoders' bit manipulation) has one meaning; flushing of subnormals is a runtime setting,
not a compile one. ``tests/test_xla_opt_level.py`` checks this on the library's paths
(element and block quantizers, stochastic rounding, the MX matmul): the same bits with XLA's
default flags in a subprocess as with the suite's flags here.

The flags are XLA-wide, so they are left alone where a GPU backend is installed (a
``jax_plugins`` CUDA or ROCm plugin: a GPU machine, or CI's compile-only GPU checks, which
read the optimized PTX's instructions and register spills). ``LOWPREC_TEST_XLA_OPT=default``
compiles with XLA's defaults instead (``=N``: level N, with the classic emitters); a flag
already in ``XLA_FLAGS`` is kept as it is. An emitter flag this jaxlib does not know (XLA
aborts on unknown flags) is left out, found by a one-off probe in a subprocess. Set in
``os.environ`` before JAX starts its backend, so every worker and subprocess (CLI runs, the
sharding subprocess, notebook kernels) inherits them.
"""

from __future__ import annotations

import hashlib
import os

ENV = "LOWPREC_TEST_XLA_OPT"
FLAG = "--xla_backend_optimization_level"
#: The classic elemental emitters: about half the backend compile time of the MLIR ones.
EMITTERS = "--xla_cpu_use_fusion_emitters"


def gpu_plugin_installed() -> bool:
    """Whether a JAX GPU plugin (``jax_plugins.xla_cuda12``, ``xla_cuda13``, ``xla_rocm*``)
    is installed; found without importing it."""
    import importlib.util
    import pkgutil

    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(m.name.startswith(("xla_cuda", "xla_rocm"))
               for m in pkgutil.iter_modules(spec.submodule_search_locations))


def apply(environ=os.environ, gpu: bool | None = None, known=None) -> None:
    """Adds ``--xla_backend_optimization_level`` (0 unless ``LOWPREC_TEST_XLA_OPT`` says
    otherwise) and ``--xla_cpu_use_fusion_emitters=false`` to ``XLA_FLAGS``, unless a GPU
    plugin is installed (``gpu``: whether one is; looked up when None) and the level was not
    asked for. ``known(flag)`` says whether this jaxlib accepts a flag (default: a probe)."""
    level = environ.get(ENV)
    flags = environ.get("XLA_FLAGS", "")
    if level is None:
        if gpu_plugin_installed() if gpu is None else gpu:
            return
        level = "0"
    if level == "default":
        return
    if not level.isdigit():
        raise ValueError(f"{ENV}={level!r}: give an XLA backend optimization level (0-3) "
                         "or 'default'")
    if FLAG not in flags:
        flags = f"{flags} {FLAG}={level}".strip()
    emitters = f"{EMITTERS}=false"
    if EMITTERS not in flags and (known or flag_known)(emitters):
        flags = f"{flags} {emitters}"
    environ["XLA_FLAGS"] = flags


def flag_known(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` (a subprocess starts JAX's CPU backend with
    it: XLA aborts the process on a flag it does not know)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                              env=env, capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def without_flag(flags: str) -> str:
    """``XLA_FLAGS`` without the suite's compile flags (XLA's defaults)."""
    return " ".join(f for f in flags.split() if not f.startswith((FLAG, EMITTERS)))


def digest() -> str:
    """SHA-256 of the bits a representative set of the library's programs produce, jitted:
    element quantize (nearest and stochastic) of adversarial inputs of an 8-bit and a 4-bit
    format, block quantize and dequantize of MXFP8, MXFP4 and NVFP4 (three scale rules, the
    two-level scales), stochastic block rounding, and the MX matmul."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import lowprec
    from helpers.inputs import adversarial_float32

    h = hashlib.sha256()

    def add(*arrays):
        for a in jax.tree.leaves(arrays):
            h.update(np.asarray(a).tobytes())

    key = jax.random.key(7)
    for fmt in ("e4m3", "e2m1"):
        x = jnp.asarray(adversarial_float32(fmt))
        add(jax.jit(lambda v, f=fmt: lowprec.quantize(v, f))(x))
        add(jax.jit(lambda v, k, f=fmt: lowprec.quantize(v, f, rounding="stochastic", key=k))(
            x, key))
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 8, 64)) * np.exp2(rng.integers(-30, 30, (4, 8, 1)))).astype(
        np.float32)
    x[0, 0, :3] = (np.nan, np.inf, -0.0)
    x = jnp.asarray(x)
    for fmt, rule in (("mxfp8_e4m3", "rceil"), ("mxfp4", "floor"), ("nvfp4", None)):
        mx = jax.jit(lambda v, f=fmt, r=rule: lowprec.quantize_mx(v, f, scale_rule=r))(x)
        add(mx.scales, mx.tensor_scale, jax.jit(lowprec.dequantize)(mx))
    add(jax.jit(lambda v, k: lowprec.fake_quantize_mx(v, "mxfp4", rounding="stochastic", key=k))(
        x, key))
    w = jnp.asarray(rng.standard_normal((64, 32)).astype(np.float32))
    add(jax.jit(lambda a, b: lowprec.matmul(a, b, lhs_format="mxfp8_e4m3",
                                            rhs_format="mxfp8_e4m3"))(x[1:], w))
    return h.hexdigest()
