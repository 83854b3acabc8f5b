"""A cell that crashed or hung runs once more on fresh ranks (``--rerun-crashes``, default 1):
one that passes then is *intermittent*, keeps its failing verdict, and shows both outcomes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CELLS = """
import os

import pytest

from keras_dtensor_conformance.verdicts import fail


def die(flag):
    import torch.distributed as dist

    if dist.get_rank() == 0 and not (flag and os.path.exists(flag)):
        if flag:
            open(flag, "w").close()
        os._exit(3)
    dist.barrier()
    return dist.get_rank()


def run(dist_ranks, flag):
    result = dist_ranks.run(die, flag)
    if not result.ok:
        fail(result)


@pytest.mark.cell(family="f", row="r", column="once")
def test_dies_once(dist_ranks, tmp_path):
    run(dist_ranks, str(tmp_path / "died"))


@pytest.mark.cell(family="f", row="r", column="always")
def test_dies_always(dist_ranks):
    run(dist_ranks, "")
"""


def cells(inner, *args) -> dict[str, dict]:
    inner.pytester.makepyfile(test_cells=CELLS)
    result = inner.run("--conformance-json", "r.json", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((inner.pytester.path / "r.json").read_text())
    return {c["id"]: c for c in report["cells"]}, result.stdout


@pytest.mark.checks_leftovers
def test_a_crash_that_passes_on_rerun_is_intermittent(inner):
    found, out = cells(inner)
    once, always = found["test_dies_once"], found["test_dies_always"]
    assert (once["verdict"], once["outcome"], once["intermittent"]) == ("crash", "failed", True)
    assert once["reruns"] == [{"verdict": "pass", "message": ""}]
    assert once["message"].startswith("intermittent: crash on the first run, then pass on rerun\n")
    assert (always["verdict"], always["intermittent"]) == ("crash", False)
    assert [r["verdict"] for r in always["reruns"]] == ["crash"]
    assert "1 intermittent" in out  # the cluster line says so
    assert inner.leftovers() == []


def test_no_rerun_when_asked_for_none(inner):
    found, _ = cells(inner, "--rerun-crashes", "0")
    assert [(c["verdict"], c["reruns"]) for c in found.values()] == [("crash", []), ("crash", [])]


INTERMITTENT = """test_dies_once    intermittent  /exit code 3/  a race in the library: one run in two
test_dies_always  intermittent  //             said to be intermittent, and it is not
"""


def test_an_intermittent_entry_keeps_the_gate_green_only_when_the_rerun_passes(inner):
    """Issue 56, item 12: the expectations file says a cell is intermittent. A crash that passes on
    its rerun is then xfail (the session green for it) and still reported intermittent; one whose
    rerun crashes too fails and says so, as does a crash without a rerun."""
    inner.pytester.path.joinpath("expect.txt").write_text(INTERMITTENT)
    found, out = cells(inner, "--conformance-expect", "expect.txt", "-rxf")
    once, always = found["test_dies_once"], found["test_dies_always"]
    assert (once["verdict"], once["outcome"], once["intermittent"], once["expected"]) == (
        "crash", "xfailed", True, "intermittent")
    assert "[crash, then passed on rerun] a race in the library: one run in two" in out
    assert (always["verdict"], always["outcome"], always["intermittent"]) == ("crash", "failed", False)
    assert "expected intermittent (said to be intermittent, and it is not), got crash (and on every rerun)" in out
    assert "1 failed, 1 xfailed" in out

    found, out = cells(inner, "--conformance-expect", "expect.txt", "--rerun-crashes", "0", "-k", "once")
    assert (found["test_dies_once"]["outcome"], found["test_dies_once"]["intermittent"]) == ("failed", False)


def test_an_intermittent_cell_is_written_intermittent_and_its_entry_outlives_its_passes(inner):
    """--update-expectations writes an intermittent cell as ``intermittent``, not as the crash it
    passed after; an intermittent entry whose cell passed stays (it crashes one run in many)."""
    path = inner.pytester.path.joinpath("expect.txt")
    cells(inner, "--update-expectations", "expect.txt")
    entries = {line.split()[0]: line.split()[1] for line in path.read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert entries == {"test_dies_once": "intermittent", "test_dies_always": "crash"}

    inner.pytester.makepyfile(test_passes="""
import pytest

@pytest.mark.cell(family="f", row="r", column="pass")
def test_passes():
    pass
""")
    path.write_text("test_passes  intermittent  a race in the library\n")
    result = inner.run("test_passes.py", "--conformance-expect", "expect.txt", "--update-expectations", "expect.txt",
                       "--conformance-strict")
    assert result.returncode == 0, result.stdout  # a pass under it is a plain pass, even when strict
    assert re.search(r"^test_passes +intermittent +a race in the library$", path.read_text(), re.MULTILINE)


ON_BATCH_CELL = "conformance/test_on_batch.py::test_on_batch[train_on_batch-colshard]"


@pytest.mark.parametrize("one_in", [2, 1], ids=["crashes-1-in-2", "crashes-always"])
def test_a_kit_build_that_crashes_one_run_in_two_keeps_the_gate_green(one_in, keras_nightly_tree, tmp_path):
    """The gate on a real cell of a kit build whose rank 0 dies by SIGSEGV one run in two: with the
    cell marked intermittent, the run is green and the report says intermittent; the same entry on a
    build that crashes every time is red. With --rank-native-stacks the story has the dying thread's
    native stack and the headline its innermost native frame; without it, neither."""
    from tests import mutants
    from tests.mutants.on_batch import crashes_one_run_in
    from tests.test_mutants import session_env

    tree = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "keras"), crashes_one_run_in(one_in))
    expect = tmp_path / "expect.txt"
    expect.write_text("test_on_batch[train_on_batch-colshard]  intermittent  /SIGSEGV/  a race: one run in two\n")
    report = tmp_path / "report.json"
    native = ["--rank-native-stacks"] if one_in == 2 else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--keras-path={tree}",
                           "--conformance-expect", str(expect), "--conformance-json", str(report), *native,
                           ON_BATCH_CELL],
                          cwd=ROOT, env=session_env(), capture_output=True, text=True, timeout=900)
    (cell,) = json.loads(report.read_text())["cells"]
    assert cell["verdict"] == "crash", proc.stdout[-3000:]
    assert "killed by signal 11 (SIGSEGV) in train_on_batch (trainer.py:" in cell["message"]
    # --rank-native-stacks: torch's native stack of the thread that died, and its innermost frame in the headline
    assert ("SIGSEGV(11), PID:" in cell["text"]) == bool(native)
    assert ("the other threads' native stacks" in cell["text"]) == bool(native)  # the dying thread's alone
    assert bool(re.search(r"\(trainer\.py:\d+\) at kill \(libc[.\w]*\)", cell["message"])) == bool(native)
    if one_in == 2:
        assert (proc.returncode, cell["outcome"], cell["intermittent"]) == (0, "xfailed", True), proc.stdout[-3000:]
        assert cell["message"].startswith("intermittent: crash on the first run, then pass on rerun")
    else:
        assert (proc.returncode, cell["outcome"], cell["intermittent"]) == (1, "failed", False), proc.stdout[-3000:]
        assert [r["verdict"] for r in cell["reruns"]] == ["crash"]
