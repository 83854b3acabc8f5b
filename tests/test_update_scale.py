"""The update-scale check (``numerics.scale_problems``): an update factor that is off by 1 % fails
under every dtype policy, where the element-wise tolerance of a mixed policy lets it through, and
16-bit rounding noise of each element does not; and a reference that failed is "not judged"."""

from __future__ import annotations

import numpy as np
import pytest
from keras_dtensor_conformance import HELD, NOT_JUDGED, NUMERICS

from conformance import axes
from conformance.judge import fit_checks, jax_compare, numerics
from conformance.judge.cells import oracle_outcome

PATHS = ("mlp/dense_a/kernel", "mlp/dense_a/bias", "mlp/dense_b/kernel", "mlp/dense_b/bias")
SHAPES = ((8, 16), (16,), (16, 4), (4,))


def weights(seed: int, scale: float = 0.3) -> dict:
    rng = np.random.default_rng(seed)
    return {p: (rng.standard_normal(s) * scale).astype("float32") for p, s in zip(PATHS, SHAPES, strict=True)}


def trained(initial: dict, update: dict, factor: float = 1.0, noise: float = 0.0, seed: int = 1) -> dict:
    """Weights after an update ``factor`` times ``update``, each element with relative ``noise``."""
    rng = np.random.default_rng(seed)
    return {p: (initial[p] + factor * update[p] * (1 + noise * rng.standard_normal(update[p].shape))).astype("float32")
            for p in PATHS}


INITIAL, UPDATE = weights(0), weights(7, scale=0.01)  # updates of about 1e-2: four steps of lr 1e-3 to 5e-2


def rank(factor=1.0, noise=0.0, seed=1) -> dict:
    return {"initial_weights": INITIAL, "weights": trained(INITIAL, UPDATE, factor, noise, seed)}


REFERENCE = {"weights": trained(INITIAL, UPDATE)}


@pytest.mark.parametrize("policy", axes.POLICIES)
def test_an_update_one_percent_too_large_fails_under_every_policy(policy):
    value = rank(1.01)
    # element-wise, a mixed policy's tolerance lets the 1 % through: the reason the scale check exists
    if policy != "float32":
        assert numerics.weight_problems(0, value, REFERENCE, numerics.TOLERANCES[policy]) == []
    (problem,) = numerics.scale_problems(0, value, REFERENCE, policy)
    assert "1.01 times the reference's" in problem and f"under {policy}" in problem


@pytest.mark.parametrize("policy", axes.POLICIES[1:])
def test_rounding_noise_of_each_element_passes(policy):
    """bfloat16 keeps 8 bits: each element of the update off by about 2**-8 relative, independently,
    leaves the median over the MLP's 212 weights where it was."""
    for seed in range(20):
        assert numerics.scale_problems(0, rank(noise=2 ** -8, seed=seed), REFERENCE, policy) == []


def test_signs_flipped_by_rounding_do_not_move_the_scale():
    """Adam's update of an element whose gradient is near 0 is about +-lr: rounding may flip it
    whole. A few flipped elements (here 4 %) leave the median; a least-squares factor would read 0.92."""
    value = rank()
    flipped = {p: w.copy() for p, w in value["weights"].items()}
    kernel = flipped[PATHS[0]].ravel()
    start = INITIAL[PATHS[0]].ravel()
    kernel[:9] = start[:9] - (kernel[:9] - start[:9])
    flipped[PATHS[0]] = kernel.reshape(SHAPES[0])
    assert numerics.scale_problems(0, {**value, "weights": flipped}, REFERENCE, "mixed_bfloat16") == []


def test_a_lost_update_is_seen_in_the_scale():
    """A fourth of the update lost (the last of four steps) is 0.75 times the reference's."""
    (problem,) = numerics.scale_problems(0, rank(0.75), REFERENCE, "mixed_bfloat16")
    assert "0.75 times" in problem


def test_the_scale_is_taken_from_each_sides_own_start():
    """A reference that reports its own initial weights is measured from them; without them
    (the JAX reference starts from the ranks'), from the rank's."""
    start = {p: w + 0.5 for p, w in INITIAL.items()}
    reference = {"initial_weights": start, "weights": trained(start, UPDATE, 1.01)}
    assert numerics.update_scale(rank(1.01), reference) == pytest.approx(1.0, abs=1e-6)
    assert numerics.update_scale(rank(1.0), REFERENCE) == pytest.approx(1.0, abs=1e-6)
    assert numerics.scale_problems(0, {"weights": REFERENCE["weights"]}, REFERENCE, "float32") == []  # no start: no scale


def _evidence(factor: float) -> dict:
    return {**rank(factor), "step_losses": [1.0], "epoch_loss": [1.0], "evaluate": 1.0,
            "predict": np.ones((4, 4), "float32"), "rows": np.arange(4), "batch_part": [0, 1], "device": "cpu"}


def test_a_mixed_cell_whose_torch_update_is_one_percent_off_jax_fails_numerics():
    """The kit's mixed-learning-rate-off-1pct on plain data: single-process and distributed torch
    agree (both 1 % off), the JAX backend's update is the right one, no oracle judges a mixed cell."""
    ranks = [_evidence(1.01)] * 2
    jax = {**_evidence(1.0), "jax_version": "0.10.2"}
    problems = jax_compare.numbers_differ_from_jax(ranks, jax, "mixed_bfloat16")
    assert len(problems) == 2 and all("1.01 times" in p for p in problems)
    assert numerics.numerics_problems(ranks, _evidence(1.01), policy="mixed_bfloat16") == []


