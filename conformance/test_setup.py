"""Setup cells: list_devices, initialize, DeviceMesh, LayoutMap, ModelParallel, DataParallel."""

from __future__ import annotations

import pytest

from conformance import rank_setup
from keras_dtensor_conformance.verdicts import CellFailure, classify_failure


@pytest.mark.parametrize("entry", rank_setup.SETUP_CELLS, ids=[c.replace("_", "-") for c in rank_setup.SETUP_CELLS])
def test_setup(keras_ranks, entry):
    result = keras_ranks.run(getattr(rank_setup, entry))
    if not result.ok:
        raise CellFailure(*classify_failure(result))
