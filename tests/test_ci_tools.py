"""The reusable workflow's install step, run here as GitHub runs it (its ``run:`` text under bash),
with pip replaced by a recorder: what a leg installs for a git checkout and for a wheel, and the
check that fails a leg whose torch came with CUDA although it named the CPU index."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from tests.workflows import REUSABLE, workflow

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # a CI helper, not part of the installed plugin
import ci  # noqa: E402
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


def step_of(job: str, name: str) -> dict:
    (step,) = [s for s in workflow(REUSABLE)["jobs"][job]["steps"] if s.get("name") == name or s.get("id") == name]
    return step


def run_step(step: dict, cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    """A step's ``run:`` under bash, as GitHub runs it (``-e``), with its outputs in $GITHUB_OUTPUT."""
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"  # this venv's python first
    environment = {**os.environ, "PATH": path, "GITHUB_ACTIONS": "true", "GITHUB_OUTPUT": str(cwd / "output"), **env}
    return subprocess.run(["bash", "-e", "-c", step["run"]], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=120)


def test_the_plan_makes_the_slices_matrix(tmp_path):
    """Issue 42, item 4: ``slices: 3`` is the matrix 1/3, 2/3, 3/3; 1 is one job; anything else one error."""
    import json

    for slices, matrix in (("3", ["1/3", "2/3", "3/3"]), ("1", ["1/1"])):
        proc = run_step(step_of("plan", "plan"), tmp_path, SLICES=slices)
        assert proc.returncode == 0, proc.stderr
        assert json.loads((tmp_path / "output").read_text().split("=", 1)[1]) == matrix
        (tmp_path / "output").unlink()
    proc = run_step(step_of("plan", "plan"), tmp_path, SLICES="0")
    assert proc.returncode == 1 and proc.stdout == "::error::slices: '0' is not a whole number of at least 1\n"


def test_the_merge_step_merges_the_downloaded_slices_and_gates(tmp_path):
    """The merge job's step on the artifacts as download-artifact lays them out (a folder per slice's
    artifact), with the previous run's report: the whole run's report, compared, and the job failed
    for the cell that failed; a slice missing fails it with one line."""
    import json

    from tests.test_merge import CELLS, report_of, sliced

    name = "conformance-keras-nightly-torch2.13.0-py3.11-n2"
    for path, report in sliced(tmp_path):
        folder = tmp_path / "slices" / f"{name}-slice-{report['slice']['k']}"
        folder.mkdir(parents=True)
        (folder / "report.json").write_text(json.dumps(report))
    (tmp_path / "previous" / name).mkdir(parents=True)
    previous = report_of(list(CELLS), tmp_path)
    next(c for c in previous["cells"] if c["id"] == "test_op[add-compiled]")["verdict"] = "pass"
    (tmp_path / "previous" / name / "report.json").write_text(json.dumps(previous))
    step = step_of("merge", "Merge the slices' reports and gate on the whole run")
    proc = run_step(step, tmp_path, REPORT_NAME=name, FAIL_ON_REGRESSION="true")
    assert proc.returncode == 1, proc.stderr
    assert "1 cell failed or did not finish: test_fit[sgd-colshard]: failing the merged run" in proc.stdout
    assert ("1 regression against the compared report: test_op[add-compiled]: failing the merged run"
            in proc.stdout)  # an expected failure now, a pass before: --fail-on-regression reached the merge
    merged = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(merged["slices"]) == 3 and [e["id"] for e in merged["compare"]["regressions"]] == ["test_op[add-compiled]"]
    assert {p.name for p in (tmp_path / "report").iterdir()} == {"report.json", "report.md", "report.html"}
    for part in (tmp_path / "slices").glob("*-slice-2"):
        (part / "report.json").unlink()
        part.rmdir()
    proc = run_step(step, tmp_path, REPORT_NAME=name, FAIL_ON_REGRESSION="false")
    assert proc.returncode == 2 and proc.stderr == "error: slice 2 of 3 missing: a merge needs every slice's report\n"


def test_the_summary_opens_with_what_nobody_expected(tmp_path):
    """Both jobs end with ``ci.py summary``: the Markdown report (unexpected results first) in the job
    summary, the same results as ``::error`` lines; a report-only leg says so first; no report, why."""
    import json

    from tests.test_merge import sliced

    from keras_dtensor_conformance.report.markdown import markdown
    from keras_dtensor_conformance.report.merge import merge

    merged = merge(sliced(tmp_path))
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.json").write_text(json.dumps(merged))
    (tmp_path / "report" / "report.md").write_text(markdown(merged))
    target = tmp_path / "summary.md"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci.py"), "summary", "report", "--report-only",
                           "true"], cwd=tmp_path, env={**os.environ, "GITHUB_STEP_SUMMARY": str(target)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    written = target.read_text()
    assert written.startswith(ci.REPORT_ONLY_LINE) and "### Unexpected results (1)" in written
    assert proc.stdout == (
        "::error title=new failure%3A test_fit[sgd-colshard]::mixed-tensor: got mixed torch.Tensor and DTensor\n")
    target.unlink()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci.py"), "summary", "nothing"], cwd=tmp_path,
                          env={**os.environ, "GITHUB_STEP_SUMMARY": str(target)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and target.read_text() == ci.NO_REPORT_LINE + "\n"


def run_container_step(tmp_path: pathlib.Path, headers: bool, tools=("g++", "git")) -> subprocess.CompletedProcess:
    """The container step's shell with g++ and git present (fakes), and a python3 whose include
    folder has Python.h or not."""
    bindir, include = tmp_path / "bin", tmp_path / "include"
    bindir.mkdir()
    include.mkdir()
    if headers:
        (include / "Python.h").write_text("")
    for name in tools:
        (bindir / name).write_text("#!/bin/sh\nexit 0\n")
        (bindir / name).chmod(0o755)
    (bindir / "python3").write_text(f"#!/bin/sh\necho {include}\n")
    (bindir / "python3").chmod(0o755)
    step = step_of("conformance", "Install a C++ compiler and git in the container")
    return run_step(step, tmp_path, CONTAINER="debian:bookworm", PATH=f"{bindir}{os.pathsep}/usr/bin:/bin")


def test_a_container_without_pythons_headers_fails_in_one_line(tmp_path):
    """Issue 41, item 3: in a chroot shaped like python:3.11-slim the step made the compiled jit cells
    pass as on the runner; with a distribution's python3 and no -dev package they still failed
    (``Python.h: No such file``) after it (docs/measurements.md). The step says so instead."""
    proc = run_container_step(tmp_path, headers=False)
    assert proc.returncode == 1
    assert proc.stdout == (f"::error::container debian:bookworm: no Python.h in {tmp_path / 'include'} (torch.compile's "
                           "C++ includes it): install this Python's -dev package (python3-dev) or use a python:* image\n")
    fine = tmp_path / "python-image"
    fine.mkdir()
    assert run_container_step(fine, headers=True).returncode == 0
