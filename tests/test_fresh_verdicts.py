"""Every verdict is the one a fresh process gets (issue 39): one selection of cells run forward,
reversed and under ``--isolation fresh`` gets the same verdicts, on the default build (60 cells) and
on builds that keep state for their process's life (``mutants.state_keeping.STATE_KEEPING``), which are right in a
fresh process (the 20 of those cells their state changes where ranks are not as fresh ones would be).
The default build's selection in three slices merges into its forward run's report (issue 42). And
``rank/leftovers.py`` finds each kind of state it names."""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from keras_dtensor_conformance.rank import isolation, leftovers
from keras_dtensor_conformance.report import merge
from tests import mutants
from tests.mutants.state_keeping import STATE_KEEPING
from tests.test_mutants import ROOT, session_env
from tests.test_newest_python import EXPECTATIONS

_OPS = ("add", "subtract", "multiply", "divide", "minimum", "maximum", "power", "where", "matmul", "dot", "einsum",
        "concatenate")
#: 60 cells: ops eager and compiled, on a plain and a DTensor operand; fits on five layouts, arrays and a
#: DataLoader, eager and nojit, SGD (whose update multiplies by a plain learning rate) and Adam; the
#: scenarios that change the distribution inside one cell; setup entry points. No jit fit: a real
#: inductor compile costs 26 to 55 s a run here, twelve runs; the compiled op cells compile.
SELECTION = (
    *(f"conformance/test_ops.py::test_op[{op}-tensor-shard1-{mode}]" for op in _OPS for mode in ("eager", "compiled")),
    *(f"conformance/test_ops.py::test_op[{op}-dtensor-shard1-eager]" for op in _OPS),
    *(f"conformance/test_ops.py::test_op[{op}-dtensor-shard1-compiled]" for op in _OPS[:7]),
    "conformance/test_ops.py::test_op[relu-shard0-eager]", "conformance/test_ops.py::test_op[relu-shard0-compiled]",
    *(f"conformance/test_fit.py::test_fit[{cell}]" for cell in (
        "sgd-arrays-nojit-colshard", "adam-arrays-nojit-dataparallel", "sgd-arrays-nojit-rowshard",
        "sgd-arrays-nojit-batchshard", "sgd-dataloader-nojit-colshard", "adam-arrays-nojit-batchshard",
        "sgd-arrays-nojit-replicated", "sgd-dataloader-nojit-dataparallel", "sgd-arrays-eager-colshard")),
    *(f"conformance/test_scenarios.py::test_scenario[{name}]" for name in (
        "mesh-reshaped-between-fits", "distribution-changed-between-fits", "clear-session-undoes-distribution",
        "iterate-dtensor")),
    "conformance/test_setup.py::test_setup[device-mesh]", "conformance/test_setup.py::test_setup[model-parallel]",
)
#: Cells of the selection where a state-keeping build is wrong for a user who changes the distribution
#: inside one process: a scenario that does so on purpose judges it, in every order and mode alike.
REAL_BUGS = {
    "promotion-mode-once": {"test_scenario[clear-session-undoes-distribution]": "error"},
    "foreach-patched-on-first-use": {"test_scenario[mesh-reshaped-between-fits]": "error"},
    "mesh-cache": {},
}
#: The state-keeping builds run a third of the selection, in its order: the cells whose verdict their
#: kept state changes where the harness does not give each cell ranks as fresh ones would be, with a
#: few that it changes in no such harness. Measured on all 60 cells (docs/measurements.md, "Fresh mode
#: and the order self-test"), against each build's own verdicts in fresh processes:
#:
#: - ranks kept whatever a cell left (no replacement): ``foreach-patched-on-first-use`` gives ``error``
#:   on 9 cells forward and 2 reversed, ``mesh-cache`` on 8 forward and 9 reversed: the SGD fits on
#:   column, row, batch and replicated layouts, from arrays and a DataLoader, eager and nojit, Adam on
#:   the batch layout, and the scenarios that change the distribution or iterate a DTensor: the first
#:   distribution's mesh (the patch's, the cache's) serves a later cell whose groups differ;
#: - the harness before issue 39 (6a01e28: the dispatch mode popped between cells, nothing compared):
#:   ``promotion-mode-once`` gives 42 other verdicts of 60, forward and reversed: ``mixed-tensor`` for
#:   the ops on a plain operand, eager and compiled (but a first cell), the fits on a sharded layout and
#:   the scenarios; ``pass`` for compiled ops on a DTensor operand (``compile-fallback`` in a fresh
#:   process); and ``clear-session-undoes-distribution``, the build's real bug, ``pass``.
#:
#: So: op cells on a plain operand eager and compiled (``add``, ``matmul``, ``concatenate``: an
#: elementwise op, a contraction, a join) and on a DTensor operand (``multiply``, eager as a control,
#: compiled; ``relu``, one operand on another placement); the seven fits above; the four scenarios, two
#: of them the REAL_BUGS; and one setup cell, which is the first cell reversed: its mesh is then the one
#: a kept patch or cache holds. Not here: the DataParallel fits and the other setup cell (no verdict of
#: theirs changed under either harness), the DTensor ops eager but one, and the other ops, which
#: changed as the ones kept did. On these 20 cells the same harnesses give 9 and 2 other verdicts
#: (``foreach-patched-on-first-use``), 8 and 8 (``mesh-cache``), 16 and 16 (``promotion-mode-once``).
STATE_SELECTION = tuple(f"conformance/{cell}" for cell in (
    "test_ops.py::test_op[add-tensor-shard1-eager]", "test_ops.py::test_op[add-tensor-shard1-compiled]",
    "test_ops.py::test_op[matmul-tensor-shard1-eager]", "test_ops.py::test_op[concatenate-tensor-shard1-compiled]",
    "test_ops.py::test_op[multiply-dtensor-shard1-eager]", "test_ops.py::test_op[multiply-dtensor-shard1-compiled]",
    "test_ops.py::test_op[relu-shard0-eager]", "test_ops.py::test_op[relu-shard0-compiled]",
    *(f"test_fit.py::test_fit[{cell}]" for cell in (
        "sgd-arrays-nojit-colshard", "sgd-arrays-nojit-rowshard", "sgd-arrays-nojit-batchshard",
        "sgd-dataloader-nojit-colshard", "adam-arrays-nojit-batchshard", "sgd-arrays-nojit-replicated",
        "sgd-arrays-eager-colshard")),
    *(f"test_scenarios.py::test_scenario[{name}]" for name in (
        "mesh-reshaped-between-fits", "distribution-changed-between-fits", "clear-session-undoes-distribution",
        "iterate-dtensor")),
    "test_setup.py::test_setup[model-parallel]",
))
RUNS = ("forward", "reversed", "fresh")
BUILDS = ("default", *(m.name for m in STATE_KEEPING))
#: The cells each build runs: the default build all of the selection (issue 39 asked for at least 60).
CELLS = {build: SELECTION if build == "default" else STATE_SELECTION for build in BUILDS}


