"""The matrix's parametrization and the single-process reference, shared by the cell modules."""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.reference import References


@pytest.fixture(scope="session")
def references(conformance_state, keras_ranks) -> References:
    pool = conformance_state.manager.reference()
    pool.start()  # here, so no cell's duration includes starting it
    return References(pool)


def training_params(full: bool) -> list:
    params = []
    for coords in axes.training_cells(full):
        model, optimizer, data, compile_mode, layout_name = coords
        marks = [pytest.mark.cell(
            family=f"fit {layout_name}",
            row=optimizer if model == "mlp" else f"{model} {optimizer}",
            column=f"{data}/{compile_mode}",
            model=model, optimizer=optimizer, data=data, compile=compile_mode, layout=layout_name,
        )]
        layout = axes.LAYOUTS[layout_name]
        if "nproc" not in layout.get("mesh", ("nproc",)):
            marks.append(pytest.mark.mesh(*layout["mesh"]))
        params.append(pytest.param(coords, id=axes.cell_id(*coords), marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "training_cell" in metafunc.fixturenames:
        metafunc.parametrize("training_cell", training_params(metafunc.config.getoption("full")))
