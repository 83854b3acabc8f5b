"""The KerasHub family's tables, its judge on synthetic evidence, and the family's skip.

The judge's checks that only KerasHub cells have (every rank given one map, the variables a map leaves
alone kept whole, generate's ids up to a near-tie) are shown to fail on evidence that breaks them and to
hold on evidence that keeps them; the cells on real builds are the kit's (``tests/mutants/hub.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from keras_dtensor_conformance.controller import hub as controller_hub
from keras_dtensor_conformance.controller.build import BuildError

from conformance import test_hub
from conformance.judge import hub as judge
from conformance.judge.sharding import whole_problems
from conformance.ranks import hub as rank_hub
from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAP = {"decoder_block.*attention.*(query|key|value).kernel": ["model", "batch", None]}
LAYOUT = {"kind": "model-parallel", "map": MAP}


def variable(path: str, shape: tuple, placements=None, local=None) -> dict:
    """A variable as ``ranks/train.describe_variable`` gives it: plain, or a DTensor."""
    if placements is None:
        return {"path": path, "type": "Parameter", "shape": shape, "dtensor": False}
    return {"path": path, "type": "Parameter", "shape": shape, "dtensor": True, "placements": placements,
            "local_shape": local or shape}


def rank_value(variables: list[dict], layout: dict = LAYOUT, generated: dict | None = None) -> dict:
    return {"layout": layout, "stages": {"built": variables}, "phases": [], "slots": [], "generated": generated}


def test_every_causal_lm_with_a_layout_map_in_this_kerashub_has_a_model_row():
    """``MODELS`` is KerasHub's own list: a causal LM whose backbone gains ``get_layout_map`` (a KerasHub
    contributor's) needs its tiny configuration here, or its map would go unjudged."""
    code = "import json; from conformance.ranks import hub; print(json.dumps(hub.causal_lms()))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(session_env(), KERAS_BACKEND="torch"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(m.task, m.backbone) for m in rank_hub.MODELS.values()} == set(found.items())


def test_the_tiers_take_every_model_flow_and_layout_with_ids_that_say_the_cell():
    full = test_hub.hub_cells(full=True)
    assert len(full) == len(rank_hub.MODELS) * len(rank_hub.FLOWS) * len(rank_hub.LAYOUTS)
    assert set(test_hub.DEFAULT) <= set(full)
    assert {model for model, _, _ in test_hub.DEFAULT} == {n for n, m in rank_hub.MODELS.items() if m.default}
    assert {flow for _, flow, _ in test_hub.DEFAULT} == set(rank_hub.FLOWS)
    ids = [p.id for p in test_hub.hub_params(full=True)]
    assert "gemma-fit-sgd-authors" in ids and "qwen3-moe-save-load-authors-2x2" in ids and len(set(ids)) == len(ids)


def test_a_variable_the_map_leaves_alone_must_stay_whole():
    norm = "decoder_block_0/pre_attention_norm/scale"
    whole = [variable(norm, (32,)), variable(norm, (32,), ["R", "R"])]
    assert whole_problems(LAYOUT, whole, 2, "") == []
    sharded = [variable(norm, (32,), ["R", "S(0)"], (16,))]
    (problem,) = whole_problems(LAYOUT, sharded, 2, "rank 0: ")
    assert problem.startswith(f"rank 0: {norm}: DTensor") and "expected whole" in problem
    # A variable the map names is the sharding check's, not this one's.
    query = variable("decoder_block_0/attention/query/kernel", (8, 32, 4), ["S(1)", "S(0)"], (4, 32, 4))
    assert whole_problems(LAYOUT, [query], 2, "") == []


def test_the_named_and_the_unnamed_variables_are_both_held_to_the_map():
    query = "decoder_block_0/attention/query/kernel"
    kept = [variable(query, (8, 32, 4), ["S(1)", "S(0)"], (4, 32, 4)), variable("x/scale", (32,))]
    spec = {"optimizer_name": "sgd"}
    assert judge.map_layout_problems(spec, [rank_value(kept), rank_value(kept)]) == []
    lost = [variable(query, (8, 32, 4)), variable("x/scale", (32,))]
    problems = judge.map_layout_problems(spec, [rank_value(lost), rank_value(kept)])
    assert problems == [f"rank 0 after built: {query}: a plain Parameter, expected a DTensor ['S(1)', 'S(0)']"]
    # DataParallel has no map to hold them to.
    assert judge.map_layout_problems(spec, [rank_value(lost, {"kind": "data-parallel"})] * 2) == []


