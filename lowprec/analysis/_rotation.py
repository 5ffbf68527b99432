"""Random Hadamard rotations for error studies.

A random Hadamard transform (RHT) multiplies blocks of n consecutive elements by
M = H_n · diag(s) / √n (H_n the Sylvester Hadamard matrix, s a random ±1 vector): M is
orthogonal, so a rotated matmul gives the same product, (M x)ᵀ (M w) = xᵀ w, while an outlier
is spread over its block before the block is quantized. NVIDIA's NVFP4 recipe rotates the
weight-gradient operands in blocks of 16 (lowprec's ``_nvfp4_train.rht``, reused here);
MR-GPTQ, Quartet and Chen et al. 2025 ("INT v.s. FP", arXiv 2510.25602) rotate in blocks of
the quantization group (16 or 32). :func:`random_hadamard` applies it along any axis, in
blocks of any power of two.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._blocks import normalize_axis
from .._nvfp4_train import rht, rht_signs
from ._common import as_f32


def random_hadamard(x, block: int = 16, *, seed: int = 0, axis: int = -1,
                    inverse: bool = False):
    """``x`` rotated along ``axis`` by a random Hadamard transform in blocks of ``block``.

    Each run of ``block`` consecutive elements along ``axis`` is multiplied by
    M = H · diag(s) / √block, with H the Sylvester Hadamard matrix and s the ±1 signs of
    ``seed`` (``_nvfp4_train.rht_signs``: for ``block=16`` exactly the rotation of lowprec's
    NVFP4 training recipe, ``Recipe(wgrad_rht=True, seed=seed)``). M is orthogonal: the
    quantization error of the rotated tensor, ‖Q(M x) − M x‖, is that of the rotated
    product, and ``inverse=True`` applies Mᵀ (so ``random_hadamard(random_hadamard(x),
    inverse=True)`` gives x back up to float32 rounding). Every step is one float32
    operation per element (the butterfly of ``_nvfp4_train.rht``; the factor 1/√block is
    1/4 exactly for 16, 1/√32 rounded to float32 for 32).

    Args:
      x: a floating-point array.
      block: the rotation's size, a power of two (16 and 32: the NVFP4 and MX block sizes);
        ``x.shape[axis]`` must be a multiple of it.
      seed: seed of the signs.
      axis: the axis rotated (the quantization's block axis).
      inverse: apply Mᵀ = diag(s) · H / √block instead.

    Returns:
      A float32 JAX array of ``x``'s shape.

    Example:
        >>> import numpy as np
        >>> x = np.zeros((2, 32), np.float32); x[0, 3] = 8.0        # one outlier
        >>> y = np.asarray(random_hadamard(x, 16))
        >>> sorted(set(np.abs(y[0, :16]).tolist())), float(np.abs(y[0, 16:]).max())
        ([2.0], 0.0)
        >>> bool(np.allclose(random_hadamard(y, 16, inverse=True), x))
        True
    """
    x = as_f32(x)
    block = int(block)
    if block < 2 or block & (block - 1):
        raise ValueError(f"block must be a power of two of at least 2, got {block}")
    ax = normalize_axis(axis, x.ndim)
    if x.shape[ax] % block:
        raise ValueError(
            f"axis {axis} has length {x.shape[ax]}, not a multiple of the rotation's block "
            f"{block}; pad it or pick another block"
        )
    v = jnp.moveaxis(x, ax, 0)
    shape = v.shape
    v = v.reshape(shape[0], -1)
    signs = rht_signs(seed, block)
    if inverse:   # Mᵀ = diag(s) H / √n: H is symmetric
        out = rht(v, jnp.ones((block,), jnp.float32)) * jnp.tile(signs, shape[0] // block)[:, None]
    else:
        out = rht(v, signs)
    return jnp.moveaxis(out.reshape(shape), 0, ax)
