"""Sharded arrays: MX blocks must not straddle shard boundaries.

Under ``jax.jit`` a sharded computation means the same as the unsharded one, so
``quantize_mx`` and the MX matmul give the same bits however their inputs are laid out
(tests/test_sharding.py checks this on 4 CPU devices). What the layout decides is whether a
device can quantize its shard *alone*: only if every 32-element block lies inside one shard.
A block split across devices needs its amax gathered from several of them (GSPMD inserts
that communication silently; a ``shard_map`` body quantizing its local shard would compute
wrong scales; explicit-sharding mode cannot even express the reshape). So lowprec refuses such
layouts with an error that says how to fix them.

Where the check can see the layout:

* concrete ``jax.Array`` inputs (eager calls): their ``.sharding`` gives every shard's shape;
* traced inputs under ``jit`` whose mesh axes are ``Explicit`` (the default of
  ``jax.make_mesh`` in current JAX): the sharding is part of the type (``jax.typeof(x)``);
* traced inputs sharded over ``Auto`` axes carry no layout at trace time (the partitioner
  chooses later): nothing to check. Results are still bit-identical; choose ``in_shardings``
  with the block axis unsplit (or split into multiples of 32) to keep quantization local.

Output shardings on ``Explicit`` axes follow ``lax.dot_general``: a dot whose contraction is
sharded on both operands (a row-parallel layer: K split across devices) needs ``out_sharding``
(``lowprec.dot_general(..., out_sharding=P(...))``, or Flax's own argument, which recipes
pass on); it is given to the inner float32 dot, so the partial sums are reduced there, as in
the float layer. The backward dots follow JAX's transpose rule for ``dot_general``: each
gradient comes out sharded as its primal operand (the weight gradient of a data-parallel
layer, which sums over sharded tokens, is reduced to the weight's layout).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec


def _axis_shards(x, axis: int) -> Optional[tuple[int, int, str]]:
    """(number of shards, shard length, description) along ``axis``, or None if unknown."""
    n = x.shape[axis]
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        sharding = x.sharding
        shard_len = sharding.shard_shape(tuple(x.shape))[axis]
        return (-(-n // shard_len) if shard_len else 1), shard_len, str(sharding)
    try:
        sharding = jax.typeof(x).sharding
        spec, mesh = sharding.spec, sharding.mesh
    except Exception:  # no sharding in the type (no mesh, or an older JAX)
        return None
    entry = spec[axis] if axis < len(spec) else None
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    count = math.prod(mesh.shape[a] for a in names)
    return count, -(-n // count), f"PartitionSpec {spec} on mesh {dict(mesh.shape)}"


def check_block_axis(x, axis: int, block: int, what: str, stride: int = 1) -> None:
    """Raises if the sharding of ``x`` splits ``axis`` inside a block of ``block`` elements.

    ``stride`` is the number of block-axis positions one step along ``axis`` covers (for a
    dimension flattened with later ones into the block axis: the product of their lengths).
    Silently returns when the layout is unknown (see the module docstring).

    Example:
        >>> import jax.numpy as jnp
        >>> check_block_axis(jnp.ones((4, 64)), 1, 32, "quantize_mx")  # one device: fine
    """
    info = _axis_shards(x, axis)
    if info is None:
        return
    count, shard_len, where = info
    if count <= 1 or (shard_len * stride) % block == 0:
        return
    n = x.shape[axis]
    raise ValueError(
        f"{what}: axis {axis} (length {n}) is split into {count} shards of {shard_len} elements "
        f"by its sharding ({where}), so {block}-element MX blocks would straddle shard "
        f"boundaries. Lay it out so each shard holds a multiple of {block} along axis {axis} "
        f"(length a multiple of {block * count} for {count} shards, or fewer shards on that "
        "axis), shard another axis instead, or block along an axis that is not sharded"
    )


def check_contraction(x, contract: Sequence[int], block: int, what: str) -> None:
    """:func:`check_block_axis` for each contracting dimension of a matmul operand; several
    contracting dims are flattened in the order given into the block axis.

    Example:
        >>> import jax.numpy as jnp
        >>> check_contraction(jnp.ones((4, 2, 32)), (1, 2), 32, "dot_general lhs")
    """
    shape = x.shape
    for i, d in enumerate(contract):
        stride = math.prod(shape[c] for c in contract[i + 1:])
        check_block_axis(x, d, block, what, stride)


# -- output shardings (Explicit axes) -----------------------------------------------------------


def explicit_sharding(x) -> Optional[NamedSharding]:
    """The NamedSharding in the type of ``x`` if its mesh has ``Explicit`` axes, else None
    (no mesh, ``Auto`` axes, an MXArray's codes: the partitioner decides, nothing to pass).

    Example:
        >>> import jax.numpy as jnp
        >>> explicit_sharding(jnp.ones(3)) is None  # no mesh
        True
    """
    try:
        sharding = jax.typeof(x).sharding
        mesh = sharding.mesh
    except Exception:  # not an array type, or a JAX without sharding in types
        return None
    if not isinstance(sharding, NamedSharding) or mesh.empty:
        return None
    if AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    return sharding


def out_sharding_arg(out_sharding, what: str = "out_sharding") -> Optional[NamedSharding]:
    """``out_sharding`` as given to a dot (None, a PartitionSpec or a NamedSharding) → a
    NamedSharding (a PartitionSpec is placed on the mesh set by ``jax.set_mesh``), or None."""
    if out_sharding is None or isinstance(out_sharding, NamedSharding):
        return out_sharding
    if isinstance(out_sharding, PartitionSpec):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{what}={out_sharding} is a PartitionSpec but no mesh is set; call inside "
                "`with jax.set_mesh(mesh):` or pass NamedSharding(mesh, spec)"
            )
        return NamedSharding(mesh, out_sharding)
    raise TypeError(
        f"{what} must be None, a PartitionSpec or a NamedSharding, got {out_sharding!r}"
    )


def split_out_sharding(sharding: Optional[NamedSharding]):
    """``(for the dot, as a constraint)``: a sharding naming only ``Explicit`` axes goes to
    ``lax.dot_general`` (which refuses ``Auto`` axes); any other is applied afterwards with
    ``lax.with_sharding_constraint`` (the partitioner's hint on ``Auto`` axes)."""
    if sharding is None:
        return None, None
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    names = [n for e in sharding.spec if e is not None for n in ((e,) if isinstance(e, str) else e)]
    if all(types.get(n) == AxisType.Explicit for n in names):
        return sharding, None
    return None, sharding


def merged_sharding(sharding: Optional[NamedSharding], groups: Sequence[Sequence[int]]):
    """``sharding`` of an array whose dimension groups (lists of consecutive dims) are
    flattened into one dim each (the canonical (B, M, N) layout of a dot's output): a group's
    mesh axes, in dim order, shard the merged dim, as ``jnp.reshape`` lays it out when only
    the group's leading dims are sharded. None stays None.

    Example:
        >>> import jax
        >>> mesh = jax.sharding.AbstractMesh((2,), ("x",))
        >>> s = NamedSharding(mesh, PartitionSpec("x", None, None))
        >>> merged_sharding(s, [[], [0, 1], [2]]).spec
        P(None, 'x', None)
    """
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (sum(len(g) for g in groups) - len(sharding.spec))
    merged = []
    for group in groups:
        names = []
        for d in group:
            entry = spec[d]
            if entry is not None:
                names.extend((entry,) if isinstance(entry, str) else entry)
        merged.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return NamedSharding(sharding.mesh, PartitionSpec(*merged))


def merge_dims(x, shape: Sequence[int], groups: Sequence[Sequence[int]]):
    """``x`` reshaped to ``shape``, whose dim i merges the consecutive dims ``groups[i]`` of
    ``x`` (an empty group: a new dim of length 1).

    On ``Explicit`` mesh axes JAX infers the layout of a reshape only in simple cases
    (``[8@x, 16, 128]`` to ``(1, 128, 128)`` is refused), so the layout is given: each merged
    dim is sharded by the mesh axes of its dims (:func:`merged_sharding`). Nothing moves when
    a group's sharded dims lead it (activations [B@x, S, D] give (B S)@x); otherwise (e.g.
    [B, S@x, D]) the partitioner moves data into that layout, and the result is the same.
    Elsewhere (no mesh, ``Auto`` axes) this is ``x.reshape(shape)``.

    Example:
        >>> import jax.numpy as jnp
        >>> merge_dims(jnp.ones((2, 3, 4)), (1, 6, 4), [[], [0, 1], [2]]).shape
        (1, 6, 4)
    """
    sharding = explicit_sharding(x)
    target = None if sharding is None else merged_sharding(sharding, [list(g) for g in groups])
    return jax.numpy.reshape(x, tuple(shape), out_sharding=target)


def split_dims(x, shape: Sequence[int], groups: Sequence[Sequence[int]]):
    """``x`` reshaped to ``shape``, dim i of ``x`` split into the consecutive dims
    ``groups[i]`` of the result (the inverse of :func:`merge_dims`).

    On ``Explicit`` mesh axes, dim i's mesh axes shard the first dim of its group (JAX infers
    this for a single split, not for several at once, such as a weight [R, C] viewed as
    16 x 16 tiles (R/16, 16, C/16, 16)); callers make each shard hold whole sub-blocks
    (checked where the layout is chosen). Elsewhere this is ``x.reshape(shape)``.

    Example:
        >>> import jax.numpy as jnp
        >>> split_dims(jnp.ones((32, 48)), (2, 16, 3, 16), [[0, 1], [2, 3]]).shape
        (2, 16, 3, 16)
    """
    sharding = explicit_sharding(x)
    target = None
    if sharding is not None:
        spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
        out = [None] * len(shape)
        for entry, group in zip(spec, groups):
            if group:
                out[group[0]] = entry
        target = NamedSharding(sharding.mesh, PartitionSpec(*out))
    return jax.numpy.reshape(x, tuple(shape), out_sharding=target)


def dot_out_sharding(lhs, rhs, dimension_numbers) -> Optional[NamedSharding]:
    """The sharding ``lax.dot_general(lhs, rhs, dimension_numbers)`` gives its output on
    ``Explicit`` mesh axes (found by tracing it abstractly, so its rules and its errors, e.g.
    a contraction sharded on both operands needs ``out_sharding``, are JAX's own); None
    where neither operand is laid out on ``Explicit`` axes. Operands may be
    ``jax.ShapeDtypeStruct``s.

    Example:
        >>> import jax.numpy as jnp
        >>> dot_out_sharding(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ()))) is None
        True
    """
    if explicit_sharding(lhs) is None and explicit_sharding(rhs) is None:
        return None
    out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dimension_numbers), lhs, rhs)
    return out.sharding


def replicated(x):
    """``x`` on every device, where it is laid out over ``Explicit`` mesh axes (an all-gather;
    for small arrays, such as one scale per expert, that are joined with unsharded ones or
    indexed by per-token data); ``x`` itself elsewhere.

    Example:
        >>> import jax.numpy as jnp
        >>> replicated(jnp.arange(3)).tolist()
        [0, 1, 2]
    """
    sharding = explicit_sharding(x)
    if sharding is None or all(e is None for e in sharding.spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(sharding.mesh, PartitionSpec()))


def without_leading(sharding: Optional[NamedSharding]) -> Optional[NamedSharding]:
    """``sharding`` with its first dim dropped (for a 3-D dot computed as a 2-D one)."""
    if sharding is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
