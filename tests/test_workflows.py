"""The GitHub Actions workflows, checked offline: schema, security audit, and README agreement."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def tool(name: str) -> str:
    """The test extra's console script: beside this interpreter (a venv run without activating it)
    first, then on PATH."""
    path = shutil.which(name, path=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return path


@pytest.mark.parametrize("workflow", WORKFLOWS, ids=[w.name for w in WORKFLOWS])
def test_workflow_matches_github_schema(workflow):
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(workflow)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_zizmor_finds_nothing_of_high_severity():
    result = subprocess.run([tool("zizmor"), "--offline", "--format", "json", str(ROOT / ".github" / "workflows")],
                            capture_output=True, text=True)
    findings = json.loads(result.stdout)
    high = [f"{f['ident']}: {f['desc']}" for f in findings if f["determinations"]["severity"] == "High"]
    assert high == []


def workflow_commands() -> list[str]:
    """Command lines of the workflows' run: blocks that start the suite or CI."""
    commands = []
    for workflow in WORKFLOWS:
        for line in workflow.read_text().splitlines():
            line = line.strip().removeprefix("run:").strip()
            if re.match(r"(pytest|bash \.ci/run)\b", line):
                commands.append(line)
    return commands


def test_workflows_run_the_commands_readme_documents():
    commands = workflow_commands()
    assert any(c.startswith("pytest --nproc") for c in commands) and "bash .ci/run" in commands
    readme = (ROOT / "README.md").read_text()
    assert [c for c in commands if c not in readme] == []


def test_reusable_workflow_can_be_called():
    text = (ROOT / ".github" / "workflows" / "keras-conformance.yml").read_text()
    assert "workflow_call:" in text
    caller = (ROOT / ".github" / "workflows" / "conformance.yml").read_text()
    assert "uses: ./.github/workflows/keras-conformance.yml" in caller


def test_every_gating_leg_can_be_green():
    """A gating leg runs a build whose failures are recorded (or that has no torch distribution and
    so skips); every other combination sits in the report-only job, which says so in its inputs."""
    from ruamel.yaml import YAML  # check-jsonschema's own YAML parser (the test extra)

    jobs = YAML(typ="safe").load((ROOT / ".github" / "workflows" / "conformance.yml").read_text())["jobs"]
    gating, report_only = jobs["conformance"], jobs["conformance-report-only"]
    assert report_only["with"]["report-only"] is True and "report-only" not in gating["with"]
    matrix = gating["strategy"]["matrix"]
    assert matrix["nproc"] == [2] and matrix["torch"] == ["2.13.0"]  # what the expectations were recorded on
    for leg in matrix["keras"]:
        expectations = leg["expectations"]
        if leg["requirement"] == "keras==3.15.1":
            assert expectations == ""  # no torch distribution: every cell skips, said once
            continue
        assert expectations.startswith("suite:") and (ROOT / expectations.removeprefix("suite:")).is_file(), leg


def test_the_floor_gates_and_the_newest_torch_reports():
    """Issue 17: a gating leg on the declared floor whose expectations say they are for it, a report-only
    leg on the newest torch (an empty torch-version: unpinned, as Keras' CI installs it), none below
    the floor; the reusable workflow installs torch unpinned when asked for no version."""
    from keras_dtensor_conformance.report.expectations import read_torch, torch_matches
    from keras_dtensor_conformance.torch_internals import TORCH_FLOOR, unsupported_torch
    from ruamel.yaml import YAML

    jobs = YAML(typ="safe").load((ROOT / ".github" / "workflows" / "conformance.yml").read_text())["jobs"]
    gating = jobs["conformance"]["strategy"]["matrix"]
    (floor,) = gating["torch"]
    assert floor.rsplit(".", 1)[0] == TORCH_FLOOR
    for leg in gating["keras"]:
        if leg["expectations"]:
            releases, _ = read_torch(str(ROOT / leg["expectations"].removeprefix("suite:")))
            assert torch_matches(releases, floor), leg
    report_only = jobs["conformance-report-only"]["strategy"]["matrix"]["torch"]
    assert "" in report_only and all(v == "" or unsupported_torch(v) is None for v in report_only)
    reusable = (ROOT / ".github" / "workflows" / "keras-conformance.yml").read_text()
    assert 'if [ -n "$TORCH_VERSION" ]; then torch="torch==$TORCH_VERSION"; else torch="torch"; fi' in reusable
