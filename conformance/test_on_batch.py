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

import json

import pytest

from conformance import axes
from conformance.judge import judge_on_batch
from conformance.marks import mesh_marks
from conformance.ranks import on_batch as rank_on_batch


def on_batch_cells(full: bool) -> list[tuple[str, str, str]]:
    """(api, compile, layout): every API on every layout, and compiled too under ``--full``."""
    modes = ("nojit", "jit") if full else ("nojit",)
    return [(api, mode, layout) for mode in modes for api in rank_on_batch.APIS for layout in axes.LAYOUTS]


def on_batch_params(full: bool) -> list:
    params = []
    for api, compile_mode, layout in on_batch_cells(full):
        cell_id = "-".join([api, layout] if compile_mode == "nojit" else [api, compile_mode, layout])
        marks = [pytest.mark.cell(family="on-batch", row=api, column=f"{layout}/{compile_mode}",
                                  api=api, compile=compile_mode, layout=layout), *mesh_marks(layout)]
        params.append(pytest.param((api, compile_mode, layout), id=cell_id, marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "on_batch_cell" in metafunc.fixturenames:
        metafunc.parametrize("on_batch_cell", on_batch_params(metafunc.config.getoption("full")))


@pytest.fixture(scope="session")
def on_batch_reference(references):
    """``get(spec)``: the single-process run of ``spec``'s API over the global batch (eager, no
    layout), cached: the cells of one API share it."""
    cache: dict[str, object] = {}

    def get(spec: dict):
        ref = dict(spec, layout={"kind": "single"}, layout_name="single", compile="nojit")
        key = json.dumps(ref, sort_keys=True)
        if key not in cache:
            cache[key] = references.pool.run(rank_on_batch.run, ref, False)
        return cache[key]

    return get


def test_on_batch(on_batch_cell, keras_ranks, on_batch_reference, request):
    api, compile_mode, layout = on_batch_cell
    spec = {"api": api, "compile": compile_mode, "layout": axes.LAYOUTS[layout], "layout_name": layout}
    request.node.user_properties.append(("spec", spec))
    request.node.user_properties.append(("reference", "same build"))
    judge_on_batch(spec, keras_ranks.run(rank_on_batch.run, spec), on_batch_reference(spec))
