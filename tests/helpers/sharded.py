"""The shares of tests/sharded_cases.py: which cases each ``test_sharding.py`` test reports.

``tests/test_sharding.py`` runs the cases in one subprocess on 4 CPU devices and sorts the
outcomes into shares, each one pytest case: the quick tier's (quantize_mx sharded every way,
deterministic and stochastic, and the split-block error), the block functions and matmuls, the
recipes, training against one device (MLPs, experts) and a transformer block in linen and nnx.
The subprocess is told which shares to run by ``LOWPREC_SHARDED_SHARES`` (comma-separated;
tests/conftest.py deselects the other cases).
"""

from __future__ import annotations

import os

ENV = "LOWPREC_SHARDED_SHARES"
SHARES = ("quick", "blocks_and_matmuls", "recipes", "training", "transformer")
_QUICK_FUNCTIONS = ("test_quantize_mx_bits_same_sharded", "test_stochastic_quantize_mx_same_sharded",
                    "test_split_block_is_a_clear_error_eager")


def share_of(function: str) -> str:
    """The share of a test function of sharded_cases.py (its name, without parameters)."""
    if function in _QUICK_FUNCTIONS:
        return "quick"
    for share, word in (("transformer", "transformer"), ("training", "training"),
                        ("recipes", "recipe")):
        if word in function:
            return share
    return "blocks_and_matmuls"


def deselect_other_shares(config, items) -> None:
    """In the subprocess (``LOWPREC_SHARDED_SHARES`` set), keeps the cases of sharded_cases.py
    in the named shares."""
    wanted = os.environ.get(ENV)
    if wanted is None:
        return
    wanted = set(wanted.split(","))
    unknown = wanted - set(SHARES)
    if unknown:
        raise ValueError(f"{ENV}: unknown shares {sorted(unknown)}; the shares are {SHARES}")
    keep, drop = [], []
    for item in items:
        in_cases = item.path.name == "sharded_cases.py"
        name = getattr(item, "originalname", item.name)
        (keep if not in_cases or share_of(name) in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def run_first(items) -> None:
    """Moves tests/test_sharding.py's tests to the front of the run: its one subprocess is the
    run's longest single piece of work (minutes of CPU), so under pytest-xdist it starts at
    once beside the other worker's tests instead of being a serial tail at the end."""
    first = [item for item in items if item.path.name == "test_sharding.py"]
    if first:
        items[:] = first + [item for item in items if item.path.name != "test_sharding.py"]
