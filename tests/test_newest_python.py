"""The newest Python leg really runs: README's set-up in a fresh virtual environment of the newest
interpreter this machine has that a workflow leg names, then the set-up cells and a few training
cells there, judged with the default build's expectations.

The resolver check (test_workflows.py) proves a leg's requirements exist for its Python; this
proves they import and train on it (a wheel that installs and then fails to import, a
deprecation turned error, a dependency that floats to a release nobody ran).
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPECTATIONS = "expectations/keras-nightly-3.16.0.dev2026102704.txt"
#: The set-up cells, and training cells that pass and fail on the default build: a MLP on each 1-D
#: layout, hand-fed arrays, and the jit cell the nightly refuses to compile under ModelParallel.
CELLS = ("conformance/test_setup.py",
         *(f"conformance/test_fit.py::test_fit[{c}]" for c in (
             "adam-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel", "sgd-dataloader-jit-colshard")))


def interpreters() -> dict[str, str]:
    """Python X.Y -> an interpreter of it on this machine: PATH's pythonX.Y, pyenv's versions,
    and the one running these tests."""
    found = {f"{sys.version_info.major}.{sys.version_info.minor}": sys.executable}
    candidates = [shutil.which(f"python3.{minor}") for minor in range(11, 20)]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    for path in filter(None, candidates):
        proc = subprocess.run([path, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            found.setdefault(proc.stdout.strip(), path)
    return found


def newest_leg_interpreter() -> tuple[str, str]:
    from tests.workflows import every_leg

    legs = {leg.python for leg in every_leg()}
    have = interpreters()
    usable = sorted((v for v in have if v in legs), key=lambda v: tuple(map(int, v.split("."))))
    return usable[-1], have[usable[-1]]


def build_env() -> dict:
    """README's set-up in a fresh virtual environment of the newest leg's interpreter: mostly a
    wait on the package index, so tests/conftest.py starts it as soon as the tests are collected."""
    version, interpreter = newest_leg_interpreter()
    venv = tempfile.mkdtemp(prefix=f"kdc-py{version}-")
    subprocess.run([interpreter, "-m", "venv", venv], check=True, capture_output=True, timeout=300)
    python = os.path.join(venv, "bin", "python")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), env.get("PATH", "")])
    install = subprocess.run(  # README's set-up, less the test extra this run does not use
        [python, "-m", "pip", "install", "--quiet", "-c", "constraints-cpu.txt", "-e", ".[default-build,jax]"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    return {"version": version, "interpreter": interpreter, "venv": venv, "python": python, "env": env,
            "install": install}


def remove_env(built: dict) -> None:
    shutil.rmtree(built["venv"], ignore_errors=True)


@pytest.fixture(scope="session")
def newest_python_env(request):
    from tests.conftest import early

    return early(request, "newest_python_env")


@pytest.mark.slow
def test_the_newest_python_leg_runs_here(newest_python_env):
    built = newest_python_env
    version, python, env = built["version"], built["python"], built["env"]
    assert built["install"].returncode == 0, built["install"].stderr[-3000:]
    report = pathlib.Path(built["venv"]) / "report.json"
    run = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--conformance-expect", EXPECTATIONS,
         "--conformance-json", str(report), *CELLS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    versions = subprocess.run([python, "-c", "import sys, torch, jax, numpy; print(sys.version.split()[0], "
                               "torch.__version__, jax.__version__, numpy.__version__)"],
                              env=env, capture_output=True, text=True).stdout.strip()
    print(f"Python {version} ({built['interpreter']}): {versions}; {run.stdout.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-3000:]
    assert re.match(rf"{re.escape(version)}\.\d+ ", versions), versions
    cells = json.loads(report.read_text())["cells"]
    verdicts = {c["id"]: (c["verdict"], c["outcome"]) for c in cells}
    assert verdicts["test_fit[adam-arrays-nojit-colshard]"] == ("pass", "passed"), verdicts
    assert verdicts["test_fit[sgd-dataloader-jit-colshard]"] == ("compile-fallback", "xfailed"), verdicts
    setup = [c for c in cells if c["nodeid"].startswith("conformance/test_setup.py")]
    assert setup and all(c["outcome"] in ("passed", "xfailed") for c in setup), setup
