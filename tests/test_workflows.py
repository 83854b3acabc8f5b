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
            if re.match(r"(pytest|bash \.ci/run)(\s|$)", line):  # not an input such as pytest-args:
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
    # Issue 42: --full gates too, in slices, on the default tier's file, which a whole --full run recorded.
    full = jobs["conformance-full"]["with"]
    assert full["tier"] == "full" and full["slices"] > 1 and not full.get("report-only")
    assert (full["nproc"], full["torch-version"]) == (2, "2.13.0")
    gated = {(leg["requirement"], leg["expectations"]) for leg in matrix["keras"] if leg["expectations"]}
    assert (full["keras-requirement"], full["expectations"]) in gated


def test_the_mesh_leg_gates_the_2x2_cells_on_their_own_expectations():
    """Issue 27, item 4: a gating leg at 4 ranks whose selection is the default tier's 2x2-mesh cells,
    the Keras-sharded ones among them, judged strictly by a file recorded for them; every entry of
    that file decides a cell the leg collects (none is there for nothing)."""
    from keras_dtensor_conformance.report.expectations import Book
    from keras_dtensor_conformance.report.expectations_file import read, read_torch, torch_matches
    from ruamel.yaml import YAML

    mesh = YAML(typ="safe").load((ROOT / ".github" / "workflows" / "conformance.yml").read_text())["jobs"]["conformance-mesh"]
    inputs = mesh["with"]
    assert mesh["uses"] == "./.github/workflows/keras-conformance.yml" and "report-only" not in inputs
    args = inputs["pytest-args"].split()
    assert inputs["nproc"] == 4 and args[args.index("-m") + 1] == "mesh" and "--conformance-strict" in args
    path = ROOT / inputs["expectations"].removeprefix("suite:")
    releases, _ = read_torch(str(path))
    assert torch_matches(releases, inputs["torch-version"]) and "nproc 4" in path.read_text().splitlines()[0]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "--nproc", "4", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = re.findall(r"::(test_\w+\[[^\]]+\])", collected.stdout)
    # The 2x2 mesh's cells: the Keras-sharded and training ones (`batchxmodel`), KerasHub's under the authors' map.
    assert ids and all(i.endswith("-batchxmodel]") or i.startswith("test_hub[") and i.endswith("-2x2]") for i in ids), \
        collected.stdout[-2000:]
    assert "test_keras_sharded[pydataset-batchxmodel]" in ids  # the cell that proves the shard count
    assert Book(read(str(path))).stale(set(ids)) == []


def test_the_floor_gates_and_the_newest_torch_reports():
    """Issue 17: a gating leg on the declared floor whose expectations say they are for it, a report-only
    leg on the newest torch (an empty torch-version: unpinned, as Keras' CI installs it), none below
    the floor; the reusable workflow installs torch unpinned when asked for no version."""
    from keras_dtensor_conformance.report.expectations_file import read_torch, torch_matches
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
    assert 'torch="torch${TORCH_VERSION:+==$TORCH_VERSION}"' in reusable


# -- every leg installs, callers can call, the shell steps lint clean --------------------------


@pytest.fixture(scope="module")
def resolved(request):
    """pip's verdict on every distinct install of every leg (``workflows.resolve_every_leg``),
    started as soon as the tests are collected (tests/conftest.py)."""
    from tests.conftest import early

    return early(request, "resolved")


def test_every_leg_of_every_workflow_installs_on_its_python(resolved):
    """Issue 26: a leg whose Python its requirements do not support (keras-nightly, jax 0.10.2 and
    numpy 2.4 need 3.11) fails on GitHub at its install step; here pip's resolver says so first."""
    legs, problems = resolved
    pythons = {leg.python for leg in legs.values()}
    assert {"3.11", "3.12", "3.13"} <= pythons, pythons
    failing = {legs[k].name: p for k, p in problems.items() if p is not None}
    assert failing == {}


def test_a_leg_that_cannot_install_fails_the_check():
    """The check above, on a conformance.yml with a Python 3.10 leg put back (as it gated before
    issue 26): that leg, and only that one, is named."""
    from tests.workflows import WORKFLOWS, caller_legs, resolve

    text = (WORKFLOWS / "conformance.yml").read_text()
    assert 'python-version: ["3.11", "3.12", "3.13"]' in text
    legs = caller_legs("conformance.yml", text.replace('python-version: ["3.11"', 'python-version: ["3.10", "3.11"'))
    new = [leg for leg in legs if leg.python == "3.10" and "keras-nightly" in " ".join(leg.downloads)]
    assert len(new) == 1
    problem = resolve(new[0])
    assert problem is not None and "keras-nightly==3.16.0.dev2026102704" in problem, problem


