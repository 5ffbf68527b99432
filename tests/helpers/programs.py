"""Program identity: two functions that trace to the same jaxpr compute the same bits.

A test of plumbing (a layer given a recipe by ``quantize_model`` against the same layer given
the recipe's products by hand) holds when both sides trace to one program: the same
equations on the same inputs, the same constants. Comparing the traced programs checks that
without compiling either (XLA's compile of a quantized forward and backward pass takes
seconds; tracing it, a fraction of that), and it is stronger than comparing outputs on one
input: it holds for every input.
"""

from __future__ import annotations

import difflib

import jax
import numpy as np

from helpers.asserts import assert_bits_equal


def traced(f, *args):
    """The closed jaxpr of ``f`` traced on ``args`` (arrays or pytrees of arrays)."""
    return jax.make_jaxpr(f)(*args)


def assert_same_program(f, g, *args, what: str = "") -> str:
    """Asserts that ``f`` and ``g`` trace to the same jaxpr on ``args``, constants included;
    returns its text (for further comparisons). The report shows the first differing lines."""
    a, b = traced(f, *args), traced(g, *args)
    ta, tb = str(a), str(b)
    if ta != tb:
        diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), "got", "want",
                                         n=1, lineterm=""))
        raise AssertionError(f"{what}: different programs:\n" + "\n".join(diff[:30]))
    assert len(a.consts) == len(b.consts), f"{what}: {len(a.consts)} != {len(b.consts)} constants"
    for i, (ca, cb) in enumerate(zip(a.consts, b.consts)):
        assert_bits_equal(np.asarray(ca), np.asarray(cb), f"{what}: constant {i}")
    return ta
