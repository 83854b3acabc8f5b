"""The build probe measures what a build can do, and a build without torch distribution
support skips every cell (said once) unless an option says it must have it.

The builds are mutants of the default build (tests/mutants/): a fork that ships
keras/src/backend/torch/distribution_lib.py but sets the backend's ``distribution_lib`` to
None (as keras 3.15.1 does), one whose torch mesh conversion raises, and a trainer that never
wraps the model in DDP. A probe that looked for files, or searched the trainer's source for
"DistributedDataParallel", would call them fully capable. The other way round, a correct fork
whose keras.distribution imports the backend's ``distribution_lib`` inside its functions has
no such module attribute: a probe that read it would call that build unsupported and skip
every cell. Every capability is therefore measured by using it through keras.distribution.
"""

from __future__ import annotations

import pytest
from keras_dtensor_conformance.controller.build import probe_build
from keras_dtensor_conformance.controller.launch import LaunchConfig

from tests.mutants import Mutant, Patch, write_mutant
from tests.test_mutants import mother, run_suite

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


def _import_inside(statement: str, indent: str = "    ") -> Patch:
    """Import the backend's distribution_lib right before ``statement``, inside its function."""
    return Patch("keras/src/distribution/distribution_lib.py", statement,
                 f"{indent}from keras.src.backend import distribution_lib  # mutant\n\n{statement}")


#: A correct build written differently: keras.distribution's module no longer has a
#: ``distribution_lib`` attribute, but every function that needs the backend's imports it.
IMPORTS_INSIDE_FUNCTIONS = Mutant(
    "distribution-lib-imported-inside-functions",
    "a fork whose keras/src/distribution/distribution_lib.py imports the backend's distribution_lib "
    "inside its functions instead of at module top (a correct build, written differently)",
    (Patch("keras/src/distribution/distribution_lib.py",
           "from keras.src.backend import distribution_lib\nfrom keras.src.backend.common import global_state\n",
           "from keras.src.backend.common import global_state\n"),
     _import_inside("    return distribution_lib.list_devices(device_type)\n"),
     _import_inside("    return distribution_lib.get_device_count(device_type=device_type)\n"),
     _import_inside("    distribution_lib.initialize(job_addresses, num_processes, process_id)\n"),
     _import_inside("            self._backend_mesh = distribution_lib._to_backend_mesh(self)\n", " " * 12),
     _import_inside("            self._backend_layout = distribution_lib._to_backend_layout(self)\n", " " * 12),
     _import_inside("        if (\n            distribution_lib is not None\n", " " * 8),
     _import_inside("    return distribution_lib.distribute_tensor(tensor, layout)\n"),
     _import_inside("    global_state.set_global_attribute(GLOBAL_ATTRIBUTE_NAME, value)\n")),
)

MESH_RAISES = Mutant(
    "torch-mesh-raises",
    "a fork whose torch distribution_lib is reachable but cannot build a device mesh (a stub)",
    (Patch("keras/src/backend/torch/distribution_lib.py",
           "def _to_backend_mesh(device_mesh):\n",
           "def _to_backend_mesh(device_mesh):\n"
           "    raise NotImplementedError(\"DeviceMesh is not supported on torch yet\")  # mutant\n"),),
)

SHARDS_REPLICATED = Mutant(
    "layouts-replicate",
    "a torch layout conversion that replicates every axis a LayoutMap asked to shard",
    (Patch("keras/src/backend/torch/distribution_lib.py",
           "            placements.append(torch_distributed_tensor.Shard(shard_dim))\n",
           "            placements.append(torch_distributed_tensor.Replicate())  # mutant\n"),),
)