def test_the_selection_is_large_and_mixed():
    assert len(SELECTION) >= 60 and len(set(SELECTION)) == len(SELECTION)
    families = collections.Counter(cell.split("::")[0] for cell in SELECTION)
    assert set(families) == {"conformance/test_ops.py", "conformance/test_fit.py", "conformance/test_scenarios.py",
                             "conformance/test_setup.py"}
    # The state-keeping builds' third: the selection's cells in its order, every family, every REAL_BUGS cell.
    assert [c for c in SELECTION if c in STATE_SELECTION] == list(STATE_SELECTION)
    assert {cell.split("::")[0] for cell in STATE_SELECTION} == set(families)
    assert {bug for bugs in REAL_BUGS.values() for bug in bugs} <= {c.split("::")[1] for c in STATE_SELECTION}


#: The default build's runs beside ``RUNS``: the selection in three slices (``--conformance-slice``),
#: whose merged report must be the forward run's (issue 42).
SLICES = tuple(f"slice-{k}/3" for k in (1, 2, 3))
#: Added to the nightly's expectations for the default build's runs: a glob with a pattern whose 12 cells
#: all pass, so a whole run finds it no longer applies, and no slice can (each runs a part of its cells):
#: only a merge that judges the expectations over every slice's cells finds it as the whole run does.
FIXED_GLOB = "test_op[*-tensor-shard1-eager]  mixed-tensor  /a cause since fixed/  every cell it decides passes"


def run_selection(keras_path: str, how: str, out, cells, options=()) -> dict:
    """The verdicts of ``cells``, the report's isolation record and the report itself, run ``how``
    (``RUNS``, or ``slice-K/N``), with ``options`` besides."""
    report = out / "report.json"
    extra = (["--conformance-slice", how.removeprefix("slice-")] if how.startswith("slice-") else
             {"forward": [], "reversed": ["-p", "tests.reverse_order"], "fresh": ["--isolation", "fresh"]}[how])
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--keras-path={keras_path}",
           "--conformance-json", str(report), *options, *extra, *cells]
    proc = subprocess.run(cmd, cwd=ROOT, env=session_env(), capture_output=True, text=True, timeout=1800,
                          check=False)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    verdicts = {c["id"]: c["verdict"] or "skipped" for c in data["cells"]}
    return {"verdicts": verdicts, "isolation": data["isolation"], "order": [c["id"] for c in data["cells"]],
            "report": str(report)}


