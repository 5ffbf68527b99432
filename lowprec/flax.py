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

What is covered, each kind of product opted in or out per path by :class:`~lowprec.Rules`
(``Rule(path, recipe, ops=(...))`` with the kinds ``"linear"``, ``"attention"``, ``"conv"``,
``"attend"``; a recipe's ``high_precision`` globs by path):

* ``"linear"``: the weight matmuls of Flax's linear layers, attention projections included
  (``MultiHeadDotProductAttention``/``MultiHeadAttention`` build them from ``DenseGeneral``/
  ``LinearGeneral``).
* ``"attention"``: attention's score and value products (``q·kᵀ`` with batch dims
  ``[b, h]`` and blocks along the head depth, ``p·v`` with blocks along the keys), through
  linen's ``qk_attn_weights_einsum_cls``/``attn_weights_value_einsum_cls`` hooks and nnx's
  ``attention_fn`` (:class:`RecipeAttention`). On by default, as qwix 0.1.8 does: its
  providers intercept every ``einsum`` inside a module a rule matches, and with an
  activation type set quantize both operands of these activation x activation products
  (Transformer Engine keeps them in high precision unless FP8 attention is asked for: opt out
  with ``Rule(".*", None, ops=("attention",))`` first in the rules).
* ``"conv"``: ``nn.Conv``/``nnx.Conv``, as the recipe's dot of the input's patches
  (:func:`conv_general_dilated`; grouped convolutions are refused with the fix named).
* ``"attend"``: ``Embed.attend`` (tied output embeddings): linen by interception; a plain
  nnx ``Embed`` is given a subclass whose ``attend`` runs the recipe (same state; nnx's
  ``attend`` has no hook), and its class back by ``quantize_model(model, None)``.

What is not, and is reported with a ``UserWarning`` once per layer path and recipe (silenced
by a rule or ``high_precision`` keeping the path in its own precision, which is where it
stays anyway): linen ``nn.Einsum`` (no injection point), ``ConvTranspose``/``ConvLocal``
(``lax.conv_transpose``/local convs: no hook), and attention, conv or ``attend`` products
under delayed scaling (no place for its state).

Nested :func:`intercepting` blocks (and a :class:`QuantizedLinen` used as a child of a model
that is itself quantized) compose: the innermost plan with a rule for a layer decides it.