def test_ranks_given_different_maps_are_the_harness_error():
    other = {**LAYOUT, "map": {**MAP, "token_embedding/embeddings": ["model", "batch"]}}
    values = [rank_value([]), rank_value([], other)]
    verdict, message = judge.hub_failure({"model": "gemma", "flow": "fit-sgd", "optimizer_name": "sgd"}, values, {})
    assert verdict == "error" and "rank 1 was given another layout map than rank 0" in message


def generated(ids, margins=None) -> dict:
    ids = np.asarray(ids)
    return {"rows": np.arange(len(ids)), "token_ids": ids, "padding_mask": np.ones_like(ids, bool),
            "margins": np.full((len(ids), ids.shape[1] - 1), 0.5) if margins is None else np.asarray(margins)}


def test_generated_ids_must_be_the_one_processs_up_to_a_near_tie():
    want = {"generated": generated([[5, 1, 2, 3], [5, 4, 4, 4]])}
    same = [rank_value([], generated=generated([[5, 1, 2, 3], [5, 4, 4, 4]]))] * 2
    assert judge.generated_problems(same, want) == []
    other = [rank_value([], generated=generated([[5, 1, 9, 9], [5, 4, 4, 4]]))] * 2
    problems = judge.generated_problems(other, want)
    assert problems[0] == ("rank 0: prompt 0: token 2 generated 9, one process 2 (which it chose by a logit "
                           "margin of 0.5)") and len(problems) == 2
    # The one process chose token 2 within TIE of another: what follows may go either way.
    tied = {"generated": generated([[5, 1, 2, 3], [5, 4, 4, 4]], [[0.5, judge.TIE / 2, 0.5], [0.5, 0.5, 0.5]])}
    assert judge.generated_problems(other, tied) == []
    # A rank that returns only its own prompts' completions does not give what one process gives.
    half = [rank_value([], generated={**generated([[5, 1, 2, 3]]), "rows": np.arange(2)})] * 2
    assert "generated ids of shape (1, 4), the one process (2, 4)" in judge.generated_problems(half, want)[0]


def test_a_kerashub_path_that_holds_none_is_one_usage_error(tmp_path):
    with pytest.raises(BuildError, match="no such directory"):
        controller_hub.resolve_hub_path(str(tmp_path / "nowhere"))
    with pytest.raises(BuildError, match=r"no KerasHub package there \(expected .*keras_hub/__init__.py\)"):
        controller_hub.resolve_hub_path(str(tmp_path))


def test_kerashub_not_installed_is_its_cells_one_skip_reason(monkeypatch):
    monkeypatch.setattr(controller_hub.importlib.util, "find_spec", lambda name: None)
    found = controller_hub.probe_keras_hub(None, None)
    assert found.skip_reason.startswith("not installed: its cells skip (install it: pip install -e '.[hub]'")
    assert found.header_line() == f"keras-hub: {found.skip_reason}"


@pytest.mark.slow
def test_a_kerashub_that_does_not_import_skips_its_cells_with_one_line_and_nothing_else_changes(tmp_path):
    """A KerasHub built for another Keras (keras-hub 0.32.0 asks the default build for ``get_keras_mask``,
    which it lacks): every KerasHub cell skips with that one reason, the header says it, and the other
    cells run as before."""
    broken = tmp_path / "hub" / "keras_hub"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("from keras.src.backend import get_keras_mask\n")
    cells = "(gemma-fit-sgd-authors and not 2x2) or llama-lora-authors or list-devices"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs",
                           "conformance/test_hub.py", "conformance/test_setup.py", "-k", cells,
                           f"--keras-hub-path={tmp_path / 'hub'}"],
                          cwd=ROOT, env=session_env(), capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out[-4000:]
    why = (f"--keras-hub-path {tmp_path / 'hub'} does not import with Keras 3.16.0.dev2026102704: its cells skip "
           "(ImportError: cannot import name 'get_keras_mask' from 'keras.src.backend'")
    assert f"keras-hub: {why}" in out
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].startswith("SKIPPED [2] conformance/test_hub.py") and why in skipped[0]
    assert "1 passed, 2 skipped" in out
    bad = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "conformance/test_hub.py",
                          "-k", cells, f"--keras-hub-path={tmp_path}"],
                         cwd=ROOT, env=session_env(), capture_output=True, text=True, timeout=600)
    assert bad.returncode == 4 and bad.stderr.strip().splitlines() == [
        f"ERROR: --keras-hub-path {tmp_path}: no KerasHub package there (expected {tmp_path / 'keras_hub' / '__init__.py'}); "
        "pass the root of a KerasHub git checkout or of an unpacked KerasHub wheel"]
