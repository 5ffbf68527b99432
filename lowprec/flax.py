"""Flax integration: run a Flax model's matmuls in a :class:`~lowprec.Recipe`.

Two levels (flax is an optional extra: ``pip install 'lowprec[training]'``):

* Per layer, the injection points Flax already has::

      nn.Dense(64, dot_general=lowprec.flax.dot_general(recipe))          # linen
      nn.DenseGeneral(..., dot_general=lowprec.flax.dot_general(recipe))
      nnx.Linear(32, 64, dot_general=lowprec.flax.dot_general(recipe), rngs=rngs)
      nnx.Einsum("btd,dnh->btnh", ..., einsum_op=lowprec.flax.einsum(recipe), rngs=rngs)

* One call for an unmodified model, :func:`quantize_model`:

  - **linen**: returns a wrapper whose ``init``/``apply`` run the model under
    ``nn.intercept_methods``; every ``nn.Dense``/``nn.DenseGeneral`` call gets the recipe's
    dot_general for that call, unless its path (``"Block_0/mlp/Dense_1"``) matches one of the
    recipe's ``high_precision`` patterns or the layer already has its own ``dot_general``.
    ``nn.Embed.attend`` (tied output embeddings) runs its product ``query · embeddingᵀ``
    through the recipe's dot_general too, with the same exclusions.
    The wrapper is a different object from the model, so a function jitted around
    ``wrapper.apply`` never shares a trace with one around ``model.apply``. (With
    :func:`intercepting` directly, remember that interception happens at trace time: a
    function traced outside the ``with`` block keeps its float matmuls.)
  - **nnx**: sets ``dot_general`` of every ``nnx.Linear``/``nnx.LinearGeneral`` and
    ``einsum_op`` of every ``nnx.Einsum`` still at Flax's default, in place (nnx modules are
    mutable; ``nnx.clone`` first to keep a float copy). These attributes are static, so
    ``nnx.jit`` retraces when the recipe changes. ``quantize_model(model, None)`` puts the
    defaults back.

What is covered: the weight matmuls of Flax's linear layers, attention projections included
(``MultiHeadDotProductAttention``/``MultiHeadAttention`` build them from ``DenseGeneral``/
``LinearGeneral``), and linen's ``Embed.attend``. What is not, and is reported with a
``UserWarning`` once per layer path and recipe (silenced by adding the path to the recipe's
``high_precision``, which is where it stays anyway):

* linen ``nn.Einsum`` (no injection point), ``nn.Conv``/``nn.ConvTranspose``/``nn.ConvLocal``
  (convolutions: no recipe convolution), warned when called;
* nnx ``Conv``/``ConvTranspose`` and ``Embed`` (its ``attend`` has no hook; an nnx module's
  methods cannot be swapped per instance), warned by :func:`quantize_model`;
* attention's score and value products (``q·kᵀ``, ``p·v``), computed by the attention
  function rather than a layer: they stay in their own precision, as in Transformer Engine's
  default recipes (FP8 attention is a separate option there); warned once per attention
  layer.

Matmuls written in a model's own code (``jnp.einsum``/``@`` calls) are invisible to any
interception and stay as they are.

Mixture-of-experts layers: neither JAX nor Flax has one, so a model's expert matmul is its
own ``jax.lax.ragged_dot(tokens [M, K], weights [G, K, N], group_sizes)`` call, which no
interception sees. :meth:`lowprec.Recipe.ragged_dot` takes the same arguments (a drop-in):
give it to the layer where it calls the ragged dot, e.g. as an attribute defaulting to
``jax.lax.ragged_dot``::

    class Experts(nn.Module):
        num_experts: int
        features: int
        ragged_dot: Any = jax.lax.ragged_dot

        @nn.compact
        def __call__(self, x, group_sizes):  # x [tokens, K], sorted by expert
            w = self.param("kernel", init, (self.num_experts, x.shape[-1], self.features))
            return self.ragged_dot(x, w, group_sizes)

    Experts(8, 256, ragged_dot=lowprec.NVIDIA_MXFP8.ragged_dot)

(per layer path with Rules: ``rules.recipe_for(path)``, None meaning ``jax.lax.ragged_dot``).
Each group is its own quantized matmul, forward and backward, as in Transformer Engine's
``GroupedLinear``: the weight gradient's blocks along tokens are formed within each group,
and per-tensor scales are per group and per expert (see the method).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import warnings
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

try:
    import flax.linen as nn
    from flax import nnx
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lowprec.flax needs Flax: pip install 'lowprec[training]' (flax and optax)"
    ) from exc

from ._delayed import DelayedScaling, DelayedState, delayed_dot_general
from ._recipe import Recipe
from ._rules import Rules, recipe_for

__all__ = [
    "DelayedDotGeneral",
    "DelayedDotGeneralNnx",
    "DelayedScalingState",
    "RecipeDotGeneral",
    "RecipeEinsum",
    "dot_general",
    "einsum",
    "intercepting",
    "quantize_model",
    "update_delayed_state",
]


def _check_plan(plan):
    """A Recipe (one for every layer) or Rules (per layer path)."""
    if isinstance(plan, (Recipe, Rules)):
        return plan
    if isinstance(plan, (list, tuple)):
        return Rules(plan)  # (module_path, recipe) pairs
    raise TypeError(
        f"expected a lowprec.Recipe, lowprec.Rules or a list of (module_path, recipe) pairs, "
        f"got {type(plan).__name__}"
    )


def _label(plan) -> str:
    return plan.name or (plan.describe() if isinstance(plan, Recipe) else "rules")


def _check_recipe(recipe) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"expected a lowprec.Recipe (e.g. lowprec.NVIDIA_MXFP8), got {type(recipe).__name__}"
        )
    if recipe.scaling == "delayed":
        raise ValueError(
            f"{recipe.name or 'the recipe'} uses delayed scaling, whose state lives in the layer: "
            "give linen layers dot_general_cls=functools.partial(lowprec.flax.DelayedDotGeneral, "
            "config=recipe.delayed) and nnx layers dot_general=lowprec.flax.DelayedDotGeneralNnx("
            "recipe.delayed), or use lowprec.flax.quantize_model(model, recipe)")
    return recipe


@dataclasses.dataclass(frozen=True)
class RecipeDotGeneral:
    """A ``lax.dot_general`` replacement running in ``recipe`` (frozen, hashable).

    Accepts everything Flax passes (``precision``, ``preferred_element_type``,
    ``out_sharding``); see :meth:`lowprec.Recipe.dot_general`.
    """

    recipe: Recipe

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        return self.recipe.dot_general(
            lhs, rhs, dimension_numbers, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
        )


@dataclasses.dataclass(frozen=True)
class RecipeEinsum:
    """A two-operand ``jnp.einsum`` replacement running in ``recipe`` (for ``einsum_op=``)."""

    recipe: Recipe

    def __call__(self, subscripts, lhs, rhs, *, precision=None, preferred_element_type=None,
                 out_sharding=None, **kwargs):
        if kwargs:
            raise TypeError(f"recipe einsum got unsupported keyword arguments {sorted(kwargs)}")
        return self.recipe.einsum(
            subscripts, lhs, rhs, precision=precision,
            preferred_element_type=preferred_element_type, out_sharding=out_sharding,
        )


# Flax's name for a variable collection whose gradient replaces the variable
# (flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT; TrainState.apply_gradients honours it).
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class DelayedDotGeneral(nn.Module):
    """A linen ``dot_general_cls=`` for FP8 delayed scaling (Transformer Engine semantics).

    Holds one matmul's :class:`~lowprec.DelayedState` (amax histories and scales of lhs,
    rhs and cotangent) in Flax's overwrite-with-gradient collection, as Flax's own
    ``Fp8DotGeneralOp`` does: the gradient of that collection *is* the next step's state, and
    ``flax.training.train_state.TrainState.apply_gradients`` writes it back instead of taking
    an optimizer step. The product is :func:`lowprec.delayed_dot_general`.

    Attributes:
      config: the :class:`~lowprec.DelayedScaling` options (margin, history length, amax
        algorithm, formats).

    Example:
        >>> import functools, jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> cls = functools.partial(lowprec.flax.DelayedDotGeneral,
        ...                         config=lowprec.DelayedScaling(amax_history_len=16))
        >>> layer = nn.Dense(3, dot_general_cls=cls)
        >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
        >>> variables["_overwrite_with_gradient"]["DelayedDotGeneral_0"]["amax_history"].shape
        (3, 16)
    """

    config: DelayedScaling = DelayedScaling()

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        """The product (``lax.dot_general``'s arguments; ``precision`` is ignored: the
        operands are FP8 values, their products exact) in the operands' promoted dtype or
        ``preferred_element_type``; ``out_sharding`` as for :func:`lowprec.delayed_dot_general`."""
        if not isinstance(self.config, DelayedScaling):
            raise TypeError(f"config must be a lowprec.DelayedScaling, got {self.config!r}")
        init = self.config.init()
        hist = self.variable(OVERWRITE_WITH_GRADIENT, "amax_history", lambda: init.amax_history)
        scale = self.variable(OVERWRITE_WITH_GRADIENT, "scale", lambda: init.scale)
        out = delayed_dot_general(lhs, rhs, DelayedState(hist.value, scale.value),
                                  dimension_numbers, self.config, out_sharding=out_sharding)
        dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        return out.astype(dtype)


class DelayedScalingState(nnx.Variable):
    """The nnx variable type of delayed scaling's state (amax histories and scales): like
    linen's overwrite-with-gradient collection, its *gradient* is the next step's value
    (:func:`update_delayed_state` writes it back)."""


class DelayedDotGeneralNnx(nnx.Module):
    """An nnx ``dot_general=`` for FP8 delayed scaling (Transformer Engine semantics): the nnx
    form of :class:`DelayedDotGeneral`, one instance per layer.

    ``nnx.Linear(..., dot_general=DelayedDotGeneralNnx(config))`` makes it a submodule of the
    layer, so its :class:`DelayedScalingState` variables (``amax_history`` [3, L] and
    ``scale`` [3]: lhs, rhs, cotangent) are part of the model's state. A training step
    differentiates with respect to them too and writes their gradient back as the next
    state (the cotangent's amax is known only in the backward pass)::

        wrt = nnx.Any(nnx.Param, lowprec.flax.DelayedScalingState)
        grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch)
        optimizer.update(model, grads)                     # nnx.Optimizer(..., wrt=nnx.Param)
        lowprec.flax.update_delayed_state(model, grads)    # the next scales

    Attributes:
      config: the :class:`~lowprec.DelayedScaling` options.

    Example:
        >>> import jax.numpy as jnp, lowprec
        >>> from flax import nnx
        >>> layer = nnx.Linear(8, 3, rngs=nnx.Rngs(0),
        ...                    dot_general=lowprec.flax.DelayedDotGeneralNnx(
        ...                        lowprec.DelayedScaling(amax_history_len=16)))
        >>> layer(jnp.ones((2, 8))).shape, layer.dot_general.amax_history.shape
        ((2, 3), (3, 16))
    """

    def __init__(self, config: DelayedScaling = DelayedScaling()):
        if not isinstance(config, DelayedScaling):
            raise TypeError(f"config must be a lowprec.DelayedScaling, got {config!r}")
        init = config.init()
        self.config = config
        self.amax_history = DelayedScalingState(init.amax_history)
        self.scale = DelayedScalingState(init.scale)

    def __call__(self, lhs, rhs, dimension_numbers, precision=None,
                 preferred_element_type=None, out_sharding=None):
        """As :meth:`DelayedDotGeneral.__call__`."""
        state = DelayedState(self.amax_history[...], self.scale[...])
        out = delayed_dot_general(lhs, rhs, state, dimension_numbers, self.config,
                                  out_sharding=out_sharding)
        return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))


def update_delayed_state(model, grads) -> None:
    """Writes the next step's delayed-scaling state into an nnx ``model``: the gradients of
    its :class:`DelayedScalingState` variables, taken from ``grads`` (an ``nnx.grad`` result
    that includes them; see :class:`DelayedDotGeneralNnx`), in place."""
    nnx.update(model, nnx.state(grads, DelayedScalingState))


def dot_general(recipe: Recipe) -> RecipeDotGeneral:
    """A ``dot_general=`` argument for ``nn.Dense``, ``nn.DenseGeneral``, ``nnx.Linear``,
    ``nnx.LinearGeneral``.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> layer = nn.Dense(3, dot_general=lowprec.flax.dot_general(lowprec.NVIDIA_MXFP8))
        >>> params = layer.init(jax.random.key(0), jnp.ones((2, 64)))
        >>> layer.apply(params, jnp.ones((2, 64))).shape
        (2, 3)
    """
    return RecipeDotGeneral(_check_recipe(recipe))


def einsum(recipe: Recipe) -> RecipeEinsum:
    """An ``einsum_op=`` argument for ``nnx.Einsum``.

    Example:
        >>> import jax.numpy as jnp, lowprec
        >>> from flax import nnx
        >>> layer = nnx.Einsum("btd,dnh->btnh", (64, 4, 8), (4, 8), rngs=nnx.Rngs(0),
        ...                    einsum_op=lowprec.flax.einsum(lowprec.OCP_MXFP8))
        >>> layer(jnp.ones((2, 5, 64))).shape
        (2, 5, 4, 8)
    """
    return RecipeEinsum(_check_recipe(recipe))


# -- linen: interception ------------------------------------------------------------------------

_LINEN_COVERED = (nn.Dense, nn.DenseGeneral)
_LINEN_UNCOVERED = {
    nn.Einsum: ("__call__",),
    nn.Conv: ("__call__",),
    nn.ConvTranspose: ("__call__",),
    nn.ConvLocal: ("__call__",),
    nn.MultiHeadDotProductAttention: ("__call__",),
}
_NNX_UNCOVERED = (
    (nnx.Conv, "Conv"),
    (nnx.ConvTranspose, "ConvTranspose"),
    (nnx.Embed, "Embed.attend (if the model calls it)"),
    (nnx.MultiHeadAttention, "MultiHeadAttention"),
)
_warned = set()
_warn_lock = threading.Lock()


def _warn_uncovered(kind: str, path: str, recipe) -> None:
    key = (kind, path, recipe)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    if kind.startswith(("MultiHead",)):
        what = ("runs its projections in the recipe but its score and value products (q·kᵀ, "
                "p·v) in their own precision, as Transformer Engine's default recipes do,")
    elif kind.endswith("(delayed scaling)"):
        what = "has no place for delayed scaling's state and runs in its own precision,"
    else:
        what = "has no dot_general hook and runs in its own precision,"
    warnings.warn(
        f"lowprec.flax: {kind} at {path or '<root>'} {what} not in recipe "
        f"{_label(recipe)!r} (add its path to high_precision, or a rule keeping it in its own "
        "precision, to silence this)",
        stacklevel=4,
    )


def _linen_interceptor(plan):
    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if isinstance(module, _LINEN_COVERED) and context.method_name == "__call__":
            if module.dot_general is not None or module.dot_general_cls is not None:
                return next_fun(*args, **kwargs)  # the layer chose its own dot_general
            recipe = recipe_for(plan, "/".join(module.path))
            if recipe is None:
                return next_fun(*args, **kwargs)
            # A linen layer reads self.dot_general (or instantiates self.dot_general_cls, a
            # child module holding delayed scaling's state) inside __call__; set it on this
            # bound instance for the duration of this call only (frozen dataclass, hence
            # object.__setattr__), and put Flax's default back afterwards.
            if recipe.scaling == "delayed":
                attr = "dot_general_cls"
                replacement = functools.partial(DelayedDotGeneral, config=recipe.delayed)
            else:
                attr, replacement = "dot_general", RecipeDotGeneral(recipe)
            object.__setattr__(module, attr, replacement)
            try:
                return next_fun(*args, **kwargs)
            finally:
                object.__setattr__(module, attr, None)
        if isinstance(module, nn.Embed) and context.method_name == "attend":
            path = "/".join(module.path)
            recipe = recipe_for(plan, path)
            if recipe is None:
                return next_fun(*args, **kwargs)
            if recipe.scaling == "delayed":  # no child module can hold state here
                _warn_uncovered("Embed.attend (delayed scaling)", path, recipe)
                return next_fun(*args, **kwargs)
            return _linen_attend(module, RecipeDotGeneral(recipe), *args, **kwargs)
        for cls, methods in _LINEN_UNCOVERED.items():
            if isinstance(module, cls) and context.method_name in methods:
                path = "/".join(module.path)
                recipe = recipe_for(plan, path)
                if recipe is not None:
                    _warn_uncovered(f"{cls.__name__}.{context.method_name}", path, recipe)
                break
        return next_fun(*args, **kwargs)

    return interceptor


def _linen_attend(module, dot, query):
    """``nn.Embed.attend`` (``query · embeddingᵀ`` in the promoted dtype) through ``dot``."""
    module._try_setup()  # an intercepted method runs before linen's lazy setup() would
    query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
    return dot(query, embedding, (((query.ndim - 1,), (1,)), ((), ())))


@contextlib.contextmanager
def intercepting(recipe):
    """Context manager: linen ``nn.Dense``/``nn.DenseGeneral`` calls traced inside it run in
    ``recipe`` (a Recipe, or :class:`~lowprec.Rules` per layer path; what
    :func:`quantize_model` wraps around ``init``/``apply``).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> model = nn.Dense(2)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 64)))
        >>> with lowprec.flax.intercepting(lowprec.Recipe(forward="mxfp4")):
        ...     y = model.apply(params, jnp.full((1, 64), 0.3))
        >>> y.shape
        (1, 2)
    """
    with nn.intercept_methods(_linen_interceptor(_check_plan(recipe))):
        yield


@dataclasses.dataclass(frozen=True)
class QuantizedLinen:
    """A linen model whose ``init``/``apply`` run under :func:`intercepting` (from
    :func:`quantize_model`). Parameters are the model's own: interchangeable with the float
    model's. Other attributes are the model's."""

    module: nn.Module
    recipe: Any  # a Recipe or Rules

    def init(self, *args, **kwargs):
        with intercepting(self.recipe):
            return self.module.init(*args, **kwargs)

    def init_with_output(self, *args, **kwargs):
        with intercepting(self.recipe):
            return self.module.init_with_output(*args, **kwargs)

    def apply(self, *args, **kwargs):
        with intercepting(self.recipe):
            return self.module.apply(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "recipe"):  # not yet set (copy/pickle): no recursion
            raise AttributeError(name)
        return getattr(self.module, name)


# -- nnx: in-place replacement ----------------------------------------------------------------


def _nnx_default(module) -> Optional[str]:
    """Which attribute of ``module`` to replace, or None (not a covered type / user-chosen op)."""
    if isinstance(module, nnx.Linear):
        return "dot_general"
    if isinstance(module, nnx.LinearGeneral):
        return None if module.dot_general_cls is not None else "dot_general"
    if isinstance(module, nnx.Einsum):
        return "einsum_op"
    return None


def _quantize_nnx(model, plan):
    ours = (RecipeDotGeneral, RecipeEinsum, DelayedDotGeneralNnx)
    for path, module in list(nnx.iter_modules(model)):
        attr = _nnx_default(module)
        name = "/".join(str(p) for p in path)
        recipe = recipe_for(plan, name)
        if attr is None:
            if recipe is not None:
                for cls, kind in _NNX_UNCOVERED:
                    if isinstance(module, cls):
                        _warn_uncovered(kind, name, recipe)
                        break
            continue
        current = getattr(module, attr)
        default = jnp.einsum if attr == "einsum_op" else lax.dot_general
        # LinearGeneral's default is None (= lax.dot_general); anything else but one of
        # ours is the user's choice and is kept.
        if not (current is default or current is None or isinstance(current, ours)):
            continue
        if recipe is None:
            new = None if isinstance(module, nnx.LinearGeneral) else default
        elif recipe.scaling == "delayed":
            if attr == "einsum_op":  # no delayed einsum: the layer keeps its precision
                _warn_uncovered("Einsum (delayed scaling)", name, recipe)
                continue
            if isinstance(current, DelayedDotGeneralNnx) and current.config == recipe.delayed:
                continue  # already delayed with these options: keep its state
            new = DelayedDotGeneralNnx(recipe.delayed)
        else:
            new = RecipeEinsum(recipe) if attr == "einsum_op" else RecipeDotGeneral(recipe)
        # nnx attributes are data (arrays, submodules: the delayed state) or static (functions):
        # a change of kind is declared.
        if isinstance(new, nnx.Module):
            new = nnx.data(new)
        elif isinstance(current, nnx.Module):
            new = nnx.static(new)
        setattr(module, attr, new)
    return model


def quantize_model(model, recipe):
    """Runs an unmodified Flax model's linear-layer matmuls in ``recipe``.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module``.
      recipe: a :class:`~lowprec.Recipe` for every layer, or per-layer
        :class:`~lowprec.Rules` (or a list of ``(module_path regex, recipe or None)`` pairs:
        first match wins, no match keeps the layer's own precision); for nnx, ``None``
        restores Flax's defaults.

    Returns:
      linen: a :class:`QuantizedLinen` (use its ``init``/``apply`` as the model's).
      nnx: ``model`` itself, modified in place.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         return nn.Dense(4, name="head")(nn.relu(nn.Dense(64, name="up")(x)))
        >>> recipe = lowprec.Recipe(forward="mxfp4", high_precision=("head",))
        >>> qmodel = lowprec.flax.quantize_model(MLP(), recipe)
        >>> params = qmodel.init(jax.random.key(0), jnp.ones((2, 32)))
        >>> qmodel.apply(params, jnp.ones((2, 32))).shape
        (2, 4)
    """
    if isinstance(model, nn.Module):
        return QuantizedLinen(model, _check_plan(recipe))
    if isinstance(model, nnx.Module):
        return _quantize_nnx(model, None if recipe is None else _check_plan(recipe))
    raise TypeError(
        f"quantize_model takes a flax.linen or flax.nnx Module, got {type(model).__name__}"
    )