def test_requires_python_is_what_the_legs_install():
    import tomllib

    from packaging.specifiers import SpecifierSet

    from tests.workflows import every_leg

    declared = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    assert not declared.contains("3.10") and all(declared.contains(leg.python) for leg in every_leg())
    assert "Python ≥ 3.11" in (ROOT / "README.md").read_text()


def readme_caller() -> dict:
    from tests.workflows import load, readme_caller_text

    return load(readme_caller_text())


def test_readme_caller_is_a_whole_workflow_keras_could_paste(tmp_path):
    caller = readme_caller()
    assert {"name", "on", "permissions", "jobs"} <= set(caller), sorted(caller)
    assert caller["permissions"] == {"contents": "read"}  # what Keras' workflows grant
    from tests.workflows import readme_caller_text

    path = tmp_path / "dtensor-conformance.yml"
    path.write_text(readme_caller_text())
    result = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    lint = actionlint(str(path))
    assert lint.returncode == 0, lint.stdout + lint.stderr


@pytest.mark.parametrize("caller", ["README", "conformance.yml"])
def test_a_contents_read_caller_can_call_the_workflows(caller):
    """GitHub refuses a called workflow whose jobs ask for more than the caller's token has, before
    any job runs: README's caller and the project's own matrix grant what each call needs."""
    from tests.workflows import caller_problems, workflow

    data = readme_caller() if caller == "README" else workflow(caller)
    assert caller_problems(data) == []


def test_the_reusable_workflow_asks_for_contents_read_only():
    from tests.workflows import REUSABLE, permission_problems, permissions, workflow

    assert permission_problems(permissions({"contents": "read"}), workflow(REUSABLE)) == []


def test_the_permission_check_names_a_job_that_asks_for_more():
    from tests.workflows import permission_problems, permissions, workflow

    previous = workflow("keras-conformance-previous.yml")
    assert permission_problems(permissions({"contents": "read"}), previous) == [
        "the nested job 'previous' is requesting 'actions: read', but is only allowed 'actions: none'"]
    assert permission_problems(permissions({"actions": "read"}), previous) == []
    assert permission_problems(permissions("read-all"), previous) == []


def test_the_reusable_workflow_takes_what_keras_needs_to_call_it():
    """Keras runs its CPU tests in a python:3.11-slim container on its own runner label, with
    torch from PyTorch's CPU index (its requirements.txt)."""
    from tests.workflows import reusable_defaults

    defaults = reusable_defaults()
    assert {"runs-on", "container", "torch-index-url", "pytest-args", "artifact-name", "previous-reports",
            "timeout-minutes"} <= set(defaults)
    assert defaults["torch-index-url"] == "https://download.pytorch.org/whl/cpu"
    assert defaults["container"] == "" and defaults["previous-reports"] == ""


def test_actions_are_current_majors_pinned_by_sha():
    pinned = {}
    for workflow in WORKFLOWS:
        for uses, comment in re.findall(r"uses: (actions/[\w-]+@\S+)(?: # (\S+))?", workflow.read_text()):
            action, ref = uses.split("@")
            assert re.fullmatch(r"[0-9a-f]{40}", ref) and comment, f"{workflow.name}: {uses} is not pinned by SHA"
            pinned.setdefault(action, set()).add((ref, comment))
    assert {a: len(v) for a, v in pinned.items()} == dict.fromkeys(pinned, 1), pinned  # one version each
    majors = {a: int(next(iter(v))[1].lstrip("v").split(".")[0]) for a, v in pinned.items()}
    # node24 releases: what GitHub's runners keep after node20's retirement
    assert majors == {"actions/checkout": 7, "actions/setup-python": 7, "actions/upload-artifact": 7,
                      "actions/download-artifact": 8, "actions/cache": 6}, majors


def zizmor_findings(path) -> list[str]:
    """zizmor as Keras runs it on its .github (every audit, the default persona), offline."""
    result = subprocess.run([tool("zizmor"), "--offline", "--format", "json", str(path)], capture_output=True, text=True)
    assert result.returncode in (0, 10, 11, 12, 13, 14), result.stderr  # 1x: findings of some severity
    return [f"{f['ident']} ({f['determinations']['severity']}): {f['desc']}" for f in json.loads(result.stdout)]


