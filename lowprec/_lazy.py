"""A module imported on first use, for the modules the checkpoint command line shares with
the JAX code: their JAX functions import JAX when they first run, not when the module loads.

``lowprec quantize`` on its native path (NumPy and the C passes of ``kernels/_ckpt_cpu.cc``)
calls no JAX function, yet reads formats, scale rules and rounding modes from modules that
define JAX functions beside them; importing JAX (1.1-1.5 CPU s) was 15-20% of a bfloat16
checkpoint command. ``importlib.util.LazyLoader`` does not serve: finding ``jax.numpy``
imports ``jax``.

Example:
    >>> from lowprec._lazy import lazy_module
    >>> fractions = lazy_module("fractions")
    >>> fractions.Fraction(1, 2)
    Fraction(1, 2)
"""

from __future__ import annotations

import functools
import importlib
import types


class _LazyModule(types.ModuleType):
    def __getattr__(self, attr):
        module = importlib.import_module(self.__name__)
        value = getattr(module, attr)
        setattr(self, attr, value)  # later reads skip this method
        return value


def lazy_module(name: str) -> types.ModuleType:
    """A stand-in for module ``name`` that imports it at its first attribute read and then
    reads through to it (``jnp = lazy_module("jax.numpy")`` in place of ``import jax.numpy as
    jnp``)."""
    return _LazyModule(name)


def resolve_public(package: str, public: dict, namespace: dict, name: str):
    """A package's public object ``name`` (PEP 562 ``__getattr__``), imported from the
    submodule ``public`` names for it (``"_module"``, or ``("_module", "attribute")`` where
    the names differ) and kept in the package's ``namespace`` (its ``globals()``), so this runs
    once per name. Raises AttributeError for a name ``public`` lacks."""
    if name not in public:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    where = public[name]
    module, attr = (where, name) if isinstance(where, str) else where
    value = getattr(importlib.import_module(f"{package}.{module}"), attr)
    namespace[name] = value
    return value


def jit_on_first_call(**options):
    """``functools.partial(jax.jit, **options)`` as a decorator that imports JAX and builds
    the jitted function at its first call, not at the module's import."""

    def wrap(fun):
        jitted = []

        @functools.wraps(fun)
        def call(*args, **kwargs):
            if not jitted:
                import jax  # noqa: PLC0415 - the point: JAX on first use

                jitted.append(jax.jit(fun, **options))
            return jitted[0](*args, **kwargs)

        return call

    return wrap