SPEC = axes.cell_spec("mlp", "sgd", "arrays", "nojit", "colshard")  # no slots to find


def _ranks() -> list[dict]:
    var = {"path": PATHS[0], "type": "DTensor", "shape": (8, 16), "dtensor": True, "placements": ["R", "S(1)"],
           "local_shape": (8, 8)}
    return [{**_evidence(1.0), "stages": {"fit": [var]}, "slots": [], "unmatched_optimizer_variables": [],
             "device": "cpu", "distribution": "ModelParallel", "unsynchronized_batch_norm": [], "compiled_graphs": 0,
             "communication": None} for _ in range(2)]


def test_a_jax_reference_that_failed_is_not_judged_not_inapplicable():
    failure = "the JAX backend's run failed: RuntimeError: boom"
    found, outcomes = fit_checks.fit_checks(SPEC, _ranks(), 2, _evidence(1.0), jax=None, jax_failure=failure)
    assert found is None
    assert outcomes[fit_checks.JAX_NUMBERS] == outcomes[fit_checks.JAX_LAYOUTS] == (NOT_JUDGED, failure)
    assert outcomes[fit_checks.VARIABLE_LAYOUTS][0] == HELD  # the LayoutMap judges torch's layouts either way
    # JAX not installed: not applicable
    _, outcomes = fit_checks.fit_checks(SPEC, _ranks(), 2, _evidence(1.0), jax=None)
    assert outcomes[fit_checks.JAX_NUMBERS][0] == outcomes[fit_checks.JAX_LAYOUTS][0] == "not applicable"


def test_an_oracle_that_raises_is_not_judged_with_its_reason(monkeypatch):
    from conformance.judge import oracle

    def broken(*args):
        raise ValueError("no such weight")

    monkeypatch.setattr(oracle, "reference_problems", broken)
    verdict, why = oracle_outcome(SPEC, _ranks(), _evidence(1.0))
    assert verdict == NOT_JUDGED and why == "the NumPy oracle raised ValueError: no such weight"
    found, outcomes = fit_checks.fit_checks(SPEC, _ranks(), 2, _evidence(1.0), jax=None,
                                            oracle=lambda: (verdict, why))
    assert found is None and outcomes[fit_checks.ORACLE_NUMBERS] == (NOT_JUDGED, why)


def test_a_numbers_difference_says_so():
    assert fit_checks.numbers_differ(SPEC, _ranks(), {**_evidence(1.0), "weights": trained(INITIAL, UPDATE, 1.01)})[0] \
        == NUMERICS


def _with_outliers(count: int, times: float, policy: str = "mixed_bfloat16") -> dict:
    """The reference's weights with ``count`` kernel elements ``times`` the policy's tolerance away."""
    tol = numerics.TOLERANCES[policy]
    weights = {p: w.copy() for p, w in REFERENCE["weights"].items()}
    kernel = weights[PATHS[0]].ravel()
    kernel[:count] += times * (tol["atol"] + tol["rtol"] * np.abs(kernel[:count]))
    weights[PATHS[0]] = kernel.reshape(SHAPES[0])
    return {"initial_weights": INITIAL, "weights": weights}


def test_a_few_elements_a_flipped_step_away_pass_a_mixed_policy_not_float32():
    """Adam's sign flips in 16 bits (measured: 3 of 212 elements, 1.8 times the tolerance)."""
    assert numerics.weight_problems(0, _with_outliers(3, 1.8), REFERENCE, numerics.TOLERANCES["mixed_bfloat16"],
                                    numerics.OUTLIERS["mixed_bfloat16"]) == []
    (problem,) = numerics.weight_problems(0, _with_outliers(3, 1.8, "float32"), REFERENCE,
                                          numerics.TOLERANCES["float32"], numerics.OUTLIERS["float32"])
    assert "3 of 128 element(s) beyond it" in problem


@pytest.mark.parametrize("count, times", [(7, 1.8), (1, 5.0), (1, float("nan"))])
def test_more_elements_or_farther_ones_fail_a_mixed_policy(count, times):
    """More than 5 % of a weight's elements (7 of the kernel's 128), or one beyond 4 times the
    tolerance, or one not finite."""
    problems = numerics.weight_problems(0, _with_outliers(count, times), REFERENCE,
                                        numerics.TOLERANCES["mixed_bfloat16"], numerics.OUTLIERS["mixed_bfloat16"])
    assert len(problems) == 1 and f"{count} of 128 element(s) beyond it, 6 allowed within 4x" in problems[0]


def test_one_element_of_a_small_tensor_may_be_an_outlier_two_may_not():
    """A 16-element bias: 1 beyond the tolerance (measured: seed 2's rowshard Adam cell) passes, 2 fail;
    a whole bias off (a lost write) fails."""
    tol, outliers = numerics.TOLERANCES["mixed_bfloat16"], numerics.OUTLIERS["mixed_bfloat16"]
    want = np.linspace(-0.5, 0.5, 16)
    step = 1.8 * (tol["atol"] + tol["rtol"] * np.abs(want))
    assert numerics.compare("bias", want + step * (np.arange(16) < 1), want, tol=tol, outliers=outliers) is None
    assert "2 of 16 element(s) beyond it, 1 allowed" in numerics.compare(
        "bias", want + step * (np.arange(16) < 2), want, tol=tol, outliers=outliers)
    assert numerics.compare("bias", want + step, want, tol=tol, outliers=outliers) is not None
