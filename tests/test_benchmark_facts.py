"""``pytest --benchmark-only`` as a contributor types it: its default selection, its known failures, the
line for the pull request, and the per-step facts (bytes moved, bytes held) beside each cell's time.

The selection and the summary line are checked on the tables and on synthetic rounds; the known failures,
the facts and the memory figure in real sessions: the recorded expectations make the default build's
known failure an xfail (exit 0), and a build that keeps a full copy of its sharded variables shows it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from keras_dtensor_conformance.bench import facts

from conformance import test_benchmarks
from tests import mutants
from tests.mutants.performance import FULL_COPY_KEPT
from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_default_selection_takes_every_layout_kind_eager_and_compiled_and_a_kerashub_model():
    cells = test_benchmarks.bench_cells(full=False)
    assert {layout for _, _, layout, _ in cells} == set(test_benchmarks.LAYOUTS)
    assert {(model, compile_mode) for model, _, _, compile_mode in cells} >= {("mlp", "nojit"), ("mlp", "jit"),
                                                                             ("attention", "nojit")}
    assert test_benchmarks.hub_bench_cells(full=False) == [("gemma", "sgd", "authors", "nojit")]
    full = test_benchmarks.bench_cells(full=True)
    assert set(cells) < set(full) and len(full) == 96 and len(test_benchmarks.hub_bench_cells(full=True)) == 3
    # Every distributed cell's step has its single-process twin, once.
    assert set(test_benchmarks.single_process_groups(full=False)) == {
        (m, o, c) for m, o, _, c in [*cells, *test_benchmarks.hub_bench_cells(full=False)]}


def rounds(ratio: float, pairs: int, rng: random.Random) -> tuple[list[float], list[float]]:
    base = [0.01 * rng.uniform(1, 3) for _ in range(pairs)]
    return [b * ratio * rng.lognormvariate(0, 0.03) for b in base], [b * rng.lognormvariate(0, 0.03) for b in base]


def entries(ratios: dict[str, float], pairs: int = 20, seed: int = 0) -> list[dict]:
    """Cells run side by side, each ``ratio`` times slower than the other build, as the glue keeps them."""
    from keras_dtensor_conformance.bench import paired_rounds

    rng = random.Random(seed)
    out = []
    for cell, ratio in ratios.items():
        dist, against = rounds(ratio, pairs, rng)
        interval = paired_rounds.ratio_interval(dist, against, seed=cell)
        out.append({"cell": cell, "overhead": None, "against": {"cpu": interval, "wall": interval},
                    "rounds": {"dist": dist, "against": against}})
    return out


def verdict_line(cells: list[dict], *args) -> str | None:
    """``facts.verdict_line`` over ``cells``' own ``overall_interval``, as the glue calls it."""
    return facts.verdict_line(cells, facts.overall_interval(cells), *args)


def test_the_line_for_the_pull_request_says_slower_over_every_cell_or_for_one():
    same = verdict_line(entries({"a": 1.0, "b": 0.97, "c": 1.03}), "cpu", 1.05, 1.15, "../keras-main", False)
    assert same.startswith("step time against ../keras-main: not slower: ") and "over 3 cells" in same
    assert "no cell above 1.15 (largest: c 1.0" in same
    slower = verdict_line(entries({"a": 1.12, "b": 1.09, "c": 1.1}), "cpu", 1.05, 1.15, "../keras-main", False)
    assert ": SLOWER: 1.0" in slower and "slower: all of it above 1.05)" in slower
    # One layout of nine 35 % slower: the mean over cells dilutes it below 1.05, its own interval does not.
    one = verdict_line(entries({**{f"c{i}": 1.0 for i in range(8)}, "rowshard": 1.35}), "cpu", 1.05, 1.15,
                       "main", False)
    assert ": SLOWER: 1.0" in one and "over 9 cells" in one and "; 1 cell above 1.15: rowshard 1.3" in one
    assert not facts.overall_interval(entries({**{f"c{i}": 1.0 for i in range(8)}, "rowshard": 1.35}))["low"] > 1.05
    assert verdict_line([], "cpu", 1.05, 1.15, "main", False) is None


