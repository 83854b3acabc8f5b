"""Prove --benchmark-against on this machine: a slowed build is flagged, the same build is not.

    python scripts/benchmark_ab.py --sessions 5 --slowdown 0.10 --ratio-fail 1.05 --pairs 300

Makes builds from the installed Keras (copies): the baseline, and a mutant whose
optimizer update adds ``--slowdown`` of a step's time in busy work, calibrated at run time
(tests/mutants/performance.py, ``slow_step``). Then runs SESSIONS pairs of pytest sessions, one benchmark
cell each, alternating which goes first: the mutant ``--benchmark-against`` the baseline, and the
baseline against a second copy of itself. Prints each session's ratio and interval for wall and
CPU time and whether ``--benchmark-ratio-fail`` flagged it, and from the pooled paired rounds of
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
from keras_dtensor_conformance.options import RATIO_STATS as STATS  # noqa: E402

from tests.mutants import write_mutant  # noqa: E402
from tests.mutants.performance import slow_step  # noqa: E402

CELL = "test_step_time and mlp-adam-dataparallel-nojit"


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
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conformance/test_benchmarks.py",
           "--benchmark-only", "-k", args.k, f"--keras-path={build}", f"--benchmark-against={against}",
           f"--benchmark-ratio-fail={args.ratio_fail}", f"--benchmark-ratio-stat={args.stat}",
           f"--benchmark-pairs={args.pairs}", f"--benchmark-json={json_path}", *args.pytest_args]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if done.returncode not in (0, 1) or not os.path.exists(json_path):
        raise SystemExit(f"session failed to run (exit {done.returncode}):\n{output[-4000:]}")
    saved = json.load(open(json_path))
    (bench,) = saved["benchmarks"]
    ratios = bench["extra_info"]["ratios"]["against"]
    flagged = "wholly above --benchmark-ratio-fail" in output
    if flagged != (done.returncode == 1):
        raise SystemExit(f"exit {done.returncode} disagrees with the session's verdict:\n{output[-4000:]}")
    return {"ratios": ratios, "flagged": flagged, "seconds": round(time.monotonic() - start, 1),
            "pairs": bench["extra_info"]["pairs"], "timer": bench["options"]["timer"],
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=0.10, help="the mutant's extra work, a fraction of a step")
    parser.add_argument("--ratio-fail", type=float, default=1.05)
    parser.add_argument("--stat", choices=STATS, default="cpu")
    parser.add_argument("--pairs", type=int, default=300)
    parser.add_argument("-k", default=CELL)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the verdicts are all as expected")
    parser.add_argument("--out", help="write every session's numbers here (JSON)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, e.g. --nproc=2")
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="kdc-ab-")
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
                print(f"session {i + 1} {kind:6s} wall {interval_text(r['wall'])}  cpu {interval_text(r['cpu'])}  "
                      f"{'FLAGGED' if result['flagged'] else 'not flagged'} ({result['seconds']} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    flagged = {kind: sum(r["flagged"] for r in results) for kind, results in runs.items()}
    print(f"\n{args.slowdown:.0%} slower mutant flagged in {flagged['mutant']} of {args.sessions} sessions; "
          f"the same build in {flagged['same']} of {args.sessions} (--benchmark-ratio-fail {args.ratio_fail:g}, "
          f"{args.stat} time, {args.pairs} pairs)")
    rng = np.random.default_rng(0)
    scaling = {}
    for stat in STATS:
        logs = np.concatenate([np.log(np.array(r["pairs"]["dist"][stat]) / np.array(r["pairs"]["against"][stat]))
                               for r in runs["same"]])
        spread = {kind: float(np.std([np.log(r["ratios"][stat]["ratio"]) for r in results], ddof=1))
                  if len(results) > 1 else float("nan") for kind, results in runs.items()}
        scaling[stat] = {"pair_log_ratio_sd": float(np.std(logs, ddof=1)), "session_ratio_sd": spread,
                         **{f"{d:.0%}": pairs_needed(logs, d, rng) for d in (0.10, 0.05)}}
        need = ", ".join(f"{d}: {s['needed'] or f'>{PAIR_COUNTS[-1]}'} pairs" for d, s in scaling[stat].items() if "%" in d)
        print(f"{stat}: paired log-ratio sd {scaling[stat]['pair_log_ratio_sd']:.3f}, session-to-session sd of "
              f"the ratio {spread['same']:.3f} (same build); pairs needed to flag a difference of {need}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "runs": runs, "flagged": flagged, "scaling": scaling}, f, indent=1)
    ok = flagged["mutant"] == args.sessions and flagged["same"] == 0
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
