"""State cells: what Keras itself must do with variables between processes (issue 19).

``test_reconcile[LAYOUT]``: every rank seeds differently before building the model under the
distribution (as unseeded user code effectively does); after build and after training, every
variable must be one global tensor every rank agrees on, each rank holding its part, drawn as one
global initialisation; trained, the ranks must equal a single-process reference that starts from
the weights they agreed on (set into it), so random streams never decide a verdict.

``test_checkpoint[KIND-LAYOUT]``: fit, checkpoint (every rank given the same path), load into a
fresh model, train on, and equal the same training uninterrupted, weights, losses and optimizer
state (``iterations`` and every slot) included, with the loaded variables and slots laid out as
the resume side asks. The kinds are ``rank_state.KINDS``: a round trip, a load under another
layout, across the process count (the ranks to the single-process pool and back), and the
checkpoints ``ModelCheckpoint`` and ``BackupAndRestore`` write.

The default tier takes ``DEFAULT_RECONCILE`` and ``DEFAULT_CHECKPOINTS``; ``--full`` every layout
and every kind over every layout that can save and load it.
"""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge.cells import raise_found, ran_everywhere
from conformance.judge import state as judge_state
from conformance.marks import mesh_marks
from conformance.ranks import state as rank_state

DEFAULT_RECONCILE = ("dataparallel", "colshard")
DEFAULT_CHECKPOINTS = (("optimizer-roundtrip", "colshard"), ("reshard-to-rowshard", "colshard"),
                       ("reshard-to-single-process", "colshard"),
                       ("modelcheckpoint", "dataparallel"))


def reconcile_params(full: bool) -> list:
    layouts = list(axes.MATRIX_LAYOUTS) if full else list(DEFAULT_RECONCILE)
    return [pytest.param(layout, id=layout, marks=[
        pytest.mark.cell(family="state reconcile", row="reconcile", column=layout, state="reconcile", layout=layout),
        *mesh_marks(layout)]) for layout in layouts]


def checkpoint_cells(full: bool) -> list[tuple[str, str]]:
    cells = list(DEFAULT_CHECKPOINTS)
    if full:
        cells += [(kind, layout) for kind in rank_state.KINDS for layout in axes.MATRIX_LAYOUTS
                  if rank_state.KINDS[kind][1] != layout]
    return list(dict.fromkeys(cells))


def checkpoint_params(full: bool) -> list:
    return [pytest.param((kind, layout), id=f"{kind}-{layout}", marks=[
        pytest.mark.cell(family="state checkpoint", row=kind, column=layout, state="checkpoint", checkpoint=kind,
                         layout=layout), *mesh_marks(layout)]) for kind, layout in checkpoint_cells(full)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    full = metafunc.config.getoption("full")
    if "reconcile_layout" in metafunc.fixturenames:
        metafunc.parametrize("reconcile_layout", reconcile_params(full))
    if "checkpoint_cell" in metafunc.fixturenames:
        metafunc.parametrize("checkpoint_cell", checkpoint_params(full))


def test_reconcile(reconcile_layout, keras_ranks, references, request):
    spec = {"layout": axes.LAYOUTS[reconcile_layout], "layout_name": reconcile_layout}
    request.node.user_properties.append(("spec", spec))
    result = keras_ranks.run(rank_state.reconcile, spec)
    ran_everywhere(result)
    start = judge_state.agreed_weights(result.values)
    reference = references.pool.run(rank_state.reconcile, dict(spec, layout={"kind": "single"}), False, start)
    ran_everywhere(reference)
    raise_found(judge_state.reconcile_failure(spec, result.values, reference.values[0]), result)


def test_checkpoint(checkpoint_cell, keras_ranks, references, request, tmp_path):
    kind, layout = checkpoint_cell
    how, resume, where, _ = rank_state.KINDS[kind]
    name = "backup" if how == "backupandrestore" else "model.keras"
    spec = {"kind": kind, "layout": axes.LAYOUTS[layout], "layout_name": layout,
            "resume_layout": rank_state.layout_of(resume or layout), "path": str(tmp_path / name)}
    request.node.user_properties.append(("spec", spec))
    if where == "single":  # saved in one process, loaded on the ranks
        saved = references.pool.run(rank_state.save_side, dict(spec, layout={"kind": "single"}), False)
        ran_everywhere(saved)
        result = keras_ranks.run(rank_state.resume_side, spec)
        ran_everywhere(result)
        saves, resumes = saved.values, result.values
    elif resume == "single":  # saved on the ranks, loaded in one process
        result = keras_ranks.run(rank_state.save_side, spec)
        ran_everywhere(result)
        loaded = references.pool.run(rank_state.resume_side, spec, False)
        ran_everywhere(loaded)
        saves, resumes = result.values, loaded.values
    else:
        result = keras_ranks.run(rank_state.checkpoint, spec)
        ran_everywhere(result)
        saves, resumes = [v["save"] for v in result.values], [v["resume"] for v in result.values]
    raise_found(judge_state.checkpoint_failure(spec["resume_layout"], saves, resumes), result)
