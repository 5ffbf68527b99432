"""The suite compiles with XLA:CPU's backend optimization level 0.

Compiling dominates the suite's CPU time (thousands of small programs, each run a few times),
and most of a CPU compile is LLVM optimizing machine code the test then runs once. At level 0
a file's CPU seconds fell by 24% (tests/test_mx.py: 56.7 -> 43.0 s, same process count) and a
notebook's by 10% (03_mx_block_scaling, whose arrays are larger), all passing.

The bits do not depend on it: XLA:CPU emits float operations without fast-math flags, so LLVM
may not reassociate, contract into FMAs or otherwise change a float result at any level,
and integer code (the encoders' bit manipulation) has one meaning; flushing of subnormals is
a runtime setting, not a compile one. ``tests/test_xla_opt_level.py`` checks this on the
library's paths (element and block quantizers, stochastic rounding, the MX matmul): the same bits at the default level in a subprocess as at level 0 here.

The level is an XLA-wide option, so it is left alone where a GPU backend is installed (a
``jax_plugins`` CUDA or ROCm plugin: a GPU machine, or CI's compile-only GPU checks, which
read the optimized PTX's instructions and register spills).
``LOWPREC_TEST_XLA_OPT=default`` compiles at XLA's default level instead (or ``=N`` at level
N); an ``--xla_backend_optimization_level`` already in ``XLA_FLAGS`` is kept as it is. Set in
``os.environ`` before JAX starts its backend, so every worker and subprocess (CLI runs, the
sharding subprocess, notebook kernels) inherits it.
"""

from __future__ import annotations

import hashlib
import os

ENV = "LOWPREC_TEST_XLA_OPT"
FLAG = "--xla_backend_optimization_level"


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


def apply(environ=os.environ, gpu: bool | None = None) -> None:
    """Adds ``--xla_backend_optimization_level`` (0 unless ``LOWPREC_TEST_XLA_OPT`` says
    otherwise) to ``XLA_FLAGS``, unless a GPU plugin is installed (``gpu``: whether one is;
    looked up when None) and the level was not asked for."""
    level = environ.get(ENV)
    flags = environ.get("XLA_FLAGS", "")
    if level is None:
        if gpu_plugin_installed() if gpu is None else gpu:
            return
        level = "0"
    if level == "default" or FLAG in flags:
        return
    if not level.isdigit():
        raise ValueError(f"{ENV}={level!r}: give an XLA backend optimization level (0-3) "
                         "or 'default'")
    environ["XLA_FLAGS"] = f"{flags} {FLAG}={level}".strip()


def without_flag(flags: str) -> str:
    """``XLA_FLAGS`` with the optimization level removed (XLA's default level)."""
    return " ".join(f for f in flags.split() if not f.startswith(FLAG))


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
