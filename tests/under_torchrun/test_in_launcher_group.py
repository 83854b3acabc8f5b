"""Collected only under torchrun (see tests/conftest.py): the plugin joins the launcher's group."""

from __future__ import annotations

import os

import torch.distributed as dist
from keras_dtensor_conformance.controller.torchrun_pool import TorchrunPool
from keras_dtensor_conformance.verdicts import ERROR, classify_failure

from conformance import axes
from conformance.ranks import train as rank_train
from tests import torch_cells


def test_pool_is_this_process(dist_ranks):
    assert isinstance(dist_ranks, TorchrunPool)
    assert dist_ranks.pids == [os.getpid()]
    assert dist_ranks.nproc == int(os.environ["WORLD_SIZE"])


def test_dtensor_cell_runs_on_every_launcher_rank(dist_ranks):
    result = dist_ranks.run(torch_cells.sharded_matmul)
    assert result.ok, result.story()
    assert [v["rank"] for v in result.values] == list(range(dist_ranks.nproc))
    assert len({v["pid"] for v in result.values}) == dist_ranks.nproc
    assert all(v["max_error"] < 1e-5 for v in result.values)


def test_exception_on_one_rank_reaches_every_rank(dist_ranks):
    """Only the last rank raises; every rank learns it, and all reach the same verdict naming it."""
    bad = dist_ranks.nproc - 1
    result = dist_ranks.run(torch_cells.raise_on_rank_only, bad)
    assert [o.status for o in result.outcomes] == ["ok"] * bad + ["raised"]
    assert [o.value for o in result.outcomes[:bad]] == list(range(bad))
    assert f"deliberate failure on rank {bad} only" in result.outcomes[bad].error.message
    verdict, message = classify_failure(result)
    assert verdict == ERROR
    assert f"failed on 1 of {dist_ranks.nproc} ranks: rank {bad} (pid " in message.splitlines()[0]
    seen: list = [None] * dist_ranks.nproc
    dist.all_gather_object(seen, (verdict, message.splitlines()[0]))
    assert seen == [(verdict, message.splitlines()[0])] * dist_ranks.nproc


def test_keras_model_parallel_fit(keras_ranks):
    result = keras_ranks.run(rank_train.train, axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard"))
    assert result.ok, result.story()
    kernel = result.values[0]["stages"]["fit"][0]
    assert kernel["dtensor"] and kernel["placements"] == ["R", "S(1)"]
