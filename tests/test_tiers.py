"""The default run's rule (tests/helpers/tiers.py): a pairwise-covering subset of each test's
parametrized cases, always including its quick-tier cases."""

import itertools
import types

from helpers import tiers


class _Item:
    def __init__(self, name, params, slow=False, extended=False):
        self.path, self.originalname, self.name = "tests/test_x.py", name, name
        self.callspec = types.SimpleNamespace(params=params)
        self._slow, self._extended = slow, extended

    def get_closest_marker(self, name):
        wanted = {"slow": self._slow, "extended": self._extended}.get(name, False)
        return object() if wanted else None


def _grid(name, quick=lambda p: False, **axes):
    names = sorted(axes)
    return [_Item(name, dict(zip(names, values)), slow=not quick(dict(zip(names, values))))
            for values in itertools.product(*(axes[n] for n in names))]


def _pairs(items):
    return {((a, p[a]), (b, p[b])) for p in (i.callspec.params for i in items)
            for a, b in itertools.combinations(sorted(p), 2)}


def test_every_pair_of_values_is_kept_and_fewer_cases_run():
    items = _grid("t", fmt=["e4m3", "e5m2", "e2m1", "bf16", "e8m0"],
                  rounding=["nearest_even", "up", "down", "stochastic"],
                  overflow=["ieee", "saturate"], impl=["reference", "eager", "jit"])
    kept = tiers.covering_cases(items)
    assert _pairs(kept) == _pairs(items)               # every pair of any two parameters
    assert len(kept) < len(items) // 4, len(kept)      # 120 cases -> at most 29
    assert len({id(i) for i in kept}) == len(kept)


def test_quick_cases_are_always_kept_and_small_grids_untouched():
    items = _grid("t", quick=lambda p: p["impl"] == "jit" and p["overflow"] == "ieee",
                  fmt=["a", "b", "c"], overflow=["ieee", "saturate"], impl=["eager", "jit"])
    two = _grid("u", quick=lambda p: p == {"fmt": "a", "axis": 0}, fmt=["a", "b", "c"], axis=[0, 1])
    one = [_Item("v", {"fmt": f}, slow=True) for f in "abc"]
    plain = [types.SimpleNamespace(name="w", get_closest_marker=lambda name: None)]  # plain
    kept = tiers.covering_cases(items + two + one + plain)
    assert all(i in kept for i in items if not i._slow)
    assert _pairs([i for i in kept if i in items]) == _pairs(items)
    assert all(i in kept for i in two + one + plain)   # two parameters: the pairs are the cases


def test_a_two_parameter_sweep_marked_slow_keeps_every_value_once():
    sweep = _grid("s", fmt=["mxfp4", "mxfp6", "mxfp8", "nvfp4"], budget=[64, 200, 1 << 20])
    kept = tiers.covering_cases(sweep)
    assert {i.callspec.params["fmt"] for i in kept} == {"mxfp4", "mxfp6", "mxfp8", "nvfp4"}
    assert {i.callspec.params["budget"] for i in kept} == {64, 200, 1 << 20}
    assert len(kept) == 4


def test_cases_marked_extended_are_left_to_the_extended_sweep():
    # A hand-picked list of (kind, layout, recipe) cases, two of them marked extended; the
    # others are all kept, quick or not (each was picked for what it checks).
    cases = [("explicit", "data", "a"), ("auto", "tensor", "a"), ("explicit", "fsdp", "b"),
             ("auto", "data", "b"), ("explicit", "tensor", "c")]
    items = [_Item("t", dict(zip(("kind", "layout", "recipe"), c)), slow=True,
                   extended=c in (("auto", "data", "b"), ("explicit", "tensor", "c")))
             for c in cases]
    plain = _Item("p", {"fmt": "a"}, extended=True)  # one parameter: dropped all the same
    kept = tiers.covering_cases(items + [plain])
    assert kept == [i for i in items if not i._extended]


def test_the_choice_does_not_depend_on_anything_but_collection_order():
    # Every xdist worker must deselect the same cases.
    a = _grid("t", fmt=list("abcdef"), rounding=list("wxyz"), impl=list("pq"))
    b = _grid("t", fmt=list("abcdef"), rounding=list("wxyz"), impl=list("pq"))
    ids = lambda kept, items: [items.index(i) for i in kept]
    assert ids(tiers.covering_cases(a), a) == ids(tiers.covering_cases(b), b)


def test_the_extended_sweep_is_opted_into_by_environment(monkeypatch):
    for value, full in (("1", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv(tiers.FULL_SUITE_ENV, value)
        assert tiers.full_suite() is full
    monkeypatch.delenv(tiers.FULL_SUITE_ENV)
    assert tiers.full_suite() is False


def test_the_element_codecs_quick_rule_keeps_every_format_mode_policy_and_implementation():
    """helpers.codecs.in_quick_tier thins the (format, rounding, overflow, implementation)
    product but, as its docstring says, every value of each still runs in the quick tier."""
    from helpers import codecs

    formats, modes = codecs.FORMATS, codecs.ROUNDING_MODES
    overflows, impls = codecs.OVERFLOW_POLICIES, codecs.IMPLS
    kept = [(f, r, o, i) for f in formats for r in modes for o in overflows for i in impls
            if codecs.in_quick_tier({"fmt": f, "rounding": r, "overflow": o,
                                     "codec": types.SimpleNamespace(name=i)}, overflows, impls)]
    for k, values in enumerate((formats, modes, overflows, impls)):
        assert {c[k] for c in kept} == set(values), values
    assert len(kept) < len(formats) * len(modes) // 3  # and it does thin the product
