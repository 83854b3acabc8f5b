"""On-batch cells: ``train_on_batch``, ``test_on_batch``, ``predict_on_batch``, ``evaluate`` and
``predict`` as a user's own loop calls them under a distribution, on every rank against a single
process.

``test_on_batch[API-LAYOUT]`` builds the MLP with an MAE metric, hands each rank its local part of
every global batch (the on-batch APIs take the per-process batch as given: no data adapter shards
it), and requires what each call returned on every rank to be the single process's over the global
batch: the logs (loss and MAE, reduced over the batch axis, the same on every rank), the
predictions of the rows the rank fed (every column), and after ``train_on_batch`` the weights
(``conformance.judge.on_batch``). The default tier runs every API on every layout, eager; ``--full``
adds them compiled (``jit``).
"""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge.cells import judge_on_batch, ran_everywhere
from conformance.marks import row_layout_params
from conformance.ranks import on_batch as rank_on_batch


def on_batch_cells(full: bool) -> list[tuple[str, str, str]]:
    """(api, compile, layout): every API on ``axes.ON_BATCH_DEFAULT_LAYOUTS``; under ``--full`` on every
    layout, and compiled too."""
    modes = ("nojit", "jit") if full else ("nojit",)
    layouts = axes.MATRIX_LAYOUTS if full else axes.ON_BATCH_DEFAULT_LAYOUTS
    return [(api, mode, layout) for mode in modes for api in rank_on_batch.APIS for layout in layouts]


def on_batch_params(full: bool) -> list:
    return row_layout_params(on_batch_cells(full), "on-batch", "api")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "on_batch_cell" in metafunc.fixturenames:
        metafunc.parametrize("on_batch_cell", on_batch_params(metafunc.config.getoption("full")))


def test_on_batch(on_batch_cell, keras_ranks, references, request):
    api, compile_mode, layout = on_batch_cell
    spec = {"api": api, "compile": compile_mode, "layout": axes.LAYOUTS[layout], "layout_name": layout}
    request.node.user_properties.append(("spec", spec))
    request.node.user_properties.append(("reference", "same build"))
    result = keras_ranks.run(rank_on_batch.run, spec)
    ran_everywhere(result)  # a cell whose ranks failed has its verdict: no reference is computed for it
    # The reference: the single process over the global batch, shared by the cells of one API.
    judge_on_batch(spec, result, references.single_process(rank_on_batch.run, spec))
