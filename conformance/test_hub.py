"""KerasHub cells: the causal LMs users shard, under their authors' layout maps, judged against one process.

``test_hub[MODEL-FLOW-LAYOUT]`` runs a flow of ``conformance/ranks/hub.FLOWS`` (fit with SGD or AdamW,
LoRA fine-tuning, a preset one process wrote loaded with ``from_preset``, greedy ``generate`` with its
KV cache, the sharded model saved to a preset and loaded back) of a model of ``hub.MODELS`` (a tiny
random configuration of each KerasHub causal LM whose backbone has ``get_layout_map``) under a layout
of ``hub.LAYOUTS`` (the authors' map on a ``(1, n)`` mesh and on the 2x2 one, a map as users write it,
DataParallel) on every rank, and judges it against one process running the same flow from the same
weights (``conformance/judge/hub.py``). The ranks and that one process import KerasHub on top of the
build, in pools of their own (``keras_hub_ranks``, ``keras_hub_reference``); where KerasHub is missing
or does not import with the build, every cell skips with that one reason.

The default tier takes ``DEFAULT``; ``--full`` every model x flow x layout.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

from conformance.judge.cells import judge_hub, ran_everywhere
from conformance.judge.communication import figures
from conformance.reference import References
from conformance.ranks import hub as rank_hub

#: The default tier's cells (model, flow, layout): every flow of the default models on their flow's
#: ``default_layouts``, and fitting and generating on the 2x2 mesh (``--nproc 4``: the gating leg's ``-m mesh``).
DEFAULT = tuple(
    (model, flow, layout)
    for model, entry in rank_hub.MODELS.items() if entry.default
    for flow, spec in rank_hub.FLOWS.items()
    for layout in (*spec.default_layouts, *(("authors-2x2",) if flow in ("fit-sgd", "generate") else ()))
)


def hub_cells(full: bool) -> list[tuple[str, str, str]]:
    if not full:
        return list(DEFAULT)
    return list(itertools.product(rank_hub.MODELS, rank_hub.FLOWS, rank_hub.LAYOUTS))


def hub_params(full: bool) -> list:
    params = []
    for model, flow, layout in hub_cells(full):
        mesh = rank_hub.LAYOUTS[layout].get("mesh")
        marks = [pytest.mark.cell(family=f"kerashub {model}", row=flow, column=layout, model=model, flow=flow,
                                  layout=layout)]
        if mesh is not None:
            marks.append(pytest.mark.mesh(*mesh))
        params.append(pytest.param((model, flow, layout), id=f"{model}-{flow}-{layout}", marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "hub_cell" in metafunc.fixturenames:
        metafunc.parametrize("hub_cell", hub_params(metafunc.config.getoption("full")))


@pytest.fixture(scope="session")
def hub_references(keras_hub_reference) -> References:
    """One process running each flow of each model (shared by a flow's layouts; not by a flow that writes
    files, whose spec names the cell's folder). It first asks the KerasHub under test for its causal LMs with
    a layout map: one ``MODELS`` has no row for (a KerasHub contributor's new map) is warned about once."""
    keras_hub_reference.start()  # here, so no cell's duration includes starting it
    listed = keras_hub_reference.run(rank_hub.causal_lms)
    ran_everywhere(listed)
    known = {model.task for model in rank_hub.MODELS.values()}
    for task, backbone in sorted(listed.values[0].items()):
        if task not in known:
            warnings.warn(pytest.PytestWarning(f"KerasHub's {task} ({backbone}.get_layout_map) has no row in "
                                               "conformance/ranks/hub.MODELS: its layout map is not judged"))
    return References(keras_hub_reference)


def test_hub(hub_cell, keras_hub_ranks, hub_references, record_checks, request, tmp_path):
    model, flow, layout = hub_cell
    spec = {"model": model, "flow": flow, "layout": rank_hub.LAYOUTS[layout], "layout_name": layout,
            "optimizer_name": rank_hub.FLOWS[flow].optimizer}
    if rank_hub.FLOWS[flow].writes_files:
        spec["folder"] = str(tmp_path)
    request.node.user_properties.append(("spec", spec))
    request.node.user_properties.append(("reference", "same build"))
    result = keras_hub_ranks.run(rank_hub.run_hub, spec)
    if result.ok:
        request.node.user_properties.append(("layout_map", result.values[0]["layout"]))
        request.node.user_properties.append(("communication", figures(result.values)))
    ran_everywhere(result)  # a cell whose ranks failed has its verdict: no reference is computed for it
    judge_hub(spec, result, hub_references.single_process(rank_hub.run_hub, spec), record=record_checks)