#: A test waits for its builds' runs, which share the machine with other builds' (``selection_runs``):
#: more than pytest.ini's outer guard of 900 s for one test.
RUNS_TIMEOUT = 2400
#: The tests that compare a state-keeping build with the default build's forward run.
_WITH_DEFAULT = ("test_a_state_keeping_build_is_judged_as_in_a_fresh_process",)


def builds_asked(items) -> list[str]:
    """The builds the selected tests of this module ask ``selection_runs`` for, in ``BUILDS`` order."""
    asked = set()
    for item in items:
        if getattr(item, "module", None) is not sys.modules[__name__] or "selection_runs" not in getattr(
                item, "fixturenames", ()):
            continue
        build = getattr(getattr(item, "callspec", None), "params", {}).get("build")
        asked.add(build or "default")
        if build is not None and item.originalname in _WITH_DEFAULT:
            asked.add("default")
    return [build for build in BUILDS if build in asked]


@pytest.fixture(scope="module")
def selection_runs(request, keras_nightly_tree, tmp_path_factory):
    """A build's three runs (``runs(build)``). Every run the module's selected tests ask for is queued
    at the first use, the default build's first, and two sessions run at a time (one keeps about 1.4
    of 2 cores busy): a build's last run shares the machine with the next build's first, where one
    build at a time left one session alone at the end of each (on the default build its fresh run,
    twice as long as the others, was that one)."""
    base = tmp_path_factory.mktemp("fresh-verdicts")
    pool = ThreadPoolExecutor(2, thread_name_prefix="fresh-verdicts")
    jobs: dict[str, dict] = {}

    def queue(build: str) -> None:
        if build in jobs:
            return
        mutant = next((m for m in STATE_KEEPING if m.name == build), None)
        tree = keras_nightly_tree if mutant is None else mutants.write_mutant(
            keras_nightly_tree, str(base / build), mutant)
        jobs[build] = {}
        options = []
        if build == "default":  # the nightly's expectations, and a glob only a whole run can find fixed
            expect = base / "expectations.txt"
            expect.write_text(pathlib.Path(ROOT, EXPECTATIONS).read_text() + f"\n{FIXED_GLOB}\n")
            options = ["--conformance-expect", str(expect)]
        # The longest first: a fresh start before every cell; the slices last, each a third.
        for how in ("fresh", "forward", "reversed", *(SLICES if build == "default" else ())):
            out = base / f"{build}-{how.replace('/', '-')}"
            out.mkdir()
            jobs[build][how] = pool.submit(run_selection, tree, how, out, CELLS[build], options)

    def runs(build: str) -> dict:
        queue(build)
        return {how: job.result() for how, job in jobs[build].items()}

    for build in builds_asked(request.session.items):
        queue(build)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
