"""``--conformance-repro DIR``: a script per failure cluster that reproduces it under torchrun with
torch and the Keras build only, proven on mutant builds (training and op cells, verdicts raised and
verdicts judged) and passing on the unmutated one; and on the default build's own clusters
(compiled op cells' compile-fallback, row-sharded attention's numerics)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import time

import pytest
from keras_dtensor_conformance.report import clusters, reproducers

from conformance import axes, reproducible
from conformance.judge import fit_checks, numerics, op_checks
from conformance.judge import workflows as judge_workflows
from conformance.ranks import ops as rank_ops
from conformance.ranks import workflows as rank_workflows
from tests import mutants
from tests.test_mutants import run_suite

#: An op whose value the judge rejects (no mutant of the kit's CASES gives an op cell numerics):
#: relu computed on the local shard and returned as if that shard were the whole tensor.
RELU_LOCAL_SHARD = mutants.Mutant(
    "relu-local-shard",
    "keras.ops.relu runs on a DTensor's local shard and returns it as the whole (replicated) tensor",
    (mutants.Patch(mutants.TORCH + "ops/nn.py",
                   "def relu(x):\n    x = convert_to_tensor(x)\n    return tnn.relu(x)\n",
                   "def relu(x):\n    x = convert_to_tensor(x)\n"
                   "    if hasattr(x, \"to_local\"):  # mutant: the local shard taken for the whole tensor\n"
                   "        from torch.distributed.tensor import DTensor, Replicate\n"
                   "        return DTensor.from_local(tnn.relu(x.to_local()), x.device_mesh,\n"
                   "                                  [Replicate()] * x.device_mesh.ndim, run_check=False)\n"
                   "    return tnn.relu(x)\n"),),
)

#: (mutant, a cell it fails, the verdict, the script's SPEC line): training cells (an exception in
#: the optimizer's update, one in the data path) and op cells (an exception, and the two verdicts
#: the op judge gives from the result: its placements and its value).
PROOFS = [
    ("foreach-plain-lr", "test_fit[sgd-arrays-nojit-colshard]", "mixed-tensor", "SPEC = {'model': 'mlp'"),
    ("batch-wrong-placement", "test_fit[adam-arrays-nojit-batchshard]", "error", "SPEC = {'model': 'mlp'"),
    ("promotion-off", "test_op[subtract-tensor-shard1-eager]", "mixed-tensor",
     "SPEC = {'op': 'subtract', 'operand': 'tensor', 'placement': 'shard1', 'compile_mode': 'eager'}"),
    ("add-gathers", "test_op[add-tensor-shard1-eager]", "sharding-lost",
     "SPEC = {'op': 'add', 'operand': 'tensor', 'placement': 'shard1', 'compile_mode': 'eager'}"),
    ("relu-local-shard", "test_op[relu-shard0-eager]", "numerics",
     "SPEC = {'op': 'relu', 'operand': None, 'placement': 'shard0', 'compile_mode': 'eager'}"),
    # Training cells the judge fails from their evidence: the script trains its own reference.
    ("grad-scale-one-rank", "test_fit[sgd-arrays-nojit-colshard]", "numerics", "SPEC = {'model': 'mlp'"),
    ("slots-plain", "test_fit[adam-arrays-nojit-colshard]", "sharding-lost", "SPEC = {'model': 'mlp'"),
    ("jit-disabled", "test_fit[sgd-arrays-jit-dataparallel]", "compile-fallback", "SPEC = {'model': 'mlp'"),
]


def mutant_named(name: str) -> mutants.Mutant:
    if name == RELU_LOCAL_SHARD.name:
        return RELU_LOCAL_SHARD
    case = next(c for c in mutants.CASES if c.mutant.name == name)
    return case.mutant


TEARDOWN = "interpreter teardown ran"


def teardown_probe(script_name: str) -> str:
    """A ``sitecustomize`` that says so when a rank of the reproducer reaches interpreter teardown,
    where gloo's threads abort a passing script now and then (SIGABRT; 2 of 28 runs here): a
    reproducer must not get there. Only the ranks: torchrun's agent, inductor's compile workers and
    the script's own single-process reference end through teardown as they should."""
    return (
        "import atexit, os, sys\n"
        f"if [os.path.basename(a) for a in sys.argv] == [{script_name!r}]:  # the script, run with no argument\n"
        f"    atexit.register(print, {TEARDOWN!r}, flush=True)\n"
    )