def test_readme_caller_passes_zizmor_as_keras_runs_it(tmp_path):
    """Issue 41, item 2: Keras runs zizmor on its workflows in every pull request; README's caller
    pasted there adds no finding (an unpinned ``uses:`` is a high one)."""
    from tests.workflows import readme_caller_text

    workflows = tmp_path / ".github" / "workflows"
    workflows.mkdir(parents=True)
    (workflows / "dtensor-conformance.yml").write_text(readme_caller_text())
    assert zizmor_findings(tmp_path / ".github") == []
    (workflows / "dtensor-conformance.yml").write_text(re.sub(r"@[0-9a-f]{40}", "@main", readme_caller_text()))
    assert any(f.startswith("unpinned-uses (High)") for f in zizmor_findings(tmp_path / ".github"))  # it can fail


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def test_readme_caller_pins_a_commit_whose_workflows_are_todays():
    """The caller names this repository's workflows at a commit SHA, the same for both, and the
    reusable workflow's inputs at that commit are today's: a maintainer who pastes it gets the
    interface README documents (when the inputs change, README's SHA moves to the commit that did it)."""
    from tests.workflows import REUSABLE, SUITE_REPOSITORY, load, readme_caller_text

    uses = [job["uses"] for job in load(readme_caller_text())["jobs"].values()]
    shas = {u.rsplit("@", 1)[1] for u in uses}
    assert all(u.startswith(f"{SUITE_REPOSITORY}/.github/workflows/") for u in uses), uses
    (sha,) = shas
    assert re.fullmatch(r"[0-9a-f]{40}", sha), uses
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone (GitHub's checkout) has not the history to look the pinned commit up in")
    pinned = _git("show", f"{sha}:.github/workflows/{REUSABLE}")
    assert pinned.returncode == 0, f"README pins {sha}, which this repository does not have: {pinned.stderr}"
    today = (WORKFLOWS[0].parent / REUSABLE).read_text()
    assert load(pinned.stdout)["on"]["workflow_call"]["inputs"] == load(today)["on"]["workflow_call"]["inputs"], (
        f"{REUSABLE}'s inputs changed since {sha}: pin README's caller to the commit that changed them")


def test_the_suite_runs_at_the_commit_its_caller_pinned():
    """Issue 41, item 2: pinning the workflow pins the suite's code: it is checked out at the commit
    the caller named (job.workflow_sha, of job.workflow_repository), unless overridden on purpose."""
    from tests.workflows import REUSABLE, reusable_defaults, workflow

    (checkout,) = [s for s in workflow(REUSABLE)["jobs"]["conformance"]["steps"] if s.get("with", {}).get("path") == "suite"]
    assert checkout["with"]["repository"] == "${{ inputs.suite-repository || job.workflow_repository }}"
    assert checkout["with"]["ref"] == "${{ inputs.suite-ref || job.workflow_sha }}"
    defaults = reusable_defaults()
    assert defaults["suite-repository"] == "" and defaults["suite-ref"] == ""


def test_a_gating_leg_runs_in_kerass_container():
    """Issue 41, item 3: one gating leg in python:3.11-slim, as Keras' CPU tests run, on the same build,
    torch and expectations as the runner's legs (so the same verdicts, or red); the reusable workflow
    installs a C++ compiler there, which torch.compile's inductor needs and the image lacks."""
    from tests.workflows import REUSABLE, workflow

    jobs = workflow("conformance.yml")["jobs"]
    containers = {name: job["with"] for name, job in jobs.items() if job.get("with", {}).get("container")}
    (inputs,) = containers.values()
    runner = jobs["conformance"]["strategy"]["matrix"]
    nightly = [k for k in runner["keras"] if k["expectations"]]
    assert inputs["container"] == "python:3.11-slim" and not inputs.get("report-only")
    assert {"requirement": inputs["keras-requirement"], "expectations": inputs["expectations"]} in nightly
    assert [inputs["torch-version"]] == runner["torch"] and [inputs["nproc"]] == runner["nproc"]
    steps = workflow(REUSABLE)["jobs"]["conformance"]["steps"]
    compiler = steps[0]
    assert compiler["if"] == "inputs.container != ''" and "build-essential" in compiler["run"]


def test_every_job_runs_in_the_legs_container():
    """Issue 56, item 8: the plan and merge jobs run where the legs do. A caller's runner may offer only
    its container (no Python on the host for setup-python), so each job takes ``inputs.container``, and
    setup-python runs only without one; the plan job needs bash and coreutils, which a python:* image has."""
    from tests.workflows import REUSABLE, workflow

    jobs = workflow(REUSABLE)["jobs"]
    assert set(jobs) == {"plan", "conformance", "merge"}
    for name, job in jobs.items():
        assert job["container"] == "${{ inputs.container }}", name
        for step in job["steps"]:
            if str(step.get("uses", "")).startswith("actions/setup-python@"):
                assert step["if"] == "inputs.container == ''", name
    plan = jobs["plan"]["steps"][0]
    assert plan["shell"] == "bash" and set(re.findall(r"\$\((\w+)", plan["run"])) <= {"seq"}


def test_what_a_maintainer_meets_is_set():
    """Issue 41, item 6: a report-only leg cannot fail the run (job-level continue-on-error: a failed
    install or checkout included); the job's time limit is an input; pip's downloads are cached;
    README's caller and the project's matrix cancel a pull request's superseded runs."""
    from tests.workflows import REUSABLE, load, readme_caller_text, workflow

    job = workflow(REUSABLE)["jobs"]["conformance"]
    assert job["continue-on-error"] == "${{ inputs.report-only }}"
    assert not any("continue-on-error" in s for s in job["steps"] if s.get("name") == "Run the conformance suite")
    assert job["timeout-minutes"] == "${{ inputs.timeout-minutes }}"
    assert any(str(s.get("uses", "")).startswith("actions/cache@") and s["with"]["path"] == "~/.cache/pip"
               for s in job["steps"])
    for caller in (load(readme_caller_text()), workflow("conformance.yml")):
        assert caller["concurrency"]["group"].startswith("${{ github.workflow }}-${{ github.head_ref || ")
    summary = next(s for s in job["steps"] if "step summary" in s.get("name", ""))
    assert summary["run"].startswith("python suite/scripts/ci.py summary report") and summary["if"].startswith("always()")


def actionlint(*paths: str) -> subprocess.CompletedProcess:
    """actionlint, with shellcheck (the test extra's) on its PATH so run: steps are checked too."""
    bindir = os.path.dirname(tool("shellcheck"))
    env = {**os.environ, "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")])}
    return subprocess.run([tool("actionlint"), "-no-color", *paths], capture_output=True, text=True, env=env, cwd=ROOT)


