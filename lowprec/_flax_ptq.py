"""Post-training quantization inside Flax: weights stored as :class:`~lowprec.MXArray` in the
model's state, served by the low-precision product (qwix's ``PtqProvider``, for lowprec's
recipes).

:func:`ptq` quantizes, once, the kernel of every linear layer a plan (a
:class:`~lowprec.Recipe` or :class:`~lowprec.Rules`, kind ``"linear"``) gives a recipe:

* **linen** (``nn.Dense``, ``nn.DenseGeneral``): ``ptq(model, plan)`` returns a
  :class:`PtqLinen`; its ``quantize_params(params, *inputs)`` traces the model once to find
  those layers and returns the parameters with each such ``kernel`` replaced by an MXArray
  (the kernel flattened to ``[in, out]`` and blocked along ``in``, the contraction), and its
  ``apply`` serves from them.
* **nnx** (``nnx.Linear``, ``nnx.LinearGeneral``): ``ptq(model, plan)`` replaces each such
  layer, in place, by a :class:`PtqLinear` holding the MXArray in a :class:`QuantizedWeight`
  variable and the bias.

A served layer computes ``lowprec.dot_general(x, kernel_mx, lhs_format=recipe's lhs format)``
with the recipe's scale rule, rounding and padding: the same bits as the recipe's forward
product on the float kernel (which quantizes the kernel the same way at every call). Only
weights are stored quantized; attention's activation products, convolutions and other layers
run as the model says. The rhs format must be an MX block format (``mxfp8``, ``mxfp6``,
``mxfp4`` ...); per-tensor scaling, delayed scaling and the NVFP4 training recipe are
refused (their weight quantization is not one MXArray). Parameter trees with MXArray leaves
serialize with ``flax.serialization`` (``to_bytes``/``from_bytes`` against a template of the
same structure, e.g. ``jax.eval_shape`` of ``quantize_params``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization
import flax.linen as nn

from ._flax_ops import RecipeDotGeneral
from ._format import MXFormat
from ._matmul import dot_general as _lp_dot_general
from ._mx import quantize_mx
from ._mxarray import MXArray
from ._recipe import Recipe
from ._rules import Rules, match

__all__ = ["PtqLinear", "PtqLinen", "QuantizedWeight", "ptq", "params_nbytes"]


def _check_ptq_recipe(recipe: Recipe, path: str) -> Recipe:
    rfmt = recipe.forward[1]
    why = None
    if recipe.scaling != "none":
        why = f"scaling={recipe.scaling!r} (a per-tensor or delayed scale is not stored)"
    elif recipe._nvfp4_training():
        why = "the NVFP4 training recipe (16 x 16 weight tiles and a tensor scale)"
    elif not isinstance(rfmt, MXFormat):
        why = f"a weight format {getattr(rfmt, 'name', rfmt)!r} that is not an MX block format"
    if why:
        raise ValueError(
            f"lowprec.flax.ptq: the layer at {path or '<root>'} has recipe "
            f"{recipe.name or recipe.describe()!r} with {why}; PTQ stores MX block-format "
            "weights (e.g. Recipe(forward='mxfp8') or Recipe(forward=('mxfp8', 'mxfp4'))): use "
            "one, or keep the layer in its own precision with a rule")
    return recipe


def _quantize_kernel(kernel, n_in: int, recipe: Recipe) -> MXArray:
    """The kernel [in..., out...] flattened to [in, out], blocked along in."""
    k = jnp.asarray(kernel)
    flat = k.reshape(math.prod(k.shape[:n_in]), math.prod(k.shape[n_in:]))
    fmt = recipe.forward[1]
    return quantize_mx(flat, fmt, axis=0, scale_options=recipe.options_of(fmt),
                       rounding=recipe.rounding, pad=recipe.pad)


def _serve(x, w: MXArray, bias, n_in: int, out_shape: tuple, recipe: Recipe, dtype):
    """``x [..., in...] · w`` (+ bias), the last ``n_in`` axes of x contracted."""
    lead = x.shape[: x.ndim - n_in]
    x2 = x.reshape(*lead, w.shape[0])
    fmt = recipe.forward[0]
    opts = recipe.options_of(fmt) if isinstance(fmt, MXFormat) else None
    y = _lp_dot_general(x2, w, (((x2.ndim - 1,), (0,)), ((), ())), lhs_format=fmt,
                        scale_options=opts, rounding=recipe.rounding, pad=recipe.pad,
                        preferred_element_type=dtype)
    y = y.reshape(*lead, *out_shape)
    if bias is not None:
        y = y + jnp.asarray(bias, dtype).reshape(out_shape)
    return y


def params_nbytes(tree) -> int:
    """Bytes of a parameter tree's storage (MXArray: codes and scales; arrays: their data)."""
    leaves = jax.tree.leaves(tree, is_leaf=lambda a: isinstance(a, MXArray))
    return sum(a.nbytes if isinstance(a, MXArray) else int(np.asarray(a).nbytes) for a in leaves)


