"""The matrix's parametrization and the single-process reference, shared by the cell modules."""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.reference import References


@pytest.fixture(scope="session")
def references(conformance_state, keras_ranks) -> References:
    return References(conformance_state.manager.reference())


def training_params(full: bool) -> list:
    params = []
    for coords in axes.training_cells(full):
        marks = []
        layout = axes.LAYOUTS[coords[4]]
        if "mesh" in layout:
            marks.append(pytest.mark.mesh(*layout["mesh"]))
        params.append(pytest.param(coords, id=axes.cell_id(*coords), marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "training_cell" in metafunc.fixturenames:
        metafunc.parametrize("training_cell", training_params(metafunc.config.getoption("full")))
