"""Keras-sharded data cells: the GLOBAL dataset handed to fit / evaluate / predict, and Keras shards it.

The hand-fed training cells (``test_fit.py``, family ``fit LAYOUT hand-fed``) feed each process its
own part with ``auto_shard_dataset=False`` and test ``distribute_data_input``; these (family
``keras-sharded LAYOUT``) leave Keras' default ``auto_shard_dataset=True`` and test Keras' data
adapters: each batch shard receives a distinct part of every epoch and together the whole, ranks of
one model axis alike; ``shuffle=True`` reshuffles epoch 2; an uneven row count neither hangs (the
short ``rank_timeout`` bounds it) nor drops a row; ``predict`` returns every row once. Evidence is
which global rows each step received (``ranks/data_sharding.py``); a build that does not shard, or
refuses to, gets ``data-not-sharded`` (``judge/data_sharding.py``).
"""

from __future__ import annotations

import pytest

from conformance import axes
from conformance.judge.cells import judge_keras_sharded
from conformance.marks import mesh_marks
from conformance.ranks import data_sharding as rank_data

#: A correct build runs a cell in a few seconds; a process left with a step its peers never take
#: waits in that step's collective until this.
SHARDED_TIMEOUT = pytest.mark.rank_timeout(30)


def sharded_params(full: bool) -> list:
    params = []
    for source, uneven, layout in axes.keras_sharded_cells(full):
        marks = [pytest.mark.cell(family=f"keras-sharded {layout}", row=source, column="uneven" if uneven else "even",
                                  data=source, uneven=uneven, layout=layout), SHARDED_TIMEOUT, *mesh_marks(layout)]
        params.append(pytest.param((source, uneven, layout), id=axes.keras_sharded_id(source, uneven, layout),
                                   marks=marks))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sharded_cell" in metafunc.fixturenames:
        metafunc.parametrize("sharded_cell", sharded_params(metafunc.config.getoption("full")))


def test_keras_sharded(sharded_cell, keras_ranks, request):
    source, uneven, layout = sharded_cell
    spec = {"source": source, "uneven": uneven, "shuffles": axes.KERAS_SHARDED_SOURCES[source],
            "layout": axes.LAYOUTS[layout], "layout_name": layout}
    request.node.user_properties.append(("spec", spec))
    judge_keras_sharded(spec, keras_ranks.run(rank_data.run, spec), keras_ranks.nproc)
