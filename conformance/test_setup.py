"""Setup cells: list_devices, initialize, DeviceMesh, LayoutMap, ModelParallel, DataParallel."""

from __future__ import annotations

import pytest

from conformance import rank_setup
from conformance.judge import judge_setup


SETUP_PARAMS = [
    pytest.param(entry, id=entry.replace("_", "-"),
                 marks=pytest.mark.cell(family="setup", row=entry.replace("_", "-"), column="keras.distribution", entry=entry))
    for entry in rank_setup.SETUP_CELLS
]


@pytest.mark.parametrize("entry", SETUP_PARAMS)
def test_setup(keras_ranks, entry):
    judge_setup(keras_ranks.run(getattr(rank_setup, entry)))
