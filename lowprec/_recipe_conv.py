"""A convolution in a :class:`~lowprec.Recipe`: the recipe's dot over the input's patches.

A convolution is a matmul whose contraction is input features x window. Written as one
(im2col): ``out[n, p, o] = sum_k patches[n, p, k] * kernel[k, o]`` with ``k`` running over the
window positions and, innermost, the input features (the order of an NHWC implicit GEMM's K).
:func:`recipe_conv_general_dilated` forms the patches exactly (a copy of input values, zeros
where padded) and runs :meth:`Recipe.dot_general` on them and the flattened kernel, so a conv
is quantized exactly as a linear layer: MX/NVFP4 blocks along that contraction (within one
window position when the input features are a multiple of the block), per-tensor scales over
the whole tensor, and the recipe's backward products (the patches' gradient is folded back onto
the input by the patches' own transpose, a sum of exact copies). qwix quantizes a conv with one
scale per output channel and per example (its subchannel tiling is refused for convs); blocks
along the flattened contraction are the recipe's own scheme, stated here.

Grouped convolutions (``feature_group_count``/``batch_group_count`` > 1) are refused: their
contraction is per group, which this statement does not cover.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

__all__ = ["recipe_conv_general_dilated"]


def recipe_conv_general_dilated(recipe, lhs, rhs, window_strides, padding, lhs_dilation=None,
                                rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                                batch_group_count=1, precision=None, preferred_element_type=None,
                                out_sharding=None):
    """``lax.conv_general_dilated`` with ``recipe``'s products (forward and backward).

    Args:
      recipe: a :class:`~lowprec.Recipe`.
      lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers:
        as for :func:`jax.lax.conv_general_dilated`.
      feature_group_count, batch_group_count: must be 1.
      precision: ignored, as by :meth:`Recipe.dot_general`.
      preferred_element_type: output dtype (default: the operands' promoted dtype).
      out_sharding: not supported (None).

    Returns:
      The convolution, laid out as ``dimension_numbers`` says.

    Example:
        >>> import jax.numpy as jnp, lowprec
        >>> x, k = jnp.ones((1, 5, 32)), jnp.full((3, 32, 4), 0.25)   # NWC, WIO
        >>> y = recipe_conv_general_dilated(lowprec.NVIDIA_MXFP8, x, k, (1,), "VALID",
        ...                                 dimension_numbers=("NWC", "WIO", "NWC"))
        >>> y.shape, float(y[0, 0, 0])
        ((1, 3, 4), 24.0)
    """
    if feature_group_count != 1 or batch_group_count != 1:
        raise ValueError(
            f"a recipe convolution needs feature_group_count=1 and batch_group_count=1 (got "
            f"{feature_group_count}, {batch_group_count}): a grouped conv contracts per group, "
            "which the recipe's single product does not state; keep the layer in its own "
            "precision (a rule with recipe None, or high_precision)")
    if out_sharding is not None:
        raise ValueError("a recipe convolution does not take out_sharding; shard its input instead")
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    nsp = lhs.ndim - 2
    # Kernel as (window..., in, out), flattened to [window * in, out]: in innermost.
    kernel = jnp.transpose(rhs, (*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0]))
    window = kernel.shape[:nsp]
    c_in, c_out = kernel.shape[nsp], kernel.shape[nsp + 1]
    wsize = math.prod(window)
    # Patches in the output layout, features = C * window, C-major (JAX's order); HIGHEST
    # keeps the one-hot copy exact where TF32 would round. Then (N, spatial_out..., C * window).
    patches = lax.conv_general_dilated_patches(
        lhs, window, window_strides, padding, lhs_dilation=lhs_dilation,
        rhs_dilation=rhs_dilation, dimension_numbers=dimension_numbers,
        precision=lax.Precision.HIGHEST)
    src = (dn.out_spec[0], *dn.out_spec[2:], dn.out_spec[1])
    patches = jnp.transpose(patches, src)
    lead = patches.shape[:-1]
    patches = patches.reshape(*lead, c_in, wsize)
    patches = jnp.swapaxes(patches, -1, -2).reshape(*lead, wsize * c_in)
    w = kernel.reshape(wsize * c_in, c_out)
    out = recipe.dot_general(patches, w, (((patches.ndim - 1,), (0,)), ((), ())),
                             preferred_element_type=preferred_element_type)
    # (N, spatial_out..., O) -> the output layout.
    inv = [0] * out.ndim
    for i, d in enumerate(src):
        inv[d] = i
    return jnp.transpose(out, inv)

