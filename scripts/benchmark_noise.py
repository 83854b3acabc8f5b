"""Measure run-to-run noise of the step-time benchmarks before choosing a --benchmark-compare-fail threshold.

    python scripts/benchmark_noise.py --runs 5 --threshold 300 -k "test_step_time and mlp-adam"

Runs the selected benchmarks RUNS times (each a fresh pytest session, saved with
--benchmark-autosave in a temporary storage), then prints per benchmark the min and median of
every run and their spread (slowest / fastest - 1), and whether the spread stays under the
threshold a comparison would fail at.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threshold", type=float, default=300.0, help="percent, as in --benchmark-compare-fail=min:N%%")
    parser.add_argument("-k", default="test_step_time and (mlp-adam-colshard-nojit or mlp-adam-dataparallel-nojit)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. --keras-path ../keras")
    args = parser.parse_args()
    storage = tempfile.mkdtemp(prefix="kdc-noise-")
    for run in range(1, args.runs + 1):
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/test_benchmarks.py",
               "--benchmark-only", "-k", args.k, f"--benchmark-storage=file://{storage}", "--benchmark-autosave",
               *args.pytest_args]
        code = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).returncode
        print(f"run {run}: exit {code}", flush=True)
        if code != 0:
            return code
    stats: dict[str, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in sorted(glob.glob(os.path.join(storage, "*", "*.json"))):
        for bench in json.load(open(path))["benchmarks"]:
            for stat in ("min", "median"):
                stats[bench["name"]][stat].append(bench["stats"][stat] * 1000)
    worst = 0.0
    for name, by_stat in stats.items():
        for stat, values in by_stat.items():
            spread = 100 * (max(values) / min(values) - 1)
            if stat == "min":
                worst = max(worst, spread)
            print(f"{name:48s} {stat:6s} ms {' '.join(f'{v:7.2f}' for v in values)}  spread {spread:6.1f}%")
    verdict = "within" if worst <= args.threshold else "OVER"
    print(f"worst spread of min over {args.runs} runs: {worst:.1f}% ({verdict} min:{args.threshold:g}%)")
    return 0 if worst <= args.threshold else 1


if __name__ == "__main__":
    sys.exit(main())
