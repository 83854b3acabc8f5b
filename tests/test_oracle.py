"""The NumPy oracle (conformance/oracle.py) and --reference-keras-path.

The oracle is checked against steps computed by hand, so that it is not Keras' own arithmetic
graded by itself; the option is checked in a real session where the build under test has a
maths bug its own single-process run shares (the adam-bias-correction-ahead mutant), the
reference runs on a release (keras 3.15.1, with Lion taken out of its API to force a fallback),
and every cell's record says which reference judged it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from conformance import axes
from conformance.judge import oracle
from conformance import cell_data
from tests import mutants
from tests.test_mutants import session_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINEAR = (("dense_b", None),)


# ---------------------------------------------------------------- the oracle, by hand
def linear_params(kernel, bias) -> dict:
    return {"m/dense_b/kernel": np.array(kernel, dtype="float64"), "m/dense_b/bias": np.array(bias, dtype="float64")}


def test_one_sgd_step_by_hand():
    """pred = 1*1 + 1*2 + 0.5 = 3.5 against y = 4: loss 0.25, dL/dpred = 2 * (3.5 - 4) / 1 = -1,
    so dW = x.T @ -1 = [[-1], [-1]], db = [-1]; SGD lr 0.1 adds 0.1 to each."""
    params = linear_params([[1.0], [2.0]], [0.5])
    loss, grads = oracle.loss_and_grads(params, np.array([[1.0, 1.0]]), np.array([[4.0]]), LINEAR)
    assert loss == pytest.approx(0.25)
    np.testing.assert_allclose(grads["m/dense_b/kernel"], [[-1.0], [-1.0]])
    np.testing.assert_allclose(grads["m/dense_b/bias"], [-1.0])
    hp = {"learning_rate": 0.1, "momentum": 0.0}
    np.testing.assert_allclose(oracle.sgd(params["m/dense_b/kernel"], grads["m/dense_b/kernel"], {}, 1, hp),
                               [[1.1], [2.1]])


def test_mse_averages_over_batch_and_outputs():
    """Two samples, two outputs, errors 1, 2, 3, 4: MSE (1 + 4 + 9 + 16) / 4 = 7.5; the gradient
    of each output is 2 * error / 4 (Keras' sum_over_batch_size of the per-sample mean)."""
    params = linear_params(np.zeros((1, 2)), [0.0, 0.0])
    y = np.array([[-1.0, -2.0], [-3.0, -4.0]])
    loss, grads = oracle.loss_and_grads(params, np.ones((2, 1)), y, LINEAR)
    assert loss == pytest.approx(7.5)
    np.testing.assert_allclose(grads["m/dense_b/bias"], [(2 * 1 + 2 * 3) / 4, (2 * 2 + 2 * 4) / 4])


def test_relu_passes_no_gradient_below_zero():
    """Hidden units with pre-activations -1 and +2: only the second gets a gradient."""
    params = {"m/dense_a/kernel": np.array([[-1.0, 2.0]]), "m/dense_a/bias": np.zeros(2),
              "m/dense_b/kernel": np.array([[1.0], [1.0]]), "m/dense_b/bias": np.zeros(1)}
    _, grads = oracle.loss_and_grads(params, np.array([[1.0]]), np.array([[0.0]]), oracle.MLP)
    # pred = relu(-1) + relu(2) = 2; dL/dpred = 4; only unit 2 passes it back: dWa = x * 4 * [0, 1].
    np.testing.assert_allclose(grads["m/dense_a/kernel"], [[0.0, 4.0]])
    np.testing.assert_allclose(grads["m/dense_b/kernel"], [[0.0], [8.0]])


def test_momentum_two_steps_by_hand():
    """Keras' SGD momentum: m1 = -lr*g1 = -0.1, w1 = 0.9; m2 = 0.9*m1 - lr*g2 = -0.29, w2 = 0.61."""
    hp, slots = {"learning_rate": 0.1, "momentum": 0.9}, {}
    w1 = oracle.sgd(np.array(1.0), np.array(1.0), slots, 1, hp)
    w2 = oracle.sgd(w1, np.array(2.0), slots, 2, hp)
    assert (float(w1), float(w2)) == pytest.approx((0.9, 0.61))


def test_adam_first_step_moves_each_weight_by_the_learning_rate():
    """Step 1: m = 0.1 g, v = 0.001 g^2, alpha = lr * sqrt(0.001) / 0.1, so the step is
    lr * g / (|g| + eps / sqrt(0.001)): lr times the sign of g, for |g| far above epsilon."""
    hp = oracle.RULES["adam"].hyperparameters({"learning_rate": 0.01})
    w = oracle.adam(np.array([1.0, 1.0]), np.array([0.5, -3.0]), {}, 1, hp)
    np.testing.assert_allclose(w, [0.99, 1.01], rtol=1e-6)


def test_adam_epsilon_is_added_to_the_uncorrected_root():
    """g = 1e-6, lr = 1, step 1: Keras adds eps to sqrt(v) = sqrt(0.001) * g (step ~0.24), not to
    the bias-corrected sqrt(v_hat) = g as the paper does (step g / (g + eps) ~0.91)."""
    hp = oracle.RULES["adam"].hyperparameters({"learning_rate": 1.0})
    g = 1e-6
    step = 1.0 - float(oracle.adam(np.array(1.0), np.array(g), {}, 1, hp))
    alpha = np.sqrt(1 - 0.999) / (1 - 0.9)
    assert step == pytest.approx(alpha * 0.1 * g / (np.sqrt(0.001) * g + 1e-7))
    assert step != pytest.approx(g / (g + 1e-7))  # the paper's placement


def test_adamw_decays_before_the_adam_step():
    """AdamW, w = 2, g = 1, lr 0.5: decay first, 2 * (1 - 0.004 * 0.5) = 1.996, then Adam's first
    step of ~lr = 0.5 (1.496); decaying after the step would give 1.5 * 0.998 = 1.497."""
    hp = oracle.RULES["adamw"].hyperparameters({"learning_rate": 0.5})
    adam_step = 0.5 * np.sqrt(0.001) / (np.sqrt(0.001) + 1e-7)
    got = float(oracle.adamw(np.array(2.0), np.array(1.0), {}, 1, hp))
    assert got == pytest.approx(2 * (1 - 0.004 * 0.5) - adam_step, rel=1e-12)


def test_rmsprop_puts_epsilon_inside_the_root():
    """Step 1: v = 0.1 g^2, w -= lr * g / sqrt(v + eps); g = 1: 0.01 / sqrt(0.1 + 1e-7)."""
    hp = oracle.RULES["rmsprop"].hyperparameters({"learning_rate": 0.01})
    w = oracle.rmsprop(np.array(0.0), np.array(1.0), {}, 1, hp)
    assert float(-w) == pytest.approx(0.01 / np.sqrt(0.1 + 1e-7), rel=1e-12)


def test_logged_loss_is_the_running_mean_per_execution():
    assert oracle.logged([1.0, 2.0, 3.0, 4.0], [8] * 4, 1) == [1.0, 1.5, 2.0, 2.5]
    assert oracle.logged([1.0, 2.0, 3.0, 4.0], [8] * 4, 4) == [2.5]
    assert oracle.logged([1.0, 3.0], [1, 3], 1) == [1.0, 2.5]  # weighted by batch size


def test_the_core_set_is_the_mlp_on_arrays_and_dataloader_with_five_optimizers():
    covered = {name for name in axes.OPTIMIZERS
               if oracle.scope(axes.cell_spec("mlp", name, "arrays", "nojit", "colshard")) is None}
    assert covered == {"sgd", "sgd-momentum", "adam", "adamw", "rmsprop"}
    for layout in axes.LAYOUTS:
        for data in ("arrays", "dataloader"):
            assert oracle.coverage(axes.cell_spec("mlp", "adamw", data, "spe4", layout)) == "yes"
    assert oracle.coverage(axes.cell_spec("attention", "adam", "arrays", "nojit", "colshard")) == \
        "no: no oracle for the attention model"
    assert oracle.coverage(axes.cell_spec("mlp", "adam", "dict", "nojit", "colshard")) == \
        "no: no oracle for the twoinput model"
    assert oracle.coverage(axes.cell_spec("mlp", "adam", "generator", "nojit", "colshard")) == \
        "no: no oracle for the generator data source"
    assert oracle.coverage(axes.cell_spec("mlp", "lossscale", "arrays", "nojit", "colshard")) == \
        "no: SGD with loss_scale has no rule"
    for policy in axes.POLICIES[1:]:  # the oracle computes in float64: no 16-bit rounding to model
        assert oracle.coverage(axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard", policy)) == \
            f"no: the oracle computes in float64, not under {policy}"


def oracle_evidence(spec: dict) -> tuple[dict, oracle.Expected]:
    """Evidence as the oracle computes it, in float32 like a build's, from seeded initial weights."""
    rng = np.random.default_rng(1)
    initial = {"mlp/dense_a/kernel": rng.normal(size=(8, 16)), "mlp/dense_a/bias": np.zeros(16),
               "mlp/dense_b/kernel": rng.normal(size=(16, 4)), "mlp/dense_b/bias": np.zeros(4)}
    initial = {p: w.astype("float32") for p, w in initial.items()}
    want = oracle.expected(spec, initial)
    evidence = {q: getattr(want, q) for q in oracle.REFERENCE_QUANTITIES}
    evidence["weights"] = {p: w.astype("float32") for p, w in want.weights.items()}
    evidence["initial_weights"] = initial
    return evidence, want


@pytest.mark.parametrize("quantity", ["weight", "step_losses", "predict"])
def test_a_difference_is_named_with_its_quantity(quantity):
    spec = axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard")
    evidence, want = oracle_evidence(spec)
    assert oracle.reference_problems(spec, evidence, "") == []
    assert len(want.batch_losses) == cell_data.STEPS and len(want.step_losses) == cell_data.STEPS
    if quantity == "weight":
        evidence["weights"]["mlp/dense_b/bias"] = evidence["weights"]["mlp/dense_b/bias"] + 1e-3
        expected = "weight mlp/dense_b/bias differs from the NumPy oracle"
    else:
        evidence[quantity] = np.asarray(evidence[quantity]) * 1.001
        expected = f"{quantity} differs from the NumPy oracle"
    (problem,) = oracle.reference_problems(spec, evidence, "the single-process reference: ")
    assert problem.startswith(f"the single-process reference: {expected}: max abs difference")


def test_distributed_ranks_are_judged_on_their_final_weights():
    spec = axes.cell_spec("mlp", "rmsprop", "dataloader", "nojit", "dataparallel")
    evidence, _ = oracle_evidence(spec)
    bad = dict(evidence, weights={p: -w for p, w in evidence["weights"].items()})
    problems = oracle.distributed_problems(spec, [evidence, bad])
    assert problems and all(p.startswith("rank 1: weight ") for p in problems)


# ---------------------------------------------------------------- --reference-keras-path
def test_bad_reference_keras_path_is_one_usage_error(inner, tmp_path):
    inner.pytester.makepyfile("def test_nothing():\n    pass\n")
    result = inner.run("--reference-keras-path", str(tmp_path / "nowhere"))
    output = result.stdout + result.stderr
    assert result.returncode == 4, output
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert errors == [f"ERROR: --reference-keras-path {tmp_path / 'nowhere'}: no such directory"], output


WITHOUT_LION = mutants.Mutant(
    "keras-3.15.1-without-lion",
    "an older release that lacks an optimizer a cell needs",
    (mutants.Patch("keras/optimizers/__init__.py", "from keras.src.optimizers.lion import Lion as Lion\n", ""),),
)
ADAM_AHEAD = next(c.mutant for c in mutants.CASES if c.mutant.name == "adam-bias-correction-ahead")
CELLS = ("sgd-arrays-nojit-colshard", "adam-arrays-nojit-colshard", "lion-arrays-nojit-colshard")


def test_reference_on_a_release_catches_a_shared_maths_bug_and_falls_back(keras_nightly_tree, keras_3151_tree,
                                                                           tmp_path):
    """The build under test has Adam's bias correction a step ahead, in its single-process run too;
    a reference on keras 3.15.1 differs from it (before the oracle is even asked), SGD agrees
    with the release, and Lion, which this copy of the release lacks, falls back to the same build."""
    build = mutants.write_mutant(keras_nightly_tree, str(tmp_path / "build"), ADAM_AHEAD)
    release = mutants.write_mutant(keras_3151_tree, str(tmp_path / "release"), WITHOUT_LION)
    report, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--keras-path", build,
           "--reference-keras-path", release, "--conformance-json", str(report), "--junitxml", str(junit),
           *(f"conformance/test_fit.py::test_fit[{c}]" for c in CELLS)]
    env = session_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "record_property" not in proc.stdout  # no junitxml warning for the cell's properties
    assert f"single-process reference: keras 3.15.1 at {release}" in proc.stdout
    cells = {c["id"]: c for c in json.loads(report.read_text())["cells"]}
    sgd, adam, lion = (cells[f"test_fit[{c}]"] for c in CELLS)
    assert (sgd["verdict"], sgd["reference"], sgd["oracle"]) == ("pass", f"keras 3.15.1 at {release}", "yes")
    assert (adam["verdict"], adam["reference"]) == ("numerics", f"keras 3.15.1 at {release}"), adam["message"]
    assert "NumPy oracle" not in adam["message"]  # the release reference caught it first
    assert lion["verdict"] == "pass", lion["message"]
    assert lion["reference"] == (f"same build (fallback: keras 3.15.1 at {release} lacks it: "
                                 "NotInBuild: keras.optimizers.Lion does not exist in this build)")
    assert lion["oracle"] == "no: no rule for keras.optimizers.Lion"
    # said once for the run too, not only in the cell's record
    assert (f"single-process reference: 1 cells fell back to the same build: keras 3.15.1 at {release} lacks it: "
            "NotInBuild: keras.optimizers.Lion does not exist in this build (e.g. test_fit[lion-arrays-nojit-colshard])"
            ) in proc.stdout
    properties = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().find("testsuite/properties")}
    fit = "conformance/test_fit.py::test_fit"
    assert properties[f"{fit}[sgd-arrays-nojit-colshard] reference"] == f"keras 3.15.1 at {release}"
    assert properties[f"{fit}[lion-arrays-nojit-colshard] oracle"].startswith("no: ")
