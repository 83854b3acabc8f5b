"""Agreement cells: what a user of keras.distribution sees, the same on every rank as in one process.

``test_metrics[METRIC-LAYOUT]`` compiles one metric as a user would (MAE; accuracy over a
classification head whose logits are column-sharded under colshard; MAE as a weighted metric fed
sample weights; a custom metric keeping a running maximum, a state that is not additive) and
requires every rank's History, callback ``logs`` and ``evaluate()`` to equal the single-process
reference over the global batch, and each other. ``test_callbacks[CALLBACK-LAYOUT]`` fits with
validation data and EarlyStopping, ReduceLROnPlateau or ModelCheckpoint(save_best_only=True) (every
rank given the same path), and requires every rank to take the same decision at the same epoch as
the reference. A rank that stops alone leaves its peers hanging in the next epoch's collectives:
the cells' short ``rank_timeout`` bounds that, and the judge names the callback and the epoch from
the decisions each rank printed (``conformance.judge.agreement``).

Each rank feeds its local part of every global batch (``cell_data.batch_part``). The default tier
is a handful of cells over DataParallel and column- and batch-sharded ModelParallel; ``--full``
takes every metric and callback over every layout, and the metrics compiled too.
"""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge.cells import judge_agreement
from conformance.marks import mesh_marks, row_layout_params
from conformance.ranks import agreement as rank_agreement

#: A correct build runs a callback cell in a few seconds; a rank that decided alone hangs its
#: peers until this (and the pool restarts).
CALLBACK_TIMEOUT = pytest.mark.rank_timeout(30)

DEFAULT_METRICS = (("mae", "nojit", "dataparallel"), ("weighted-mae", "nojit", "dataparallel"),
                   ("max", "nojit", "dataparallel"), ("accuracy", "nojit", "colshard"),
                   ("top2", "nojit", "colshard"), ("top2", "nojit", "rowshard"),
                   ("mae", "nojit", "batchshard"), ("max", "nojit", "batchshard"))
DEFAULT_CALLBACKS = (("earlystopping", "dataparallel"), ("reducelronplateau", "dataparallel"),
                     ("modelcheckpoint", "dataparallel"), ("earlystopping", "batchshard"))


def metric_cells(full: bool) -> list[tuple[str, str, str]]:
    """(metric, compile, layout): the default tier's, and under ``--full`` every metric on every
    layout, plus compiled (``jit``) under DataParallel, where the nightly really compiles."""
    cells = list(DEFAULT_METRICS)
    if full:
        cells += [(m, "nojit", layout) for m in rank_agreement.METRICS for layout in axes.MATRIX_LAYOUTS]
        cells += [(m, "jit", "dataparallel") for m in rank_agreement.METRICS]
    return list(dict.fromkeys(cells))


def callback_cells(full: bool) -> list[tuple[str, str]]:
    cells = list(DEFAULT_CALLBACKS)
    if full:
        cells += [(c, layout) for c in rank_agreement.CALLBACKS for layout in axes.MATRIX_LAYOUTS]
    return list(dict.fromkeys(cells))


def metric_params(full: bool) -> list:
    return row_layout_params(metric_cells(full), "agreement metrics", "metric")


def callback_params(full: bool) -> list:
    params = []
    for callback, layout in callback_cells(full):
        marks = [pytest.mark.cell(family="agreement callbacks", row=callback, column=layout,
                                  callback=callback, layout=layout), CALLBACK_TIMEOUT, *mesh_marks(layout)]
        params.append(pytest.param((callback, layout), id=f"{callback}-{layout}", marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    full = metafunc.config.getoption("full")
    if "metric_cell" in metafunc.fixturenames:
        metafunc.parametrize("metric_cell", metric_params(full))
    if "callback_cell" in metafunc.fixturenames:
        metafunc.parametrize("callback_cell", callback_params(full))


@pytest.fixture(scope="session")
def agreement_reference(references, tmp_path_factory):
    """``get(spec)``: the single-process run of ``spec`` over the global batch, on the build under test
    (``References.single_process``: cells that differ only in layout or compile mode share one),
    its ModelCheckpoint writing a file of its own."""
    checkpoint = str(tmp_path_factory.mktemp("agreement-reference") / "best.keras")
    return lambda spec: references.single_process(rank_agreement.run, dict(spec, checkpoint=checkpoint))


def _run(spec: dict, keras_ranks, agreement_reference, request) -> None:
    request.node.user_properties.append(("spec", spec))
    request.node.user_properties.append(("reference", "same build"))
    result = keras_ranks.run(rank_agreement.run, spec)
    judge_agreement(spec, result, agreement_reference(spec))


def test_metrics(metric_cell, keras_ranks, agreement_reference, request):
    metric, compile_mode, layout = metric_cell
    spec = {"metric": metric, "compile": compile_mode, "layout": axes.LAYOUTS[layout], "layout_name": layout}
    _run(spec, keras_ranks, agreement_reference, request)


def test_callbacks(callback_cell, keras_ranks, agreement_reference, request, tmp_path):
    callback, layout = callback_cell
    spec = {"callback": callback, "compile": "nojit", "layout": axes.LAYOUTS[layout], "layout_name": layout,
            "checkpoint": str(tmp_path / "best.keras")}  # the same path on every rank
    _run(spec, keras_ranks, agreement_reference, request)
