"""The matrix's parametrization and the single-process reference, shared by the cell modules."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Iterator

import pytest
from keras_dtensor_conformance import CHECKS_PROPERTY, as_record

from conformance import axes
from conformance.judge import oracle
from conformance.judge.sharding import mesh_shape
from conformance.marks import mesh_marks
from conformance.reference import JaxReferences, OtherBuild, References, both, jax_installed


@pytest.fixture
def record_checks(request):
    """``record(outcomes)``: a cell's checks' outcomes (``{name: (outcome, why)}``) on its item, for
    the report, which counts promises from them (``keras_dtensor_conformance.checks``)."""
    def record(outcomes: dict) -> None:
        request.node.user_properties.append((CHECKS_PROPERTY, as_record(outcomes)))

    return record


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


def jax_devices(nproc: int) -> int:
    """Virtual CPU devices for the JAX reference: enough for every layout's mesh with ``nproc`` ranks."""
    sizes = [nproc]
    for layout in axes.LAYOUTS.values():
        if layout["kind"] == "model-parallel":
            batch, model = mesh_shape(layout, nproc)
            sizes.append(batch * model)
    return max(sizes)


#: pytest's cache folder (``.pytest_cache``) that keeps the JAX reference's XLA executables between
#: sessions (``PoolManager.jax_reference``); ``--cache-clear`` empties it.
JAX_CACHE = "keras-dtensor-conformance-jax-xla"


@pytest.fixture(scope="session")
def jax_references(conformance_state, keras_ranks, pytestconfig) -> Iterator[JaxReferences]:
    """The JAX references of training cells (``conformance/reference.py``); without JAX installed,
    one that runs nothing and says why (the report header says it once)."""
    pool = None
    if jax_installed():
        # Without pytest's cacheprovider (-p no:cacheprovider), the session's own folder.
        cache = pytestconfig.cache.mkdir(JAX_CACHE) if getattr(pytestconfig, "cache", None) is not None else None
        pool = conformance_state.manager.jax_reference(jax_devices(keras_ranks.nproc), cache and str(cache))
        # Started here, so no cell's duration includes it, and side by side with the torch reference.
        thread = threading.Thread(target=pool.start, name="kdc-jax-start", daemon=True)
        thread.start()
        try:
            conformance_state.manager.reference().start()
        finally:
            thread.join()
    references = JaxReferences(pool, keras_ranks.nproc)
    yield references
    references.close()


@pytest.fixture
def references_for(references, jax_references, request):
    """``references_for(spec, result)``: the cell's single-process torch reference (PoolResult) and
    its JAX reference (``reference.JaxReference``), computed side by side; records on the cell which
    references judged it (``references``: same-build torch, jax (or why not), numpy oracle) and,
    as before, ``reference`` and ``oracle``."""

    def get(spec: dict, result):
        properties = request.node.user_properties
        coverage = oracle.coverage(spec)
        properties.append(("oracle", coverage))
        torch_reference, jax = both(references, jax_references, spec, result.values if result.ok else None)
        properties.append(("reference", torch_reference.source))
        properties.append(("references", {"same-build torch": torch_reference.source, "jax": jax.note,
                                          "numpy oracle": coverage}))
        return torch_reference.result, jax

    return get


def training_params(full: bool) -> list:
    params = []
    for coords in axes.training_cells(full):
        model, optimizer, data, compile_mode, layout_name, policy = coords
        marks = [pytest.mark.cell(
            # "hand-fed": each rank feeds its own part (auto_shard_dataset=False), as against the
            # "keras-sharded" cells of test_data_sharding.py; promises.py reads the first word.
            family=f"fit {layout_name} hand-fed",
            row=" ".join(axes.row_parts(model, optimizer, policy)),
            column=f"{data}/{compile_mode}",
            model=model, optimizer=optimizer, data=data, compile=compile_mode, layout=layout_name, policy=policy,
        ), *mesh_marks(layout_name)]
        params.append(pytest.param(coords, id=axes.cell_id(*coords), marks=marks))
    return params


@pytest.hookimpl(optionalhook=True)
def pytest_conformance_reproducer_families() -> list:
    """The training and op cells' reproducers (``reproducible.py``); optional, as a hook of a
    plugin that may be disabled (``-p no:dtensor_conformance``) must be."""
    from conformance import reproducible

    return list(reproducible.FAMILIES)


@pytest.hookimpl(optionalhook=True)
def pytest_conformance_recorded_expectations(config) -> list:
    """The expectations files recorded for the default build (``expectations/``: its nproc-2 file and the
    2x2 mesh's), each naming the build, torch, backend and nproc it was recorded for."""
    folder = pathlib.Path(__file__).resolve().parent.parent / "expectations"
    return sorted(str(path) for path in folder.glob("*.txt"))


@pytest.hookimpl(optionalhook=True)
def pytest_conformance_promises() -> list:
    """The promises of keras.distribution the cells test (``promises.py``), which the report leads with."""
    from conformance import promises

    return list(promises.PROMISES)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "training_cell" in metafunc.fixturenames:
        metafunc.parametrize("training_cell", training_params(metafunc.config.getoption("full")))