Post-training quantization (serving from low-precision weights stored in the model's state):
:func:`ptq` (``lowprec/_flax_ptq.py``).

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
import functools
import inspect
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
from ._flax_ops import RecipeAttention, RecipeConv, RecipeDotGeneral, RecipeEinsum
from ._flax_ptq import PtqLinear, PtqLinen, QuantizedWeight, params_nbytes, ptq
from ._rules import Rules, match

__all__ = [
    "PtqLinear",
    "PtqLinen",
    "QuantizedWeight",
    "params_nbytes",
    "ptq",
    "RecipeAttention",
    "RecipeConv",
    "DelayedDotGeneral",
    "DelayedDotGeneralNnx",
    "DelayedScalingState",
    "RecipeDotGeneral",
    "RecipeEinsum",
    "attention",
    "conv_general_dilated",
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
        >>> variables = jax.jit(layer.init)(jax.random.key(0), jnp.ones((2, 8)))
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
        >>> forward = nnx.jit(lambda layer, x: layer(x))   # the history is updated in place
        >>> forward(layer, jnp.ones((2, 8))).shape, layer.dot_general.amax_history.shape
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


def conv_general_dilated(recipe: Recipe) -> RecipeConv:
    """A ``conv_general_dilated=`` argument for ``nn.Conv`` and ``nnx.Conv``: the convolution
    as the recipe's dot of the input's patches (window positions, then input features
    innermost) and the flattened kernel, forward and backward (``lowprec/_recipe_conv.py``).
    Grouped convolutions are refused.

    Example:
        >>> import jax.numpy as jnp, lowprec
        >>> from flax import nnx
        >>> conv = nnx.Conv(32, 8, (3, 3), rngs=nnx.Rngs(0),
        ...                 conv_general_dilated=lowprec.flax.conv_general_dilated(lowprec.NVIDIA_MXFP8))
        >>> conv(jnp.ones((2, 6, 6, 32))).shape
        (2, 6, 6, 8)
    """
    return RecipeConv(_check_recipe(recipe))


def attention(recipe: Recipe) -> RecipeAttention:
    """An ``attention_fn=`` argument for ``nnx.MultiHeadAttention`` (linen's
    ``MultiHeadDotProductAttention`` takes ``qk_attn_weights_einsum_cls`` /
    ``attn_weights_value_einsum_cls``: pass ``lambda: lowprec.flax.einsum(recipe)`` to both).

    Example:
        >>> import jax.numpy as jnp, lowprec
        >>> from flax import nnx
        >>> mha = nnx.MultiHeadAttention(2, 64, rngs=nnx.Rngs(0), decode=False,
        ...                              attention_fn=lowprec.flax.attention(lowprec.NVIDIA_MXFP8))
        >>> mha(jnp.ones((2, 5, 64))).shape
        (2, 5, 64)
    """
    return RecipeAttention(_check_recipe(recipe))


# -- linen: interception ------------------------------------------------------------------------

_LINEN_COVERED = (nn.Dense, nn.DenseGeneral)
_LINEN_UNCOVERED = {
    nn.Einsum: ("__call__",),
    nn.ConvTranspose: ("__call__",),
    nn.ConvLocal: ("__call__",),
}
_NNX_UNCOVERED = (
    (nnx.ConvTranspose, "ConvTranspose", "conv"),
)
_warned = set()
_warn_lock = threading.Lock()


def _warn_uncovered(kind: str, path: str, recipe, why: str = "") -> None:
    key = (kind, path, recipe)
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    if kind.endswith("(delayed scaling)"):
        what = "has no place for delayed scaling's state and runs in its own precision,"
    else:
        what = why or "has no dot_general hook and runs in its own precision,"
    warnings.warn(
        f"lowprec.flax: {kind} at {path or '<root>'} {what} not in recipe "
        f"{_label(recipe)!r} (add its path to high_precision, or a rule keeping it in its own "
        "precision, to silence this)",
        stacklevel=4,
    )


# The plans of the active intercepting() blocks of this thread, outermost first. One linen
# interceptor (installed by the outermost block) asks them innermost first: nested blocks
# compose like nested contexts, the inner one deciding every layer it has a rule for.
_plans = threading.local()


def _stack() -> list:
    if not hasattr(_plans, "stack"):
        _plans.stack = []
    return _plans.stack


def _decide(path: str, op: str) -> Optional[Recipe]:
    """The recipe of the product of kind ``op`` at ``path``: the innermost plan that has a rule
    for it decides; None (own precision) when none has."""
    for plan in reversed(_stack()):
        matched, recipe = match(plan, path, op)
        if matched:
            return recipe
    return None


@contextlib.contextmanager
def _set_for_call(module, **attrs):
    """Sets attributes of a bound linen module for one call (frozen dataclass, hence
    object.__setattr__), putting the old values back afterwards."""
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        object.__setattr__(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            object.__setattr__(module, k, v)


def _linen_interceptor(next_fun, args, kwargs, context):
    module, method = context.module, context.method_name
    if isinstance(module, _LINEN_COVERED) and method == "__call__":
        if module.dot_general is not None or module.dot_general_cls is not None:
            return next_fun(*args, **kwargs)  # the layer chose its own dot_general
        recipe = _decide("/".join(module.path), "linear")
        if recipe is None:
            return next_fun(*args, **kwargs)
        # A linen layer reads self.dot_general (or instantiates self.dot_general_cls, a child
        # module holding delayed scaling's state) inside __call__.
        if recipe.scaling == "delayed":
            with _set_for_call(module, dot_general_cls=functools.partial(
                    DelayedDotGeneral, config=recipe.delayed)):
                return next_fun(*args, **kwargs)
        with _set_for_call(module, dot_general=RecipeDotGeneral(recipe)):
            return next_fun(*args, **kwargs)
    if isinstance(module, nn.MultiHeadDotProductAttention) and method == "__call__":
        path = "/".join(module.path)
        recipe = _decide(path, "attention")
        if recipe is None or module.qk_attn_weights_einsum_cls is not None \
                or module.attn_weights_value_einsum_cls is not None:
            return next_fun(*args, **kwargs)  # own precision, or the layer's own einsums
        kind = "MultiHeadDotProductAttention score/value products"
        takes = inspect.signature(module.attention_fn).parameters
        if recipe.scaling == "delayed":
            _warn_uncovered(kind + " (delayed scaling)", path, recipe)
        elif module.precision is not None:  # Flax refuses precision together with the hooks
            _warn_uncovered(kind, path, recipe, "set precision=, which Flax's einsum hooks "
                            "exclude; they run in their own precision,")
        elif not {"qk_attn_weights_einsum", "attn_weights_value_einsum"} <= set(takes):
            _warn_uncovered(kind, path, recipe, "have an attention_fn without einsum hooks "
                            "and run in their own precision,")
        else:
            einsum_cls = functools.partial(RecipeEinsum, recipe)
            with _set_for_call(module, qk_attn_weights_einsum_cls=einsum_cls,
                               attn_weights_value_einsum_cls=einsum_cls):
                return next_fun(*args, **kwargs)
        return next_fun(*args, **kwargs)
    if isinstance(module, nn.Conv) and method == "__call__":
        if module.conv_general_dilated is not None or module.conv_general_dilated_cls is not None:
            return next_fun(*args, **kwargs)
        path = "/".join(module.path)
        recipe = _decide(path, "conv")
        if recipe is None:
            return next_fun(*args, **kwargs)
        if recipe.scaling == "delayed":
            _warn_uncovered("Conv (delayed scaling)", path, recipe)
            return next_fun(*args, **kwargs)
        _check_conv(module.feature_group_count, path)
        with _set_for_call(module, conv_general_dilated=RecipeConv(recipe)):
            return next_fun(*args, **kwargs)
    if isinstance(module, nn.Embed) and method == "attend":
        path = "/".join(module.path)
        recipe = _decide(path, "attend")
        if recipe is None:
            return next_fun(*args, **kwargs)
        if recipe.scaling == "delayed":  # no child module can hold state here
            _warn_uncovered("Embed.attend (delayed scaling)", path, recipe)
            return next_fun(*args, **kwargs)
        return _linen_attend(module, RecipeDotGeneral(recipe), *args, **kwargs)
    for cls, methods in _LINEN_UNCOVERED.items():
        if isinstance(module, cls) and method in methods:
            path = "/".join(module.path)
            recipe = _decide(path, "conv" if cls is not nn.Einsum else "linear")
            if recipe is not None:
                _warn_uncovered(f"{cls.__name__}.{method}", path, recipe)
            break
    return next_fun(*args, **kwargs)


def _check_conv(groups: int, path: str) -> None:
    if groups != 1:
        raise ValueError(
            f"lowprec.flax: the grouped convolution at {path or '<root>'} (feature_group_count="
            f"{groups}) has no exact recipe product (each group is its own contraction); keep it "
            f"in its own precision with a rule (lowprec.Rules([({path!r}, None), ...]) or "
            "Rule(..., ops=('conv',)) with recipe None) or the recipe's high_precision")


def _linen_attend(module, dot, query):
    """``nn.Embed.attend`` (``query · embeddingᵀ`` in the promoted dtype) through ``dot``."""
    module._try_setup()  # an intercepted method runs before linen's lazy setup() would
    query, embedding = module.promote_dtype(query, module.embedding, dtype=module.dtype)
    return dot(query, embedding, (((query.ndim - 1,), (1,)), ((), ())))


@contextlib.contextmanager
def intercepting(recipe):
    """Context manager: linen layers traced inside it run in ``recipe`` (a Recipe, or
    :class:`~lowprec.Rules` per layer path; what :func:`quantize_model` wraps around
    ``init``/``apply``): ``Dense``/``DenseGeneral``, ``MultiHeadDotProductAttention``'s score
    and value products, ``Conv`` and ``Embed.attend``.

    Blocks nest like other contexts: the innermost block decides every layer it has a rule for
    (a Recipe has one for every layer; Rules for the paths they match), and a layer it has no
    rule for is asked of the next block out. (qwix 0.1.8 lets the outermost provider with a
    matching rule decide; lowprec follows the innermost-wins order of nested Python contexts
    and of the issue that asked for it.) A layer given its own ``dot_general`` keeps it.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> model = nn.Dense(2)
        >>> params = model.init(jax.random.key(0), jnp.ones((1, 64)))
        >>> with lowprec.flax.intercepting(lowprec.Recipe(forward="mxfp4")):
        ...     y = model.apply(params, jnp.full((1, 64), 0.3))
        >>> y.shape
        (1, 2)
    """
    plan = _check_plan(recipe)
    stack = _stack()
    stack.append(plan)
    try:
        if len(stack) == 1:
            with nn.intercept_methods(_linen_interceptor):
                yield
        else:
            yield
    finally:
        stack.pop()


class QuantizedLinen(nn.Module):
    """A linen model run under :func:`intercepting` (from :func:`quantize_model`).

    Its ``init``/``apply`` are the model's, run under the recipe, and its parameters are the
    model's own (the wrapper shares the model's scope: no extra level), interchangeable with
    the float model's. It is also a linen module: as a child of another module it runs the
    wrapped model's ``__call__`` under the recipe, its parameters under the child's name; a
    wrapper inside a wrapper decides the layers its rules match (:func:`intercepting`). Other
    attributes are the model's.

    Attributes:
      module: the wrapped linen model.
      recipe: a :class:`~lowprec.Recipe` or :class:`~lowprec.Rules`.
    """

    module: nn.Module
    recipe: Any

    def setup(self):
        nn.share_scope(self, self.module)

    def __call__(self, *args, **kwargs):
        with intercepting(self.recipe):
            return self.module(*args, **kwargs)

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
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "recipe") or name.startswith("_"):
                raise
            return getattr(self.module, name)


# -- nnx: in-place replacement ----------------------------------------------------------------


class _RecipeEmbed(nnx.Embed):
    """nnx ``Embed`` whose ``attend`` (tied logits, ``query · embeddingᵀ``) runs in the
    recipe it holds. ``nnx.Embed.attend`` has no hook, so :func:`quantize_model` gives a plain
    ``nnx.Embed`` this class (the same state; ``quantize_model(model, None)`` gives it back)."""

    def attend(self, query, *, out_sharding=None):
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return self.lowprec_recipe.dot_general(
            query, embedding, (((query.ndim - 1,), (1,)), ((), ())), out_sharding=out_sharding)


def _quantize_nnx_embed(module, name, plan) -> None:
    if type(module) not in (nnx.Embed, _RecipeEmbed):
        return  # a user's subclass keeps its own attend
    recipe = match(plan, name, "attend")[1]
    if recipe is not None and recipe.scaling == "delayed":
        _warn_uncovered("Embed.attend (delayed scaling)", name, recipe)
        recipe = None
    if recipe is None:
        if type(module) is _RecipeEmbed:
            del module.lowprec_recipe
            object.__setattr__(module, "__class__", nnx.Embed)
        return
    object.__setattr__(module, "__class__", _RecipeEmbed)
    module.lowprec_recipe = nnx.static(recipe)


def _nnx_slot(module):
    """(attribute to replace, Flax's default for it, kind of product, our type), or None (not a
    covered type / user-chosen op)."""
    if isinstance(module, nnx.Linear):
        return "dot_general", lax.dot_general, "linear", RecipeDotGeneral
    if isinstance(module, nnx.LinearGeneral):
        if module.dot_general_cls is not None:
            return None
        return "dot_general", None, "linear", RecipeDotGeneral  # None means lax.dot_general
    if isinstance(module, nnx.Einsum):
        return "einsum_op", jnp.einsum, "linear", RecipeEinsum
    if isinstance(module, nnx.Conv):
        return "conv_general_dilated", lax.conv_general_dilated, "conv", RecipeConv
    if isinstance(module, nnx.MultiHeadAttention):
        return "attention_fn", nnx.dot_product_attention, "attention", RecipeAttention
    return None


def _quantize_nnx(model, plan):
    ours = (RecipeDotGeneral, RecipeEinsum, RecipeConv, RecipeAttention, DelayedDotGeneralNnx)
    for path, module in list(nnx.iter_modules(model)):
        slot = _nnx_slot(module)
        name = "/".join(str(p) for p in path)
        if isinstance(module, nnx.Embed):
            _quantize_nnx_embed(module, name, plan)
            continue
        if slot is None:
            for cls, kind, op in _NNX_UNCOVERED:
                if isinstance(module, cls):
                    recipe = match(plan, name, op)[1]
                    if recipe is not None:
                        _warn_uncovered(kind, name, recipe)
                    break
            continue
        attr, default, op, ours_cls = slot
        recipe = match(plan, name, op)[1]
        current = getattr(module, attr)
        # Anything but Flax's default or one of ours is the user's choice and is kept.
        if not (current is default or current is None or current is lax.dot_general
                or isinstance(current, ours)):
            continue
        if recipe is None:
            new = default
        elif recipe.scaling == "delayed":
            if op != "linear" or attr == "einsum_op":  # no delayed state there: own precision
                _warn_uncovered(f"{type(module).__name__} (delayed scaling)", name, recipe)
                continue
            if isinstance(current, DelayedDotGeneralNnx) and current.config == recipe.delayed:
                continue  # already delayed with these options: keep its state
            new = DelayedDotGeneralNnx(recipe.delayed)
        else:
            if op == "conv":
                _check_conv(module.feature_group_count, name)
            new = ours_cls(recipe)
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
