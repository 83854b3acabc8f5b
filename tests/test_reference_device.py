"""The single-process reference computes where the ranks compute: the guard of the GPU path on CPU CI.

On one H100 the reference ran in a CPU pool while the NCCL ranks ran on cuda, and the same Keras
seed gives other initial weights there: every training cell was ``numerics``. CI has no GPU, so
these tests hold the mechanism itself: the reference pool takes the session's backend, the
evidence names its device, and a mismatch is the harness' ``error``, never Keras' ``numerics``.
"""

from __future__ import annotations

import types

import pytest
from keras_dtensor_conformance.controller.launch import LaunchConfig
from keras_dtensor_conformance.controller.pools import PoolManager
from keras_dtensor_conformance.verdicts import ERROR, CellFailure

from conformance import axes
from conformance.judge import fit_checks
from conformance.judge.cells import judge_fit
from conformance.ranks import train as rank_train


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_the_reference_pool_runs_on_the_sessions_backend(backend, tmp_path):
    manager = PoolManager(LaunchConfig(None, str(tmp_path)), timeout=10, workdir=str(tmp_path), backend=backend)
    try:
        assert manager.reference().backend == backend  # nccl: GPUs visible, Keras computes on cuda
    finally:
        manager.close_all()


def test_a_reference_on_another_device_is_a_harness_error():
    verdict, message = fit_checks.reference_elsewhere([{"device": "cuda"}, {"device": "cuda"}], {"device": "cpu"})
    assert verdict == ERROR and "computed on cpu, the ranks on cuda" in message
    assert fit_checks.reference_elsewhere([{"device": "cpu"}], {"device": "cpu"}) is None  # same device


def test_a_real_cell_and_its_reference_report_the_same_device(keras_ranks, references):
    spec = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard")
    result = keras_ranks.run(rank_train.train, spec)
    reference = references.get(spec)
    assert {v["device"] for v in result.values} == {reference.values[0]["device"]} == {"cpu"}
    judge_fit(spec, result, reference, keras_ranks.nproc)  # passes on the default build
    moved = types.SimpleNamespace(ok=True, values=[dict(reference.values[0], device="cuda")], story=lambda: "")
    with pytest.raises(CellFailure) as failure:
        judge_fit(spec, result, moved, keras_ranks.nproc)
    assert failure.value.verdict == ERROR
