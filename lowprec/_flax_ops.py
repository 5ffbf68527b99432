"""The recipe's products as the callables Flax layers take (``dot_general=``, ``einsum_op=``,
``conv_general_dilated=``, ``attention_fn=``): frozen, hashable wrappers of a
:class:`lowprec.Recipe`, re-exported by :mod:`lowprec.flax` (and used by ``_flax_ptq`` to
recognize a layer already running in a recipe)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import flax.linen as nn

from ._recipe import Recipe
from ._recipe_conv import recipe_conv_general_dilated


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


@dataclasses.dataclass(frozen=True)
class RecipeConv:
    """A ``lax.conv_general_dilated`` replacement running in ``recipe`` (for linen's and nnx's
    ``Conv(conv_general_dilated=...)``): the recipe's dot over the input's patches, see
    :func:`lowprec.flax.conv_general_dilated`."""

    recipe: Recipe

    def __call__(self, lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
                 dimension_numbers=None, feature_group_count=1, batch_group_count=1,
                 precision=None, preferred_element_type=None, out_sharding=None):
        return recipe_conv_general_dilated(
            self.recipe, lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
            dimension_numbers, feature_group_count, batch_group_count, precision,
            preferred_element_type, out_sharding)


@dataclasses.dataclass(frozen=True)
class RecipeAttention:
    """An ``attention_fn`` for ``nnx.MultiHeadAttention`` whose score and value products
    (``q·kᵀ`` per head, ``p·v``) run in ``recipe`` (:meth:`Recipe.einsum`, blocks along the
    head depth and along the keys); the softmax, mask, bias and dropout are Flax's
    (``flax.linen.dot_product_attention`` with its einsum hooks). Grouped-query attention
    repeats the key/value heads (the same products); ``is_causal`` adds the causal mask."""

    recipe: Recipe

    def __call__(self, query, key, value, bias=None, mask=None, broadcast_dropout=True,
                 dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                 precision=None, module=None, promote_dtype=None, is_causal=False):
        del precision  # the recipe's products ignore it, as Recipe.dot_general does
        if module is not None:
            raise ValueError(
                "sow_weights=True is not supported with a recipe attention_fn: call the layer "
                "without it, or keep the attention products in their own precision (a rule "
                "with ops=('attention',) and recipe None)")
        if key.shape[-2] != query.shape[-2]:  # grouped-query attention: repeat kv heads
            rep = query.shape[-2] // key.shape[-2]
            key, value = jnp.repeat(key, rep, axis=-2), jnp.repeat(value, rep, axis=-2)
        if is_causal:
            causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
            mask = causal if mask is None else jnp.logical_and(mask, causal)
        kwargs = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
        ein = RecipeEinsum(self.recipe)
        return nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
            dtype=dtype, qk_attn_weights_einsum=ein, attn_weights_value_einsum=ein, **kwargs)
