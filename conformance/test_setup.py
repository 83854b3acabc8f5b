"""Setup cells: list_devices, initialize, DeviceMesh, LayoutMap, ModelParallel, DataParallel."""

from __future__ import annotations

import pytest

from conformance import rank_setup
from keras_dtensor_conformance.verdicts import fail


SETUP_PARAMS = [
    pytest.param(entry, id=entry.replace("_", "-"),
                 marks=pytest.mark.cell(family="setup", row=entry.replace("_", "-"), column="keras.distribution", entry=entry))
    for entry in rank_setup.SETUP_CELLS
]


@pytest.mark.parametrize("entry", SETUP_PARAMS)
def test_setup(keras_ranks, entry):
    result = keras_ranks.run(getattr(rank_setup, entry))
    if not result.ok:
        fail(result)
