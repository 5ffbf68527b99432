"""Deprecated module attributes: one lookup that every module's ``__getattr__`` shares, and
assignment to the ones that were settable knobs."""

from __future__ import annotations

import sys
import types
import warnings


def deprecated_attribute(module: str, table: dict, name: str):
    """The value of ``module``'s deprecated attribute ``name``, with a DeprecationWarning
    that points at the caller's line.

    ``table`` maps each deprecated name to ``(what to use instead, thunk giving the value)``;
    any other name raises the AttributeError Python's own lookup would.
    """
    if name not in table:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    use, value = table[name]
    # stacklevel 4: past these two functions and the module's __getattr__, to the caller
    warn_deprecated(f"{module}.{name}", use, stacklevel=4)
    return value()


def warn_deprecated(old: str, use: str, stacklevel: int = 3) -> None:
    """The DeprecationWarning of a former spelling ``old`` (an attribute or a keyword),
    naming its replacement ``use``; ``stacklevel`` counts from this function (3: the caller
    of the function that calls it)."""
    warnings.warn(f"{old} is deprecated; use {use}", DeprecationWarning, stacklevel=stacklevel)


def settable_deprecated_attributes(module: str, table: dict) -> None:
    """Makes assignments to ``module``'s deprecated attributes (read through
    :func:`deprecated_attribute`) still take effect, with a DeprecationWarning at the
    assigning line.

    ``table`` maps each name to ``(what to use instead, function taking the assigned
    value)``; other assignments are ordinary ones.
    """
    mod = sys.modules[module]

    class _Module(types.ModuleType):
        def __setattr__(self, name, value):
            if name not in table:
                super().__setattr__(name, value)
                return
            use, setter = table[name]
            warn_deprecated(f"{module}.{name}", use)
            setter(value)

    mod.__class__ = _Module