def torchrun(script, keras_tree, tmp_path) -> subprocess.CompletedProcess:
    """The script as a contributor runs it: PYTHONPATH names the build and nothing of this project
    (besides a teardown probe, which imports nothing)."""
    probe = tmp_path / "teardown_probe"
    probe.mkdir(exist_ok=True)
    (probe / "sitecustomize.py").write_text(teardown_probe(script.name))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([keras_tree, str(probe)])
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    print(f"torchrun {script.name} on {keras_tree}: exit {proc.returncode} in {time.perf_counter() - start:.1f} s")
    return proc


def assert_standalone(text: str) -> None:
    assert not re.search(r"^\s*(from|import) (conformance|keras_dtensor_conformance)\b", text, re.M)


#: One proof per path a script takes, run by default (each costs a suite run and two torchrun runs,
#: about a minute): a training cell whose rank raises (classified as the suite classifies), a
#: training cell the inlined judge fails against the script's own single-process reference, and an
#: op cell the inlined op judge fails. The others take the same paths with other verdicts:
#: ``--reproducer-proofs all`` runs them.
ONE_PER_PATH = ("foreach-plain-lr", "grad-scale-one-rank", "add-gathers")


@pytest.mark.parametrize("name, cell, verdict, spec", PROOFS, ids=[p[0] for p in PROOFS])
def test_a_reproducer_shows_the_failure_and_passes_on_the_unmutated_build(keras_nightly_tree, tmp_path, name, cell,
                                                                           verdict, spec, request):
    if name not in ONE_PER_PATH and request.config.getoption("reproducer_proofs") != "all":
        pytest.skip("the same path as a proof of ONE_PER_PATH with another verdict: --reproducer-proofs all runs it")
    case = next((c for c in mutants.CASES if c.mutant.name == name), None)
    assert case is None or case.expected[cell] == verdict
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), mutant_named(name))
    repro = tmp_path / "repro"
    module = "test_ops.py" if cell.startswith("test_op[") else "test_fit.py"
    assert run_suite(build, ["--conformance-repro", str(repro), f"conformance/{module}::{cell}"], tmp_path) == {
        cell: verdict}
    script = repro / (re.search(r"\[(.*)\]", cell).group(1) + ".py")
    text = script.read_text()
    assert_standalone(text)
    assert spec in text  # the cell literally, not a reference to the suite's axes

    broken = torchrun(script, build, tmp_path)
    said = re.findall(r"^rank (\d): (REPRODUCED|DIFFERENT|trained|the op ran)[^\n]*", broken.stdout, re.M)
    # Whichever rank raises first ends torchrun's group, which may SIGTERM its peer before that one
    # prints (seen once in a clean-clone CI run): the reproduction is any rank's, none different.
    tags = {tag for _, tag in said}
    assert broken.returncode != 0 and "REPRODUCED" in tags and "DIFFERENT" not in tags, (
        broken.stdout[-3000:] + broken.stderr[-3000:])
    assert f"REPRODUCED: {verdict}:" in broken.stdout
    assert f"from {build}/keras" in broken.stdout
    assert TEARDOWN not in broken.stdout

    healthy = torchrun(script, keras_nightly_tree, tmp_path)
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    assert healthy.stdout.count(f"did not reproduce {verdict}") == 2
    assert TEARDOWN not in healthy.stdout, healthy.stdout[-3000:]


