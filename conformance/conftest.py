"""The matrix's parametrization and the single-process reference, shared by the cell modules."""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge import oracle
from conformance.reference import OtherBuild, References


@pytest.fixture(scope="session")
def references(conformance_state, keras_ranks) -> References:
    """The single-process references: on the build under test, or on --reference-keras-path's
    build with the build under test as the fallback (then started only when a cell needs it)."""
    manager = conformance_state.manager
    if conformance_state.reference_path is None:
        manager.reference().start()  # here, so no cell's duration includes starting it
        return References(manager.reference())
    other = manager.reference(conformance_state.reference_path)
    other.start()
    return References(manager.reference(), OtherBuild(other, conformance_state.reference_label))


@pytest.fixture
def reference_for(references, request):
    """``reference_for(spec)``: the cell's reference PoolResult; records on the cell (JSON report,
    junitxml) which reference that was and whether the NumPy oracle judges the cell.

    Through the item's ``user_properties``, as the cell's axes are (``record_property`` would warn
    under junitxml's default xunit2 family)."""

    def get(spec: dict):
        properties = request.node.user_properties
        properties.append(("oracle", oracle.coverage(spec)))
        reference = references.lookup(spec)
        properties.append(("reference", reference.source))
        return reference.result

    return get


def training_params(full: bool) -> list:
    params = []
    for coords in axes.training_cells(full):
        model, optimizer, data, compile_mode, layout_name = coords
        marks = [pytest.mark.cell(
            # "hand-fed": each rank feeds its own part (auto_shard_dataset=False), as against the
            # "keras-sharded" cells of test_data_sharding.py; promises.py reads the first word.
            family=f"fit {layout_name} hand-fed",
            row=optimizer if model == "mlp" else f"{model} {optimizer}",
            column=f"{data}/{compile_mode}",
            model=model, optimizer=optimizer, data=data, compile=compile_mode, layout=layout_name,
        )]
        layout = axes.LAYOUTS[layout_name]
        if "nproc" not in layout.get("mesh", ("nproc",)):
            marks.append(pytest.mark.mesh(*layout["mesh"]))
        params.append(pytest.param(coords, id=axes.cell_id(*coords), marks=marks))
    return params


@pytest.hookimpl(optionalhook=True)
def pytest_conformance_reproducer_families() -> list:
    """The training and op cells' reproducers (``reproducible.py``); optional, as a hook of a
    plugin that may be disabled (``-p no:dtensor_conformance``) must be."""
    from conformance import reproducible

    return list(reproducible.FAMILIES)


@pytest.hookimpl(optionalhook=True)
def pytest_conformance_promises() -> list:
    """The promises of keras.distribution the cells test (``promises.py``), which the report leads with."""
    from conformance import promises

    return list(promises.PROMISES)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "training_cell" in metafunc.fixturenames:
        metafunc.parametrize("training_cell", training_params(metafunc.config.getoption("full")))
