"""Runs the docstring examples of every public module (they are documentation that must not rot)."""

import doctest
import importlib
import importlib.machinery
import pkgutil

import pytest

import lowprec
import lowprec_formats


def _modules():
    names = [lowprec_formats.__name__]
    for info in pkgutil.walk_packages(lowprec.__path__, prefix="lowprec."):
        # The native kernels' shared library (lowprec/kernels/liblowprec_cpu.so) is loaded with
        # ctypes, not imported: a walk lists it because ".so" is an extension-module suffix.
        spec = info.module_finder.find_spec(info.name.rpartition(".")[2])
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            continue
        names.append(info.name)
    return sorted(set(names))


# Left out of the quick tier: examples that take a second or more (compiling matmuls, Flax
# models, compare() over formats and seeds); the quick tier runs those modules in their tests.
SLOW_EXAMPLES = (
    "lowprec.analysis._compare", "lowprec.flax", "lowprec._matmul", "lowprec._recipe",
    "lowprec._delayed", "lowprec.kernels", "lowprec.checkpoint._engine_convert",
    "lowprec.analysis._metrics", "lowprec.optim", "lowprec._ragged", "lowprec._gpt_oss",
    "lowprec.analysis._bounds", "lowprec._pack", "lowprec.analysis._stochastic",
    "lowprec.analysis._mx_stats", "lowprec.checkpoint", "lowprec.checkpoint._convert",
    "lowprec.analysis._plots", "lowprec.checkpoint._chunk", "lowprec._bits",
    "lowprec._rounding_key",
    # 1-2 s each: the exact float32 pipelines of IF4 and MixFP4, MXFP4 -> NVFP4, PTQ, the
    # Pallas GEMV and the recipe's convolution (quick tests run those modules: test_four_bit_2026,
    # test_gguf, test_flax_ptq, test_kernels, test_flax)
    "lowprec._scheme_if4", "lowprec._scheme_mixfp4", "lowprec._mxfp4_nvfp4",
    "lowprec._flax_ptq", "lowprec.kernels._gemv_pallas", "lowprec._recipe_conv",
)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_EXAMPLES else n for n in _modules()],
)
def test_docstring_examples(name):
    if name.endswith("__main__"):
        pytest.skip("entry point module")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest failure(s) in {name}"


def test_there_are_docstring_examples():
    # Guards the parametrization above: a walk that found nothing would pass vacuously.
    total = sum(
        len(doctest.DocTestFinder().find(importlib.import_module(n)))
        for n in ("lowprec._codec", "lowprec._mx", "lowprec._format")
    )
    assert total >= 10