# -- MXArray in flax.serialization: its leaves as a dict, restored into a template's metadata.


def _mx_to_state(m: MXArray) -> dict:
    out = {"elements": m.elements, "scales": m.scales}
    if m.tensor_scale is not None:
        out["tensor_scale"] = m.tensor_scale
    return out


def _mx_from_state(target: MXArray, state: dict) -> MXArray:
    return dataclasses.replace(
        target, elements=jnp.asarray(state["elements"]), scales=jnp.asarray(state["scales"]),
        tensor_scale=None if target.tensor_scale is None else jnp.asarray(state["tensor_scale"]))


serialization.register_serialization_state(MXArray, _mx_to_state, _mx_from_state, override=True)


# -- linen ---------------------------------------------------------------------------------------


def _linen_layout(module):
    """(number of contracted input axes, output feature shape) of a Dense/DenseGeneral, or
    a reason it is not served."""
    if isinstance(module, nn.Dense):
        return 1, (module.features,)
    axis = module.axis if isinstance(module.axis, tuple) else (module.axis,)
    features = module.features if isinstance(module.features, tuple) else (module.features,)
    if module.batch_dims or tuple(sorted(axis)) != tuple(range(-len(axis), 0)):
        return "DenseGeneral with batch_dims or contracting axes other than the last ones " \
            "(given as negative axes)"
    return len(axis), features


@dataclasses.dataclass(frozen=True)
class PtqLinen:
    """A linen model served from PTQ parameters (from :func:`ptq`).

    ``quantize_params(params, *args, **kwargs)`` runs the model once on example inputs (as
    ``apply`` would, so layer paths are the model's) and returns the parameters with the
    kernels of the layers the plan covers stored as MXArrays; ``apply(qparams, ...)`` runs the
    model with those layers computing from the stored codes. Other attributes are the model's.
    """

    module: nn.Module
    plan: Any

    def _plan_for(self, module):
        if not isinstance(module, (nn.Dense, nn.DenseGeneral)):
            return None
        if module.dot_general is not None or module.dot_general_cls is not None:
            return None  # the layer chose its own product
        path = "/".join(module.path)
        recipe = match(self.plan, path, "linear")[1]
        if recipe is None:
            return None
        layout = _linen_layout(module)
        if isinstance(layout, str):
            raise ValueError(f"lowprec.flax.ptq: the {layout} at {path} is not supported; keep "
                             "it in its own precision with a rule")
        return _check_ptq_recipe(recipe, path), layout

    def quantize_params(self, params, *args, **kwargs):
        found = {}

        def record(next_fun, a, kw, context):
            if context.method_name == "__call__":
                got = self._plan_for(context.module)
                if got is not None:
                    found[tuple(context.module.path)] = got
            return next_fun(*a, **kw)

        with nn.intercept_methods(record):
            jax.eval_shape(lambda p: self.module.apply(p, *args, **kwargs), params)
        out = jax.tree.map(lambda a: a, params)  # a copy of the nested dicts
        for path, (recipe, (n_in, _)) in found.items():
            node = out["params"]
            for name in path:
                node = node[name]
            node["kernel"] = _quantize_kernel(node["kernel"], n_in, recipe)
        return out

    def apply(self, variables, *args, **kwargs):
        def serve(next_fun, a, kw, context):
            module = context.module
            if context.method_name != "__call__" or not module.has_variable("params", "kernel"):
                return next_fun(*a, **kw)
            kernel = module.get_variable("params", "kernel")
            if not isinstance(kernel, MXArray):
                return next_fun(*a, **kw)
            got = self._plan_for(module)
            if got is None:
                raise ValueError(f"lowprec.flax.ptq: {'/'.join(module.path)} holds a quantized "
                                 "kernel but the plan gives it no recipe")
            recipe, (n_in, features) = got
            if kernel.fmt != recipe.forward[1]:
                raise ValueError(
                    f"lowprec.flax.ptq: the kernel at {'/'.join(module.path)} is stored in "
                    f"{kernel.fmt.name} but the plan's recipe has weights in "
                    f"{recipe.forward[1].name}: quantize_params with this plan")
            bias = module.get_variable("params", "bias") if module.use_bias else None
            (x,) = a
            dtype = module.dtype or jnp.result_type(x, module.param_dtype)
            return _serve(jnp.asarray(x, dtype), kernel, bias, n_in, features, recipe, dtype)

        with nn.intercept_methods(serve):
            return self.module.apply(variables, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "plan"):
            raise AttributeError(name)
        return getattr(self.module, name)


# -- nnx -----------------------------------------------------------------------------------------


