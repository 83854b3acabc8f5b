"""pytest-benchmark: what the persistent pool saves. An empty call on --nproc ranks through the
warm pool, against starting fresh rank processes (interpreter, torch import, group) for it; what
a replacement of the session's ranks costs (a build that keeps state pays it before nearly every
cell), torch-only and with Keras; and a session over the same 60 cells on the default build, a
state-keeping one and a failing one.

Each set is one benchmark group, so pytest-benchmark's table shows them side by side; the figures
are in docs/measurements.md. No timing is asserted here: speed is measured, never a pass/fail rule.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.controller.rank_pool import RankPool
from keras_dtensor_conformance.rank import calls as rank_calls

from tests import mutants
from tests.mutants.state_keeping import STATE_KEEPING
from tests.test_fresh_verdicts import SELECTION, run_selection


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


#: One build of each kind the suite exists for, beside the default build: one that keeps state for its
#: process's life (its ranks are replaced before nearly every cell) and one that fails many cells.
BUILD_KINDS = {"default": None, "state-keeping": "promotion-mode-once", "failing": "promotion-off"}


@pytest.mark.benchmark(group="tier: the order self-test's 60 cells, one session per build kind")
@pytest.mark.parametrize("kind", list(BUILD_KINDS))
def test_tier_time(benchmark, kind, keras_nightly_tree, tmp_path):
    """What a contributor waits for, per kind of build: a whole session (``python -m pytest``, the
    rank start-ups and every replacement included) over ``test_fresh_verdicts.SELECTION`` (ops eager
    and compiled, fits on five layouts, scenarios, setup). Compare the kinds within one run (the
    state-keeping build's goal is within 1.5x of the default's, docs/measurements.md), or a run with
    a saved one (``--benchmark-compare``). The session's verdicts are its own business here: the
    order self-test checks them."""
    name = BUILD_KINDS[kind]
    mutant = next((m for m in (*STATE_KEEPING, *(case.mutant for case in mutants.CASES)) if m.name == name),
                  None)
    assert (mutant is None) == (name is None), f"no kit mutant {name!r}"
    tree = keras_nightly_tree if mutant is None else mutants.write_mutant(keras_nightly_tree, str(tmp_path / "tree"),
                                                                           mutant)
    runs = iter(range(1000))

    def session():
        out = tmp_path / f"run{next(runs)}"
        out.mkdir()
        report = run_selection(tree, "forward", out, SELECTION)
        assert len(report["verdicts"]) == len(SELECTION), report["report"]

    benchmark.pedantic(session, rounds=1, iterations=1)
    benchmark.extra_info["build"] = name or "the installed keras-nightly"
