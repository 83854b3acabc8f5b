"""Workflow cells: the flows Keras users run between and around fits, judged against one process.

``test_workflow[FLOW-MODE-LAYOUT]`` runs a flow of ``conformance/ranks/workflows.FLOWS`` (fine-tuning
between fits as Keras' transfer-learning guide does it, LoRA enabled after a fit, a recompile with
another optimizer and loss, a model made untrainable and trainable again, a second fit with another
batch size, a model built or loaded before the distribution, one model fitted under two
distributions, a global batch the ranks do not divide, a one-column output, RematScope) on every rank, each rank feeding its part of every global batch, and judges it
against one process running the same flow on the global batches: after every fit, the losses,
every weight, the ranks' agreement, frozen variables bit-equal, the layouts
(``conformance/judge/workflows.py``). ``MODE`` is ``eager`` (``run_eagerly=True``) or ``jit``
(``jit_compile=True``, judged compiled as training cells are).

The default tier takes ``DEFAULT``; ``--full`` every flow x ``LAYOUTS`` x ``MODES``.
"""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge.cells import judge_workflow, ran_everywhere
from conformance.marks import mesh_marks
from conformance.ranks import workflows as rank_workflows

#: The layouts a flow runs on: DataParallel and two model-parallel layouts that split the kernels.
LAYOUTS = ("dataparallel", "colshard", "rowshard")
MODES = ("eager", "jit")
#: Flows that write a file of their own (``spec['folder']``: the cell's temporary folder).
WRITES_FILES = ("load-keras-fit", "load-weights-fit")
#: Flows whose model-parallel cells the default tier runs: those whose variables change hands between
#: fits (frozen, unfrozen, LoRA's new kernels, loaded, made before the distribution or under another)
#: or whose layout is their subject (a one-column split, a group initialize() makes). The others (a
#: recompile, another batch size, an indivisible batch: on a (1, n) mesh every rank feeds every row;
#: RematScope) and every compiled cell are ``--full``'s, held to issue 54's budget (docs/measurements.md).
MODEL_PARALLEL_DEFAULT = ("freeze-fit-unfreeze-fit", "fit-freeze-fit", "fit-lora-fit", "model-untrainable-fit",
                          "built-before-distribution", "load-keras-fit", "load-weights-fit",
                          "fit-other-distribution-fit", "one-unit-output", "initialize-from-torchrun")
#: The default tier's cells (flow, mode, layout): every flow eager under DataParallel, those above on
#: column-sharded kernels, LoRA and loaded weights on row-sharded ones too.
DEFAULT = (
    *((flow, "eager", "dataparallel") for flow in rank_workflows.FLOWS),
    *((flow, "eager", "colshard") for flow in MODEL_PARALLEL_DEFAULT),
    ("fit-lora-fit", "eager", "rowshard"), ("load-weights-fit", "eager", "rowshard"),
)


def second_layout(layout: dict) -> dict:
    """The distribution the second fit of ``fit-other-distribution-fit`` runs under: DataParallel
    after a ModelParallel layout, the column-sharded layout after DataParallel."""
    return axes.LAYOUTS["dataparallel" if layout["kind"] == "model-parallel" else "colshard"]


def workflow_cells(full: bool) -> list[tuple[str, str, str]]:
    if not full:
        return list(DEFAULT)
    return [(flow, mode, layout) for flow in rank_workflows.FLOWS for mode in MODES for layout in LAYOUTS]


def workflow_params(full: bool) -> list:
    return [pytest.param((flow, mode, layout), id=f"{flow}-{mode}-{layout}", marks=[
        pytest.mark.cell(family="workflows", row=flow, column=f"{layout}/{mode}", flow=flow, compile=mode,
                         layout=layout), *mesh_marks(layout)]) for flow, mode, layout in workflow_cells(full)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "workflow_cell" in metafunc.fixturenames:
        metafunc.parametrize("workflow_cell", workflow_params(metafunc.config.getoption("full")))


def test_workflow(workflow_cell, keras_ranks, references, conformance_state, request, tmp_path):
    flow, mode, layout = workflow_cell
    spec = {"flow": flow, "compile": mode, "layout": axes.LAYOUTS[layout], "layout_name": layout}
    if flow in WRITES_FILES:
        spec["folder"] = str(tmp_path)
    if flow == "fit-other-distribution-fit":
        spec["second_layout"] = second_layout(spec["layout"])
    request.node.user_properties.append(("spec", spec))
    request.node.user_properties.append(("reference", "same build"))
    if rank_workflows.FLOWS[flow].bare:  # processes as torchrun starts a script: no group of the harness'
        bare = conformance_state.manager.bare_group(keras_ranks.nproc, keras_ranks.backend, [str(request.config.rootpath)])
        if bare is None:
            pytest.skip("the session runs under torchrun: its processes are the ranks, and no group starts beside them")
        result = bare.run(rank_workflows.run_flow, spec)
    else:
        result = keras_ranks.run(rank_workflows.run_flow, spec)
    ran_everywhere(result)  # a cell whose ranks failed has its verdict: no reference is computed for it
    # One process running the same flow, shared by the cells of one flow (none that writes files).
    judge_workflow(spec, result, references.single_process(rank_workflows.run_flow, spec),
                   rank_workflows.FLOWS[flow])
