"""Deprecated module attributes: one lookup that every module's ``__getattr__`` shares."""

from __future__ import annotations

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
    # stacklevel 3: past this function and the module's __getattr__, to the caller
    warnings.warn(f"{module}.{name} is deprecated; use {use}", DeprecationWarning, stacklevel=3)
    return value()
