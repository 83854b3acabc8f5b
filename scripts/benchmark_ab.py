"""Prove --benchmark-against on this machine: a slowed build is flagged, the same build is not.

    python scripts/benchmark_ab.py --sessions 3 --slowdown 0.10                  # the default selection
    python scripts/benchmark_ab.py --sessions 5 --slowdown 0.10 --ratio-fail 1.05 --pairs 300 \
        -k "test_step_time and mlp-adam-dataparallel-nojit"                         # one cell, many pairs

Makes builds from the installed Keras (copies): the baseline, and a mutant whose
optimizer update adds ``--slowdown`` of a step's time in busy work, calibrated at run time
(tests/mutants/performance.py, ``slow_step``). Then runs SESSIONS pairs of pytest sessions (the default
selection, or ``-k``'s cells), alternating which goes first: the mutant ``--benchmark-against`` the
baseline, and the baseline against a second copy of itself (``--load N``: with N busy loops beside).
Prints each session's ratio over every cell and the first cell's, for wall and CPU time, whether the
session's summary line called the build slower (and ``--benchmark-ratio-fail`` failed a cell, where
given), and from the pooled paired rounds of
the same-build sessions, how many pairs a 10 % and a 5 % difference need here (resampled: the
smallest count at which 95 % of simulated sessions flag the difference with the threshold at
half of it, and none of the same-build ones). ``--check``: exit 1 unless every mutant session was
flagged and no same-build session was. ``--out FILE``: everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from keras_dtensor_conformance.bench.paired_rounds import TRIM, interval_text  # noqa: E402
from keras_dtensor_conformance.options import DEFAULT_CELL_FLAG, DEFAULT_RATIO_FLAG  # noqa: E402
from keras_dtensor_conformance.options import RATIO_STATS as STATS  # noqa: E402

from tests.mutants import write_mutant  # noqa: E402
from tests.mutants.performance import slow_step  # noqa: E402

#: The busy loop a loaded session runs beside it (``--load N``: N of them, one core each).
BUSY = "import itertools\nfor _ in itertools.count(): pass"


def installed_keras_tree(dest: str) -> str:
    """A tree holding a copy of the installed Keras package: what --keras-path takes."""
    import importlib.util

    spec = importlib.util.find_spec("keras")
    if spec is None or spec.origin is None:
        raise SystemExit("no Keras installed: pip install -c constraints-cpu.txt -e '.[default-build]'")
    package = os.path.dirname(spec.origin)
    # With its bytecode (valid where it is: copy2 keeps the sources' times), or every process that
    # imports a copy compiles all of Keras again where PYTHONDONTWRITEBYTECODE is set.
    shutil.copytree(package, os.path.join(dest, "keras"))
    return dest


def session(build: str, against: str, args, json_path: str) -> dict:
    """One session of ``args.k``'s cells (all of the default selection without ``-k``), the build under test
    against the other; what its summary line said (``flagged``: SLOWER), its ratio over every cell, each
    cell's, and every cell's paired rounds."""
    report_path = json_path + ".report.json"
    selection = ["-k", args.k] if args.k else []
    fail = [f"--benchmark-ratio-fail={args.ratio_fail}"] if args.ratio_fail else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/test_benchmarks.py",
           "--benchmark-only", *selection, f"--keras-path={build}", f"--benchmark-against={against}", *fail,
           f"--benchmark-ratio-stat={args.stat}", f"--benchmark-pairs={args.pairs}", f"--benchmark-json={json_path}",
           f"--conformance-json={report_path}", *args.pytest_args]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode not in (0, 1) or not os.path.exists(json_path):
        raise SystemExit(f"session failed to run (exit {done.returncode}):\n{output[-4000:]}")
    saved = json.load(open(json_path))
    benchmarks = json.load(open(report_path))["benchmarks"]
    distributed = [b for b in saved["benchmarks"] if b["extra_info"].get("ratios", {}).get("against")]
    flagged = benchmarks["verdict"].split(": ")[1] == "SLOWER"
    if args.ratio_fail and ("wholly above --benchmark-ratio-fail" in output) != (done.returncode == 1):
        raise SystemExit(f"exit {done.returncode} disagrees with the session's cells:\n{output[-4000:]}")
    first = distributed[0]
    return {"ratios": first["extra_info"]["ratios"]["against"], "overall": benchmarks["overall"],
            "verdict": benchmarks["verdict"], "flagged": flagged, "seconds": round(time.monotonic() - start, 1),
            "cells": {b["name"]: b["extra_info"]["ratios"]["against"] for b in distributed},
            "pairs": first["extra_info"]["pairs"],
            "cell_pairs": {b["name"]: b["extra_info"]["pairs"] for b in distributed},
            "timer": first["options"]["timer"],
            "builds": {k: saved["machine_info"].get(k) for k in ("keras_build", "keras_build_against")}}


def bootstrap_low(logs: np.ndarray, rng: np.random.Generator, resamples: int = 400) -> np.ndarray:
    """The lower 2.5 % bound of the bootstrapped trimmed mean (paired_rounds' interval), for each
    row of ``logs`` (simulated sessions x pairs); a few sessions at a time, to bound the memory."""
    sessions, n = logs.shape
    cut = int(TRIM * n)
    lows = []
    for start in range(0, sessions, 10):
        rows = logs[start:start + 10]
        picks = rng.integers(0, n, size=(len(rows), resamples, n))
        drawn = np.sort(rows[np.arange(len(rows))[:, None, None], picks], axis=2)
        lows.append(np.quantile(drawn[:, :, cut:n - cut].mean(axis=2), 0.025, axis=1))
    return np.concatenate(lows)


PAIR_COUNTS = (10, 20, 40, 60, 80, 120, 160, 200, 250, 320, 400)


def pairs_needed(same_logs: np.ndarray, difference: float, rng: np.random.Generator, simulated: int = 200) -> dict:
    """Smallest pair count at which a ``difference`` slower build is flagged in 95 % of simulated
    sessions at threshold 1 + difference / 2, resampling the same-build sessions' paired
    log-ratios (their noise, and any bias between two pools of one build) shifted by the difference."""
    threshold = np.log1p(difference / 2)
    table = {}
    for n in PAIR_COUNTS:
        drawn = rng.choice(same_logs, size=(simulated, n))
        power = float(np.mean(bootstrap_low(drawn + np.log1p(difference), rng) > threshold))
        false_alarm = float(np.mean(bootstrap_low(drawn, rng) > threshold))
        table[n] = {"flagged": power, "false_alarm": false_alarm}
        if power >= 0.95:
            break
    needed = next((n for n, row in table.items() if row["flagged"] >= 0.95), None)
    return {"needed": needed, "table": table}


def summary_rates(same_runs: list[dict], stat: str, pairs: int, rng: np.random.Generator,
                  simulated: int = 200, threshold: float = DEFAULT_RATIO_FLAG,
                  cell_threshold: float = DEFAULT_CELL_FLAG) -> dict:
    """How often the summary line says SLOWER (the ratio over every cell wholly above ``threshold``, or one
    cell's above ``cell_threshold``: ``bench/facts.verdict_line``) in simulated sessions of ``pairs`` pairs a
    cell, drawn from the same-build sessions' paired log-ratios of each cell: unshifted (the false alarms), every
    cell shifted by a uniform slowdown, and one cell alone shifted (a regression of one layout)."""
    cells = {}
    for run in same_runs:
        for name, p in run["cell_pairs"].items():
            cells.setdefault(name, []).extend(np.log(np.array(p["dist"][stat]) / np.array(p["against"][stat])))
    logs = [np.array(v) for v in cells.values()]
    n, cut = pairs, int(TRIM * pairs)

    def lows(drawn: np.ndarray, resamples: int = 300) -> np.ndarray:  # drawn: sessions x pairs
        picks = rng.integers(0, n, size=(len(drawn), resamples, n))
        boot = np.sort(drawn[np.arange(len(drawn))[:, None, None], picks], axis=2)[:, :, cut:n - cut].mean(axis=2)
        return boot  # sessions x resamples: each resample's trimmed mean

    def slower(shifts: list[float]) -> float:
        per_cell = [lows(rng.choice(cell, size=(simulated, n)) + np.log1p(shift)) for cell, shift in zip(logs, shifts)]
        overall_low = np.quantile(np.mean(per_cell, axis=0), 0.025, axis=1)
        cell_low = np.max([np.quantile(c, 0.025, axis=1) for c in per_cell], axis=0)
        return float(np.mean((overall_low > np.log(threshold)) | (cell_low > np.log(cell_threshold))))

    out = {"false_alarm": slower([0.0] * len(logs))}
    for d in (0.05, 0.08, 0.10, 0.20, 0.30):
        out[f"every cell {d:.0%}"] = slower([d] * len(logs))
    for d in (0.20, 0.30, 0.50):
        out[f"one cell {d:.0%}"] = float(np.mean([slower([d if i == j else 0.0 for j in range(len(logs))])
                                                for i in range(len(logs))]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=0.10, help="the mutant's extra work, a fraction of a step")
    parser.add_argument("--ratio-fail", type=float, default=None,
                        help="--benchmark-ratio-fail (default: none, the summary's own threshold, 1.05)")
    parser.add_argument("--stat", choices=STATS, default="cpu")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("-k", default=None, help="the cells (default: the default selection, every cell of it)")
    parser.add_argument("--load", type=int, default=0, help="busy loops beside every session (a loaded machine)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the verdicts are all as expected")
    parser.add_argument("--out", help="write every session's numbers here (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. --nproc=2")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="kdc-ab-")
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.load)]
    try:
        base = installed_keras_tree(os.path.join(work, "base"))
        twin = installed_keras_tree(os.path.join(work, "twin"))
        mutant = write_mutant(base, os.path.join(work, "mutant"), slow_step(args.slowdown))
        runs = {"mutant": [], "same": []}
        for i in range(args.sessions):
            order = [("mutant", mutant, base), ("same", twin, base)]
            if i % 2:
                order.reverse()
            for kind, build, against in order:
                result = session(build, against, args, os.path.join(work, f"{kind}{i}.json"))
                runs[kind].append(result)
                r = result["ratios"]
                print(f"session {i + 1} {kind:6s} over every cell {interval_text(result['overall'])}  first cell: wall "
                      f"{interval_text(r['wall'])}  cpu {interval_text(r['cpu'])}  "
                      f"{'FLAGGED' if result['flagged'] else 'not flagged'} ({result['seconds']} s)", flush=True)
                print(f"    {result['verdict']}", flush=True)
    finally:
        for proc in busy:
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)

    flagged = {kind: sum(r["flagged"] for r in results) for kind, results in runs.items()}
    print(f"\n{args.slowdown:.0%} slower mutant flagged in {flagged['mutant']} of {args.sessions} sessions; "
          f"the same build in {flagged['same']} of {args.sessions} (--benchmark-ratio-fail "
          f"{args.ratio_fail or 'none: the summary line'}, {args.stat} time, {args.pairs} pairs, "
          f"{args.load} busy loops beside)")
    rng = np.random.default_rng(0)
    scaling = {}
    for stat in STATS:
        logs = np.concatenate([np.log(np.array(p["dist"][stat]) / np.array(p["against"][stat]))
                               for r in runs["same"] for p in r["cell_pairs"].values()])
        spread = {kind: float(np.std([np.log(r["ratios"][stat]["ratio"]) for r in results], ddof=1))
                  if len(results) > 1 else float("nan") for kind, results in runs.items()}
        scaling[stat] = {"pair_log_ratio_sd": float(np.std(logs, ddof=1)), "session_ratio_sd": spread,
                         **{f"{d:.0%}": pairs_needed(logs, d, rng) for d in (0.10, 0.05)}}
        need = ", ".join(f"{d}: {s['needed'] or f'>{PAIR_COUNTS[-1]}'} pairs" for d, s in scaling[stat].items() if "%" in d)
        print(f"{stat}: paired log-ratio sd {scaling[stat]['pair_log_ratio_sd']:.3f}, session-to-session sd of "
              f"the ratio {spread['same']:.3f} (same build); pairs needed to flag a difference of {need}")
    rates = None
    if runs["same"] and runs["same"][0].get("cell_pairs") and len(runs["same"][0]["cell_pairs"]) > 1:
        rates = summary_rates(runs["same"], args.stat, args.pairs, rng)
        print("the summary line's SLOWER, in 200 simulated sessions resampled from the same-build ones: "
              + ", ".join(f"{k} {v:.0%}" for k, v in rates.items()))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": runs, "flagged": flagged, "scaling": scaling, "rates": rates}, f,
                      indent=1)
    ok = flagged["mutant"] == args.sessions and flagged["same"] == 0
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
