"""The plugin is a good guest in a Keras contributor's environment: it keeps their torch and Keras.

Its requirements are a torch range and no Keras; the default build and the CPU torch pin are an
extra and a constraints file that README's set-up and CI name. The dry run below asks pip itself
what installing the project into this environment would change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the self-tests run on 3.11 (ci.yml)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def requirements(section: list[str]) -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, section)}


def project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_requirements_are_a_torch_range_and_no_keras():
    deps = requirements(project()["dependencies"])
    assert not {"keras", "keras-nightly"} & set(deps)
    torch = deps["torch"].specifier
    # CUDA builds carry a local version label; a range admits them, a pin to another version would not.
    assert all(torch.contains(v) for v in ("2.13.0+cu128", "2.13.0+cpu", "2.14.0", "2.15.0+cu130"))
    assert not torch.contains("2.12.1+cu126")


def test_the_declared_floor_is_the_one_the_plugin_names():
    """pyproject's torch>= and torch_internals.TORCH_FLOOR (what an older torch's error names) agree."""
    from keras_dtensor_conformance.torch_internals import TORCH_FLOOR

    assert str(requirements(project()["dependencies"])["torch"].specifier) == f">={TORCH_FLOOR}"


def test_the_default_build_and_the_cpu_pin_are_opt_in():
    extras = project()["optional-dependencies"]
    assert "keras-nightly" in requirements(extras["default-build"])
    with open(os.path.join(ROOT, "constraints-cpu.txt"), encoding="utf-8") as f:
        pins = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert pins == ["torch==2.13.0"]
    for path in (".ci/run", "README.md"):
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = f.read()
            assert '-c constraints-cpu.txt -e ".[default-build,jax,test,hub]"' in text, path
            assert "--no-deps -r requirements-hub.txt" in text, path


def test_installing_the_plugin_keeps_the_installed_torch(tmp_path):
    """``pip install --dry-run --report``: torch (a local-label build here: +cpu) is not replaced.

    The installed +cpu build stands in for a user's CUDA build: both are "2.13.0" plus a local
    label, which a range requirement accepts as it is.
    """
    import torch

    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-build-isolation",
         "--report", str(report), "-e", ROOT],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "+" in torch.__version__
    assert "torch" not in installs and not {"keras", "keras-nightly"} & installs, installs


def test_kerashub_installs_without_replacing_the_build_or_bringing_tensorflow(tmp_path):
    """``pip install --dry-run``: the ``hub`` extra (KerasHub's dependencies) and requirements-hub.txt with
    ``--no-deps`` (KerasHub itself) install neither the ``keras`` distribution, which would be written over
    the build under test, nor TensorFlow, which a plain install of the same KerasHub brings (its metadata
    asks for keras>=3.15 and tensorflow-text: requirements-hub.txt)."""
    def installs(*args: str) -> set[str]:
        report = tmp_path / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                               *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}

    needed = project()["optional-dependencies"]["hub"]
    extra = installs("--ignore-installed", *needed)  # what the extra brings, as into an empty environment
    hub = installs("--ignore-installed", "--no-deps", "-r", os.path.join(ROOT, "requirements-hub.txt"))
    assert hub == {"keras-hub-nightly"}
    assert "grain" in extra and "sentencepiece" in extra, extra
    for unwanted in ("keras", "keras-nightly", "tensorflow", "tensorflow-text", "keras-hub-nightly"):
        assert unwanted not in extra, extra