class QuantizedWeight(nnx.Variable):
    """The nnx variable type of a PTQ kernel (an MXArray): not a ``Param``, so optimizers
    leave it alone; ``nnx.state(model, QuantizedWeight)`` selects the stored weights."""


class PtqLinear(nnx.Module):
    """An nnx linear layer served from an MXArray kernel (made by :func:`ptq` from an
    ``nnx.Linear``/``nnx.LinearGeneral``): ``x [..., in...] · kernel [in, out]`` in the
    recipe's forward formats, plus the float bias."""

    def __init__(self, kernel: MXArray, bias, n_in: int, out_shape: tuple, recipe: Recipe,
                 dtype=None):
        self.kernel = QuantizedWeight(kernel)
        self.bias = None if bias is None else nnx.Param(bias)
        self.n_in, self.out_shape, self.recipe, self.dtype = n_in, tuple(out_shape), recipe, dtype

    def __call__(self, inputs, out_sharding=None):
        if out_sharding is not None:
            raise ValueError("a PTQ layer does not take out_sharding; shard its input instead")
        bias = None if self.bias is None else self.bias[...]
        dtype = self.dtype or jnp.result_type(inputs, jnp.float32 if bias is None else bias)
        return _serve(jnp.asarray(inputs, dtype), self.kernel.get_value(), bias, self.n_in,
                      self.out_shape, self.recipe, dtype)


def _nnx_layout(module):
    if isinstance(module, nnx.Linear):
        return 1, (module.out_features,)
    axis = module.axis if isinstance(module.axis, tuple) else (module.axis,)
    if module.batch_axis or tuple(sorted(axis)) != tuple(range(-len(axis), 0)):
        return "LinearGeneral with batch axes or contracting axes other than the last ones"
    out = module.out_features if isinstance(module.out_features, tuple) else (module.out_features,)
    return len(axis), out


def _ptq_nnx(model, plan):
    replaced = []
    for path, module in list(nnx.iter_modules(model)):
        if not isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
            continue
        if not path:
            raise ValueError(
                "lowprec.flax.ptq replaces linear layers in place inside a model; the model "
                f"given is itself an nnx.{type(module).__name__}: wrap it in a module")
        current = module.dot_general
        if not (current is None or current is jax.lax.dot_general
                or isinstance(current, RecipeDotGeneral)) or \
                getattr(module, "dot_general_cls", None) is not None:
            continue
        name = "/".join(str(p) for p in path)
        recipe = match(plan, name, "linear")[1]
        if recipe is None:
            continue
        layout = _nnx_layout(module)
        if isinstance(layout, str):
            raise ValueError(f"lowprec.flax.ptq: the {layout} at {name} is not supported; keep it "
                             "in its own precision with a rule")
        n_in, out_shape = layout
        _check_ptq_recipe(recipe, name)
        bias = None if module.bias is None else module.bias[...]
        replaced.append((path, PtqLinear(_quantize_kernel(module.kernel[...], n_in, recipe), bias,
                                         n_in, out_shape, recipe, module.dtype)))
    for path, new in replaced:
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        if isinstance(path[-1], int):
            parent[path[-1]] = new
        else:
            setattr(parent, path[-1], new)
    return model


def ptq(model, plan):
    """Post-training quantization: a Flax model served from MX-block weights.

    Args:
      model: a ``flax.linen.Module`` or a ``flax.nnx.Module`` (whose root is not itself a
        linear layer).
      plan: a :class:`~lowprec.Recipe`, :class:`~lowprec.Rules` or list of (path, recipe)
        pairs: which layers, in which formats (the recipe's forward formats, scale rule,
        rounding and padding).

    Returns:
      linen: a :class:`PtqLinen` (``quantize_params`` once, then ``apply``).
      nnx: ``model``, its covered layers replaced in place by :class:`PtqLinear`.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, lowprec
        >>> model = lowprec.flax.ptq(nn.Dense(8), lowprec.Recipe(forward="mxfp4"))
        >>> x = jnp.ones((2, 64))
        >>> qparams = model.quantize_params(nn.Dense(8).init(jax.random.key(0), x), x)
        >>> type(qparams["params"]["kernel"]).__name__, model.apply(qparams, x).shape
        ('MXArray', (2, 8))
    """
    if isinstance(plan, (list, tuple)):
        plan = Rules(plan)
    if not isinstance(plan, (Recipe, Rules)):
        raise TypeError(f"ptq takes a lowprec.Recipe or Rules, got {type(plan).__name__}")
    if isinstance(model, nn.Module):
        return PtqLinen(model, plan)
    if isinstance(model, nnx.Module):
        return _ptq_nnx(model, plan)
    raise TypeError(f"ptq takes a flax.linen or flax.nnx Module, got {type(model).__name__}")
