"""Tracing lowprec's CUDA-only kernel branches on a machine that cannot compile for CUDA."""

from __future__ import annotations

import jax
import pytest

from lowprec.kernels import _dispatch


@pytest.fixture
def cuda_branches(monkeypatch):
    """Makes lowprec trace its CUDA-only Pallas branches even where JAX cannot compile for
    CUDA (no plugin: CI), so that lowering for "cuda" shows them; caches cleared around.
    (Import it into a test module to use it there.)"""
    jax.clear_caches()
    monkeypatch.setattr(_dispatch, "cuda_kernels_possible", lambda: True)
    yield
    jax.clear_caches()


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO text of ``jax.jit(fn)`` lowered for the "cuda" platform (no GPU needed)."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
