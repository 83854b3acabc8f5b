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
#: The KerasHub benchmark cells' model, layouts and optimizer (``test_step_time_kerashub``; ``--full`` takes the
#: layouts; ``ranks/hub.MODELS``, ``axes.HUB_LAYOUTS``): Gemma, the model the nightly trains as one process
#: under every map. Not compiled by torch: its cells' flows are not (``ranks/hub.Run.compile``).
HUB_MODEL, HUB_OPTIMIZER, HUB_LAYOUTS = "gemma", "sgd", ("authors", "ffn-only", "dataparallel")

#: What ``pytest --benchmark-only`` runs (``--full``: every cell): one cell for each place a step can get
#: slower, in minutes. Each layout kind once on the MLP with Adam (its slots are held with the weights):
#: column- and row-split kernels, replicated under ModelParallel (DTensors, no split: the promotion mode's
#: own cost) and DataParallel (DDP's all-reduce); compiled on a split layout (the nightly falls back to
#: eager there, a fixed build compiles) and under DataParallel (inductor); the attention model's 3-D
#: kernels split and under DataParallel; and a sharded KerasHub model (``HUB_DEFAULT``). Left to ``--full``:
#: the other optimizers (their updates are the optimizer's, the same on every layout), the embedding model
#: (the nightly cannot run it row-split), each model on every layout compiled.
DEFAULT = (
    ("mlp", "adam", "colshard", "nojit"), ("mlp", "adam", "rowshard", "nojit"), ("mlp", "adam", "replicated", "nojit"),
    ("mlp", "adam", "dataparallel", "nojit"), ("mlp", "adam", "colshard", "jit"), ("mlp", "adam", "dataparallel", "jit"),
    ("attention", "adam", "colshard", "nojit"), ("attention", "adam", "dataparallel", "nojit"),
)
HUB_DEFAULT = ((HUB_MODEL, HUB_OPTIMIZER, "authors", "nojit"),)


def bench_spec(model, optimizer, layout, compile_mode) -> dict:
    if model == HUB_MODEL:
        return {"model": model, "family": "kerashub", "optimizer": axes.OPTIMIZERS[optimizer].spec,
                "optimizer_name": optimizer, "data": "arrays", "compile": compile_mode,
                "layout": axes.HUB_LAYOUTS[layout], "layout_name": layout}
    return axes.cell_spec(model, optimizer, "arrays", compile_mode, layout)


def bench_cells(full: bool) -> list[tuple[str, str, str, str]]:
    """(model, optimizer, layout, compile) of the tier's distributed cells (KerasHub's apart)."""
    return list(itertools.product(MODELS, OPTIMIZERS, LAYOUTS, COMPILE)) if full else list(DEFAULT)


def hub_bench_cells(full: bool) -> list[tuple[str, str, str, str]]:
    return [(HUB_MODEL, HUB_OPTIMIZER, layout, "nojit") for layout in HUB_LAYOUTS] if full else list(HUB_DEFAULT)


def single_process_groups(full: bool) -> list[tuple[str, str, str]]:
    """(model, optimizer, compile) of the tier's distributed cells, each once: their single-process steps."""
    cells = [*bench_cells(full), *hub_bench_cells(full)]
    return list(dict.fromkeys((model, optimizer, compile_mode) for model, optimizer, _, compile_mode in cells))


def cell_params(cells) -> list:
    return [pytest.param(m, o, layout, c, id=f"{m}-{o}-{layout}-{c}") for m, o, layout, c in cells]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    full = metafunc.config.getoption("full")
    names = ("model", "optimizer", "layout", "compile_mode")
    if metafunc.definition.originalname == "test_step_time":
        metafunc.parametrize(",".join(names), cell_params(bench_cells(full)))
    elif metafunc.definition.originalname == "test_step_time_kerashub":
        metafunc.parametrize(",".join(names), cell_params(hub_bench_cells(full)))
    elif metafunc.definition.originalname == "test_step_time_single_process":
        metafunc.parametrize("model, optimizer, compile_mode", [
            pytest.param(m, o, c, id=f"{m}-{o}-{c}") for m, o, c in single_process_groups(full)])


def round_seconds(config) -> float:
    """How long a timed round lasts at least: pytest-benchmark's ``--benchmark-min-time`` (its
    per-round minimum), never below rank_bench's floor (its default of 5 us is one op, not a step)."""
    return max(rank_bench.ROUND_SECONDS, float(config.getoption("benchmark_min_time")))


class Baselines:
    """Single-process step times (no distribution, no group), measured once per configuration, on the
    pool of its model's kind (KerasHub's imports KerasHub)."""

    def __init__(self, pools, rounds: int, seconds: float):
        self.pools = pools  # "keras", "kerashub" -> a function giving that single-process pool
        self.rounds = rounds
        self.seconds = seconds
        self._cache: dict[tuple, tuple[list[float], int]] = {}

    def times(self, model, optimizer, compile_mode) -> tuple[list[float], int]:
        """The single process's per-step wall times, and its batch."""
        key = (model, optimizer, compile_mode)
        if key not in self._cache:
            spec = bench_spec(model, optimizer, "authors" if model == HUB_MODEL else "colshard", compile_mode)
            pool = self.pools["kerashub" if model == HUB_MODEL else "keras"]()
            result = pool.run(rank_bench.step_times, spec, WARMUP, self.rounds, False, self.seconds)
            ran_everywhere(result)
            self._cache[key] = result.values[0]["wall"], result.values[0]["batch"]
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
    pools = {"keras": lambda: single_process, "kerashub": lambda: request.getfixturevalue("hub_single_process")}
    return Baselines(pools, conformance_state.options["benchmark_pairs"], round_seconds(request.config))


