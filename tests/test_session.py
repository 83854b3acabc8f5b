"""Whole pytest sessions in a subprocess: bad input, builds without torch distribution,
--keras-path, mesh skips, and no process left behind however the session ends."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest

from tests.conftest import alive

USAGE_ERROR = 4
INTERRUPTED = 2

CELLS = """
import os, time
import torch.distributed as dist

def whoami():
    return dist.get_rank(), os.getpid()

def keras_file():
    import keras
    return keras.__file__

def sleep_forever():
    print("cell started", flush=True)
    open(f"cell-started-{os.getpid()}", "w").close()  # what the test waits for before it interrupts
    while True:
        time.sleep(0.1)

def test_torch_cell(dist_ranks):
    assert dist_ranks.run(whoami).ok

def test_keras_cell(keras_ranks):
    assert keras_ranks.run(keras_file).ok
"""


def only_error_line(result) -> str:
    """The session must say one thing: an ``ERROR:`` line, and no traceback."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1, output
    return errors[0]


@pytest.mark.checks_leftovers
def test_nonexistent_keras_path_is_a_usage_error(inner, tmp_path):
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", str(tmp_path / "nowhere"))
    assert result.returncode == USAGE_ERROR
    assert "no such directory" in only_error_line(result)
    assert inner.leftovers() == []  # no rank started


def test_folder_without_keras_is_a_usage_error(inner, tmp_path):
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", str(tmp_path))
    assert result.returncode == USAGE_ERROR
    assert "no Keras package there" in only_error_line(result)


def test_keras_that_fails_to_import_shows_its_error(inner, tmp_path):
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("raise ImportError('boom: this build is broken')\n")
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", str(tmp_path))
    assert result.returncode == USAGE_ERROR
    line = only_error_line(result)
    assert "`import keras` failed" in line and "boom: this build is broken" in line


def test_more_gpus_than_visible_is_a_usage_error(inner, keras_build):
    if keras_build.cuda_devices >= 64:
        pytest.skip("this machine has 64 GPUs")
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--dist-backend", "nccl", "--nproc", "64")
    assert result.returncode == USAGE_ERROR
    assert "needs one GPU per rank" in only_error_line(result)


def test_build_without_torch_distribution_skips_every_cell_once(inner, keras_3151_tree):
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", keras_3151_tree, "-rs")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "keras: 3.15.1 from " + keras_3151_tree in out
    assert "torch_distribution_lib=no" in out
    assert "1 passed, 1 skipped" in out  # the pure torch cell still runs
    reason = "has no torch distribution support: keras.src.backend.distribution_lib, which keras.distribution calls"
    summary = [line for line in out.splitlines() if "conformance cells skipped" in line]
    assert len(summary) == 1 and reason in summary[0], out


KERAS_CELLS = """
import pytest

def version():
    import keras
    return keras.__version__

@pytest.mark.parametrize("opt", ["sgd", "adam", "lion"])
@pytest.mark.parametrize("data", ["arrays", "dataloader"])
def test_fit(keras_ranks, opt, data):
    keras_ranks.run(version)
"""


def test_unsupported_build_counts_the_selected_cells_and_draws_no_grid(inner, keras_3151_tree):
    """6 cells collected, 2 selected by -k: the end of the run says 2, and shows no grid of skips."""
    inner.pytester.makepyfile(KERAS_CELLS.replace(
        "def test_fit", "@pytest.mark.cell(family='fit colshard', row='r', column='c')\ndef test_fit"))
    result = inner.run("--keras-path", keras_3151_tree, "-k", "adam")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "2 skipped, 4 deselected" in out
    summary = [line for line in out.splitlines() if "conformance cells skipped" in line]
    assert len(summary) == 1 and summary[0].startswith("2 conformance cells skipped: Keras 3.15.1"), out
    assert "fit colshard" not in out and "slowest cells" not in out
    assert "2 cells: 2 skipped (2 skipped)" in out


