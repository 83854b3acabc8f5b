"""The workflow cells' judge on hand-made evidence: no ranks, no Keras.

A flow of several fits is judged fit by fit against one process running it: a frozen variable must
be bit-equal after the fit it was frozen in, the variables laid out as the phase's LayoutMap asks
(except where the flow made them before that distribution), the one process must have started from
the ranks' weights, and every fit's losses and weights must be the one process's, the ranks agreeing.
The cells' table: every flow in ``--full`` on every layout and mode, ids that say the cell.
"""

from __future__ import annotations

import numpy as np
import pytest
from keras_dtensor_conformance.verdicts import COMPILE_FALLBACK, ERROR, NUMERICS, SHARDING_LOST

from conformance import axes
from conformance.judge.sharding import intended
from conformance.judge.workflows import workflow_failure
from conformance.ranks import workflows as rank_workflows
from conformance.test_workflows import (
    DEFAULT,
    LAYOUTS,
    MODEL_PARALLEL_DEFAULT,
    MODES,
    second_layout,
    workflow_cells,
    workflow_params,
)

NPROC = 2
SHAPES = {"mlp/dense_a/kernel": (8, 16), "mlp/dense_a/bias": (16,), "mlp/dense_b/kernel": (16, 4),
          "mlp/dense_b/bias": (4,)}
COLSHARD = axes.LAYOUTS["colshard"]


def weights(offset: float) -> dict:
    return {path: np.full(shape, offset, "float32") for path, shape in SHAPES.items()}


def described(layout: dict, rank: int) -> list[dict]:
    """The variables as ``describe_variable`` gives them, laid out as ``layout`` asks."""
    out = []
    for path, shape in SHAPES.items():
        want = intended(layout, path, shape, NPROC, rank) if layout.get("map") else None
        out.append({"path": path, "type": "Variable", "shape": shape, "dtensor": want is not None,
                    **({"placements": want[0], "local_shape": want[1]} if want else {})})
    return out


def phase(name: str, offset: float, layout: dict, rank: int, frozen: dict | None = None) -> dict:
    return {"name": name, "batch": 24, "layout": layout, "batch_part": [0, 1], "step_losses": [1.0 - offset, 0.9],
            "frozen": frozen or {}, "weights": weights(offset), "variables": described(layout, rank)}


def evidence(layout: dict = COLSHARD, rank: int = 0, **fields) -> dict:
    found = {"flow": "fit-freeze-fit", "initial_weights": weights(0.0), "device": "cpu",
             "phases": [phase("all trained", 0.1, layout, rank),
                        phase("first layer frozen", 0.2, layout, rank,
                              frozen={"mlp/dense_a/kernel": weights(0.1)["mlp/dense_a/kernel"]})],
             "compiled_graphs": 0, "warnings": []}
    for p in found["phases"]:  # the frozen kernel kept its value in the second fit
        p["weights"]["mlp/dense_a/kernel"] = weights(0.1)["mlp/dense_a/kernel"]
    return {**found, **fields}


SPEC = {"flow": "fit-freeze-fit", "compile": "eager", "layout": COLSHARD}


def judged(ranks: list[dict], reference: dict | None = None, spec: dict = SPEC, **flow):
    return workflow_failure(spec, ranks, reference or evidence({"kind": "single"}), **flow)


def test_ranks_that_ran_the_flow_as_one_process_pass():
    assert judged([evidence(rank=0), evidence(rank=1)]) is None


def test_a_frozen_variable_that_moved_in_its_fit_is_numerics_naming_the_variable_and_the_fit():
    moved = evidence(rank=1)
    moved["phases"][1]["weights"]["mlp/dense_a/kernel"] = weights(0.3)["mlp/dense_a/kernel"]
    verdict, message = judged([evidence(rank=0), moved])
    assert verdict == NUMERICS
    assert "rank 1: frozen mlp/dense_a/kernel changed in the fit 'first layer frozen'" in message


def test_a_variable_that_lost_its_layout_after_a_fit_is_sharding_lost():
    lost = evidence(rank=0)
    lost["phases"][1]["variables"][0] = {"path": "mlp/dense_a/kernel", "type": "Parameter", "shape": (8, 16),
                                         "dtensor": False}
    verdict, message = judged([lost, evidence(rank=1)])
    assert verdict == SHARDING_LOST
    assert "rank 0 after the fit 'first layer frozen': mlp/dense_a/kernel: a plain Parameter" in message


def test_layouts_are_not_judged_where_the_flow_made_its_variables_before_the_distribution():
    plain = [evidence({"kind": "single"}, rank=r) for r in (0, 1)]
    for value in plain:
        for p in value["phases"]:
            p["layout"] = COLSHARD
    assert judged(plain)[0] == SHARDING_LOST
    assert judged(plain, layout_phases=()) is None
    assert judged(plain, layout_phases=(1,))[1].count("after the fit 'first layer frozen'") == 4  # 2 kernels, 2 ranks
    assert "after the fit 'all trained'" not in judged(plain, layout_phases=(1,))[1]


