"""A pytest plugin that runs the collected items in reverse order (``-p tests.reverse_order``): the
order self-test runs one selection forward, reversed and on fresh ranks (tests/test_fresh_verdicts.py)."""

import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    items.reverse()
