"""``--conformance-repro DIR``: a script per failure cluster that reproduces it under torchrun with
torch and the Keras build only, proven on two mutant builds and passing on the unmutated one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import mutants
from tests.test_mutants import run_suite

#: (mutant, a cell it fails, the verdict): an exception in the optimizer's update, and one in the data path.
PROOFS = [("foreach-plain-lr", "test_fit[sgd-arrays-nojit-colshard]", "mixed-tensor"),
          ("batch-wrong-placement", "test_fit[adam-arrays-nojit-batchshard]", "error")]


def torchrun(script, keras_tree, tmp_path) -> subprocess.CompletedProcess:
    """The script as a contributor runs it: PYTHONPATH names the build and nothing of this project."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = keras_tree
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name, cell, verdict", PROOFS, ids=[p[0] for p in PROOFS])
def test_a_reproducer_shows_the_failure_and_passes_on_the_unmutated_build(keras_nightly_tree, tmp_path, name, cell,
                                                                           verdict):
    case = next(c for c in mutants.CASES if c.mutant.name == name)
    assert case.expected[cell] == verdict
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), case.mutant)
    repro = tmp_path / "repro"
    assert run_suite(build, ["--conformance-repro", str(repro), f"conformance/test_fit.py::{cell}"], tmp_path) == {
        cell: verdict}
    script = repro / (re.search(r"\[(.*)\]", cell).group(1) + ".py")
    text = script.read_text()
    assert not re.search(r"^\s*(from|import) (conformance|keras_dtensor_conformance)\b", text, re.M)
    assert "SPEC = {'model': 'mlp'" in text  # the cell literally, not a reference to the suite's axes

    broken = torchrun(script, build, tmp_path)
    said = re.findall(r"^rank (\d): (REPRODUCED|DIFFERENT|trained)[^\n]*", broken.stdout, re.M)
    assert broken.returncode != 0 and ("0", "REPRODUCED") in said, broken.stdout[-3000:] + broken.stderr[-3000:]
    assert f"REPRODUCED: {verdict}:" in broken.stdout
    assert f"from {build}/keras" in broken.stdout

    healthy = torchrun(script, keras_nightly_tree, tmp_path)
    assert healthy.returncode == 0, healthy.stdout[-3000:] + healthy.stderr[-3000:]
    assert healthy.stdout.count(f"did not reproduce {verdict}") == 2
