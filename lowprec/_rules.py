"""Per-layer recipes: rules matched against a layer's module path, first match wins.

A :class:`Rules` object is an ordered list of :class:`Rule` s, each a regular expression over
layer paths (names joined by ``/``, e.g. ``"block_0/mlp/up"``) and the :class:`~lowprec.Recipe`
for the layers it matches, or ``None`` to keep them in their own precision. As in qwix's
``QuantizationRule`` (``module_path`` matched with :func:`re.fullmatch`), rules are tried in
order and the first whose pattern matches the whole path decides; a layer no rule matches is
left in its own precision. A recipe's own ``high_precision`` globs still apply inside a rule.
A rule may name the kinds of product it covers (``ops``, as qwix's ``op_names``): ``"linear"``
(Dense/Linear/Einsum layers), ``"attention"`` (an attention layer's score and value products),
``"conv"`` (convolutions) and ``"attend"`` (tied output embeddings, ``Embed.attend``); a rule
without ``ops`` covers all of them. Formats, scale rules, backward modes and the weight-gradient choice are all fields of the
recipe, so any of them can differ per layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple, Union

from ._recipe import Recipe

__all__ = ["OPS", "Rule", "Rules", "match", "recipe_for"]

#: The kinds of product a rule can name in ``Rule.ops``.
OPS = ("linear", "attention", "conv", "attend")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: layers whose whole path matches ``module_path`` (a regular expression, as
    :func:`re.fullmatch`) run in ``recipe``; ``recipe=None`` keeps them in their own precision.
    ``ops`` limits the rule to those kinds of product (:data:`OPS`); empty: every kind.

    Example:
        >>> Rule("block_[0-9]+/mlp/.*", None).matches("block_3/mlp/up")
        True
        >>> Rule(".*", None, ops=("attention",)).matches("b0/attn", "linear")
        False
    """

    module_path: str
    recipe: Optional[Recipe]
    ops: Tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.module_path, str):
            raise TypeError(f"module_path must be a regular expression string, got {self.module_path!r}")
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(f"module_path {self.module_path!r} is not a valid regular expression: {e}") from None
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            raise TypeError(
                f"a rule's recipe must be a lowprec.Recipe or None, got {type(self.recipe).__name__}"
            )
        ops = (self.ops,) if isinstance(self.ops, str) else tuple(self.ops)
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown} in rule {self.module_path!r}; valid: {OPS}")
        object.__setattr__(self, "ops", ops)

    def matches(self, path: str, op: Optional[str] = None) -> bool:
        """Whether ``path`` (names joined by ``/``) matches the whole pattern and, when ``op``
        is given, the rule covers that kind of product."""
        if op is not None and self.ops and op not in self.ops:
            return False
        return re.fullmatch(self.module_path, path) is not None


@dataclasses.dataclass(frozen=True)
class Rules:
    """Ordered per-layer rules (first match wins; no match: own precision). Frozen, hashable.

    Args:
      rules: :class:`Rule` s, or ``(module_path, recipe)`` pairs.
      name: a label for warnings and tables.

    Example:
        >>> import lowprec
        >>> rules = Rules([("lm_head", None), (".*attn/.*", lowprec.NVIDIA_MXFP8),
        ...                (".*", lowprec.Recipe(forward="mxfp4", grad="mxfp8_e4m3"))])
        >>> rules.recipe_for("lm_head") is None, rules.recipe_for("b0/attn/query").name
        (True, 'nvidia_mxfp8')
        >>> rules.recipe_for("b0/mlp/up").forward[0].name
        'mxfp4'
    """

    rules: Tuple[Rule, ...]
    name: str = ""

    def __post_init__(self):
        rules = self.rules
        if isinstance(rules, (Rule, str)) or not hasattr(rules, "__iter__"):
            raise TypeError(f"rules takes a sequence of Rule or (module_path, recipe) pairs, got {rules!r}")
        out = []
        for r in rules:
            if isinstance(r, Rule):
                out.append(r)
            elif isinstance(r, (tuple, list)) and len(r) in (2, 3):
                out.append(Rule(*r))
            else:
                raise TypeError(
                    f"each rule must be a Rule or a (module_path, recipe[, ops]) tuple, got {r!r}")
        object.__setattr__(self, "rules", tuple(out))
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {self.name!r}")

    def recipe_for(self, path: str, op: Optional[str] = None) -> Optional[Recipe]:
        """The recipe of the product of kind ``op`` at ``path``, or None (own precision)."""
        return match(self, path, op)[1]

    def describe(self) -> str:
        """One line per rule."""
        return "\n".join(
            f"{r.module_path}: {'own precision' if r.recipe is None else r.recipe.name or r.recipe.describe()}"
            for r in self.rules
        )


def match(plan: Union[None, Recipe, Rules], path: str,
          op: Optional[str] = None) -> Tuple[bool, Optional[Recipe]]:
    """Whether ``plan`` decides the product of kind ``op`` at ``path``, and its recipe (None:
    own precision). A Recipe decides every path (its ``high_precision`` globs keep a path in its
    own precision); Rules decide the paths one of their rules matches; None decides nothing.
    Nested :func:`lowprec.flax.intercepting` blocks ask the innermost plan first and the next
    one out only where it decides nothing.

    Example:
        >>> import lowprec
        >>> match(Rules([("head", None)]), "head"), match(Rules([("head", None)]), "up")
        ((True, None), (False, None))
    """
    if op is not None and op not in OPS:
        raise ValueError(f"unknown op {op!r}; valid: {OPS}")
    if plan is None:
        return False, None
    if isinstance(plan, Rules):
        for rule in plan.rules:
            if rule.matches(path, op):
                return True, recipe_for(rule.recipe, path)
        return False, None
    return True, (None if plan.keeps_high_precision(path) else plan)


def recipe_for(plan: Union[None, Recipe, Rules], path: str,
               op: Optional[str] = None) -> Optional[Recipe]:
    """The recipe the product of kind ``op`` (:data:`OPS`; None: any) at ``path`` runs in
    under ``plan`` (a Recipe, Rules or None); None: its own precision.

    Example:
        >>> import lowprec
        >>> recipe_for(lowprec.Recipe(forward="mxfp8", high_precision=("head",)), "head") is None
        True
    """
    return match(plan, path, op)[1]
