"""Per-layer recipes: rules matched against a layer's module path, first match wins.

A :class:`Rules` object is an ordered list of :class:`Rule` s, each a regular expression over
layer paths (names joined by ``/``, e.g. ``"block_0/mlp/up"``) and the :class:`~lowprec.Recipe`
for the layers it matches, or ``None`` to keep them in their own precision. As in qwix's
``QuantizationRule`` (``module_path`` matched with :func:`re.fullmatch`), rules are tried in
order and the first whose pattern matches the whole path decides; a layer no rule matches is
left in its own precision. A recipe's own ``high_precision`` globs still apply inside a rule.
Formats, scale rules, backward modes and the weight-gradient choice are all fields of the
recipe, so any of them can differ per layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple, Union

from ._recipe import Recipe

__all__ = ["Rule", "Rules", "recipe_for"]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: layers whose whole path matches ``module_path`` (a regular expression, as
    :func:`re.fullmatch`) run in ``recipe``; ``recipe=None`` keeps them in their own precision.

    Example:
        >>> Rule("block_[0-9]+/mlp/.*", None).matches("block_3/mlp/up")
        True
    """

    module_path: str
    recipe: Optional[Recipe]

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

    def matches(self, path: str) -> bool:
        """Whether ``path`` (names joined by ``/``) matches the whole pattern."""
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
            elif isinstance(r, (tuple, list)) and len(r) == 2:
                out.append(Rule(*r))
            else:
                raise TypeError(f"each rule must be a Rule or a (module_path, recipe) pair, got {r!r}")
        object.__setattr__(self, "rules", tuple(out))
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a string, got {self.name!r}")

    def recipe_for(self, path: str) -> Optional[Recipe]:
        """The recipe of the layer at ``path``, or None (own precision)."""
        for rule in self.rules:
            if rule.matches(path):
                return recipe_for(rule.recipe, path)
        return None

    def describe(self) -> str:
        """One line per rule."""
        return "\n".join(
            f"{r.module_path}: {'own precision' if r.recipe is None else r.recipe.name or r.recipe.describe()}"
            for r in self.rules
        )


def recipe_for(plan: Union[None, Recipe, Rules], path: str) -> Optional[Recipe]:
    """The recipe a layer at ``path`` runs in under ``plan`` (a Recipe, Rules or None).

    Example:
        >>> import lowprec
        >>> recipe_for(lowprec.Recipe(forward="mxfp8", high_precision=("head",)), "head") is None
        True
    """
    if plan is None:
        return None
    if isinstance(plan, Rules):
        return plan.recipe_for(path)
    return None if plan.keeps_high_precision(path) else plan
