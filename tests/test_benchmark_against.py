"""--benchmark-against: side-by-side step times, paired ratios and their intervals.

The statistics are checked on numbers whose answer is known; the whole machinery (two builds'
rank pools in one session, rounds interleaved, the verdict, pytest-benchmark's JSON) by the short
version of scripts/benchmark_ab.py that CI runs: a build made twice as slow is flagged at 1.25,
the same build against a copy of itself is not. The 10 % proof on this machine is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from keras_dtensor_conformance.bench import paired_rounds

from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def noisy_pairs(ratio: float, pairs: int, seed: int) -> tuple[list[float], list[float]]:
    """Pairs sharing a moment's load (a common factor up to 4x) with independent 5 % noise each."""
    rng = random.Random(seed)
    a, b = [], []
    for _ in range(pairs):
        load = rng.uniform(1, 4)
        b.append(0.010 * load * rng.lognormvariate(0, 0.05))
        a.append(0.010 * ratio * load * rng.lognormvariate(0, 0.05))
    return a, b


def test_a_paired_ratio_sees_through_load_that_moves_both_sides():
    slower, base = noisy_pairs(1.10, 30, seed=1)
    interval = paired_rounds.ratio_interval(slower, base, seed="cell")
    assert interval["low"] < 1.10 < interval["high"]
    assert paired_rounds.above(interval, 1.05)
    same, base = noisy_pairs(1.0, 30, seed=2)
    assert not paired_rounds.above(paired_rounds.ratio_interval(same, base, seed="cell"), 1.05)


def test_unpaired_the_same_numbers_say_nothing():
    """What pairing buys: the ratio of the same rounds, unpaired, is lost in the load."""
    slower, base = noisy_pairs(1.10, 30, seed=1)
    shuffled = random.Random(0).sample(base, len(base))
    unpaired = paired_rounds.ratio_interval(slower, shuffled, seed="cell")
    paired = paired_rounds.ratio_interval(slower, base, seed="cell")
    assert unpaired["high"] - unpaired["low"] > 4 * (paired["high"] - paired["low"])
    assert not paired_rounds.above(unpaired, 1.0)


def test_a_load_spike_on_one_side_of_a_pair_is_one_outlier_and_no_more():
    slower, base = noisy_pairs(1.10, 30, seed=1)
    calm = paired_rounds.ratio_interval(slower, base, seed="cell")
    slower[3] *= 10  # another process took the cores for that one round
    base[7] *= 10
    spiked = paired_rounds.ratio_interval(slower, base, seed="cell")
    assert abs(spiked["ratio"] / calm["ratio"] - 1) < 0.01
    assert paired_rounds.above(spiked, 1.05)


def test_the_trimmed_mean_drops_a_fifth_at_each_end():
    assert paired_rounds.trimmed_mean([0, 1, 2, 3, 100]) == 2
    assert paired_rounds.trimmed_mean(list(range(10)) + [1000]) == 5
    assert paired_rounds.trimmed_mean([4.0]) == 4.0


def test_the_session_summary_says_fail_only_for_an_interval_wholly_above():
    def interval(low, high):
        return {"ratio": (low + high) / 2, "low": low, "high": high, "pairs": 20, "confidence": 0.95}

    entries = [{"cell": name, "overhead": {"wall": interval(1.5, 2.0), "cpu": interval(0.2, 0.3)},
                "against": {"cpu": interval(*cpu), "wall": interval(0.9, 1.3)}}
               for name, cpu in (("slower", (1.06, 1.2)), ("straddles", (1.01, 1.2)))]
    slower, straddles, legend = paired_rounds.summary_lines(entries, "cpu", 1.05)
    assert slower.endswith(" FAIL") and "vs --benchmark-against cpu 1.130x [1.060, 1.200]" in slower
    assert "(wall 1.100x [0.900, 1.300])" in slower and "dtensor overhead wall 1.750x" in slower
    assert straddles.endswith(" ok") and "1.05" in legend


def test_the_interval_is_reproducible_from_the_cell_name():
    a, b = noisy_pairs(1.0, 20, seed=3)
    assert paired_rounds.ratio_interval(a, b, seed="x") == paired_rounds.ratio_interval(a, b, seed="x")


def test_unequal_rounds_are_refused():
    with pytest.raises(ValueError, match="differ in number"):
        paired_rounds.ratio_interval([1.0, 2.0], [1.0], seed="x")


def test_each_pair_runs_every_side_once_in_a_shuffled_order():
    log = []
    sides = {name: (lambda name=name: log.append(name) or {"wall": 1.0}) for name in ("a", "b", "c")}
    samples = paired_rounds.interleave(sides, 40, random.Random(0))
    assert {name: len(rounds) for name, rounds in samples.items()} == {"a": 40, "b": 40, "c": 40}
    pairs = [tuple(log[i:i + 3]) for i in range(0, len(log), 3)]
    assert all(sorted(p) == ["a", "b", "c"] for p in pairs)
    assert len(set(pairs)) == 6  # every order occurs: no side always goes first


def test_a_call_that_continues_the_last_one_skips_the_reset(monkeypatch):
    """Interleaving needs a benchmark's later rounds to find the model its first call built: a call
    with ``isolate=False`` runs without the reset between cells; every other call is reset first."""
    from types import SimpleNamespace

    from keras_dtensor_conformance.rank import worker as rank_worker

    resets = []
    monkeypatch.setattr(rank_worker.isolation, "reset_all", resets.append)
    monkeypatch.setattr(rank_worker.rank_context, "current", lambda: SimpleNamespace(rank=0))
    assert rank_worker.run_call(("os.path", "join", ("a", "b"), {}), "snapshot").value == os.path.join("a", "b")
    assert resets == ["snapshot"]
    rank_worker.run_call(("os.path", "join", ("a", "b"), {}, False), "snapshot")
    assert resets == ["snapshot"]
    rank_worker.run_call(("os.path", "join", ("a", "b"), {}, True), "snapshot")
    assert resets == ["snapshot", "snapshot"]


@pytest.mark.measures_time
def test_the_short_version_flags_a_slowed_build_and_not_a_copy(tmp_path):
    """CI's short version: one cell, one session each way, few pairs, a slowdown no noise here hides."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "scripts/benchmark_ab.py", "--sessions", "1", "--slowdown", "1.0", "--ratio-fail", "1.25",
           "--pairs", "8", "-k", "test_step_time and mlp-adam-dataparallel-nojit", "--check", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env=session_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "mutant flagged in 1 of 1 sessions; the same build in 0 of 1" in done.stdout
    report = json.loads(out.read_text())
    (slowed,), (same,) = report["runs"]["mutant"], report["runs"]["same"]
    # The line a reviewer pastes: the build slower (over its one cell), and its copy not.
    assert slowed["verdict"].split(": ")[1] == "SLOWER" and same["verdict"].split(": ")[1] == "not slower"
    assert "over 1 cell (cpu time, 8 interleaved pairs a cell" in slowed["verdict"]
    assert slowed["ratios"]["wall"]["low"] > 1.25 and slowed["ratios"]["cpu"]["ratio"] > 1.25
    for run in (slowed, same):
        assert run["timer"].endswith("rank_clock")  # the rounds reached pytest-benchmark through its marker
        assert run["builds"]["keras_build"]["keras_path"] != run["builds"]["keras_build_against"]["keras_path"]
        assert {len(v["wall"]) for v in run["pairs"].values()} == {8}
