"""The key of the stochastic rounding inside training dots: :func:`stochastic_rounding_key`.

A layer's dot gets no key from Flax, so a recipe that rounds its gradients stochastically
(:data:`~lowprec.NVIDIA_NVFP4`) either derives its words from the data (its default: a hash
of the cotangent's bits, reproducible but chaotic: a one-ulp change anywhere in the cotangent
changes every word) or takes them from a key given around the training step:

    with lowprec.stochastic_rounding_key(jax.random.fold_in(key, step)):
        grads = jax.grad(loss)(params, batch)

The i-th such dot traced inside the block (i = 0, 1, ... in program order) takes the key
``fold_in(key, i)``: keyed per step (by the caller) and per tensor (by its place in the
program), and independent of the data, as Transformer Engine's words come from its random
state rather than from the tensor. A run on any number of devices then draws the same words
as on one device, so data-parallel training tracks the one-device run (the cotangents differ
there only in float32 summation order, which moves a rounding only where a word sits within
that difference of its threshold).

The key must be traced with the step: enter the block inside the function that ``jax.jit``
compiles, from a key that is one of its arguments. A concrete key met while the operands are
being traced would be compiled into the function as a constant, and every later call would
reuse its words; that is refused. Blocks nest (the innermost one keys the dots inside it,
counting from 0), so a layer traced once and run many times (``lax.scan`` over layers) gets
its own words per layer from a block inside the scanned body keyed by ``fold_in(key, layer)``.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

_STATE = threading.local()


def _stack() -> list:
    if not hasattr(_STATE, "stack"):
        _STATE.stack = []
    return _STATE.stack


def _check_key(key):
    """A PRNG key: typed (``jax.random.key``) of shape (), or raw uint32 words of shape (2,)."""
    try:
        dtype, shape = key.dtype, tuple(key.shape)
    except AttributeError:
        dtype = shape = None
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return key
    elif dtype is not None and np.dtype(dtype) == np.dtype(np.uint32) and shape == (2,):
        return key
    raise TypeError(
        "stochastic_rounding_key takes one PRNG key (jax.random.key(seed), or a split or "
        f"fold_in of your training key), got {key!r}"
    )


@contextlib.contextmanager
def stochastic_rounding_key(key):
    """Keys the stochastic rounding of the training dots traced inside this block.

    The i-th dot that rounds stochastically (i = 0, 1, ... in program order; the NVFP4
    training recipe's gradient rounding, :data:`~lowprec.NVIDIA_NVFP4`) draws its words from
    ``jax.random.fold_in(key, i)`` instead of from its cotangent's bits, so its words do not
    depend on the data: the same on any number of devices. Enter it inside the jitted step,
    with a key that is an argument of the step (a new one each step, e.g.
    ``fold_in(key, step)``); see ``lowprec/_rounding_key.py`` for the contract.

    Args:
      key: a PRNG key (typed, or raw uint32 words of shape (2,)).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import lowprec
        >>> x = jax.random.normal(jax.random.key(1), (16, 16))
        >>> def grad_w(w, key):  # the key: an argument of the jitted step
        ...     with lowprec.stochastic_rounding_key(key):
        ...         return jax.grad(lambda v: jnp.sum(
        ...             lowprec.NVIDIA_NVFP4.dot_general(x, v, (((1,), (0,)), ((), ()))) ** 2))(w)
        >>> step = jax.jit(grad_w)
        >>> w = jnp.eye(16)
        >>> key = jax.random.key(0)
        >>> a, b = step(w, jax.random.fold_in(key, 0)), step(w, jax.random.fold_in(key, 1))
        >>> bool(jnp.all(a == step(w, jax.random.fold_in(key, 0)))), bool(jnp.all(a == b))
        (True, False)
    """
    entry = [_check_key(key), 0]
    stack = _stack()
    stack.append(entry)
    try:
        yield
    finally:
        stack.pop()


def _concrete(x) -> bool:
    """Whether ``x`` has a value now (not a tracer of a function being compiled)."""
    if not isinstance(x, jax.core.Tracer):
        return True
    try:
        return x.to_concrete_value() is not None
    except Exception:  # a tracer type without concrete values
        return False


def next_key(*operands, what: str = "a stochastic-rounding training dot"):
    """The key of the next dot inside the innermost :func:`stochastic_rounding_key` block
    (``fold_in(key, i)``, i counting that block's dots), or None outside any block.

    Raises ValueError where the block's key is concrete while ``operands`` are traced: the
    key would be compiled into the function as a constant.
    """
    stack = _stack()
    if not stack:
        return None
    entry = stack[-1]
    key, index = entry
    if _concrete(key) and not all(_concrete(x) for x in operands):
        raise ValueError(
            f"{what} is traced (under jax.jit or another transformation that compiles) inside "
            "lowprec.stochastic_rounding_key(key) whose key is a concrete value: it would be "
            "compiled into the function as a constant, and every later call would reuse its "
            "random words. Pass the key as an argument of the jitted step and enter the block "
            "inside it, e.g. `def step(params, batch, key): with "
            "lowprec.stochastic_rounding_key(key): ...`"
        )
    entry[1] = index + 1
    return jax.random.fold_in(key, index)


__all__ = ["stochastic_rounding_key"]
