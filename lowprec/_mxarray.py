"""The block-quantized array: :class:`MXArray`, a JAX pytree of codes, and its leaf checks.

Its leaves are the element codes, the scale codes and (where the format's scale scheme has
one) a float32 tensor scale; its static metadata the format, the block axis, the logical
shape and the scale rule. It validates itself on construction (statically, so also under
``jit``); the scale scheme judges the tensor-scale leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._blocks import normalize_axis
from ._format import MXFormat, mx_format
from ._scale_rules import ScaleRule, check_scale_rule


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["elements", "scales", "tensor_scale"],
    meta_fields=["fmt", "axis", "shape", "scale_rule"],
)
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block-quantized array (a JAX pytree). Validates itself on construction.

    Attributes:
      elements: uint8 element codes with the (padded) input shape; sub-byte codes are packed
        along ``axis`` as a little-endian bit stream: FP4 two per byte (even element in the
        low nibble), so that axis is halved; FP6 four per three bytes (axis times 3/4).
        MXINT8 codes are two's-complement bytes.
      scales: uint8 scale codes of the format's scale scheme (E8M0; E4M3 for NVFP4), the
        input shape with ``axis`` divided by the block size. The scale format's NaN (0xFF;
        NVFP4: 0x7F) marks a block that held a NaN or an infinity (it dequantizes to NaN).
      fmt: the :class:`MXFormat` (static; a format name is resolved).
      axis: the block axis (static; a negative axis is normalized).
      shape: shape of the original, unpadded array (static).
      scale_rule: the :class:`~lowprec.ScaleRule` that chose the scales, or None if
        unknown or not applicable (NVFP4) (static).
      tensor_scale: the float32 scalar multiplying every block scale, for formats whose
        scale scheme has one (NVFP4); None otherwise.

    Construction checks (statically, so also under ``jit``) that both arrays are uint8 and
    that their shapes agree with ``shape``, ``axis``, the block size and the packing, and
    asks the format's scale scheme whether the tensor scale is valid (present exactly when
    the scheme has one; NVFP4's: a positive finite float32).
    Leading dimensions beyond ``shape`` are accepted when both arrays carry the same ones:
    they are the batch dimensions of an MXArray built under ``vmap`` (or stacked), which
    only ``vmap``/``scan`` over them may consume.

    Example:
        >>> import jax.numpy as jnp
        >>> MXArray(jnp.zeros((64,), jnp.uint8), jnp.zeros((2,), jnp.uint8), "mxfp8", 0, (64,))
        MXArray(elements=uint8[64], scales=uint8[2], fmt=MXFormat('mxfp8_e4m3'), axis=0, shape=(64,), scale_rule=None)
        >>> MXArray(jnp.zeros((32,), jnp.uint8), jnp.zeros((2,), jnp.uint8), "mxfp8", 0, (64,))
        Traceback (most recent call last):
        ...
        ValueError: MXArray: elements have shape (32,) but mxfp8_e4m3 over shape (64,) blocked along axis 0 needs (64,) (scales (2,))
    """

    elements: jax.Array
    scales: jax.Array
    fmt: MXFormat
    axis: int
    shape: tuple
    scale_rule: Optional[ScaleRule] = None
    tensor_scale: Optional[jax.Array] = None

    def __post_init__(self):
        fmt = self.fmt
        if isinstance(fmt, str):
            fmt = mx_format(fmt)
        if not isinstance(fmt, MXFormat):
            raise TypeError(f"MXArray fmt must be an MXFormat or its name, got {fmt!r}")
        try:
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise TypeError(f"MXArray shape must be a tuple of ints, got {self.shape!r}") from None
        if any(d < 0 for d in shape) or not shape:
            raise ValueError(f"MXArray shape must be a non-empty tuple of sizes, got {shape}")
        axis = normalize_axis(self.axis, len(shape), "MXArray axis")
        rule = None if self.scale_rule is None else check_scale_rule(self.scale_rule)
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axis", axis)
        object.__setattr__(self, "scale_rule", rule)
        # Leaves are arrays, tracers or ShapeDtypeStructs — or placeholders when JAX rebuilds
        # the pytree internally (e.g. vmap axis specs); only arrays are checked.
        if all(hasattr(v, "shape") and hasattr(v, "dtype") for v in (self.elements, self.scales)):
            _check_leaves(self.elements, self.scales, fmt, axis, shape)
            fmt.scheme.check_tensor_scale_leaf(self.tensor_scale, self.scales, fmt.name, shape)

    def __repr__(self) -> str:
        def leaf(v):
            if hasattr(v, "shape") and hasattr(v, "dtype"):
                return f"{np.dtype(v.dtype).name}{list(v.shape)}"
            return repr(v)

        rule = None if self.scale_rule is None else self.scale_rule.value
        ts = "" if self.tensor_scale is None else f", tensor_scale={leaf(self.tensor_scale)}"
        return (
            f"MXArray(elements={leaf(self.elements)}, scales={leaf(self.scales)}, "
            f"fmt={self.fmt!r}, axis={self.axis}, shape={self.shape}, scale_rule={rule!r}{ts})"
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def padded_length(self) -> int:
        """Length of the block axis after zero padding (a multiple of the block size)."""
        return -(-self.shape[self.axis] // self.fmt.block_size) * self.fmt.block_size

    def transpose(self, axes) -> "MXArray":
        """The array with its dimensions permuted as ``jnp.transpose(values, axes)`` would
        permute its values: codes and scales move together and the block axis goes where
        ``axes`` puts it. No code is re-encoded, so the result holds the same values.
        Leading batch dimensions (an MXArray built under ``vmap``) stay in front.

        Example:
            >>> import jax.numpy as jnp, lowprec
            >>> t = lowprec.quantize_mx(jnp.ones((2, 64)), "mxfp4", axis=1).transpose((1, 0))
            >>> t.shape, t.axis, t.elements.shape, t.scales.shape
            ((64, 2), 0, (32, 2), (2, 2))
        """
        nd = self.ndim
        try:
            axes = tuple(normalize_axis(a, nd, "MXArray.transpose axes") for a in axes)
        except TypeError:
            raise TypeError(f"MXArray.transpose: axes must be a sequence of {nd} ints, "
                            f"got {axes!r}") from None
        if sorted(axes) != list(range(nd)):
            raise ValueError(f"MXArray.transpose: axes {axes} are not a permutation of "
                             f"range({nd}) (one entry per dimension of shape {self.shape})")

        def move(v):
            lead = v.ndim - nd  # vmap's batch dimensions stay in front
            return jnp.transpose(v, tuple(range(lead)) + tuple(lead + a for a in axes))

        return MXArray(move(self.elements), move(self.scales), self.fmt, axes.index(self.axis),
                       tuple(self.shape[a] for a in axes), self.scale_rule, self.tensor_scale)

    @property
    def nbytes(self) -> int:
        """Bytes of storage (elements + scales, + 4 for a float32 tensor scale)."""
        extra = 0 if self.tensor_scale is None else 4 * int(np.prod(self.tensor_scale.shape))
        return int(np.prod(self.elements.shape)) + int(np.prod(self.scales.shape)) + extra


def _check_leaves(elements, scales, fmt: MXFormat, axis: int, shape: tuple) -> None:
    for what, v in (("elements", elements), ("scales", scales)):
        if np.dtype(v.dtype) != np.uint8:
            raise TypeError(
                f"MXArray {what} must be uint8 codes, got dtype {np.dtype(v.dtype)}"
                + (f" ({fmt.scheme.scale.name.upper()} scale codes, one byte each)"
                   if what == "scales" else "")
            )
    el, sc = tuple(elements.shape), tuple(scales.shape)
    nd = len(shape)
    blocks = -(-shape[axis] // fmt.block_size)
    want_sc = shape[:axis] + (blocks,) + shape[axis + 1 :]
    want_el = shape[:axis] + (blocks * fmt.bytes_per_block,) + shape[axis + 1 :]
    ok = len(el) == len(sc) >= nd and el[: len(el) - nd] == sc[: len(sc) - nd]
    if not ok or sc[len(sc) - nd :] != want_sc:
        raise ValueError(
            f"MXArray: scales have shape {sc} but {fmt.name} over shape {shape} blocked along "
            f"axis {axis} needs {want_sc} (one {fmt.scheme.scale.name.upper()} code per "
            f"{fmt.block_size} elements)"
        )
    if el[len(el) - nd :] != want_el:
        packing = {
            4: " (FP4: two codes per byte along the block axis)",
            6: " (FP6: four codes per three bytes along the block axis)",
        }.get(fmt.element.code_bits, "")
        raise ValueError(
            f"MXArray: elements have shape {el} but {fmt.name} over shape {shape} blocked "
            f"along axis {axis} needs {want_el}{packing} (scales {sc})"
        )