def session(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rx", *args], cwd=ROOT,
                          env=session_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_a_known_failure_is_the_xfail_its_recorded_cause_says(tmp_path):
    """As typed, on the default build: a benchmark cell the build cannot run (the row-split Embedding,
    ``--full``) is an xfail with its cause, from the expectations recorded for this build, and the session
    is green; the conformance cells are deselected, not skipped."""
    report = tmp_path / "report.json"
    done = session("--benchmark-only", "--full", "-k", "embedding-sgd-rowshard-nojit or mlp-sgd-dataparallel-nojit",
                   f"--conformance-json={report}")
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    assert "expectations: expectations/keras-nightly-3.16.0.dev2026102704.txt, recorded for this build" in out
    assert "XFAIL conformance/test_benchmarks.py::test_step_time[embedding-sgd-rowshard-nojit]" in out
    assert "row-sharded Embedding: IndexError in torch DTensor MaskPartial.apply_mask" in out
    assert " skipped" not in out.splitlines()[-1] and "deselected" in out.splitlines()[-1]
    assert "expectation entries match no collected cell" not in out


def test_the_recorded_file_is_the_one_whose_banner_names_the_build_its_torch_and_nproc(tmp_path):
    """What a ``--benchmark-only`` session given no ``--conformance-expect`` applies: a file recorded for
    another Keras, nproc or torch is not this build's (given explicitly, any file applies, as always)."""
    from keras_dtensor_conformance.report.expectations_file import recorded_for

    def recorded(banner: str, torch: str = "2.13") -> str:
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.txt"
        path.write_text(f"# keras-dtensor-conformance expectations: {banner}\n# torch: {torch}\n")
        return str(path)

    this = ("3.16.0.dev2026102704", "2.13.0+cpu", "gloo", 2)
    assert recorded_for(recorded("Keras 3.16.0.dev2026102704, torch 2.13.0+cpu, gloo, nproc 2"), *this)
    assert recorded_for(recorded("Keras 3.16.0.dev2026102704, torch 2.13.0+cpu, gloo, nproc 4, the 2x2 mesh"),
                        "3.16.0.dev2026102704", "2.13.0+cpu", "gloo", 4)
    assert not recorded_for(recorded("Keras 3.15.1, torch 2.13.0+cpu, gloo, nproc 2"), *this)
    assert not recorded_for(recorded("Keras 3.16.0.dev2026102704, torch 2.13.0+cpu, gloo, nproc 4"), *this)
    assert not recorded_for(recorded("Keras 3.16.0.dev2026102704, torch 2.15.0, gloo, nproc 2", torch="2.15"), *this)
    assert not recorded_for(str(tmp_path / "missing.txt"), *this)


@pytest.mark.slow
def test_the_facts_say_what_each_rank_moves_and_holds_and_a_kept_full_copy_shows(keras_nightly_tree, tmp_path):
    """A column-split MLP holds about half of its parameters and slots on each of 2 ranks, on the build
    under test and on ``--benchmark-against``'s; the build that keeps each sharded variable's full original
    (``full-copy-kept``) holds that much again in other tensors, and so does nothing else."""
    tree = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "full-copy"), FULL_COPY_KEPT)
    report = tmp_path / "report.json"
    done = session("--benchmark-only", "-k", "test_step_time and mlp-adam-colshard-nojit", f"--keras-path={tree}",
                   f"--benchmark-against={keras_nightly_tree}", "--benchmark-pairs=4", f"--conformance-json={report}")
    assert done.returncode == 0, done.stdout[-4000:]
    (cell,) = json.loads(report.read_text())["benchmarks"]["cells"]
    held = cell["facts"]["held"]
    single = held["single"][0]
    kernels = 4 * (64 * 256 + 256 * 256 + 256 * 8)  # the split kernels' float32 bytes (ranks/bench.py's MLP)
    for side in ("dist", "against"):
        for rank in held[side]:
            assert 0.45 < facts.held(rank) / facts.held(single) < 0.55, (side, rank, single)
    kept = min(r["other"] for r in held["dist"]) - max(r["other"] for r in held["against"])
    assert kept >= kernels, (held, kernels)
    moved = cell["facts"]["moved"]
    assert moved["dist"][0]["bytes"] == moved["against"][0]["bytes"] > 0  # the same step communicates the same
    assert "parameters and slots 0.50x one process's" in done.stdout and "per step: time, bytes each rank" in done.stdout
    assert "step time against " in done.stdout and "over 1 cell (" in done.stdout