@pytest.mark.parametrize("requirement, flag", [
    (("--require-distribution",), "--require-distribution"),
    (("-o", "require_distribution=true"), "the ini option require_distribution"),
], ids=["option", "ini"])
@pytest.mark.checks_leftovers
def test_required_distribution_on_a_build_without_it_is_one_error(inner, keras_3151_tree, requirement, flag):
    """Asked to require it, a build without torch distribution fails instead of skipping to green."""
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", keras_3151_tree, *requirement)
    assert result.returncode == USAGE_ERROR, result.stdout + result.stderr
    line = only_error_line(result)
    assert line.startswith(f"ERROR: Keras 3.15.1 ({keras_3151_tree}) has no torch distribution support, but {flag} "
                           "says it must have it: keras.src.backend.distribution_lib"), line
    assert "the build does not ship keras/src/backend/torch/distribution_lib.py" in line
    assert inner.leftovers() == []


def test_keras_path_tree_is_what_every_rank_imports(inner, keras_nightly_tree):
    inner.pytester.makepyfile(
        CELLS
        + f"""
def test_ranks_import_the_tree(keras_ranks):
    files = keras_ranks.run(keras_file).values
    assert all(f.startswith({keras_nightly_tree!r}) for f in files), files
"""
    )
    result = inner.run("--keras-path", keras_nightly_tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"from {keras_nightly_tree}" in result.stdout
    assert "model_parallel=yes" in result.stdout
    assert "3 passed" in result.stdout


def test_cell_whose_mesh_does_not_fit_nproc_is_skipped(inner):
    inner.pytester.makepyfile(
        """
import pytest

@pytest.mark.mesh(2, 2)
def test_two_by_two(dist_ranks):
    pass

@pytest.mark.mesh(2)
def test_two(dist_ranks):
    pass
"""
    )
    result = inner.run("--nproc", "2", "-rs")
    assert result.returncode == 0, result.stdout
    assert "mesh 2x2 needs --nproc 4 (this run has --nproc 2)" in result.stdout
    assert "1 passed, 1 skipped" in result.stdout


@pytest.mark.checks_leftovers
@pytest.mark.parametrize("body, code", [("pass", 0), ("assert False", 1)], ids=["normal-end", "failing-end"])
def test_session_end_leaves_no_process(inner, body, code, tmp_path, monkeypatch):
    """Nor a folder of its own in the temporary directory (its ranks' private KERAS_HOME)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    inner.pytester.makepyfile(CELLS + f"\ndef test_last(dist_ranks):\n    {body}\n")
    result = inner.run("-k", "torch_cell or last")
    assert result.returncode == code, result.stdout
    assert inner.leftovers() == []
    assert sorted(p.name for p in tmp_path.glob("kdc-*")) == []


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


HANGING_CELL = """
import pytest

@pytest.mark.cell(family="scenarios", row="hangs", column="colshard")
def test_hangs(dist_ranks):
    dist_ranks.run(sleep_forever)
"""


def is_rank(proc) -> bool:
    """A rank: ``python -m ...rank.worker``, or forked by the session's zygote (which shows the
    zygote's command line) and not the zygote itself."""
    try:
        if any(part.endswith("rank.worker") for part in proc.cmdline()):
            return True
        parent = proc.parent()
        return parent is not None and any(part.endswith("rank.zygote") for part in parent.cmdline())
    except psutil.Error:
        return False


def start_a_hanging_session(inner, *args: str) -> tuple:
    inner.pytester.makepyfile(CELLS + HANGING_CELL)
    proc = inner.popen("-k", "hangs", "-s", *args)

    def rank_workers():
        found = [p for p in inner.leftovers() if is_rank(p)]
        return found if len(found) == 2 else None

    ranks = wait_for(rank_workers, 120, "the ranks to start")
    # The cell runs on both ranks: a fixed wait after the ranks started was too short on a loaded
    # machine (the session was interrupted before its cell began, and its report had no cell).
    wait_for(lambda: len(list(inner.pytester.path.glob("cell-started-*"))) >= 2, 120, "the cell to start on both ranks")
    return proc, ranks


#: How long an interrupted session may take to end. 60 s was exceeded twice in one clean-clone CI run
#: (2026-11-25, 3936f2c: both Ctrl-C tests, 76 s each, near the end of 57 minutes of self-tests)
#: where the same tests end in 40 s alone and under two busy loops: a bound for a loaded 2-core
#: machine, not a speed requirement.
INTERRUPTED_SESSION_ENDS_WITHIN = 180


def ended(proc) -> str:
    """The interrupted session's output once it has ended; if it has not within
    ``INTERRUPTED_SESSION_ENDS_WITHIN``, it is killed and the test fails with what it printed."""
    try:
        return proc.communicate(timeout=INTERRUPTED_SESSION_ENDS_WITHIN)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        raise AssertionError(f"the interrupted session did not end within {INTERRUPTED_SESSION_ENDS_WITHIN}s; "
                             f"it printed:\n{out[-4000:]}") from None


@pytest.mark.checks_leftovers
def test_ctrl_c_leaves_no_process(inner):
    proc, ranks = start_a_hanging_session(inner)
    proc.send_signal(signal.SIGINT)
    out = ended(proc)
    assert proc.returncode == INTERRUPTED, out
    assert "KeyboardInterrupt" in out
    wait_for(lambda: inner.leftovers() == [] and not any(alive(p) for p in ranks), 15, "no leftover process")


@pytest.mark.checks_leftovers
def test_a_cell_interrupted_by_ctrl_c_is_interrupted_not_skipped(inner):
    proc, ranks = start_a_hanging_session(inner, "--conformance-json", "r.json")
    proc.send_signal(signal.SIGINT)
    out = ended(proc)
    assert proc.returncode == INTERRUPTED, out
    (cell,) = json.loads((inner.pytester.path / "r.json").read_text())["cells"]
    assert (cell["id"], cell["verdict"], cell["outcome"]) == ("test_hangs", None, "interrupted"), cell
    assert "1 cells: 1 interrupted (1 interrupted)" in out


@pytest.mark.checks_leftovers
def test_sigterm_ends_the_session_as_ctrl_c_does(inner):
    """``timeout`` or a CI job's time limit sends SIGTERM: the running cell is interrupted, the
    reports are still written and no rank is left behind (by default SIGTERM would end pytest at
    once, with no summary and no files)."""
    proc, ranks = start_a_hanging_session(inner, "--conformance-json", "r.json", "--conformance-html", "r.html")
    proc.send_signal(signal.SIGTERM)
    out = ended(proc)
    assert proc.returncode == INTERRUPTED, out
    assert "SIGTERM received" in out
    (cell,) = json.loads((inner.pytester.path / "r.json").read_text())["cells"]
    assert (cell["id"], cell["verdict"], cell["outcome"]) == ("test_hangs", None, "interrupted"), cell
    assert (inner.pytester.path / "r.html").is_file()
    assert "1 cells: 1 interrupted (1 interrupted)" in out
    wait_for(lambda: inner.leftovers() == [] and not any(alive(p) for p in ranks), 15, "no leftover process")


def test_the_session_gives_sigterm_back(pytester):
    """The handler is the session's, not the process's: once a conformance session ends, SIGTERM has
    its default action again (a later ``pytest.main`` in the same process, or the caller, gets it)."""
    pytester.makepyfile("""
        import signal

        def test_installed(conformance_state):
            assert conformance_state.active
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    """)
    outer = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this session's own handler, set aside
    try:
        result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, outer)


@pytest.mark.checks_leftovers
def test_killed_controller_takes_its_ranks_along(inner):
    """pytest SIGKILLed (CI cancel, OOM): each rank sees its parent gone and exits."""
    proc, ranks = start_a_hanging_session(inner)
    proc.kill()
    proc.wait(timeout=10)
    # Both: the scan finds every tagged process (the ranks' children too), but misses a rank that is
    # still exiting; the rank's own handle sees it until it is gone (the race behind a red CI).
    wait_for(lambda: inner.leftovers() == [] and not any(alive(p) for p in ranks), 15, "the orphaned ranks to exit")
    assert inner.leftovers() == [] and not any(alive(p) for p in ranks)
