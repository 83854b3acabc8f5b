"""A plugin for tests/test_slicing.py: writes every selected item's node id and slicing family, in
collection order, to the file $KDC_SLICE_DUMP (after -k, -m and any --conformance-slice)."""

import json
import os

import pytest

from keras_dtensor_conformance.slicing.estimate import family_key


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    with open(os.environ["KDC_SLICE_DUMP"], "w") as f:
        json.dump([[item.nodeid, family_key(item)] for item in session.items], f)
