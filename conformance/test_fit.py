"""Training cells: model x optimizer x data source x compile mode x layout (see axes.py).

Each cell trains on every rank and is judged on: no failure (classified into a verdict);
sharding kept after build, fit, evaluate and predict, optimizer slots and EMA copies included;
numbers equal to the single-process torch reference, then to the same build's JAX backend (which
also defines the expected layouts), then the NumPy oracle; and, for jit cells, that dynamo really compiled.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from keras_dtensor_conformance import CellFailure

from conformance import axes
from conformance.judge.cells import judge_fit, ran_everywhere, skip_if_not_in_build
from conformance.judge.communication import figures
from conformance.ranks import train as rank_train


def test_fit(training_cell, keras_ranks, references_for, jax_references, record_checks, request):
    data = training_cell[2]
    package = axes.DATA_SOURCES[data]
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"data source {data} needs the {package} package, which is not installed")
    spec = axes.cell_spec(*training_cell)
    if request.config.getoption("conformance_seed"):  # --conformance-seed: other initial weights and data
        spec["seed"] = request.config.getoption("conformance_seed")
    # The cell as data: the report keeps it, a reproducer carries it. On the item, as the axes are
    # (the record-property fixture would warn under junitxml's default xunit2 family).
    request.node.user_properties.append(("spec", spec))
    jax_references.prefetch(spec)  # the JAX process computes while the ranks do
    result = keras_ranks.run(rank_train.train, spec)
    skip_if_not_in_build(result)
    record_communication(result, request)
    ran_everywhere(result)  # a cell whose ranks failed has its verdict: no reference is computed for it
    reference, jax = references_for(spec, result)
    try:
        judge_fit(spec, result, reference, keras_ranks.nproc, jax.evidence, record=record_checks,
                  jax_failure=jax.failure)
    except CellFailure:
        if jax.evidence is not None:  # what the cell's reproducer judges against
            request.node.user_properties.append(("jax_reference", plain(jax.evidence)))
        raise


def plain(value):
    """``value`` as JSON data: arrays and tuples as lists, NumPy scalars as Python numbers."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def record_communication(result, request) -> None:
    """The cell's collectives per train step (``communication.figures``), for the JSON and HTML reports."""
    if result.ok:
        request.node.user_properties.append(("communication", figures(result.values)))
