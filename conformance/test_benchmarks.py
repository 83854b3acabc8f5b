"""Step-time benchmarks: model x optimizer x layout x compile mode, and the single-process step.

Run with ``pytest --benchmark-only`` (skipped otherwise, see pytest.ini). The times are measured
on the ranks (rank_bench.py) and recorded through pytest-benchmark's public API (its marker's
``timer``, see benchmarking.py), so ``--benchmark-autosave``, ``--benchmark-compare`` and
``--benchmark-compare-fail`` work as usual.

Each distributed cell times its rounds side by side with the same step in one process (the
DTensor overhead) and, with ``--benchmark-against PATH``, with the same cell on that build's
ranks: one round of each per pair, in an order drawn afresh per pair (paired_rounds.py). Ratios
of two moments are never taken.
"""

from __future__ import annotations

import functools
import itertools
import random
import statistics

import pytest
from keras_dtensor_conformance import RATIO_STATS as STATS
from keras_dtensor_conformance import paired_rounds, rank_clock, record_rank_rounds

from conformance import axes
from conformance.judge.cells import ran_everywhere
from conformance.ranks import bench as rank_bench

pytestmark = pytest.mark.benchmark(timer=rank_clock)

WARMUP = 5
MODELS = ("mlp", "attention", "embedding")
OPTIMIZERS = axes.BENCHMARKED  # the entries of axes.OPTIMIZERS with benchmark=True
LAYOUTS = ("colshard", "rowshard", "replicated", "dataparallel")
COMPILE = ("nojit", "jit")


def bench_spec(model, optimizer, layout, compile_mode) -> dict:
    return axes.cell_spec(model, optimizer, "arrays", compile_mode, layout)


def round_seconds(config) -> float:
    """How long a timed round lasts at least: pytest-benchmark's ``--benchmark-min-time`` (its
    per-round minimum), never below rank_bench's floor (its default of 5 us is one op, not a step)."""
    return max(rank_bench.ROUND_SECONDS, float(config.getoption("benchmark_min_time")))


class Baselines:
    """Single-process step times (no distribution, no group), measured once per configuration."""

    def __init__(self, pool, rounds: int, seconds: float):
        self.pool = pool
        self.rounds = rounds
        self.seconds = seconds
        self._cache: dict[tuple, list[float]] = {}

    def times(self, model, optimizer, compile_mode) -> list[float]:
        key = (model, optimizer, compile_mode)
        if key not in self._cache:
            spec = bench_spec(model, optimizer, "colshard", compile_mode)
            result = self.pool.run(rank_bench.step_times, spec, WARMUP, self.rounds, False, self.seconds)
            ran_everywhere(result)
            self._cache[key] = result.values[0]["wall"]
        return self._cache[key]


@pytest.fixture(scope="session")
def single_process(conformance_state, keras_ranks):
    pool = conformance_state.manager.reference()
    pool.start()
    return pool


@pytest.fixture(scope="session")
def against_ranks(conformance_state, keras_ranks):
    """``--benchmark-against``'s ranks (started here, so no cell's time includes it), or None."""
    if conformance_state.against is None:
        return None
    pool = conformance_state.manager.other_build(conformance_state.against.path, conformance_state.nproc)
    pool.start()
    return pool


@pytest.fixture(scope="session")
def baselines(request, conformance_state, single_process) -> Baselines:
    return Baselines(single_process, conformance_state.options["benchmark_pairs"], round_seconds(request.config))


def record_extra_info(benchmark, conformance_state, times: list[float], batch: int, **extra) -> None:
    median = statistics.median(times)
    benchmark.extra_info.update(
        build=conformance_state.build.banner(conformance_state.nproc, conformance_state.backend),
        nproc=conformance_state.nproc,
        backend=conformance_state.backend,
        samples_per_s=round(batch / median, 1),
        **extra,
    )


