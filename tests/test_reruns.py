"""A cell that crashed or hung runs once more on fresh ranks (``--rerun-crashes``, default 1):
one that passes then is *intermittent*, keeps its failing verdict, and shows both outcomes."""

from __future__ import annotations

import json

import pytest

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
