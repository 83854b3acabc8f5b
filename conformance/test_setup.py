"""Setup cells: list_devices, initialize, DeviceMesh, LayoutMap, ModelParallel, DataParallel."""

from __future__ import annotations

import pytest

from conformance.judge.cells import judge_setup
from conformance.ranks import setup_cells as rank_setup

SETUP_PARAMS = [
    pytest.param(entry, id=entry.replace("_", "-"),
                 marks=pytest.mark.cell(family="setup", row=entry.replace("_", "-"), column="keras.distribution", entry=entry))
    for entry in rank_setup.SETUP_CELLS
]


@pytest.mark.parametrize("entry", SETUP_PARAMS)
def test_setup(keras_ranks, entry):
    judge_setup(keras_ranks.run(getattr(rank_setup, entry)))