@pytest.mark.parametrize("build", BUILDS)
def test_verdicts_are_the_same_in_every_order_and_on_fresh_ranks(build, selection_runs):
    forward, backward, fresh = (selection_runs(build)[how] for how in RUNS)
    assert backward["order"] == list(reversed(forward["order"]))  # the plugin did reverse the run
    assert len(forward["verdicts"]) == len(CELLS[build])
    assert backward["verdicts"] == forward["verdicts"], f"{build}: reversed differs from forward"
    assert fresh["verdicts"] == forward["verdicts"], f"{build}: --isolation fresh differs from forward"
    # Fresh mode gave every cell fresh ranks.
    assert fresh["isolation"]["mode"] == "fresh"
    assert fresh["isolation"]["by cause"].get("--isolation fresh", 0) >= len(CELLS[build]) - 1


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_three_slices_merge_into_the_whole_runs_report(selection_runs):
    """The selection in three slices, merged (``report/merge.py``), is the report its forward run
    wrote: every cell's verdict, outcome, expectation and promise states in the same order, the
    promise counts, the clusters, the references not judged and the glob that no longer applies
    (durations, rank starts and messages aside: they are the run's, not the build's)."""
    runs = selection_runs("default")
    whole = json.loads(pathlib.Path(runs["forward"]["report"]).read_text())
    parts = [(runs[how]["report"], json.loads(pathlib.Path(runs[how]["report"]).read_text())) for how in SLICES]
    assert all(part["cells"] for _, part in parts) and sum(len(p["cells"]) for _, p in parts) == len(SELECTION)
    assert all(FIXED_GLOB.split()[0] not in part["expectations"]["no_longer_apply"] for _, part in parts)
    merged = merge.merge(parts)

    def judged(report: dict) -> dict:
        cells = [(c["id"], c["verdict"], c["outcome"], c["expected"], c["promises"], c["cause"], c["checks"])
                 for c in report["cells"]]
        return {"cells": cells, **{key: report[key] for key in (
            "summary", "promises", "unclaimed_failures", "clusters", "reference_fallbacks", "not_judged",
            "collected", "run", "expectations", "build")}}

    assert whole["expectations"]["no_longer_apply"] == [FIXED_GLOB.split()[0]]
    assert judged(merged) == judged(whole)


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
@pytest.mark.parametrize("build", [m.name for m in STATE_KEEPING])
def test_a_state_keeping_build_is_judged_as_in_a_fresh_process(build, selection_runs):
    """Right in a fresh process: its verdicts are the default build's, but for the scenario that
    changes the distribution inside one process on purpose; and its ranks were replaced for what
    it kept (so the comparison could fail)."""
    default, mutant = selection_runs("default")["forward"], selection_runs(build)["forward"]
    differs = {c: v for c, v in mutant["verdicts"].items() if v != default["verdicts"][c]}
    assert differs == REAL_BUGS[build]
    kept = {cause for cause in mutant["isolation"]["by cause"] if cause in leftovers.CAUSES}
    assert kept - {leftovers.KERAS_MODULES} == KEPT[build], mutant["isolation"]


#: What each state-keeping build is found to keep (beside the modules a first fit imports).
KEPT = {"promotion-mode-once": {leftovers.DISPATCH_MODE, leftovers.KERAS_STATE},
        "foreach-patched-on-first-use": {leftovers.TORCH_PATCHED},
        "mesh-cache": {leftovers.KERAS_STATE}}


@pytest.mark.slow
@pytest.mark.timeout(RUNS_TIMEOUT)
def test_the_default_build_leaves_nothing(selection_runs):
    """On the default build no cell leaves anything: not even the torch optimizers the first fit
    imports, which ranks import when they start (``isolation.LAZY_PACKAGES``), so no pool is started
    twice."""
    causes = selection_runs("default")["forward"]["isolation"]["by cause"]
    assert set(causes) == {"first start"}, causes


# ---------------------------------------------------------------- the comparison, in this process
@pytest.fixture
def fake_build(monkeypatch):
    """A module of a 'build' package (``kdc_fake_build``) with the kinds of state a build keeps."""
    module = types.ModuleType("kdc_fake_build.core")
    module.CACHE, module.FLAG, module.LOCAL = {}, None, threading.local()
    module.LOCAL.policy = "float32"

    class Variable:
        def assign(self, value):
            return value

    Variable.__module__ = module.__name__
    module.Variable = Variable
    monkeypatch.setitem(sys.modules, "kdc_fake_build", types.ModuleType("kdc_fake_build"))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_a_rank_imports_the_lazy_packages_and_leaves_out_what_fails(tmp_path, monkeypatch):
    """Every module directly in a listed package is imported, but one that raises (its cell reports
    that) and a package the build lacks."""
    package = tmp_path / "kdc_lazy_build" / "optimizers"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text("VALUE = 1\n")
    (package / "broken.py").write_text("raise RuntimeError('this build cannot import it')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(isolation.LAZY_PACKAGES, "kdc", ("kdc_lazy_build.optimizers", "kdc_lazy_build.absent"))
    try:
        assert isolation.import_lazy_packages("kdc") == ["kdc_lazy_build.optimizers", "kdc_lazy_build.optimizers.good"]
        assert "kdc_lazy_build.optimizers.broken" not in sys.modules
        assert isolation.import_lazy_packages("another-backend") == []
    finally:
        for name in [n for n in sys.modules if n.startswith("kdc_lazy_build")]:
            del sys.modules[name]


def _causes(baseline) -> set:
    return set(baseline.changes())


def test_a_rank_as_it_was_is_as_fresh(fake_build):
    baseline = leftovers.Baseline("kdc_fake_build")
    assert baseline.changes() == {}
    fake_build.LOCAL = threading.local()  # rebound to an equivalent object, as clear_session() does
    fake_build.LOCAL.policy = "float32"
    assert baseline.changes() == {}


@pytest.mark.parametrize("change, cause", [
    (lambda m: m.CACHE.update(mesh=object()), leftovers.KERAS_STATE),
    (lambda m: setattr(m, "FLAG", True), leftovers.KERAS_STATE),
    (lambda m: setattr(m.LOCAL, "distribution", None), leftovers.KERAS_STATE),
    (lambda m: setattr(m.Variable, "assign", lambda self, value: None), leftovers.KERAS_STATE),
    (lambda m: sys.modules.__setitem__("kdc_fake_build.lazy", types.ModuleType("kdc_fake_build.lazy")),
     leftovers.KERAS_MODULES),
], ids=["cache-filled", "flag-set", "local-attribute", "class-patched", "module-imported"])
def test_state_a_build_kept_is_found(fake_build, monkeypatch, change, cause):
    baseline = leftovers.Baseline("kdc_fake_build")
    monkeypatch.delitem(sys.modules, "kdc_fake_build.lazy", raising=False)
    change(fake_build)
    assert cause in _causes(baseline)


def test_a_patched_torch_function_and_class_are_found(monkeypatch):
    from torch.distributed.tensor import DTensor

    baseline = leftovers.Baseline(None)
    monkeypatch.setattr(torch, "_foreach_mul", lambda *a: None)
    assert leftovers.TORCH_PATCHED in _causes(baseline)
    monkeypatch.undo()
    assert baseline.changes() == {}
    monkeypatch.setattr(DTensor, "__sub__", lambda self, other: None, raising=False)  # shadows Tensor.__sub__
    assert baseline.changes()[leftovers.TORCH_PATCHED] == ["torch.distributed.tensor.DTensor.__sub__"]


def test_a_dispatch_mode_flags_and_threads_left_are_found():
    from torch.utils._python_dispatch import TorchDispatchMode

    baseline = leftovers.Baseline(None)
    mode = TorchDispatchMode()
    mode.__enter__()
    try:
        assert leftovers.DISPATCH_MODE in _causes(baseline)
    finally:
        mode.__exit__(None, None, None)
    with torch.no_grad():
        assert leftovers.TORCH_FLAGS in _causes(baseline)
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="left-running")
    thread.start()
    try:
        assert "left-running" in " ".join(baseline.changes()[leftovers.THREADS])
    finally:
        release.set()
        thread.join()
    assert baseline.changes() == {}


