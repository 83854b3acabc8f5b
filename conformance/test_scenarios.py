"""Scenario cells: failure modes real Keras builds have hit, each judged on what it must keep.

Scenarios that make rank 0 alone run a collective get a short timeout (a ``rank_timeout`` marker):
on a build that hangs there, the cell fails as ``hang`` in seconds, every rank's stack is dumped, and the session goes on.
No SPMD build can gather a sharded kernel on one rank alone, so those scenarios pass when rank 0
gets a clear error quickly and every rank finishes training (``judge.scenarios.SCENARIO_JUDGES['rank-zero-only']``).
"""

from __future__ import annotations

import pytest

from conformance.judge.scenarios import judge_scenario
from conformance.ranks import scenarios as rank_scenarios

#: A correct build finishes these in milliseconds; a hang costs this, plus a restart. A scenario's
#: optional fourth field holds its extra marks.
HANG_TIMEOUT = pytest.mark.rank_timeout(20)

SCENARIOS = {
    "iterate-dtensor": (rank_scenarios.iterate_dtensor, (), "iterate"),
    "assign-partial": (rank_scenarios.assign_partial, (), "partial"),
    "uneven-sharding": (rank_scenarios.uneven_sharding, (), "uneven"),
    "rank0-convert-to-numpy": (rank_scenarios.rank_zero_only, ("convert-to-numpy",), "rank-zero-only", HANG_TIMEOUT),
    "rank0-callback-get-weights": (rank_scenarios.rank_zero_only, ("get-weights",), "rank-zero-only", HANG_TIMEOUT),
    "rank0-checkpoint-save": (rank_scenarios.rank_zero_only, ("save-weights",), "rank-zero-only", HANG_TIMEOUT),
    "distribution-changed-between-fits": (rank_scenarios.distribution_changed_between_fits, (), "changed"),
    "mesh-reshaped-between-fits": (rank_scenarios.mesh_reshaped_between_fits, (), "reshaped"),
    "clear-session-undoes-distribution": (rank_scenarios.clear_session_undoes_distribution, (), "cleared"),
    "integer-variable": (rank_scenarios.integer_variable, (), "integer"),
    "mixed-float16": (rank_scenarios.mixed_precision, ("mixed_float16",), "precision"),
    "mixed-bfloat16": (rank_scenarios.mixed_precision, ("mixed_bfloat16",), "precision"),
    "save-load-keras": (rank_scenarios.save_and_load, ("keras",), "saved"),
    "save-load-weights-h5": (rank_scenarios.save_and_load, ("h5",), "saved"),
}


def marks(name: str) -> list:
    cell = pytest.mark.cell(family="scenarios", row=name, column="colshard", scenario=name)
    return [cell, *SCENARIOS[name][3:]]


@pytest.mark.parametrize("scenario", [pytest.param(name, id=name, marks=marks(name)) for name in SCENARIOS])
def test_scenario(keras_ranks, scenario):
    function, args, judge = SCENARIOS[scenario][:3]
    judge_scenario(judge, keras_ranks.run(function, *args))