@pytest.fixture(scope="session")
def hub_single_process(keras_hub_reference):
    """KerasHub's single-process pool, started (the KerasHub cells' and their baselines')."""
    keras_hub_reference.start()
    return keras_hub_reference


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


def test_step_time(benchmark, request, keras_ranks, single_process, against_ranks, conformance_state,
                   model, optimizer, layout, compile_mode):
    step_time_cell(benchmark, request, conformance_state, {"dist": (keras_ranks, True),
                   "single": (single_process, False), "against": (against_ranks, True)},
                   bench_spec(model, optimizer, layout, compile_mode))


def test_step_time_kerashub(benchmark, request, keras_hub_ranks, hub_single_process, keras_hub_against_ranks,
                            conformance_state, model, optimizer, layout, compile_mode):
    """A sharded KerasHub model's step: its pools import KerasHub (``--benchmark-against``'s too)."""
    if keras_hub_against_ranks is not None:
        keras_hub_against_ranks.start()  # here, so no round's time includes it
    step_time_cell(benchmark, request, conformance_state, {"dist": (keras_hub_ranks, True),
                   "single": (hub_single_process, False), "against": (keras_hub_against_ranks, True)},
                   bench_spec(model, optimizer, layout, compile_mode))


def step_time_cell(benchmark, request, conformance_state, pools: dict, spec: dict) -> None:
    """Time ``spec``'s step on each side of ``pools`` (name -> (pool or None, distributed)), rounds
    interleaved; record the rounds, the ratios and the facts a user picks a build on."""
    benchmark.group = f"{spec['model']}-{spec['optimizer_name']}-{spec['compile']}"
    sides = {name: side for name, side in pools.items() if side[0] is not None}
    steps_per_round, opened_on = {}, {}
    for name, (pool, distributed) in sides.items():
        opened = pool.run(rank_bench.open_bench, spec, WARMUP, distributed, round_seconds(request.config))
        ran_everywhere(opened)
        steps_per_round[name] = opened.values[0]["steps_per_round"]
        opened_on[name] = opened.values
    cell = request.node.callspec.id
    against_ranks = sides.get("against", (None,))[0]
    # Side by side with another build, its rounds and the build under test's interleave; the single process is
    # timed only as it opens (its calibration), for the facts: the pairs go to the comparison asked for.
    timed = {name: side for name, side in sides.items() if against_ranks is None or name != "single"}
    samples = paired_rounds.interleave({name: functools.partial(one_round, pool) for name, (pool, _) in timed.items()},
                                       conformance_state.options["benchmark_pairs"], random.Random(cell))
    entry = {"cell": cell, "against": None,
             "overhead": ratios(samples, "dist", "single", f"{cell}:overhead") if "single" in samples else None}
    if against_ranks is not None:
        entry["against"] = ratios(samples, "dist", "against", f"{cell}:against")
        entry["rounds"] = {name: [s[stat] for s in samples[name]] for name in ("dist", "against")
                           for stat in [conformance_state.options["benchmark_ratio_stat"]]}
    entry["facts"] = facts(spec, samples, opened_on)
    conformance_state.bench.ratios.append(entry)
    wall = [s["wall"] for s in samples["dist"]]
    record_extra_info(benchmark, conformance_state, wall, opened_on["dist"][0]["batch"],
             dtensor_overhead=round(entry["overhead"]["wall"]["ratio"], 3) if entry["overhead"] else None,
             cpu_per_step_s=statistics.median(s["cpu"] for s in samples["dist"]),
             steps_per_round=steps_per_round,
             ratios={k: v for k, v in entry.items() if k not in ("cell", "facts", "rounds")}, facts=entry["facts"],
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


def facts(spec: dict, samples: dict, opened_on: dict) -> dict:
    """Per side, the median step (wall), what each rank holds for the model and what one more step moved
    (``rank_bench.open_bench``): the per-step facts beside the ratios, as the JSON and the HTML report have them."""
    step = {name: values[0]["step_s"] for name, values in opened_on.items()}  # the calibration's, where not timed
    step.update({name: statistics.median(s["wall"] for s in rounds) for name, rounds in samples.items()})
    return {"layout": spec["layout_name"], "kind": spec["layout"]["kind"], "step_s": step,
            "held": {name: [value["held"] for value in values] for name, values in opened_on.items()},
            "moved": {name: [value["moved"] for value in values] for name, values in opened_on.items()
                      if values[0]["moved"] is not None}}


def test_step_time_single_process(benchmark, baselines, conformance_state, model, optimizer, compile_mode):
    benchmark.group = f"{model}-{optimizer}-{compile_mode}"
    times, batch = baselines.times(model, optimizer, compile_mode)
    record_extra_info(benchmark, conformance_state, times, batch, dtensor_overhead=1.0)
    record_rank_rounds(benchmark, times)
