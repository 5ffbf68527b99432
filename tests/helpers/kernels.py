"""Tracing lowprec's CUDA-only kernel branches on a machine that cannot compile for CUDA."""

from __future__ import annotations

import contextlib

import jax
import pytest

import lowprec.kernels
from lowprec.kernels import _dispatch


# Programs traced while a fixture below has patched lowprec are kept apart by a JAX user
# context (part of every jit cache key, as lowprec's kernel policy is) instead of emptying
# JAX's caches around each such test, which made every later test of the worker compile its
# programs again. JAX without user contexts: the caches are emptied around, as before.
_PATCHED = jax.make_user_context(None) if hasattr(jax, "make_user_context") else None


@contextlib.contextmanager
def _traced_apart(name: str):
    if _PATCHED is None:
        jax.clear_caches()
        try:
            yield
        finally:
            jax.clear_caches()
        return
    with _PATCHED((_PATCHED.value, name)):  # nested fixtures: both names in the key
        yield


@pytest.fixture
def cuda_branches(monkeypatch):
    """Makes lowprec trace its CUDA-only Pallas branches even where JAX cannot compile for
    CUDA (no plugin: CI), so that lowering for "cuda" shows them; what it traces is cached
    apart. (Import it into a test module to use it there.)"""
    monkeypatch.setattr(_dispatch, "cuda_kernels_possible", lambda: True)
    with _traced_apart("cuda_branches"):
        yield


@pytest.fixture
def gpu_routes_on_cpu(monkeypatch):
    """Runs the quantized products' CUDA formulations (lowprec/_gpu_gemm.py: codes read as
    float8 for the FP8 GEMM, block values as bfloat16, tensor scales on the output) on this
    backend: the GPU GEMM routes are enabled as where JAX can compile for CUDA, and the
    products' ``on_cuda`` choices take their CUDA branch everywhere, so that XLA:CPU computes
    the GPU program's math (conversions exact, float32 sums); what it traces is cached apart.
    (Import it into a test module to use it there.)"""
    from lowprec import _delayed, _nvfp4_train, _qdot, _ragged

    monkeypatch.setattr(_dispatch, "cuda_kernels_possible", lambda: True)
    for module in (_qdot, _delayed, _nvfp4_train, _ragged):
        monkeypatch.setattr(module, "on_cuda", lambda gpu, portable, *args: gpu(*args))
    with _traced_apart("gpu_routes_on_cpu"):
        yield


@pytest.fixture
def fused_mxdot():
    """Turns on the fused MX dot kernel (off by default: ``Policy.fused_mxdot``), so that a
    test can check that it is taken and what it computes (``lowprec.kernels.policy``, which
    clears JAX's caches when the policy in force changes)."""
    with lowprec.kernels.policy(fused_mxdot=True):
        yield


# The GPU that a lowering for "cuda" targets where JAX sees none: JAX >= 0.11 asks Pallas'
# Triton lowering for the device's compute capability and refuses without a GPU unless an
# abstract mesh names one.
_TARGET_GPU = ("NVIDIA H100 80GB HBM3", 132)


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for the "cuda" platform (no GPU needed).

    Traced with every platform's branch (``policy(platform_branches="all")``): on an install
    that can only compile for CPU, lowprec traces the CPU branch alone and refuses to lower
    such a trace for another platform (lowprec/_platform.py)."""
    with lowprec.kernels.policy(platform_branches="all"):
        return _lower_for_cuda(fn, *args)


def _lower_for_cuda(fn, *args) -> str:
    traced = jax.jit(fn).trace(*args)
    try:
        return traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        if "abstract GPU device" not in str(e):
            raise
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    kind, cores = _TARGET_GPU
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=AbstractDevice(
        device_kind=kind, num_cores=cores, platform="gpu"))
    with use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
