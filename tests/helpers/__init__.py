"""Importable test helpers: assertions, oracles, input generators and the codec harness.

Test files import what they use (``from helpers.asserts import assert_codes_equal``);
tests/conftest.py keeps only what every test file needs (the Hypothesis profiles and the
``element_cases`` parametrization).
"""
