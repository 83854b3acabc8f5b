"""Training cells: model x optimizer x data source x compile mode x layout (see axes.py).

Each cell trains on every rank and is judged on: no failure (classified into a verdict);
sharding kept after build, fit, evaluate and predict, optimizer slots and EMA copies included;
numbers equal to the single-process reference; and, for jit cells, that dynamo really compiled.
"""

from __future__ import annotations

import importlib.util

import pytest

from conformance import axes, rank_train
from conformance.sharding import sharding_problems
from conformance.numerics import numerics_problems
from keras_dtensor_conformance.verdicts import (
    COMPILE_FALLBACK,
    ERROR,
    NUMERICS,
    SHARDING_LOST,
    CellFailure,
    fail,
)


def skip_if_not_in_build(result) -> None:
    for outcome in result.outcomes:
        if outcome.error is not None and outcome.error.type.endswith("NotInBuild"):
            pytest.skip(outcome.error.message)


def judge(spec: dict, result, reference, nproc: int) -> None:
    """Raise ``CellFailure`` with the cell's verdict, or return when the cell passes."""
    if not result.ok:
        fail(result)
    values = result.values
    problems = []
    for rank, value in enumerate(values):
        for stage, variables in value["stages"].items():
            problems += sharding_problems(spec["layout"], variables, nproc, f"rank {rank} after {stage}: ")
        problems += sharding_problems(spec["layout"], value["slots"], nproc, f"rank {rank} optimizer slot ")
    if problems:
        raise CellFailure(SHARDING_LOST, "\n".join(problems), result)
    if not reference.ok:
        raise CellFailure(ERROR, "the single-process reference failed:\n" + reference.story(), reference)
    problems = numerics_problems(values, reference.values[0])
    if problems:
        raise CellFailure(NUMERICS, "\n".join(problems), result)
    if spec["compile"] == "jit" and any(v["compiled_graphs"] == 0 for v in values):
        said = "; ".join(dict.fromkeys(w for v in values for w in v["warnings"])) or "no warning"
        raise CellFailure(COMPILE_FALLBACK, f"jit_compile=True but torch._dynamo compiled no graph ({said})", result)


def test_fit(training_cell, keras_ranks, references):
    model, optimizer, data, compile_mode, layout = training_cell
    package = axes.DATA_SOURCES[data]
    if package and importlib.util.find_spec(package) is None:
        pytest.skip(f"data source {data} needs the {package} package, which is not installed")
    spec = axes.cell_spec(*training_cell)
    result = keras_ranks.run(rank_train.train, spec)
    skip_if_not_in_build(result)
    judge(spec, result, references.get(spec), keras_ranks.nproc)
