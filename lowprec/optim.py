"""Low-precision parameters for optax: weights stored in bf16 (or another element format),
each update rounded stochastically so that small updates are not lost.

With round-to-nearest, a bf16 weight w only moves when the update exceeds half its ulp
(2^-9 |w| or more): an Adam step of 1e-3 on a weight of 1.0 is rounded away every time and
training stalls. Stochastic rounding rounds ``w + u`` up or down with probabilities that make
the stored weight correct *in expectation* (E[q] = w + u), so the updates accumulate as they
would in float32, plus zero-mean noise of at most one ulp per step.

:func:`low_precision_params` wraps any optax optimizer. The inner optimizer sees float32
parameters and gradients and keeps its state (Adam's moments ...) in float32; only the
parameters live in the low-precision format, so this removes the float32 master copy.

Key contract (reproducible, independent of sharding and of the tree's leaf count elsewhere):
at step ``t`` (``state.count``, from 0) leaf ``i`` (its position in ``jax.tree.leaves``)
rounds with ``k = jax.random.fold_in(jax.random.fold_in(key, t), i)``, and element ``j`` of
that leaf rounds away from zero iff ``lowprec.random_bits(k, leaf.shape)[j] <
frac_j * 2**16`` (the contract of ``lowprec.quantize(..., rounding="stochastic")``), where
``frac_j`` is how far the float32 value ``w + u`` lies from its smaller-magnitude neighbour in
the format towards the larger one, as a fraction of the gap between them.

Chaining order: the updates are ``q - w``, exact only as they are. Put every other transform
(clipping, schedules, weight decay, ...) *inside* ``inner``: ``low_precision_params(optax.chain(
optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), "bf16", key=key)``. A transform chained
*after* it (``optax.chain(low_precision_params(...), optax.scale(0.5))``) changes ``q - w`` into
a value that ``apply_updates`` then rounds to nearest when casting back: the stochastic rounding
is silently undone. That cannot be detected from inside the chain, so it is documented here.

State: the key is stored as its raw data (``jax.random.key_data``, uint32), not as a typed PRNG
key, so the whole state is plain arrays: ``flax.serialization.to_bytes``/``from_bytes`` and
orbax checkpoints take it as they take Adam's moments.

Applying the updates: :func:`optax.apply_updates` adds them in float32 and casts back to the
parameter dtype. The update returned is ``q - w`` (float32), so the stored result is exactly
``q`` whenever ``q - w`` is exact in float32 — always unless a weight shrinks by a factor
above 2^15 in one step (w and q are bf16 values with 8-bit significands; their difference fits
float32's 24 bits while their exponents differ by at most 15). Otherwise it differs from ``q``
by less than float32's own rounding of ``w + u``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

try:
    import optax
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lowprec.optim needs optax: pip install 'lowprec[training]' (flax and optax)"
    ) from exc

from ._codec import quantize
from ._dtypes import exactly_representable
from ._format import ElementFormat, element_format

__all__ = ["LowPrecisionState", "cast_params", "low_precision_params", "storage_dtype"]

#: Parameter rounding modes of :func:`low_precision_params`.
PARAM_ROUNDINGS: tuple[str, ...] = ("stochastic", "nearest_even")


class LowPrecisionState(NamedTuple):
    """State of :func:`low_precision_params`: the step count, the base key's raw data
    (``jax.random.key_data``: uint32, serializable), the inner state."""

    count: jax.Array
    key: jax.Array
    inner_state: Any


def storage_dtype(fmt: Union[str, ElementFormat]) -> np.dtype:
    """The dtype parameters in ``fmt`` are stored as: bfloat16 for bf16, float16 for fp16,
    float32 (holding exactly representable values) for the other element formats.

    Example:
        >>> storage_dtype("bf16"), storage_dtype("e4m3")
        (dtype(bfloat16), dtype('float32'))
    """
    fmt = element_format(fmt)
    return np.dtype({"bf16": jnp.bfloat16, "fp16": jnp.float16}.get(fmt.name, jnp.float32))


def cast_params(params, fmt: Union[str, ElementFormat] = "bf16"):
    """Rounds float parameters to ``fmt`` (to nearest) in its :func:`storage_dtype`.

    Example:
        >>> import jax.numpy as jnp
        >>> cast_params({"w": jnp.array([1.0, 1.001])})["w"].dtype
        dtype(bfloat16)
    """
    fmt = element_format(fmt)
    dtype = storage_dtype(fmt)

    def cast(p):
        return quantize(jnp.asarray(p).astype(jnp.float32), fmt).astype(dtype)

    return jax.tree.map(cast, params)


def _check_leaf(p, fmt: ElementFormat):
    dtype = jnp.asarray(p).dtype
    if not jnp.issubdtype(dtype, jnp.floating) or not exactly_representable(fmt, dtype):
        raise TypeError(
            f"a parameter of dtype {dtype} cannot hold {fmt.name!r} values exactly; cast the "
            f"parameters with lowprec.optim.cast_params(params, {fmt.name!r}) first"
        )
    want = storage_dtype(fmt)
    if np.dtype(dtype).itemsize > want.itemsize:
        raise TypeError(
            f"a parameter of dtype {dtype} stores {fmt.name!r} values in {np.dtype(dtype).itemsize} "
            f"bytes instead of {want.itemsize}: no memory is saved. Cast the parameters with "
            f"lowprec.optim.cast_params(params, {fmt.name!r}) (dtype {want}) first"
        )


def _as_key(key) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(
        f"key must be a PRNG key (jax.random.key(seed)), got dtype {key.dtype} shape {key.shape}"
    )


def low_precision_params(
    inner: optax.GradientTransformation,
    fmt: Union[str, ElementFormat] = "bf16",
    *,
    key=None,
    rounding: str = "stochastic",
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so parameters stay in ``fmt``, each update rounded stochastically.

    Args:
      inner: any optax transformation (``optax.adam(1e-3)``, a chain ...); it runs on float32
        views of the parameters and gradients, so its state is float32.
      fmt: element format of the parameters (``"bf16"`` default, ``"fp16"``, ``"e4m3"`` ...);
        parameters must be stored in its :func:`storage_dtype` (see :func:`cast_params`):
        float32 parameters for ``"bf16"`` are refused, as they would save no memory.
      key: PRNG key for stochastic rounding (see the module docstring for how it is split).
      rounding: ``"stochastic"`` (default) or ``"nearest_even"`` (what a plain cast does; the
        baseline that stalls), which takes no key.

    Returns:
      An optax transformation whose updates, applied with :func:`optax.apply_updates`, put
      ``round(w + inner_update)`` into the parameters. Chain nothing after it (see the
      module docstring): other transforms go inside ``inner``.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> params = cast_params({"w": jnp.ones(4096)}, "bf16")
        >>> opt = low_precision_params(optax.sgd(1e-3), "bf16", key=jax.random.key(0))
        >>> state = opt.init(params)
        >>> grads = {"w": jnp.ones(4096, jnp.bfloat16)}  # each step: w -= 1e-3 < ulp(1) / 4
        >>> for _ in range(100):
        ...     updates, state = opt.update(grads, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params["w"].dtype, round(float(params["w"].astype(jnp.float32).mean()), 2)
        (dtype(bfloat16), 0.9)
    """
    fmt = element_format(fmt)
    if fmt.name == "e8m0":
        raise ValueError("e8m0 is a scale format (no sign, no zero); choose bf16, fp16, e4m3 ...")
    if rounding not in PARAM_ROUNDINGS:
        raise ValueError(f"unknown parameter rounding {rounding!r}; valid: {PARAM_ROUNDINGS}")
    if rounding == "stochastic":
        if key is None:
            raise ValueError(
                "stochastic rounding needs key=jax.random.key(seed); "
                "or pass rounding='nearest_even' for deterministic rounding"
            )
        key = _as_key(key)
    elif key is not None:
        raise ValueError("key is only used with rounding='stochastic'; drop it")
    else:
        key = jax.random.key(0)  # unused; keeps the state's structure the same
    impl = jax.random.key_impl(key)
    key_data = jax.random.key_data(key)  # the state holds raw data: serializable

    def to_f32(tree):
        return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), tree)

    def init_fn(params):
        for p in jax.tree.leaves(params):
            _check_leaf(p, fmt)
        return LowPrecisionState(jnp.zeros([], jnp.int32), key_data, inner.init(to_f32(params)))

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "low_precision_params needs the parameters: call opt.update(grads, state, params)"
            )
        p32 = to_f32(params)
        inner_updates, inner_state = optax.with_extra_args_support(inner).update(
            to_f32(updates), state.inner_state, p32, **extra_args
        )
        leaves, treedef = jax.tree.flatten(p32)
        u_leaves = treedef.flatten_up_to(inner_updates)
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key, impl=impl), state.count)
        out = []
        for i, (p, u) in enumerate(zip(leaves, u_leaves)):
            new = p + u.astype(jnp.float32)
            if rounding == "stochastic":
                q = quantize(new, fmt, rounding="stochastic", key=jax.random.fold_in(step_key, i))
            else:
                q = quantize(new, fmt)
            out.append(q - p)
        new_state = LowPrecisionState(state.count + 1, state.key, inner_state)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
