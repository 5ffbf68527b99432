"""The suite compiles with XLA:CPU's backend optimization level 0 and its classic emitters.

Compiling dominates the suite's CPU time (thousands of small programs, each run a few times),
and most of a CPU compile is LLVM optimizing machine code the test then runs once. At level 0
a file's CPU seconds fell by 24% (tests/test_mx.py: 56.7 -> 43.0 s, same process count) and a
notebook's by 10% (03_mx_block_scaling, whose arrays are larger), all passing.

XLA:CPU also has two code generators for fused elementwise work: the MLIR "fusion emitters"
(its default) and the classic elemental IR emitter (``--xla_cpu_use_fusion_emitters=false``).
The classic one compiles a small program in about half the CPU time (51 of the library's
programs, level 0: 10.97 -> 5.43 CPU s of backend compile, same bits), so the suite uses it
where the running jaxlib accepts the flag (:func:`knows_flag`: an XLA flag it does not know
aborts the process, so a name found in jaxlib's libraries is confirmed by starting JAX with it
in a subprocess, once per run).

The bits do not depend on either: XLA:CPU emits float operations without fast-math flags, so
LLVM may not reassociate, contract into FMAs or otherwise change a float result at any level,
and integer code (the encoders' bit manipulation) has one meaning; flushing of subnormals is
a runtime setting, not a compile one. ``tests/test_xla_opt_level.py`` checks this on the
library's paths (element and block quantizers, stochastic rounding, the MX matmul): the same
bits with XLA's defaults (level and emitters) in a subprocess as with this run's flags here.

Neither flag is set where a GPU backend is installed (a ``jax_plugins`` CUDA or ROCm plugin: a
GPU machine, or CI's compile-only GPU checks, which read the optimized PTX's instructions and
register spills): the level is an XLA-wide option, and the plugin parses ``XLA_FLAGS`` with
its own copy of XLA. On an H200 with jax 0.11.2 every pytest worker died at start ("node down:
Not properly terminated") with the emitter flag set beside the CUDA 13 plugin.
``LOWPREC_TEST_XLA_OPT=default`` compiles with XLA's defaults instead (or ``=N`` at level
N); a ``--xla_backend_optimization_level`` or ``--xla_cpu_use_fusion_emitters`` already in
``XLA_FLAGS`` is kept as it is. Set in ``os.environ`` before JAX starts its backend, so every
worker and subprocess (CLI runs, the sharding subprocess, notebook kernels) inherits it.
"""

from __future__ import annotations

import hashlib
import os

ENV = "LOWPREC_TEST_XLA_OPT"
FLAG = "--xla_backend_optimization_level"
EMITTERS = "--xla_cpu_use_fusion_emitters"
# "1" or "0": whether this run's jaxlib accepts EMITTERS, set by the first apply() so that
# workers and subprocesses, which inherit it, do not probe again.
EMITTERS_KNOWN = "LOWPREC_TEST_XLA_EMITTERS"


def _package_folders(name: str) -> list:
    """The folders of the installed package ``name`` ([] if none), found without importing
    it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def gpu_plugin_installed() -> bool:
    """Whether a JAX GPU plugin (``jax_plugins.xla_cuda12``, ``xla_cuda13``, ``xla_rocm*``)
    is installed; found without importing it."""
    import pkgutil

    return any(m.name.startswith(("xla_cuda", "xla_rocm"))
               for m in pkgutil.iter_modules(_package_folders("jax_plugins")))


def knows_flag(name: str = EMITTERS) -> bool:
    """Whether the installed jaxlib's XLA accepts the boolean flag ``name``: its name appears
    in jaxlib's shared libraries (found without importing jaxlib, in ~0.05 s) and JAX starts
    with ``name=false`` in ``XLA_FLAGS`` (:func:`accepts`, ~1 s). A name alone is not proof:
    a flag XLA retired can live on as a string (a proto field, a message)."""
    return _in_libraries(name) and accepts(f"{name}=false")


def accepts(flags: str) -> bool:
    """Whether a Python with ``XLA_FLAGS=flags`` starts JAX's CPU backend (XLA aborts the
    process on a flag it does not know, which no ``try`` in this one could catch)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return probe.returncode == 0


def _in_libraries(name: str) -> bool:
    """Whether ``name`` (without its dashes) appears in one of jaxlib's shared libraries."""
    import mmap

    needle = name.lstrip("-").encode()
    for folder in _package_folders("jaxlib"):
        for path in sorted(os.listdir(folder)):
            if not path.endswith(".so"):
                continue
            with open(os.path.join(folder, path), "rb") as f:
                try:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                        if m.find(needle) >= 0:
                            return True
                except ValueError:  # an empty file
                    continue
    return False


def apply(environ=os.environ, gpu: bool | None = None, emitters_flag: bool | None = None) -> None:
    """Adds ``--xla_backend_optimization_level`` (0 unless ``LOWPREC_TEST_XLA_OPT`` says
    otherwise) to ``XLA_FLAGS``, unless a GPU plugin is installed (``gpu``: whether one is;
    looked up when None) and the level was not asked for; and, with no GPU plugin,
    ``--xla_cpu_use_fusion_emitters=false`` where jaxlib accepts that flag (``emitters_flag``:
    whether it does; probed once per run when None). ``LOWPREC_TEST_XLA_OPT=default`` adds
    neither."""
    level = environ.get(ENV)
    if level == "default":
        return
    if level is not None and not level.isdigit():
        raise ValueError(f"{ENV}={level!r}: give an XLA backend optimization level (0-3) "
                         "or 'default'")
    flags = environ.get("XLA_FLAGS", "").split()
    on_gpu = gpu_plugin_installed() if gpu is None else gpu
    if not any(f.startswith(FLAG) for f in flags):
        if level is not None or not on_gpu:
            flags.append(f"{FLAG}={level or 0}")
    if not on_gpu and not any(f.startswith(EMITTERS) for f in flags):
        if emitters_flag is None:
            if environ.get(EMITTERS_KNOWN) not in ("0", "1"):
                environ[EMITTERS_KNOWN] = "1" if knows_flag() else "0"
            emitters_flag = environ[EMITTERS_KNOWN] == "1"
        if emitters_flag:
            flags.append(f"{EMITTERS}=false")
    if flags:
        environ["XLA_FLAGS"] = " ".join(flags)


def without_flag(flags: str) -> str:
    """``XLA_FLAGS`` with the optimization level and the emitter choice removed (XLA's
    defaults, which users run)."""
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
