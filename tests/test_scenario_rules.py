"""The rank-0-only scenarios: a build passes by refusing quickly and clearly, a build that hangs is ``hang``.

No SPMD build can gather a sharded kernel on one rank alone, so the scenario's passing side is
rank 0 raising a clear error (not the process group's own timeout) within a few seconds while
every rank finishes training. The judge's rule is tested on evidence of each kind, the nightly
(which hangs) still gets ``hang``, and a mutant build that refuses the gather passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from keras_dtensor_conformance.rank.outcomes import OK, PoolResult, RankOutcome
from keras_dtensor_conformance.verdicts import CRASH_VERDICT, ERROR, HANG_VERDICT, SHARDING_LOST, CellFailure

from conformance.judge.scenarios import RANK0_RAISE_WITHIN_S, judge_scenario
from conformance.ranks import scenarios as rank_scenarios
from conformance.test_scenarios import HANG_TIMEOUT
from tests import mutants
from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARDED_KERNEL = {"dtensor": True, "placements": ["R", "S(1)"]}
RANK0_SCENARIOS = ("rank0-convert-to-numpy", "rank0-callback-get-weights", "rank0-checkpoint-save")


def verdict(result) -> str:
    try:
        judge_scenario("rank-zero-only", result)
    except CellFailure as failure:
        return failure.verdict
    return "pass"


def evidence(raised=None, kernel=SHARDED_KERNEL) -> PoolResult:
    """Rank 0 with ``raised`` as the callback's exception, rank 1 trained on untouched."""
    values = [{"what": "convert-to-numpy", "rank": r, "kernel": kernel, "raised": raised if r == 0 else None,
               "returned_shape": None} for r in range(2)]
    return PoolResult("rank_zero_only", [RankOutcome(rank=r, status=OK, value=v) for r, v in enumerate(values)])


def raised(message: str, elapsed: float, type_: str = "RuntimeError") -> dict:
    return {"type": type_, "message": message, "elapsed": elapsed}


@pytest.mark.parametrize("result, want", [
    (evidence(raised("convert_to_numpy of a sharded DTensor is a collective", 0.01)), "pass"),
    (evidence(raised("anything clear", RANK0_RAISE_WITHIN_S + 1)), HANG_VERDICT),
    (evidence(raised("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer", 0.5)), HANG_VERDICT),
    (evidence(raised("Timed out waiting 1800000ms for send operation to complete", 1.0)), HANG_VERDICT),
    (evidence(None), ERROR),  # rank 0 "gathered" alone without a word: it cannot have
    (evidence(raised("clear", 0.01), kernel={"dtensor": False}), SHARDING_LOST),
], ids=["clear-and-quick", "slow", "connection-closed", "group-timeout", "no-error", "kernel-lost"])
def test_rank_zero_rule(result, want):
    assert verdict(result) == want


#: What keras-nightly's rank-alone gather ends in: rank 0's all_gather meets rank 1's next training
#: collective, and either both wait (``hang``) or gloo aborts rank 0 on the mismatched message
#: (``crash``, what this tree measures); never a clear error, never a pass.
NIGHTLY_RANK0_VERDICTS = (HANG_VERDICT, CRASH_VERDICT)


@pytest.mark.parametrize("scenario", RANK0_SCENARIOS)
def test_the_nightly_still_fails_them(keras_ranks, scenario):
    """keras-nightly gathers on rank 0 with a collective rank 1 never joins: no pass under the new rule."""
    from conformance.test_scenarios import SCENARIOS

    function, args, judge, marker = SCENARIOS[scenario]
    assert (function, judge, marker) == (rank_scenarios.rank_zero_only, "rank-zero-only", HANG_TIMEOUT)
    with pytest.raises(CellFailure) as failure:  # the marker's seconds: this test calls the ranks itself
        judge_scenario(judge, keras_ranks.run(function, *args, timeout=marker.args[0]))
    assert failure.value.verdict in NIGHTLY_RANK0_VERDICTS, failure.value.detail


#: The passing side: a build whose convert_to_numpy refuses a sharded DTensor (an implicit gather,
#: a collective) with a clear error, instead of entering the collective. The nightly's
#: get_weights() and save_weights() go through convert_to_numpy, so all three scenarios pass.
REFUSES_IMPLICIT_GATHER = mutants.Mutant(
    "convert-to-numpy-refuses-sharded",
    "a build that refuses an implicit gather of a sharded DTensor with a clear error",
    (mutants.Patch(
        mutants.TORCH + "ops/core.py",
        "            if isinstance(x, DTensor):\n",
        "            if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):\n"
        "                raise RuntimeError(  # mutant: refuse, do not enter the collective\n"
        "                    'convert_to_numpy of a sharded DTensor is a collective: call it on every rank'\n"
        "                )\n"
        "            if isinstance(x, DTensor):\n"),),
)


def test_a_build_that_refuses_clearly_passes(keras_nightly_tree, tmp_path):
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), REFUSES_IMPLICIT_GATHER)
    report = tmp_path / "report.json"
    cells = [f"conformance/test_scenarios.py::test_scenario[{s}]" for s in RANK0_SCENARIOS]
    env = session_env()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--keras-path", build,
                           "--rank-timeout", "60", "--conformance-json", str(report), *cells],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    verdicts = {c["id"]: c["verdict"] for c in json.loads(report.read_text())["cells"]}
    assert verdicts == {f"test_scenario[{s}]": "pass" for s in RANK0_SCENARIOS}, proc.stdout[-3000:]
