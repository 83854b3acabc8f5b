"""The mutation kit: patched copies of a Keras build, each imitating a real bug.

A mutant is the default build (an unpacked keras-nightly wheel) with a few exact text
replacements. Every replacement must match exactly once, so a mutant that no longer
applies to a new build fails loudly instead of silently testing the unmodified build.
The copy is made of hard links except for the patched files, so writing one costs
milliseconds.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil



@dataclasses.dataclass(frozen=True)
class Patch:
    path: str  # relative to the tree root, e.g. "keras/src/optimizers/base_optimizer.py"
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    imitates: str  # the real bug it stands for
    patches: tuple[Patch, ...]


def write_mutant(source_tree: str, dest: str, mutant: Mutant) -> str:
    """Copy ``source_tree`` to ``dest`` (hard links, its bytecode too) and apply the mutant's
    patches there; a patched module's bytecode is removed, so it compiles from the patch."""
    if os.path.exists(dest):
        shutil.rmtree(dest)
    shutil.copytree(source_tree, dest, copy_function=os.link)
    for patch in mutant.patches:
        target = os.path.join(dest, patch.path)
        folder, module = os.path.split(target)
        for compiled in glob.glob(os.path.join(folder, "__pycache__", os.path.splitext(module)[0] + ".*.pyc")):
            os.unlink(compiled)
        with open(target, encoding="utf-8") as f:
            text = f.read()
        count = text.count(patch.old)
        if count != 1:
            raise ValueError(f"mutant {mutant.name}: {patch.path} has {count} matches for {patch.old!r}, not 1")
        os.unlink(target)  # break the hard link: the source tree stays unmodified
        with open(target, "w", encoding="utf-8") as f:
            f.write(text.replace(patch.old, patch.new))
    return dest


# ------------------------------------------------------------------ the bug-imitating mutants
TORCH = "keras/src/backend/torch/"

#: The small tier every mutant runs (exact pytest node ids); the expected changes below are
#: relative to the unmutated build, on which every one of these cells passes.
TIER = (
    "conformance/test_fit.py::test_fit[sgd-arrays-nojit-colshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-colshard]",
    "conformance/test_fit.py::test_fit[adam-dataloader-nojit-rowshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-replicated]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-batchshard]",
    "conformance/test_fit.py::test_fit[adam-arrays-nojit-dataparallel]",
    "conformance/test_fit.py::test_fit[sgd-arrays-jit-dataparallel]",
    "conformance/test_ops.py::test_op[subtract-tensor-shard1-eager]",
    "conformance/test_ops.py::test_op[matmul-tensor-first-shard0-eager]",
    "conformance/test_ops.py::test_op[add-scalar-shard0-eager]",
    "conformance/test_ops.py::test_op[relu-shard0-eager]",
    "conformance/test_setup.py::test_setup[list-devices]",
)


@dataclasses.dataclass(frozen=True)
class Case:
    """A mutant, the tier it runs, and the verdict each cell of that tier must get."""

    mutant: Mutant
    expected: dict  # cell name -> verdict; every other cell of the tier must pass
    tier: tuple[str, ...] = TIER
    #: --rank-timeout for the run: short only where a hang is the expected verdict (a real
    #: inductor compile of a jit cell can take longer than that on 2 busy cores).
    rank_timeout: int = 300
    #: --nproc for the run: 4 for a bug only the 2x2 mesh shows (1 < batch shards < processes).
    nproc: int = 2
    #: --full for the run: its tier names cells only --full collects.
    full: bool = False

    def verdict(self, cell: str) -> str:
        return self.expected.get(cell, "pass")


def cell_ids(*names: str) -> list[str]:
    return [f"test_fit[{n}]" if "-arrays-" in n or "-dataloader-" in n else n for n in names]


DATA_ADAPTERS = "keras/src/trainers/data_adapters/"


def sharded_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_data_sharding.py::test_keras_sharded[{n}]" for n in names)


def fit_ids(*names: str) -> tuple[str, ...]:
    return tuple(f"conformance/test_fit.py::test_fit[{n}]" for n in names)


# ------------------------------------------------------------------ the kit: every family's cases
# Imported here, after the kit's core above, which each family imports.
from tests.mutants import backends, checks, data, hub, models, on_batch, performance, state, training, workflows  # noqa: E402

CASES = (*training.CASES, *data.CASES, *checks.CASES, *on_batch.CASES, *models.CASES, *state.CASES, *backends.CASES,
         *workflows.CASES, *hub.CASES, *performance.CASES)


#: Cells of some mutant's tier that the unmutated build fails, each with its verdict: the build's own bug
#: (in its expectations file too), in a tier so that a correct rewrite shows the cell passes without it.
UNMUTATED_FAILS = {"test_metrics[max-dataparallel]": "numerics", "test_metrics[max-batchshard]": "numerics",
                   # dynamo compiles no frame under the promotion dispatch mode
                   "test_op[relu-shard0-compiled]": "compile-fallback",
                   "test_reconcile[dataparallel]": "numerics", "test_checkpoint[modelcheckpoint-dataparallel]": "error",
                   # issue 19: get_data_adapter refuses to shard anything but tf.data and PyDataset
                   **{f"test_keras_sharded[{n}]": "data-not-sharded" for n in (
                       "arrays-dataparallel", "tensors-batchshard", "dataloader-dataparallel",
                       "dataloader-sampler-batchshard", "iterable-dataparallel",
                       "arrays-batchxmodel", "dataloader-sampler-batchxmodel")},
                   **backends.UNMUTATED_FAILS, **workflows.UNMUTATED_FAILS, **models.UNMUTATED_FAILS,
                   **hub.UNMUTATED_FAILS}


def unmutated_tier(nproc: int = 2) -> tuple[str, ...]:
    """Every cell some mutant's tier runs with ``nproc`` ranks: the unmutated build must pass them all."""
    return tuple(dict.fromkeys(cell for case in CASES if case.nproc == nproc for cell in case.tier))


def unmutated_needs_full(nproc: int = 2) -> bool:
    """Whether ``unmutated_tier(nproc)`` names cells only ``--full`` collects."""
    return any(case.full for case in CASES if case.nproc == nproc)


def unmutated_fails(nproc: int = 2) -> dict[str, str]:
    """``UNMUTATED_FAILS`` of the cells ``unmutated_tier(nproc)`` runs."""
    names = {cell.rsplit("::", 1)[-1] for cell in unmutated_tier(nproc)}
    return {cell: verdict for cell, verdict in UNMUTATED_FAILS.items() if cell in names}


#: The rank counts the kit runs with.
KIT_NPROCS = tuple(sorted({case.nproc for case in CASES}))