def test_actionlint_finds_nothing():
    result = actionlint(*map(str, WORKFLOWS))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_actionlint_checks_expressions_and_shell(tmp_path):
    """The check above can fail: an unknown input in an expression and an unquoted variable in a
    run: step (shellcheck's SC2086) are both reported."""
    bad = tmp_path / "bad.yml"
    bad.write_text("on:\n  workflow_call:\n    inputs:\n      a:\n        type: string\n"
                   "jobs:\n  j:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ inputs.b }}\n      - run: echo $SOME_PATH\n")
    out = actionlint(str(bad)).stdout
    assert "inputs.b" in out and "SC2086" in out, out


def test_the_workflow_goes_wide_in_slices_and_gates_on_their_merge():
    """Issue 42, item 4: ``slices: N`` runs the selection as an N-job matrix of ``--conformance-slice
    K/N``; a last job merges their reports (``report/merge.py``), writes the summary, uploads the
    whole run's report under the name one job would use (what the next run compares with) and fails
    as one run would; a report-only leg's merge cannot fail the run either."""
    from tests.workflows import REUSABLE, reusable_defaults, workflow

    jobs = workflow(REUSABLE)["jobs"]
    assert reusable_defaults()["slices"] == 1
    suite, merge = jobs["conformance"], jobs["merge"]
    assert suite["needs"] == "plan" and suite["strategy"]["matrix"]["slice"] == "${{ fromJSON(needs.plan.outputs.slices) }}"
    assert suite["strategy"]["fail-fast"] is False
    run = next(s for s in suite["steps"] if s.get("name") == "Run the conformance suite")["run"]
    assert 'args+=(--conformance-slice "$SLICE")' in run
    assert merge["needs"] == ["plan", "conformance"] and merge["if"] == "${{ !cancelled() && inputs.slices > 1 }}"
    assert merge["continue-on-error"] == "${{ inputs.report-only }}" and merge["permissions"] == {"contents": "read"}
    steps = {s.get("name", s.get("uses", "")): s for s in merge["steps"]}
    assert steps["Download the slices' reports"]["with"]["pattern"] == "${{ env.REPORT_NAME }}-slice-*"
    assert "python -m keras_dtensor_conformance.report.merge slices/*/report.json" in (
        steps["Merge the slices' reports and gate on the whole run"]["run"])
    assert steps["Upload the report"]["with"]["name"] == "${{ env.REPORT_NAME }}"
    assert merge["env"]["REPORT_NAME"] == "${{ needs.conformance.outputs.report-name }}"