def test_the_default_builds_clusters_reproduce(keras_nightly_tree, tmp_path):
    """The default build's own failures, no mutant: compiled op cells on DTensors compile no graph
    (two cells, one cluster, one script), and row-sharded attention trains to other numbers than a
    single process. Each script shows its verdict under torchrun; the compiled op with no tensor
    work passes and gets none."""
    cells = ["test_op[add-tensor-shard1-compiled]", "test_op[multiply-scalar-shard0-compiled]",
             "test_op[shape-shard1-compiled]", "test_fit[attention-adam-arrays-nojit-rowshard]"]
    repro = tmp_path / "repro"
    paths = [f"conformance/{'test_ops' if c.startswith('test_op[') else 'test_fit'}.py::{c}" for c in cells]
    verdicts = run_suite(keras_nightly_tree, ["--conformance-repro", str(repro), *paths], tmp_path)
    assert verdicts == {cells[0]: "compile-fallback", cells[1]: "compile-fallback", cells[2]: "pass",
                        cells[3]: "numerics"}
    assert sorted(p.name for p in repro.glob("*.py")) == ["add-tensor-shard1-compiled.py",
                                                          "attention-adam-arrays-nojit-rowshard.py"]
    for name, shown in [("add-tensor-shard1-compiled.py", "compile-fallback: rank 0: torch.compile ran the op on "
                                                          "DTensors but torch._dynamo compiled 0 graph(s)"),
                        ("attention-adam-arrays-nojit-rowshard.py", "numerics: ")]:
        script = repro / name
        assert_standalone(script.read_text())
        run = torchrun(script, keras_nightly_tree, tmp_path)
        assert run.returncode != 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert run.stdout.count(f"REPRODUCED: {shown}") == 2, run.stdout[-3000:] + run.stderr[-3000:]


# ---------------------------------------------------------------- without ranks
def _cell(cell_id: str, family: str, verdict: str, spec: dict | None, exception: str) -> dict:
    return {"id": cell_id, "family": family, "verdict": verdict, "outcome": "failed", "axes": {}, "spec": spec,
            "message": f"{exception}\nmore", "cause": {"exception": exception, "where": "", "ops": []}}


def test_every_cluster_gets_a_script_or_says_why(tmp_path):
    fit = {"model": "mlp", "optimizer": {"name": "sgd"}, "data": "arrays", "compile": "nojit", "layout": {}}
    op = {"op": "add", "operand": "tensor", "placement": "shard1", "compile_mode": "compiled"}
    cells = [
        _cell("test_op[add-tensor-shard1-compiled]", "ops compiled", "compile-fallback", op, "rank 0: compiled 0"),
        _cell("test_op[add-tensor-shard0-compiled]", "ops compiled", "compile-timeout", {**op, "placement": "shard0"},
              "timed out while compiling"),
        _cell("test_fit[sgd-arrays-nojit-colshard]", "fit colshard", "error", fit, "IndexError: N"),
        _cell("test_fit[attention-sgd-arrays-nojit-colshard]", "fit colshard", "numerics", fit, "rank 0: step_losses"),
        _cell("test_setup[list-devices]", "setup", "error", None, "ValueError: no devices"),
        _cell("test_fit[adam-arrays-nojit-colshard]", "fit colshard", "hang", None, "hung"),  # failed in setup
        _cell("test_workflow[fit-freeze-fit-eager-dataparallel]", "workflows", "mixed-tensor",
              {"flow": "fit-freeze-fit", "compile": "eager", "layout": {"kind": "data-parallel"}}, "RuntimeError: N"),
    ]
    report = {"cells": cells, "clusters": clusters.clusters(cells),
              "build": {"keras_version": "3", "torch_version": "2", "backend": "gloo", "nproc": 2}}
    result = reproducers.write(report, str(tmp_path), every_cell=False, timeout=240.0,
                               families=reproducible.FAMILIES)
    assert sorted(w["cell"] for w in result["written"]) == ["test_fit[attention-sgd-arrays-nojit-colshard]",
                                                            "test_fit[sgd-arrays-nojit-colshard]",
                                                            "test_op[add-tensor-shard1-compiled]",
                                                            "test_workflow[fit-freeze-fit-eager-dataparallel]"]
    assert {w["verdict"]: w["why"] for w in result["without"]} == {
        "compile-timeout": "a compile still running at the timeout, not a failure: rerun with a larger --rank-timeout",
        "error": "no training, op, workflow or KerasHub cell in it (family setup)",
        "hang": "none of its cells recorded its spec (they failed before they ran)",
    }
    workflow = (tmp_path / "fit-freeze-fit-eager-dataparallel.py").read_text()
    assert_standalone(workflow)
    assert inspect.getsource(rank_workflows.run_flow) in workflow
    assert inspect.getsource(judge_workflows.workflow_failure) in workflow
    text = (tmp_path / "add-tensor-shard1-compiled.py").read_text()
    assert_standalone(text)
    # The suite's own judge and rank code, inlined, not a copy of them.
    assert inspect.getsource(op_checks.op_failure) in text
    assert inspect.getsource(rank_ops.op_cell) in text
    assert "\nSHARDING_LOST = 'sharding-lost'\n" in text  # a verdict's name, inlined by value
    assert "The suite's verdict: compile-fallback: rank 0: compiled 0\n" in text
    text = (tmp_path / "attention-sgd-arrays-nojit-colshard.py").read_text()
    assert_standalone(text)
    assert inspect.getsource(fit_checks.numbers_differ) in text and inspect.getsource(numerics.compare) in text