# ---------------------------------------------------------------- reproducers, the second witness
#: A failure only the suite's ranks show (they carry the harness's variables): a fresh process, as a
#: reproducer runs, does not have it. The witness must say so rather than confirm the verdict.
SUITE_ONLY_RELU = mutants.Patch(
    mutants.TORCH + "ops/nn.py", "def relu(x):\n    x = convert_to_tensor(x)\n    return tnn.relu(x)\n",
    "def relu(x):\n    x = convert_to_tensor(x)\n"
    "    if 'KDC_CONTROL' in __import__('os').environ:  # mutant: only in the suite's ranks\n"
    "        raise RuntimeError('relu refused in the harness')\n"
    "    return tnn.relu(x)\n")


@pytest.mark.slow
def test_reproducers_run_in_fresh_processes_confirm_or_mark_each_cluster(keras_nightly_tree, tmp_path):
    """On a state-keeping build, the compiled op's cluster (the build's own compile-fallback) is
    reproduced by its script in fresh processes; a failure that needs the suite's ranks is marked as
    not reproduced, in the JSON and under its cluster."""
    once = next(m for m in STATE_KEEPING if m.name == "promotion-mode-once")
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), mutants.Mutant(
        "promotion-mode-once-suite-only-relu", "both", (*once.patches, SUITE_ONLY_RELU)))
    report, repro = tmp_path / "report.json", tmp_path / "repro"
    cells = ["conformance/test_ops.py::test_op[add-tensor-shard1-compiled]",
             "conformance/test_ops.py::test_op[relu-shard0-eager]"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--keras-path={build}",
                           "--conformance-json", str(report), "--conformance-repro", str(repro),
                           "--conformance-repro-run", *cells], cwd=ROOT, env=session_env(), capture_output=True,
                          text=True, timeout=1200, check=False)
    data = json.loads(report.read_text())
    assert {c["id"]: c["verdict"] for c in data["cells"]} == {
        "test_op[add-tensor-shard1-compiled]": "compile-fallback", "test_op[relu-shard0-eager]": "error"}
    fresh = {c["example"]: c.get("reproduced_fresh") for c in data["clusters"]}
    assert fresh == {"test_op[add-tensor-shard1-compiled]": "reproduced",
                     "test_op[relu-shard0-eager]": "did not reproduce"}, data["reproducers"]
    assert "its reproducer, run in fresh processes: DID NOT REPRODUCE" in proc.stdout
