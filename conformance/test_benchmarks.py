"""Step-time benchmarks: model x optimizer x layout x compile mode, and the single-process step.

Run with ``pytest --benchmark-only`` (skipped otherwise, see pytest.ini). The times are measured
on the ranks (rank_bench.py) and recorded through pytest-benchmark, so ``--benchmark-autosave``,
``--benchmark-compare`` and ``--benchmark-compare-fail`` work as usual.
"""

from __future__ import annotations

import itertools
import statistics

import pytest

from conformance import axes, rank_bench
from keras_dtensor_conformance.benchmarking import record_rank_rounds
from conformance.judge import ran_everywhere

WARMUP = 5
ROUNDS = 20
MODELS = ("mlp", "attention", "embedding")
OPTIMIZERS = ("sgd", "adam", "adamw", "lion")
LAYOUTS = ("colshard", "rowshard", "replicated", "dataparallel")
COMPILE = ("nojit", "jit")


def bench_spec(model, optimizer, layout, compile_mode) -> dict:
    return axes.cell_spec(model, optimizer, "arrays", compile_mode, layout)


class Baselines:
    """Single-process step times (no distribution, no group), measured once per configuration."""

    def __init__(self, pool):
        self.pool = pool
        self._cache: dict[tuple, list[float]] = {}

    def times(self, model, optimizer, compile_mode) -> list[float]:
        key = (model, optimizer, compile_mode)
        if key not in self._cache:
            spec = bench_spec(model, optimizer, "colshard", compile_mode)
            result = self.pool.run(rank_bench.step_times, spec, WARMUP, ROUNDS, False)
            ran_everywhere(result)
            self._cache[key] = result.values[0]["times"]
        return self._cache[key]


@pytest.fixture(scope="session")
def baselines(conformance_state, keras_ranks) -> Baselines:
    pool = conformance_state.manager.reference()
    pool.start()
    return Baselines(pool)


def describe(benchmark, conformance_state, times: list[float], batch: int, **extra) -> None:
    median = statistics.median(times)
    benchmark.extra_info.update(
        build=conformance_state.build.banner(conformance_state.nproc, conformance_state.backend),
        nproc=conformance_state.nproc,
        backend=conformance_state.backend,
        samples_per_s=round(batch / median, 1),
        **extra,
    )


CELLS = [
    pytest.param(m, o, layout, c, id=f"{m}-{o}-{layout}-{c}")
    for m, o, layout, c in itertools.product(MODELS, OPTIMIZERS, LAYOUTS, COMPILE)
]


@pytest.mark.parametrize("model, optimizer, layout, compile_mode", CELLS)
def test_step_time(benchmark, keras_ranks, baselines, conformance_state, model, optimizer, layout, compile_mode):
    benchmark.group = f"{model}-{optimizer}-{compile_mode}"
    result = keras_ranks.run(rank_bench.step_times, bench_spec(model, optimizer, layout, compile_mode), WARMUP, ROUNDS)
    ran_everywhere(result)
    times = result.values[0]["times"]
    single = statistics.median(baselines.times(model, optimizer, compile_mode))
    describe(benchmark, conformance_state, times, result.values[0]["batch"],
             dtensor_overhead=round(statistics.median(times) / single, 3))
    record_rank_rounds(benchmark, times)


@pytest.mark.parametrize("model, optimizer, compile_mode", [
    pytest.param(m, o, c, id=f"{m}-{o}-{c}") for m, o, c in itertools.product(MODELS, OPTIMIZERS, COMPILE)
])
def test_step_time_single_process(benchmark, baselines, conformance_state, model, optimizer, compile_mode):
    benchmark.group = f"{model}-{optimizer}-{compile_mode}"
    times = baselines.times(model, optimizer, compile_mode)
    describe(benchmark, conformance_state, times, rank_bench.BATCH, dtensor_overhead=1.0)
    record_rank_rounds(benchmark, times)