def test_a_reference_that_started_elsewhere_is_the_harness_error():
    other = evidence({"kind": "single"}, initial_weights=weights(0.5))
    verdict, message = judged([evidence(rank=0), evidence(rank=1)], other)
    assert verdict == ERROR and "did not start from the ranks' weights" in message


def test_a_later_fit_that_differs_is_numerics_naming_that_fit_on_the_first_line():
    drifted = [evidence(rank=r) for r in (0, 1)]
    drifted[1]["phases"][1]["weights"]["mlp/dense_b/kernel"] = weights(0.25)["mlp/dense_b/kernel"]
    verdict, message = judged(drifted)
    assert verdict == NUMERICS
    first = message.splitlines()[0]
    assert "after fit 2 of 2 ('first layer frozen'): rank 1: weight mlp/dense_b/kernel" in first
    assert "ranks 0 and 1 disagree on weight mlp/dense_b/kernel" in message
    assert "fit 1 of 2" not in message


def test_ranks_that_ran_other_fits_than_the_one_process_are_numerics():
    short = [evidence(rank=r) for r in (0, 1)]
    for value in short:
        value["phases"] = value["phases"][:1]
    verdict, message = judged(short)
    assert verdict == NUMERICS and "the ranks ran the fits ['all trained']" in message


def test_a_jit_cell_that_compiled_nothing_is_compile_fallback_after_its_numbers_pass():
    spec = dict(SPEC, compile="jit")
    ranks = [evidence(rank=r, warnings=["jit_compile=True is not supported"]) for r in (0, 1)]
    verdict, message = judged(ranks, spec=spec)
    assert verdict == COMPILE_FALLBACK and "is not supported" in message


def _group(**fields) -> dict:
    group = {"before": False, "after": True, "rank": 0, "world_size": 2, "backend": "gloo",
             "environment": {"RANK": "0", "WORLD_SIZE": "2"}, "devices": ["cpu:0", "cpu:1"]}
    return {**group, **fields}


def test_initialize_that_made_the_group_torchrun_describes_passes_and_one_that_made_none_is_an_error():
    ranks = [evidence(rank=r, group=_group(rank=r, environment={"RANK": str(r), "WORLD_SIZE": "2"})) for r in (0, 1)]
    assert judged(ranks) is None
    ranks[1]["group"] = _group(after=False, rank=None, world_size=None, environment={"RANK": "1", "WORLD_SIZE": "2"})
    verdict, message = judged(ranks)
    assert verdict == ERROR and "rank 1: no process group after initialize() (RANK=1, WORLD_SIZE=2)" in message


def test_initialize_whose_group_is_not_the_environments_is_an_error():
    ranks = [evidence(rank=r, group=_group(rank=0, world_size=1, devices=["cpu:0"],
                                           environment={"RANK": str(r), "WORLD_SIZE": "2"})) for r in (0, 1)]
    verdict, message = judged(ranks)
    assert verdict == ERROR
    assert "rank 1: initialize() made a group of rank 0 of 1, torchrun's variables say 1 of 2" in message


def test_every_flow_is_in_the_full_tier_on_every_layout_and_mode_with_ids_that_say_the_cell():
    cells = workflow_cells(full=True)
    assert len(cells) == len(set(cells)) == len(rank_workflows.FLOWS) * len(LAYOUTS) * len(MODES)
    ids = [p.id for p in workflow_params(full=True)]
    assert "freeze-fit-unfreeze-fit-eager-dataparallel" in ids and "load-keras-fit-jit-rowshard" in ids
    assert set(DEFAULT) <= set(cells) and set(workflow_cells(full=False)) == set(DEFAULT)
    assert {flow for flow, _, _ in DEFAULT} == set(rank_workflows.FLOWS)
    assert set(MODEL_PARALLEL_DEFAULT) <= set(rank_workflows.FLOWS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_second_distribution_is_of_the_other_kind(layout):
    assert second_layout(axes.LAYOUTS[layout])["kind"] != axes.LAYOUTS[layout]["kind"]


@pytest.mark.parametrize(("count", "batch"), [(1, 24), (2, 24), (2, 20), (4, 20)])
def test_the_batch_shards_of_a_fit_together_feed_every_row_once(count, batch):
    rows = np.concatenate([rank_workflows.fit_rows(i, count, batch) for i in range(count)])
    assert sorted(rows.tolist()) == list(range(rank_workflows.SAMPLES))


def test_a_batch_the_shards_do_not_divide_is_a_skip_with_the_reason():
    with pytest.raises(rank_workflows.Skip, match="does not split into 3 equal batch shards"):
        rank_workflows.fit_rows(0, 3, rank_workflows.NEW_BATCH)

