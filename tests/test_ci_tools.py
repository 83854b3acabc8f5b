"""The reusable workflow's install step, run here as GitHub runs it (its ``run:`` text under bash),
with pip replaced by a recorder: what a leg installs for a git checkout and for a wheel, and the
check that fails a leg whose torch came with CUDA although it named the CPU index."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from keras_dtensor_conformance import ci
from tests.workflows import REUSABLE, workflow

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def install_step() -> dict:
    (step,) = [s for s in workflow(REUSABLE)["jobs"]["conformance"]["steps"]
               if s.get("name", "").startswith("Install the suite")]
    return step


def fake_checkout(tmp_path: pathlib.Path, dependencies: list[str]) -> None:
    tree = tmp_path / "keras-tree"
    (tree / "keras").mkdir(parents=True)
    (tree / "pyproject.toml").write_text(
        "[project]\nname = 'keras'\ndependencies = [" + ", ".join(repr(d) for d in dependencies) + "]\n")


def run_install_step(tmp_path: pathlib.Path, cuda: str | None = None, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    """The step's shell in a work directory holding ``suite`` (this checkout) and maybe a
    ``keras-tree``; ``python -m pip`` is recorded, not run; ``cuda`` fakes torch.version.cuda."""
    (tmp_path / "suite").symlink_to(ROOT)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "pip.log"
    # A stand-in torch module, found first, so that the check sees the build we ask for.
    fake = tmp_path / "faketorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        f"__version__ = '2.13.0{'+cu130' if cuda else '+cpu'}'\nclass version:\n    cuda = {cuda!r}\n")
    (bindir / "python").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -m ] && [ "$2" = pip ]; then shift 2; echo "$@" >> {log}; exit 0; fi\n'
        f'PYTHONPATH={fake.parent} exec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    step = install_step()
    environment = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "TORCH_VERSION": "2.13.0",
                   "TORCH_INDEX_URL": CPU_INDEX, "KERAS_REQUIREMENT": "", "GITHUB_ACTIONS": "true", **env}
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)
    return proc, log.read_text() if log.exists() else ""


def test_a_git_checkout_installs_what_its_pyproject_declares(tmp_path):
    """Issue 41, item 5: a Keras pull request that adds a dependency gets it installed, with the
    leg's torch, not the nightly's dependencies."""
    fake_checkout(tmp_path, ["absl-py", "kdc-declared-by-the-checkout>=1.2", "torch>=2.1"])
    proc, pip = run_install_step(tmp_path)
    assert proc.returncode == 0, proc.stderr
    (line,) = pip.splitlines()
    assert line.split() == ["install", "--extra-index-url", CPU_INDEX, "torch==2.13.0", "absl-py",
                            "kdc-declared-by-the-checkout>=1.2", "-e", "./suite[jax]"]


def test_a_wheel_installs_with_its_own_dependencies(tmp_path):
    proc, pip = run_install_step(tmp_path, KERAS_REQUIREMENT="keras==3.15.1", TORCH_VERSION="")
    assert proc.returncode == 0, proc.stderr
    assert pip.split() == ["install", "--extra-index-url", CPU_INDEX, "torch", "keras==3.15.1", "-e", "./suite[jax]"]


def test_a_checkout_without_declared_dependencies_is_one_error_line(tmp_path):
    (tmp_path / "keras-tree").mkdir()
    proc, pip = run_install_step(tmp_path)
    assert proc.returncode != 0 and pip == ""
    assert proc.stderr.strip().splitlines() == [
        "::error::keras-tree: no pyproject.toml, so no declared dependencies to install (a Keras git checkout "
        "has one; pass a wheel as keras-requirement instead)"]


def test_a_cuda_torch_fails_a_leg_that_named_the_cpu_index(tmp_path):
    """Issue 41, item 4: pip took the CUDA build (the CPU index unreachable, or without that wheel):
    the leg stops at its install step with one line, not hours later on a GB download's torch."""
    fake_checkout(tmp_path, ["numpy"])
    proc, _ = run_install_step(tmp_path, cuda="13.0")
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("::error::torch 2.13.0+cu130 came with CUDA 13.0 although this leg named PyTorch's CPU "
                           f"index ({CPU_INDEX})"), line


def test_a_cuda_torch_is_fine_where_no_cpu_index_was_named(tmp_path):
    fake_checkout(tmp_path, ["numpy"])
    proc, _ = run_install_step(tmp_path, cuda="13.0", TORCH_INDEX_URL="")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA 13.0" in proc.stdout


@pytest.mark.parametrize("url, named", [(CPU_INDEX, True), (CPU_INDEX + "/", True),
                                        ("https://download.pytorch.org/whl/cu130", False), ("", False)])
def test_the_cpu_index_is_told_by_its_path(url, named):
    assert ci.names_cpu_index(url) is named


def test_the_dependency_list_refuses_what_is_not_a_list(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'keras'\ndynamic = ['dependencies']\n")
    with pytest.raises(ci.CIError, match=r"no \[project\] dependencies list"):
        ci.keras_dependencies(str(tmp_path))
