"""pytest-benchmark: what the persistent pool saves. An empty call on --nproc ranks through the
warm pool, against starting fresh rank processes (interpreter, torch import, group) for it.

The two are in one benchmark group, so pytest-benchmark's table shows them side by side; the
ratio is in docs/measurements.md. No timing is asserted here: speed is measured, never a pass/fail rule.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.controller.rank_pool import RankPool
from keras_dtensor_conformance.rank import calls as rank_calls


@pytest.mark.benchmark(group="dispatch: empty call on all ranks")
def test_empty_call_through_the_pool(benchmark, dist_ranks):
    assert dist_ranks.run(rank_calls.noop).ok  # started and warm before timing

    def call():
        result = dist_ranks.run(rank_calls.noop)
        assert result.ok, result.story()

    benchmark(call)


@pytest.mark.benchmark(group="dispatch: empty call on all ranks")
def test_empty_call_on_fresh_ranks(benchmark, conformance_state, tmp_path):
    def fresh_pool_call():
        pool = RankPool(
            conformance_state.launch,
            conformance_state.nproc,
            conformance_state.backend,
            import_keras=False,
            workdir=str(tmp_path),
            timeout=120,
        )
        try:
            result = pool.run(rank_calls.noop)
            assert result.ok, result.story()
        finally:
            pool.close()

    benchmark.pedantic(fresh_pool_call, rounds=3, iterations=1)