MESH_CALL = "keras.distribution.DeviceMesh((1,), ['model'], ['cpu:0']).backend_mesh"
MEASURED_NO_LIB = "keras.src.backend.distribution_lib, which keras.distribution calls, is None under the torch backend"
USED_NO_LIB = f"{MESH_CALL} raised AttributeError: 'NoneType' object has no attribute '_to_backend_mesh'"
FULL_SUPPORT = {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": True}
NO_SUPPORT = {"torch_distribution_lib": False, "model_parallel": False, "data_parallel": False}

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


@pytest.fixture(scope="module")
def fork_importing_inside(keras_nightly_tree, tmp_path_factory) -> str:
    return write_mutant(keras_nightly_tree, str(tmp_path_factory.mktemp("mutant") / "tree"), IMPORTS_INSIDE_FUNCTIONS)


def probe(tree: str, tmp_path, **kwargs):
    """As a session probes: forked from a zygote (the self-tests' mother's), its imports done."""
    return probe_build(LaunchConfig(keras_path=tree, keras_home=str(tmp_path)), zygote=mother().zygote, **kwargs)


def test_the_default_build_is_measured_fully_capable(keras_nightly_tree, tmp_path):
    build = probe(keras_nightly_tree, tmp_path)
    assert build.capabilities == FULL_SUPPORT
    assert build.capability_notes == {
        "torch_distribution_lib": f"{MESH_CALL} is a torch DeviceMesh of shape (1,) over ('model',)",
        "model_parallel": "a sharded Dense kernel is a DTensor placed (Shard(dim=1),) on a mesh over ('model',)",
        "data_parallel": "train_on_batch under DataParallel over 2 processes reduced 168 bytes in 3 collective(s) "
                         "on rank 0 for 160 bytes of gradients (DistributedDataParallel.forward ran 1 time(s))",
    }
    assert build.skip_reason is None


def test_a_fork_importing_the_backend_lib_inside_functions_is_measured_fully_capable(fork_importing_inside,
                                                                                    tmp_path):
    """A correct build written differently: keras.distribution's module has no ``distribution_lib``
    attribute (a probe that read it called this build unsupported), yet every use works."""
    build = probe(fork_importing_inside, tmp_path)
    assert build.capabilities == FULL_SUPPORT, build.capability_notes
    assert build.skip_reason is None
    assert build.header_lines(2, "gloo")[2] == (
        "keras torch-distribution capabilities: torch_distribution_lib=yes, model_parallel=yes, data_parallel=yes")


#: A ModelParallel cell (column-sharded, Adam slots), a DataParallel cell and a sharded op cell.
INSIDE_FORK_CELLS = (
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-colshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-dataparallel]",
    "conformance/test_ops.py::test_op[add-scalar-shard0-eager]",
)


def test_cells_run_and_pass_on_a_fork_importing_the_backend_lib_inside_functions(fork_importing_inside, tmp_path):
    verdicts = run_suite(fork_importing_inside, INSIDE_FORK_CELLS, tmp_path)
    assert verdicts == {cell.split("::")[1]: "pass" for cell in INSIDE_FORK_CELLS}


