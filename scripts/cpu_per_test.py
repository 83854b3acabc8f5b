"""A pytest plugin: the machine's busy CPU time during each test, where ``--durations`` gives wall time.

    PYTHONPATH=scripts pytest tests -p cpu_per_test -k "not test_mutants"

Reads the busy jiffies of ``/proc/stat`` (all processes: an inner session's ranks too, which a
process's own accounting misses once they are forked elsewhere) at each test's start and end, so
run it on a machine with nothing else on it and without the mutant kit, whose sessions run beside
the other tests. Writes ``[nodeid, wall s, busy CPU s]`` rows as JSON to ``$CPU_PER_TEST_OUT``
(default ``cpu-per-test.json``) and prints the files that took the most CPU.
"""

from __future__ import annotations

import collections
import json
import os
import time

_started: dict[str, tuple[float, int]] = {}
_rows: list[tuple[str, float, float]] = []


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def pytest_runtest_logstart(nodeid, location):
    _started[nodeid] = (time.monotonic(), _busy_jiffies())


def pytest_runtest_logfinish(nodeid, location):
    wall, busy = _started.pop(nodeid)
    cpu = (_busy_jiffies() - busy) / os.sysconf("SC_CLK_TCK")
    _rows.append((nodeid, round(time.monotonic() - wall, 2), round(cpu, 2)))


def pytest_terminal_summary(terminalreporter):
    with open(os.environ.get("CPU_PER_TEST_OUT", "cpu-per-test.json"), "w") as f:
        json.dump(_rows, f)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for nodeid, wall, cpu in _rows:
        files[nodeid.split("::")[0]][0] += wall
        files[nodeid.split("::")[0]][1] += cpu
    terminalreporter.write_sep("=", "busy CPU per file (s)")
    for name, (wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][1])[:15]:
        terminalreporter.write_line(f"{cpu:8.1f} CPU {wall:8.1f} wall  {name}")
