"""Private helpers shared by the analysis modules: input checks, Python-float results and the
one argument order (array first, format second) for functions taking several arrays.

Exact powers of two and exponents come from :mod:`lowprec._bits`, built from float32 bits,
never with ``exp2``/``log2`` in floating point.
"""

from __future__ import annotations

import functools
import pathlib
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from .._bits import F32_ABS, f32_bits, floor_log2_bits
from .._format import is_format_like


def floor_log2(x):
    """floor(log2 |x|) of a float32 array from its bits (int32; 0 gives -150)."""
    return floor_log2_bits(f32_bits(x) & jnp.uint32(F32_ABS))


def as_f32(x, what: str = "x"):
    """``x`` as float32, refusing integer and boolean arrays (float64 is rounded first)."""
    # A NumPy array is put on the device as it is (the same dtype canonicalization):
    # jnp.asarray compiles a program of its own (JAX's "stage") for every new shape.
    x = jax.device_put(x) if isinstance(x, np.ndarray) else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{what} must be a floating-point array, got dtype {x.dtype}; convert it with "
            f"{what}.astype(jnp.float32)"
        )
    return x.astype(jnp.float32)


def scalar(value):
    """A 0-d result as a Python float, or unchanged while traced (jit, vmap, grad)."""
    if isinstance(value, jax.core.Tracer):
        return value
    return float(value)


def array_first(func: str, *args):
    """Returns ``args`` ordered (arrays..., format), accepting lowprec 0.1's (format, arrays...).

    The analysis API takes the array(s) first and the format last, as the rest of lowprec.
    The old order is recognised by type — an array is never a string or a format object —
    and still works, with a DeprecationWarning pointing at the caller.
    """
    if is_format_like(args[0]) and not is_format_like(args[-1]):
        arrays = ", ".join(("x", "q")[: len(args) - 1]) if func == "ulp_error" else "x"
        warnings.warn(
            f"lowprec.analysis.{func}(fmt, {arrays}) is the old argument order; write "
            f"lowprec.analysis.{func}({arrays}, fmt) (array first, format second). The old "
            "order will be removed.",
            DeprecationWarning,
            stacklevel=3,
        )
        return (*args[1:], args[0])
    return args


def require_pandas(func: str):
    """The pandas module, imported on first use (``import lowprec.analysis`` needs none); a
    clear ImportError naming ``func`` and the extra to install otherwise."""
    try:
        import pandas
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"lowprec.analysis.{func} returns a pandas DataFrame: pip install 'lowprec[analysis]'"
        ) from e
    return pandas


@functools.lru_cache(maxsize=1)
def provenance() -> dict:
    """What produced a result: ``{"lowprec_version": ..., "commit": ...}``.

    ``commit`` is the short hash of the git checkout lowprec is imported from (an editable
    install), with ``"+uncommitted"`` when its code or format data differ from it, or None
    (an installed wheel, no git). Read once per process.
    """
    import lowprec

    root = pathlib.Path(lowprec.__file__).resolve().parent.parent
    commit = None
    if (root / ".git").exists() and (root / "formats").is_dir():
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()

        try:
            commit = git("rev-parse", "--short=12", "HEAD") or None
            if commit and git("status", "--porcelain", "--", "lowprec", "reference", "formats"):
                commit += "+uncommitted"
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"lowprec_version": lowprec.__version__, "commit": commit}
