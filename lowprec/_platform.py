"""Per-platform formulations without tracing the ones that cannot run: lowprec's one
replacement for ``lax.platform_dependent``.

``lax.platform_dependent`` traces every branch it is given (a C++ kernel call *and* the whole
portable XLA formulation beside it) and lowers one per platform. Where JAX here compiles
for CPU alone (no GPU or TPU plugin installed: :func:`other_platforms_possible`), a program
can only be lowered for CPU, so :func:`platform_dependent` traces the CPU branch alone; it
was about half of an NVFP4 training step's trace time (benchmarks/README.md, "The training
step on CPU"). Such a program is marked CPU-only (:data:`cpu_only_p`, an identity on the
branch's outputs that lowers to nothing on CPU) so that lowering it for another platform
(``jax.export(..., platforms=...)``, ``.lower(lowering_platforms=...)``) fails with an
error naming the fix, ``lowprec.kernels.policy(platform_branches="all")``, rather than
running a CPU formulation (XLA:CPU's correctly rounded division, a CPU custom call) where
it gives other bits or does not exist. With the CUDA plugin installed (compile-only GPU
work, a GPU machine) every branch is traced as before.
"""

from __future__ import annotations

import functools
import importlib.util
import pkgutil

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

#: The platforms ``lax.platform_dependent`` takes branches for here.
_BRANCHES = ("cpu", "cuda", "rocm", "tpu")


@functools.lru_cache(maxsize=None)
def _plugin_installed() -> bool:
    """Whether an accelerator plugin is importable here: any ``jax_plugins`` module (each is
    a PJRT plugin for a platform other than CPU: CUDA, ROCm, ...; any version) or libtpu.
    Found without importing them."""
    try:
        plugins = importlib.util.find_spec("jax_plugins")
        if plugins is not None and any(
                pkgutil.iter_modules(plugins.submodule_search_locations or [])):
            return True
        return importlib.util.find_spec("libtpu") is not None
    except (ImportError, ValueError):
        return False


# Set by kernels/_dispatch.py, which sits above this module (no import cycle): whether its
# policy or JAX here (a GPU, the CUDA plugin) lets a program be lowered beyond CPU.
_policy_allows_others = None


def set_policy_reader(reader) -> None:
    """Gives :func:`other_platforms_possible` the kernel policy's answer (a function of no
    arguments, read while tracing: ``Policy.platform_branches == "all"``, or JAX can compile
    for CUDA); ``kernels/_dispatch.py`` calls it when it loads."""
    global _policy_allows_others
    _policy_allows_others = reader


def other_platforms_possible() -> bool:
    """Whether a program traced here may be lowered for a platform other than CPU (read while
    tracing): the policy's ``platform_branches`` is ``"all"``, or JAX here can compile for
    CUDA (``kernels._dispatch.cuda_kernels_possible``: a GPU, or the CUDA plugin for
    compile-only work), or any accelerator plugin (``jax_plugins``, libtpu) is installed; also before the dispatch
    module has loaded (every branch, as ``lax.platform_dependent`` traces them)."""
    reader = _policy_allows_others
    return reader is None or reader() or _plugin_installed()


def _refuse(ctx, *args, **params):
    platforms = ", ".join(repr(p) for p in ctx.module_context.platforms)
    raise ValueError(
        f"this program was traced by lowprec for CPU alone and is being lowered for {platforms}: "
        "JAX here compiles for no other platform (no GPU or TPU plugin installed), so lowprec "
        "traced only its CPU formulations (kernels and float arithmetic exact on XLA:CPU alone), "
        "not lax.platform_dependent's branch for every platform. To lower for other platforms "
        "(jax.export(..., platforms=...), lower(lowering_platforms=...)), trace the program "
        "inside `with lowprec.kernels.policy(platform_branches=\"all\"):` (or call "
        "lowprec.kernels.set_policy(platform_branches=\"all\") first)")


#: Identity on the outputs of a CPU branch taken without ``lax.platform_dependent``: lowers
#: to nothing on CPU, and refuses to lower for any other platform (:func:`_refuse`).
cpu_only_p = Primitive("lowprec_cpu_only")
cpu_only_p.multiple_results = True
cpu_only_p.def_impl(lambda *xs: xs)
cpu_only_p.def_abstract_eval(lambda *avals: avals)
mlir.register_lowering(cpu_only_p, lambda ctx, *xs: xs, platform="cpu")
mlir.register_lowering(cpu_only_p, _refuse)
batching.primitive_batchers[cpu_only_p] = lambda xs, dims: (cpu_only_p.bind(*xs), dims)


def _jvp(primals, tangents):
    # The tangents pass through unmarked: they are whatever the branch's derivative computes,
    # whose own CPU-only parts carry their own marks.
    return cpu_only_p.bind(*primals), list(tangents)


ad.primitive_jvps[cpu_only_p] = _jvp


def cpu_only(tree):
    """``tree`` (arrays) marked as computed by a CPU-only formulation: the same values."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    return jax.tree.unflatten(treedef, cpu_only_p.bind(*leaves))


def platform_dependent(*args, default, **branches):
    """``lax.platform_dependent(*args, default=default, **branches)`` (branches named by
    platform: ``cpu``, ``cuda``, ...), except where no platform but CPU can lower the program
    (:func:`other_platforms_possible` false): then the CPU branch (else ``default``) alone is
    traced and its outputs marked CPU-only (:func:`cpu_only`)."""
    unknown = set(branches) - set(_BRANCHES)
    if unknown:
        raise TypeError(f"unknown platform branch {sorted(unknown)}; valid: {_BRANCHES}")
    if other_platforms_possible():
        return lax.platform_dependent(*args, default=default, **branches)
    return cpu_only(branches.get("cpu", default)(*args))