def test_a_name_defined_twice_is_refused():
    """Inlined modules share the script's namespace: one that redefines another's name is refused."""
    modules = ("conformance.ranks.ops", "conformance.judge.op_checks", "conformance.judge.numerics",
               "conformance.judge.numerics")
    family = dataclasses.replace(reproducible.OPS, modules=modules)
    op = {"op": "add", "operand": "tensor", "placement": "shard1", "compile_mode": "compiled"}
    with pytest.raises(RuntimeError, match="would define TOLERANCES twice"):
        reproducers.script(_cell("test_op[add-tensor-shard1-compiled]", "ops compiled", "compile-fallback", op, "x"),
                           family, {}, 240.0)


def test_a_name_an_inlined_module_reads_but_nothing_defines_is_refused():
    """An inlined module's import is dropped: one that imported a name under another name
    (``import expected as expected_slots``) would leave that name undefined, a NameError only when the
    code that reads it runs. The writer refuses the script instead."""
    assert reproducers._undefined_globals("def f():\n    return expected_slots(1)\n", "x.py") == {"expected_slots"}
    assert reproducers._undefined_globals("x = 1\ndef f():\n    return len([x])\n", "x.py") == set()
    training = reproducible.TRAINING
    cell = _cell("test_fit[adam-arrays-nojit-colshard]", "fit colshard", "numerics",
                 axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard"), "x")
    reproducers.script(cell, training, {}, 240.0)  # the suite's own: every name defined
    with pytest.raises(RuntimeError, match="would read expected_slots, which nothing in it defines"):
        reproducers._check_definitions(reproducers.script(cell, training, {}, 240.0)
                                       + "\ndef g():\n    return expected_slots()\n", cell["id"])


def test_a_script_that_would_import_this_project_is_not_written():
    """``oracle`` imports the module ``axes`` (not a constant, not inlined before it)."""
    with pytest.raises(RuntimeError, match=r"would import this project: from conformance import axes, cell_data \(axes is"):
        reproducers.inlined_source(("conformance.judge.oracle",))


def test_a_suite_that_offers_no_family_gets_no_script_and_is_told_why(tmp_path):
    """The plugin knows no family of its own: the families are the suite's, through its hook."""
    fit = {"model": "mlp", "optimizer": {"class": "SGD"}, "data": "arrays", "compile": "nojit", "layout": {}}
    cells = [_cell("test_fit[sgd-arrays-nojit-colshard]", "fit colshard", "error", fit, "IndexError: N")]
    report = {"cells": cells, "clusters": clusters.clusters(cells), "build": {}}
    result = reproducers.write(report, str(tmp_path), every_cell=False, timeout=240.0, families=[])
    assert result["written"] == [] and not list(tmp_path.glob("*.py"))
    assert [w["why"] for w in result["without"]] == [
        "the suite offers no reproducer family (pytest_conformance_reproducer_families); family fit colshard"]
