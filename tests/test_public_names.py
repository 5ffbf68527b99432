"""One public spelling per concept (issue 38): every vocabulary ``lowprec`` exports is an enum
whose members are its names; no tuple of the same names, no alias of a member, no second
name for one object. The old spellings still work for a while, with a DeprecationWarning.
"""

from __future__ import annotations

import enum

import pytest

import lowprec
import lowprec.kernels
import lowprec_formats
from lowprec import _scheme

#: The vocabularies of the public API and the enum that spells each.
VOCABULARIES = {
    "rounding mode": "Rounding",
    "overflow policy": "Overflow",
    "scale rule": "ScaleRule",
    "backward mode": "BackwardMode",
    "NVFP4 element step": "NVFP4Step",
}


def _public():
    return {name: getattr(lowprec, name) for name in lowprec.__all__}


def _enums():
    return {n: v for n, v in _public().items() if isinstance(v, type) and issubclass(v, enum.Enum)}


def test_every_vocabulary_is_one_exported_enum():
    enums = _enums()
    assert set(VOCABULARIES.values()) <= set(enums), sorted(set(VOCABULARIES.values()) - set(enums))
    for name in VOCABULARIES.values():
        members = list(enums[name])
        # str members, each documented, so the enum is the one place its names are defined
        assert all(isinstance(m, str) and m == m.value for m in members), name
        assert all(m.__doc__ and m.__doc__ != enums[name].__doc__ for m in members), name


@pytest.mark.parametrize("module", ["lowprec", "lowprec.checkpoint",
                                    "lowprec.checkpoint._formats"])
def test_no_second_spelling_of_a_vocabulary(module):
    """Neither lowprec nor lowprec.checkpoint (nor the checkpoint module the CLI reads its
    vocabularies from) exports a vocabulary's names a second time."""
    import importlib

    mod = importlib.import_module(module)
    enums = _enums()
    values = {n: {m.value for m in e} for n, e in enums.items()}
    for name, obj in {n: getattr(mod, n) for n in mod.__all__}.items():
        if name in enums:
            continue
        for enum_name, enum_cls in enums.items():
            # a member exported under a name of its own (the old DEFAULT_SCALE_RULE)
            assert not isinstance(obj, enum_cls), f"{module}.{name} is a {enum_name} member"
            # a tuple (or set, list, dict) of the enum's names
            if isinstance(obj, (tuple, list, set, frozenset, dict)) and obj and all(
                    isinstance(v, str) for v in obj):
                assert not set(obj) <= values[enum_name], (
                    f"{module}.{name} spells {enum_name}'s names a second time")


def test_no_public_object_has_two_names():
    seen = {}
    for name, obj in _public().items():
        if isinstance(obj, (int, float, str)):
            continue
        assert id(obj) not in seen, f"lowprec.{name} is lowprec.{seen[id(obj)]}"
        seen[id(obj)] = name


def test_the_tests_see_a_second_spelling():
    # The check above fails on what the old API had: a tuple of rounding names beside Rounding.
    values = {m.value for m in lowprec.Rounding}
    assert set(lowprec_formats.ROUNDING_MODES) <= values


def test_scheme_class_and_its_registry_are_exported_together():
    assert "ScaleScheme" in lowprec.__all__ and "register_scale_scheme" in lowprec.__all__
    assert lowprec.register_scale_scheme is _scheme.register


def test_kernel_entry_points_live_in_lowprec_kernels():
    assert "mxfp4_gemv" in lowprec.kernels.__all__ and "mxfp4_gemv" not in lowprec.__all__


# (old name, its value now: derived from the enum or found where it moved)
DEPRECATED = [
    ("ROUNDING_MODES", lambda: tuple(lowprec_formats.ROUNDING_MODES)),
    ("OVERFLOW_POLICIES", lambda: tuple(p.value for p in lowprec.Overflow)),
    ("SCALE_RULES", lambda: tuple(r.value for r in lowprec.ScaleRule)),
    ("DEFAULT_SCALE_RULE", lambda: lowprec.ScaleRule.FLOOR),
    ("BACKWARD_MODES", lambda: tuple(m.value for m in lowprec.BackwardMode)),
    ("mxfp4_gemv", lambda: lowprec.kernels.mxfp4_gemv),
]


@pytest.mark.parametrize("name, now", DEPRECATED, ids=[d[0] for d in DEPRECATED])
def test_old_spellings_warn_and_still_work(name, now):
    assert name not in lowprec.__all__
    with pytest.warns(DeprecationWarning, match=f"lowprec.{name} is deprecated"):
        value = getattr(lowprec, name)
    assert value == now()
    if isinstance(value, tuple):  # what was given before: the names in the data's order
        assert value == tuple(v.value if isinstance(v, enum.Enum) else v for v in value)


@pytest.mark.parametrize("name, now", DEPRECATED[2:4], ids=[d[0] for d in DEPRECATED[2:4]])
def test_checkpoint_scale_rule_tuples_are_deprecated(name, now):
    """The CLI's module of checkpoint vocabularies exported SCALE_RULES / DEFAULT_SCALE_RULE
    beside lowprec.ScaleRule: the same deprecation path as lowprec's."""
    from lowprec.checkpoint import _formats

    assert name not in _formats.__all__
    with pytest.warns(DeprecationWarning, match=f"lowprec.checkpoint._formats.{name} is "
                                                "deprecated; use lowprec.ScaleRule"):
        assert getattr(_formats, name) == now()
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        _formats.NO_SUCH_NAME  # noqa: B018


def test_old_spellings_are_not_star_imported():
    namespace = {}
    exec("from lowprec import *", namespace)  # noqa: S102 - the module's own __all__
    assert not {d[0] for d in DEPRECATED} & set(namespace)
    with pytest.raises(AttributeError, match="no attribute 'NO_SUCH_NAME'"):
        lowprec.NO_SUCH_NAME  # noqa: B018


def test_string_spellings_are_still_accepted():
    import jax.numpy as jnp

    a, b = jnp.ones((2, 64)), jnp.ones((64, 3))
    for mode in lowprec.BackwardMode:
        assert (lowprec.matmul(a, b, lhs_format="mxfp8", backward=mode.value).tolist()
                == lowprec.matmul(a, b, lhs_format="mxfp8", backward=mode).tolist())
    with pytest.raises(ValueError, match="unknown backward mode 'nope'"):
        lowprec.matmul(a, b, lhs_format="mxfp8", backward="nope")
    x = jnp.linspace(-3.0, 3.0, 64)
    for step in lowprec.NVFP4Step:
        s = lowprec.quantize_mx(x, "nvfp4", nvfp4_step=step.value)
        e = lowprec.quantize_mx(x, "nvfp4", nvfp4_step=step)
        assert s.elements.tolist() == e.elements.tolist()
    with pytest.raises(ValueError, match="unknown nvfp4_step 'nope'"):
        lowprec.quantize_mx(x, "nvfp4", nvfp4_step="nope")