def test_a_torch_lib_that_cannot_build_a_mesh_is_no_support(keras_nightly_tree, tmp_path):
    """The backend's distribution_lib is the torch one and is reachable: only using it tells."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), MESH_RAISES)
    build = probe(tree, tmp_path)
    assert build.capabilities == NO_SUPPORT
    assert build.skip_reason == (
        f"Keras 3.16.0.dev2026102704 ({tree}) has no torch distribution support: "
        f"{MESH_CALL} raised NotImplementedError: DeviceMesh is not supported on torch yet"
    )
    assert build.header_lines(2, "gloo")[2] == (
        "keras torch-distribution capabilities: torch_distribution_lib=no "
        f"({MESH_CALL} raised NotImplementedError: DeviceMesh is not supported on torch yet), "
        "model_parallel=no, data_parallel=no"
    )


def test_a_kernel_not_placed_as_asked_is_no_model_parallel(keras_nightly_tree, tmp_path):
    """A DTensor is not enough: the kernel must carry the placement the LayoutMap asked for."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), SHARDS_REPLICATED)
    build = probe(tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": False, "data_parallel": True}
    assert build.capability_notes["model_parallel"] == (
        "a sharded Dense kernel is a DTensor placed (Replicate(),) on a mesh over ('model',) "
        "(asked: (None, 'model'), i.e. (Shard(dim=1),) over ('model',))"
    )
    assert build.skip_reason is None


def test_data_parallel_is_measured_not_grepped(keras_nightly_tree, tmp_path):
    """The mutant's trainer still names DistributedDataParallel: only running it tells."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), TRAINER_WITHOUT_DDP)
    build = probe(tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    header = build.header_lines(2, "gloo")[2]
    assert header == (
        "keras torch-distribution capabilities: torch_distribution_lib=yes, model_parallel=yes, data_parallel=no "
        "(train_on_batch under DataParallel over 2 processes reduced 8 bytes in 2 collective(s) on rank 0 for 160 "
        "bytes of gradients (DistributedDataParallel.forward ran 0 time(s)))"
    )
    assert build.skip_reason is None  # DataParallel cells run, and get their verdicts


#: A correct DataParallel written to skip what a world of one process does not need: it wraps the
#: model in DDP only where there is a peer to reduce with. In a one-process group its
#: ``train_on_batch`` reduces no gradient (the probe measured there called it ``data_parallel=no
#: (... reduced 8 bytes ...)``), while every DataParallel cell, run in the ranks' world, passes.
DDP_ONLY_WITH_PEERS = Mutant(
    "ddp-only-with-peers",
    "a correct trainer that skips the gradient all-reduce in a world of one process (world_size == 1)",
    (Patch("keras/src/backend/torch/trainer.py",
           "        if torch.distributed.is_initialized() and self.ddp_model is None:\n",
           "        if (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1\n"
           "                and self.ddp_model is None):  # mutant: a world of one has nothing to reduce\n"),),
)


def test_data_parallel_is_measured_in_the_ranks_world(keras_nightly_tree, tmp_path):
    """``data_parallel`` is measured where the behaviour shows, in a world of the session's nproc
    processes: a build that all-reduces only when ``world_size > 1`` is a ``yes`` (its DataParallel
    cells pass), while one that never reduces stays a ``no``
    (``test_data_parallel_is_measured_not_grepped``)."""
    build = probe(write_mutant(keras_nightly_tree, str(tmp_path / "tree"), DDP_ONLY_WITH_PEERS), tmp_path, nproc=3)
    assert build.capabilities == FULL_SUPPORT
    assert build.capability_notes["data_parallel"].startswith("train_on_batch under DataParallel over 3 processes ")
    assert build.capability_notes["data_parallel"].endswith("(DistributedDataParallel.forward ran 1 time(s))")


def test_data_parallel_is_judged_by_synchronised_gradients_not_by_ddp(keras_nightly_tree, tmp_path):
    """A correct build written differently: no DistributedDataParallel, every gradient all-reduced
    and averaged after backward. It synchronises, so it supports DataParallel."""
    from tests.mutants.performance import DATAPARALLEL_WITHOUT_DDP

    build = probe(write_mutant(keras_nightly_tree, str(tmp_path / "tree"), DATAPARALLEL_WITHOUT_DDP), tmp_path)
    assert build.capabilities == FULL_SUPPORT
    assert build.capability_notes["data_parallel"].endswith("(DistributedDataParallel.forward ran 0 time(s))")


def test_a_shipped_but_unreachable_distribution_lib_is_no_support(fork_without_lib, tmp_path):
    build = probe(fork_without_lib, tmp_path)
    assert build.capabilities == NO_SUPPORT
    assert build.skip_reason == (
        f"Keras 3.16.0.dev2026102704 ({fork_without_lib}) has no torch distribution support: {MEASURED_NO_LIB} "
        f"(although the build ships keras/src/backend/torch/distribution_lib.py): {USED_NO_LIB}"
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


@pytest.mark.checks_leftovers
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
        f"(although the build ships keras/src/backend/torch/distribution_lib.py): {USED_NO_LIB}"
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


DDP_PROBE = "Train one batch under DataParallel and measure the bytes its collectives reduce"


def test_a_probe_that_hangs_is_unknown_and_says_so(keras_nightly_tree, tmp_path):
    """A train step that waits (rank 0 sleeps; its peer waits for it in the all-reduce) gets an answer
    within the probe's limit, not an import that times out after minutes: "unknown", since a probe
    that did not return measured nothing of the build."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"),
                        _train_step_does("__import__('time').sleep(3600)", "train-step-waits"))
    build = probe(tree, tmp_path, timeout=120, group_probe_limit=5)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    # rank 0 sleeps, and rank 1 waits for it in the gradients' all-reduce
    hung = f"probe hung: did not return within 5s ({DDP_PROBE}) on rank(s) 0, 1 of 2 processes"
    assert build.capability_notes["data_parallel"] == hung
    assert build.header_lines(2, "gloo")[2].endswith(f"data_parallel=unknown ({hung})")
    assert build.skip_reason is None  # the cells run, and the hang gets its own verdict there


