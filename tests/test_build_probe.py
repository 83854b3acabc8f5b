"""The build probe measures what a build can do, and a build without torch distribution
support skips every cell (said once) unless an option says it must have it.

The builds are mutants of the default build (tests/mutants.py): a fork that ships
keras/src/backend/torch/distribution_lib.py but sets the backend's ``distribution_lib`` to
None (as keras 3.15.1 does), and a trainer that never wraps the model in DDP. A probe that
looked for files, or searched the trainer's source for "DistributedDataParallel", would call
both fully capable.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.controller.build import probe_build
from keras_dtensor_conformance.controller.launch import LaunchConfig

from tests.mutants import Mutant, Patch, write_mutant

USAGE_ERROR = 4

DISTRIBUTION_LIB_NONE = Mutant(
    "distribution-lib-none",
    "a fork that ships the torch distribution_lib.py but whose backend exposes distribution_lib = None",
    (Patch("keras/src/backend/__init__.py",
           "    from keras.src.backend.torch import *  # noqa: F403\n",
           "    from keras.src.backend.torch import *  # noqa: F403\n\n    distribution_lib = None  # mutant\n"),),
)

TRAINER_WITHOUT_DDP = Mutant(
    "trainer-without-ddp",
    "a torch trainer that imports DistributedDataParallel but never wraps the model in it",
    (Patch("keras/src/backend/torch/trainer.py",
           "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
           "        if False:  # mutant: never wrap the model in DistributedDataParallel\n"),),
)

MEASURED_NO_LIB = "keras.src.backend.distribution_lib, which keras.distribution calls, is None under the torch backend"

CELLS = """
def whoami():
    import torch.distributed as dist
    return dist.get_rank()

def test_torch_cell(dist_ranks):
    assert dist_ranks.run(whoami).ok

def test_keras_cell(keras_ranks):
    assert keras_ranks.run(whoami).ok

def test_another_keras_cell(keras_ranks):
    assert keras_ranks.run(whoami).ok
"""


@pytest.fixture(scope="module")
def fork_without_lib(keras_nightly_tree, tmp_path_factory) -> str:
    return write_mutant(keras_nightly_tree, str(tmp_path_factory.mktemp("mutant") / "tree"), DISTRIBUTION_LIB_NONE)


def probe(tree: str, tmp_path):
    return probe_build(LaunchConfig(keras_path=tree, keras_home=str(tmp_path)))


def test_the_default_build_is_measured_fully_capable(keras_nightly_tree, tmp_path):
    build = probe(keras_nightly_tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": True}
    assert build.capability_notes["data_parallel"].endswith("ran DistributedDataParallel.forward 1 time(s)")
    assert build.skip_reason is None


def test_data_parallel_is_measured_not_grepped(keras_nightly_tree, tmp_path):
    """The mutant's trainer still names DistributedDataParallel: only running it tells."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), TRAINER_WITHOUT_DDP)
    build = probe(tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    header = build.header_lines(2, "gloo")[2]
    assert header == (
        "keras torch-distribution capabilities: torch_distribution_lib=yes, model_parallel=yes, data_parallel=no "
        "(train_on_batch under DataParallel ran DistributedDataParallel.forward 0 time(s))"
    )
    assert build.skip_reason is None  # DataParallel cells run, and get their verdicts


def test_a_shipped_but_unreachable_distribution_lib_is_no_support(fork_without_lib, tmp_path):
    build = probe(fork_without_lib, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": False, "model_parallel": False, "data_parallel": False}
    assert build.skip_reason == (
        f"Keras 3.16.0.dev2026102704 ({fork_without_lib}) has no torch distribution support: {MEASURED_NO_LIB} "
        "(although the build ships keras/src/backend/torch/distribution_lib.py)"
    )


def test_without_a_requirement_every_keras_cell_is_skipped_once(inner, fork_without_lib):
    inner.pytester.makepyfile(CELLS)
    result = inner.run("--keras-path", fork_without_lib)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "torch_distribution_lib=no (" + MEASURED_NO_LIB in out
    assert "1 passed, 2 skipped" in out  # the pure torch cell still runs
    summary = [line for line in out.splitlines() if "conformance cells skipped" in line]
    assert len(summary) == 1 and summary[0].startswith("2 conformance cells skipped: "), out
    assert MEASURED_NO_LIB in summary[0]


def test_an_expectations_file_requires_distribution(inner, fork_without_lib):
    """Expectations describe a build that runs the cells: skipping them all must not go green."""
    inner.pytester.makepyfile(CELLS)
    inner.pytester.path.joinpath("expect.txt").write_text("test_keras_cell  error  a known bug\n")
    result = inner.run("--keras-path", fork_without_lib, "--conformance-expect", "expect.txt")
    output = result.stdout + result.stderr
    assert result.returncode == USAGE_ERROR, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert errors == [
        f"ERROR: Keras 3.16.0.dev2026102704 ({fork_without_lib}) has no torch distribution support, but "
        f"--conformance-expect expect.txt says it must have it: {MEASURED_NO_LIB} "
        "(although the build ships keras/src/backend/torch/distribution_lib.py)"
    ], output
    assert inner.leftovers() == []  # no rank started


def _train_step_does(statement: str, name: str) -> Mutant:
    """A trainer whose rank 0 runs ``statement`` before updating weights (as rank0-waits does)."""
    return Mutant(name, f"rank 0's train step runs {statement}", (Patch(
        "keras/src/backend/torch/trainer.py",
        "            # Update weights\n            with torch.no_grad():\n",
        "            # Update weights\n"
        "            if torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:\n"
        f"                {statement}  # mutant\n"
        "            with torch.no_grad():\n"),))


DDP_PROBE = "Train one batch under DataParallel and count DistributedDataParallel.forward calls"


def test_a_probe_that_hangs_is_a_no_that_says_so(keras_nightly_tree, tmp_path):
    """A train step that waits (for a peer the one-process group does not have) gets an answer
    within the probe's limit, not an import that times out after minutes."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"),
                        _train_step_does("__import__('time').sleep(3600)", "train-step-waits"))
    build = probe_build(LaunchConfig(keras_path=tree, keras_home=str(tmp_path)), timeout=120, group_probe_limit=5)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    assert build.capability_notes["data_parallel"] == f"probe hung: did not return within 5s ({DDP_PROBE})"
    assert build.skip_reason is None  # the cells run, and the hang gets its own verdict there


def test_a_probe_that_crashes_is_a_no_that_says_so(keras_nightly_tree, tmp_path):
    """A rank-0-only ``recv`` in a one-process gloo group segfaults (measured): what the probe
    printed before it started says which capability killed it."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), _train_step_does(
        "__import__('os').kill(__import__('os').getpid(), __import__('signal').SIGSEGV)", "train-step-segfaults"))
    build = probe(tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    assert build.capability_notes["data_parallel"] == (
        f"probe ended (killed by signal 11 (SIGSEGV)) while measuring it ({DDP_PROBE})"
    )
    assert build.capability_notes["model_parallel"] == "a sharded Dense kernel is a DTensor"