def one_round(pool) -> dict:
    """One timed round of the benchmark ``pool`` has open (no reset: it continues that call)."""
    result = pool.run(rank_bench.time_rounds, 1, isolate=False)
    ran_everywhere(result)
    value = result.values[0]
    return {stat: value[stat][0] for stat in STATS}


def ratios(samples: dict, numerator: str, denominator: str, seed: str) -> dict:
    return {stat: paired_rounds.ratio_interval([s[stat] for s in samples[numerator]],
                                               [s[stat] for s in samples[denominator]], seed=f"{seed}:{stat}")
            for stat in STATS}


CELLS = [
    pytest.param(m, o, layout, c, id=f"{m}-{o}-{layout}-{c}")
    for m, o, layout, c in itertools.product(MODELS, OPTIMIZERS, LAYOUTS, COMPILE)
]


@pytest.mark.parametrize("model, optimizer, layout, compile_mode", CELLS)
def test_step_time(benchmark, request, keras_ranks, single_process, against_ranks, conformance_state,
                   model, optimizer, layout, compile_mode):
    benchmark.group = f"{model}-{optimizer}-{compile_mode}"
    spec = bench_spec(model, optimizer, layout, compile_mode)
    sides = {"dist": (keras_ranks, True), "single": (single_process, False)}
    if against_ranks is not None:
        sides["against"] = (against_ranks, True)
    steps_per_round = {}
    for name, (pool, distributed) in sides.items():
        opened = pool.run(rank_bench.open_bench, spec, WARMUP, distributed, round_seconds(request.config))
        ran_everywhere(opened)
        steps_per_round[name] = opened.values[0]["steps_per_round"]
    cell = request.node.callspec.id
    samples = paired_rounds.interleave({name: functools.partial(one_round, pool) for name, (pool, _) in sides.items()},
                                       conformance_state.options["benchmark_pairs"], random.Random(cell))
    entry = {"cell": cell, "overhead": ratios(samples, "dist", "single", f"{cell}:overhead"), "against": None}
    if against_ranks is not None:
        entry["against"] = ratios(samples, "dist", "against", f"{cell}:against")
    conformance_state.bench.ratios.append(entry)
    wall = [s["wall"] for s in samples["dist"]]
    record_extra_info(benchmark, conformance_state, wall, rank_bench.BATCH,
             dtensor_overhead=round(entry["overhead"]["wall"]["ratio"], 3),
             cpu_per_step_s=statistics.median(s["cpu"] for s in samples["dist"]),
             steps_per_round=steps_per_round,
             ratios={k: v for k, v in entry.items() if k != "cell"},
             pairs={name: {stat: [s[stat] for s in rounds] for stat in STATS} for name, rounds in samples.items()})
    record_rank_rounds(benchmark, wall)
    threshold = conformance_state.options["benchmark_ratio_fail"]
    stat = conformance_state.options["benchmark_ratio_stat"]
    if threshold is None:
        return
    interval = entry["against"][stat]
    if paired_rounds.above(interval, threshold):
        pytest.fail(f"{stat} step time {paired_rounds.interval_text(interval)} of --benchmark-against's "
                    f"({interval['pairs']} interleaved pairs, {interval['confidence']:.0%} interval): wholly above "
                    f"--benchmark-ratio-fail {threshold:g}", pytrace=False)


@pytest.mark.parametrize("model, optimizer, compile_mode", [
    pytest.param(m, o, c, id=f"{m}-{o}-{c}") for m, o, c in itertools.product(MODELS, OPTIMIZERS, COMPILE)
])
def test_step_time_single_process(benchmark, baselines, conformance_state, model, optimizer, compile_mode):
    benchmark.group = f"{model}-{optimizer}-{compile_mode}"
    times = baselines.times(model, optimizer, compile_mode)
    record_extra_info(benchmark, conformance_state, times, rank_bench.BATCH, dtensor_overhead=1.0)
    record_rank_rounds(benchmark, times)