def test_a_probe_that_crashes_is_unknown_and_says_so(keras_nightly_tree, tmp_path):
    """A train step that kills its process (as a rank-0-only ``recv`` in a one-process gloo group
    does, measured): the probe's world says which capability, and which of its processes, ended."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), _train_step_does(
        "__import__('os').kill(__import__('os').getpid(), __import__('signal').SIGSEGV)", "train-step-segfaults"))
    build = probe(tree, tmp_path)
    assert build.capabilities == {"torch_distribution_lib": True, "model_parallel": True, "data_parallel": False}
    assert build.capability_notes["data_parallel"] == (
        f"probe ended (killed by signal 11 (SIGSEGV)) while measuring it ({DDP_PROBE}) on rank 0 of 2 processes"
    )
    assert build.capability_notes["model_parallel"] == (
        "a sharded Dense kernel is a DTensor placed (Shard(dim=1),) on a mesh over ('model',)")


MESH_PROBE = "Build a keras.distribution.DeviceMesh's backend mesh"


def test_a_mesh_probe_that_crashes_is_unknown_and_its_cells_run(keras_nightly_tree, tmp_path):
    """The device mesh is built in the process group, under the same protections: a build whose
    mesh kills the process is "unknown", naming the probe, and the others are unmeasured; its cells
    are not skipped as unsupported, so they show the crash themselves."""
    tree = write_mutant(keras_nightly_tree, str(tmp_path / "tree"), Mutant(
        "torch-mesh-segfaults", "a torch mesh conversion that kills the process",
        (Patch("keras/src/backend/torch/distribution_lib.py", "def _to_backend_mesh(device_mesh):\n",
               "def _to_backend_mesh(device_mesh):\n"
               "    __import__('os').kill(__import__('os').getpid(), __import__('signal').SIGSEGV)  # mutant\n"),)))
    build = probe(tree, tmp_path)
    assert build.capabilities == NO_SUPPORT
    assert build.capability_notes == {
        "torch_distribution_lib": f"probe ended (killed by signal 11 (SIGSEGV)) while measuring it ({MESH_PROBE})",
        "model_parallel": "not measured: an earlier probe ended the process",
        "data_parallel": "not measured: an earlier probe ended the process",
    }
    note = build.capability_notes["torch_distribution_lib"]
    assert build.header_lines(2, "gloo")[2] == (
        f"keras torch-distribution capabilities: torch_distribution_lib=unknown ({note}), model_parallel=unknown "
        "(not measured: an earlier probe ended the process), data_parallel=unknown (not measured: an earlier "
        "probe ended the process)")
    assert build.skip_reason is None
