"""pytest-benchmark: what the persistent pool saves. An empty call on --nproc ranks through the
warm pool, against starting fresh rank processes (interpreter, torch import, group) for it; and
what a replacement of the session's ranks costs (a build that keeps state pays it before nearly
every cell), torch-only and with Keras.

Each pair is one benchmark group, so pytest-benchmark's table shows them side by side; the figures
are in docs/measurements.md. No timing is asserted here: speed is measured, never a pass/fail rule.
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


@pytest.mark.benchmark(group="replacement: the session's ranks killed, started again, an empty call")
@pytest.mark.parametrize("kind", ["torch", "keras"])
def test_a_replacement(benchmark, conformance_state, kind):
    """What a build that keeps state pays before nearly every cell (``controller/fresh_ranks.py``): the
    pool's ranks killed and forked again from the zygote (Keras imported, the group joined, the
    baseline taken), then the call. docs/measurements.md has the parts of it."""
    pool = conformance_state.pool(import_keras=kind == "keras")
    assert pool.run(rank_calls.noop).ok  # the first start is not a replacement

    def replace():
        pool.kill("a benchmark's replacement")
        result = pool.run(rank_calls.noop)
        assert result.ok, result.story()

    benchmark.pedantic(replace, rounds=5, iterations=1)
