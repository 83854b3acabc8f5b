"""The JAX reference's judge, on plain data: the layout translation (JAX PartitionSpec -> torch
placements), the sharding and slot checks fed JAX's layouts, the numbers against JAX with their
own message after single-process torch's, and the reference's cache key; and, in a JAX process,
the compilation cache that spares it compiling a program twice."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from keras_dtensor_conformance.verdicts import JAX_BACKEND_DIFFERS, NUMERICS, SHARDING_LOST

from conformance import axes
from conformance.judge import fit_checks, jax_compare, numerics
from conformance.reference import jax_key

MESH_AXES = ["batch", "model"]
SPEC = axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "colshard")
KERNEL, BIAS = "mlp/dense_a/kernel", "mlp/dense_a/bias"
SLOT = "adagrad/mlp_dense_a_kernel_accumulator"


@pytest.mark.parametrize("spec, want", [
    ([None, "model"], ["R", "S(1)"]),
    (["model", None], ["R", "S(0)"]),  # the model axis (mesh axis 1) shards dimension 0
    (["batch", "model"], ["S(0)", "S(1)"]),
    ([["batch", "model"], None], ["S(0)", "S(0)"]),
    ([None, None], None),  # replicated: no DTensor required
    ([None], None),
    (None, None),  # one device, no distribution
])
def test_a_partition_spec_is_translated_to_torch_placements_per_mesh_axis(spec, want):
    assert jax_compare.placements(spec, MESH_AXES) == want


def _jax(slot_spec=(None, "model"), slots=1) -> dict:
    return {"mesh_axes": MESH_AXES, "mesh_shape": [1, 2],
            "variables": [{"path": KERNEL, "shape": (8, 16), "spec": [None, "model"]},
                          {"path": BIAS, "shape": (16,), "spec": [None]}],
            "slots": [{"path": SLOT if i == 0 else f"{SLOT}{i}", "shape": (8, 16), "spec": list(slot_spec),
                       "reference": KERNEL, "factor": None} for i in range(slots)]}


def _var(path, shape, placements=None, local=None, **extra) -> dict:
    entry = {"path": path, "type": "Parameter" if placements is None else "DTensor", "shape": shape,
             "dtensor": placements is not None, **extra}
    if placements is not None:
        entry.update(placements=placements, local_shape=local)
    return entry


def _rank(rank: int, slot_dtensor: bool = True) -> dict:
    variables = [_var(KERNEL, (8, 16), ["R", "S(1)"], (8, 8)), _var(BIAS, (16,))]
    slot = (_var(SLOT, (8, 16), ["R", "S(1)"], (8, 8), reference=KERNEL, factor=None) if slot_dtensor
            else _var(SLOT, (8, 16), reference=KERNEL, factor=None))
    return {"stages": {"built": variables, "fit": variables}, "slots": [slot], "unmatched_optimizer_variables": []}


def sharding_lost(*args):
    return fit_checks.sharding_checks(*args)[0]


def test_the_jax_layouts_pass_a_rank_that_has_them():
    assert sharding_lost(SPEC, [_rank(0), _rank(1)], 2, _jax()) is None
    assert fit_checks.jax_layouts_differ(SPEC, [_rank(0), _rank(1)], 2, _jax()) is None


def test_a_slot_that_lost_its_variables_sharding_is_sharding_lost_and_says_whether_jax_lost_it_too():
    verdict, message = sharding_lost(SPEC, [_rank(0, slot_dtensor=False), _rank(1)], 2, _jax())
    assert verdict == SHARDING_LOST
    assert f"rank 0 optimizer slot {SLOT}: a plain Parameter, expected a DTensor ['R', 'S(1)']" in message
    assert "JAX backend departs" not in message
    # A build whose shared optimizer code drops the slots' layout drops it on JAX too (the slots-plain mutant)
    verdict, message = sharding_lost(SPEC, [_rank(0, slot_dtensor=False)] * 2, 2, _jax(slot_spec=(None, None)))
    assert verdict == SHARDING_LOST and f"optimizer slot {SLOT}: a plain Parameter" in message
    assert (f"the JAX backend departs from the LayoutMap too (code both backends share?): optimizer slot {SLOT}: "
            f"the JAX backend lays it out replicated, its variable {KERNEL} is laid out ['R', 'S(1)']") in message


def test_a_slot_count_jax_departs_from_is_the_jax_backends_not_torchs():
    """JAX keeps two full slots for the kernel where Adagrad keeps one (``axes.SLOTS``): torch, which
    keeps one, follows the optimizer; the JAX backend departs."""
    assert sharding_lost(SPEC, [_rank(0), _rank(1)], 2, _jax(slots=2)) is None
    verdict, message = fit_checks.jax_layouts_differ(SPEC, [_rank(0), _rank(1)], 2, _jax(slots=2))
    assert verdict == JAX_BACKEND_DIFFERS
    assert f"{KERNEL}: the JAX backend keeps 2 optimizer slot(s) and 0 factored, adagrad keeps 1 and 0" in message


def test_a_variable_jax_shards_that_the_layout_map_leaves_whole_is_a_jax_departure_not_sharding_lost():
    """The LayoutMap is the specification: torch keeping the bias whole, as it asks, passes; the
    JAX backend sharding it is named."""
    jax = _jax()
    jax["variables"][1]["spec"] = ["model"]
    assert sharding_lost(SPEC, [_rank(0), _rank(1)], 2, jax) is None
    verdict, message = fit_checks.jax_layouts_differ(SPEC, [_rank(0), _rank(1)], 2, jax)
    assert verdict == JAX_BACKEND_DIFFERS
    assert message.startswith("the JAX backend departs from the LayoutMap, which torch follows: ")
    assert f"{BIAS}: the JAX backend lays it out ['R', 'S(0)'], the LayoutMap asks replicated" in message


def test_what_the_layout_map_shards_is_asked_even_where_jax_left_it_whole():
    jax = _jax()
    jax["variables"][0]["spec"] = [None, None]
    ranks = [_rank(0), _rank(1)]
    for value in ranks:
        value["stages"]["fit"] = [_var(KERNEL, (8, 16)), _var(BIAS, (16,))]
    verdict, message = sharding_lost(SPEC, ranks, 2, jax)
    assert verdict == SHARDING_LOST and f"after fit: {KERNEL}: a plain Parameter" in message
    assert f"{KERNEL}: the JAX backend lays it out replicated, the LayoutMap asks ['R', 'S(1)']" in message


def test_a_jax_layout_departure_is_the_verdict_only_where_torch_passed_everything_else():
    jax = {**_jax(), **_numbers()}
    jax["variables"][1]["spec"] = ["model"]
    verdict, message = fit_checks.fit_failure(SPEC, [_evidence(), _evidence()], 2, _numbers(), jax=jax)
    assert verdict == JAX_BACKEND_DIFFERS and f"{BIAS}: the JAX backend lays it out" in message
    # torch's own numbers bug first
    assert fit_checks.fit_failure(SPEC, [_evidence(1.01)] * 2, 2, _numbers(), jax=jax)[0] == NUMERICS


def _numbers(scale: float = 1.0) -> dict:
    return {"step_losses": [1.0, 0.9], "epoch_loss": [0.95], "evaluate": 0.8,
            "predict": np.ones((4, 2), "float32"), "rows": np.arange(4), "batch_part": [0, 1],
            "weights": {KERNEL: np.full((8, 16), 0.5 * scale, "float32")}, "device": "cpu",
            "distribution": "ModelParallel", "unsynchronized_batch_norm": []}


def _evidence(scale=1.0) -> dict:
    return {**_numbers(scale), **_rank(0), "compiled_graphs": 0}


def test_numbers_that_differ_from_jax_but_not_from_single_process_torch_say_a_bug_both_share():
    ranks = [_evidence(1.01), _evidence(1.01)]
    found = fit_checks.fit_failure(SPEC, ranks, 2, _numbers(1.01), jax={**_jax(), **_numbers()})
    assert found[0] == NUMERICS and found[1].startswith(jax_compare.BOTH_SHARE)
    assert f"weight {KERNEL}: max abs difference" in found[1]


def test_numbers_that_differ_from_single_process_torch_say_a_distribution_bug_first():
    ranks = [_evidence(1.01), _evidence(1.01)]
    found = fit_checks.fit_failure(SPEC, ranks, 2, _numbers(), jax={**_jax(), **_numbers()})
    assert found[0] == NUMERICS and found[1].startswith("distributed torch differs from single-process torch")


def test_numbers_within_the_tolerance_of_jax_pass():
    tol = jax_compare.tolerance()
    ranks = [_evidence(1 + tol["rtol"] / 10)] * 2
    assert fit_checks.fit_failure(SPEC, ranks, 2, _numbers(1 + tol["rtol"] / 10), jax={**_jax(), **_numbers()}) is None


def test_a_mixed_policy_cell_is_held_to_its_policys_tolerance_not_float32s():
    # A difference within bfloat16's rounding and far outside float32's: the single process and the
    # ranks computed in 16 bits with sums in another order.
    mixed = axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "colshard", "mixed_bfloat16")
    scale = 1 + numerics.TOLERANCES["mixed_bfloat16"]["rtol"] / 2
    assert fit_checks.fit_failure(mixed, [_evidence(scale)] * 2, 2, _numbers(), jax=None) is None
    found = fit_checks.fit_failure(SPEC, [_evidence(scale)] * 2, 2, _numbers(), jax=None)
    assert found[0] == NUMERICS and found[1].startswith("distributed torch differs from single-process torch")
    # The kernel 0.05 away (four lost Adam updates of 1e-2, and a little more) fails under bfloat16 too;
    # the mutant mixed-update-writes-lost shows that lost updates fail on real cells, predictions first.
    assert fit_checks.fit_failure(mixed, [_evidence(1.1)] * 2, 2, _numbers(), jax=None)[0] == NUMERICS


def test_without_a_jax_reference_the_hand_written_table_judges():
    assert fit_checks.fit_failure(SPEC, [_evidence(1.01)] * 2, 2, _numbers(1.01), jax=None) is None


def test_a_mixed_policy_widens_the_tolerance_against_jax_to_its_own():
    for policy in axes.POLICIES:
        precision = numerics.TOLERANCES[policy]
        assert jax_compare.tolerance(policy) == {k: max(jax_compare.DEFAULT[k], precision[k]) for k in precision}
    assert jax_compare.tolerance("float32") == jax_compare.DEFAULT
    assert jax_compare.tolerance("mixed_bfloat16") == numerics.TOLERANCES["mixed_bfloat16"]
    assert 0 < jax_compare.DEFAULT["rtol"] <= 1e-3 and 0 < jax_compare.DEFAULT["atol"] <= 1e-4  # far below one update


def test_one_jax_reference_serves_every_compile_mode_and_plain_data_source():
    weights = {KERNEL: np.zeros((8, 16), "float32")}
    key = jax_key(SPEC, weights, 2)
    for other in (axes.cell_spec("mlp", "adagrad", "dataloader", "jit", "colshard"),
                  axes.cell_spec("mlp", "adagrad", "arrays", "eager", "colshard"),
                  axes.cell_spec("mlp", "adagrad", "arrays", "spe4", "colshard")):
        assert jax_key(other, weights, 2) == key
    for other, w, n in ((axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "rowshard"), weights, 2),
                        (axes.cell_spec("mlp", "adagrad", "sample-weights", "nojit", "colshard"), weights, 2),
                        (SPEC, {KERNEL: np.ones((8, 16), "float32")}, 2),
                        (SPEC, weights, 4),
                        (axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "colshard", "mixed_bfloat16"), weights, 2)):
        assert jax_key(other, w, n) != key
    # The numbers' key leaves the layout out: one fitted run serves every layout.
    numbers = jax_key(SPEC, weights, None)
    assert jax_key(axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "rowshard"), weights, None) == numbers
    assert jax_key(axes.cell_spec("mlp", "adagrad", "sample-weights", "nojit", "colshard"), weights, None) != numbers


class FakeJaxPool:
    """Stands for the JAX process: records each run and answers numbers and layouts that say which
    run made them."""

    def __init__(self):
        self.runs = []

    def run(self, fn, spec, initial, nproc, jit, fit):
        import types

        self.runs.append((spec["layout_name"], fit))
        evidence = {"variables": [spec["layout_name"]], "slots": [], "unmatched_optimizer_variables": [], "unattributed_slots": [],
                    "mesh_axes": ["batch", "model"], "mesh_shape": [1, nproc], "jax_version": "x"}
        if fit:
            evidence["weights"] = {"fitted under": spec["layout_name"]}
        return types.SimpleNamespace(ok=True, values=[evidence], outcomes=[])


def test_one_fitted_jax_run_serves_every_layout_and_each_other_layout_only_builds():
    from conformance.reference import JaxReferences

    pool = FakeJaxPool()
    references = JaxReferences(pool, 2)
    values = [{"initial_weights": {KERNEL: np.zeros((8, 16), "float32")}}]
    first = references.get(axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "colshard"), values)
    other = references.get(axes.cell_spec("mlp", "adagrad", "arrays", "jit", "rowshard"), values)
    again = references.get(axes.cell_spec("mlp", "adagrad", "dataloader", "spe4", "rowshard"), values)
    assert pool.runs == [("colshard", True), ("rowshard", False)]
    assert first.evidence["variables"] == ["colshard"] and first.evidence["weights"] == {"fitted under": "colshard"}
    assert other.evidence["variables"] == ["rowshard"] and other.evidence["weights"] == {"fitted under": "colshard"}
    assert "layouts built" in other.note and again.evidence == other.evidence


def test_a_cell_of_a_model_seen_before_gets_its_jax_reference_started_before_its_ranks_report():
    from conformance.reference import JaxReferences

    pool = FakeJaxPool()
    references = JaxReferences(pool, 2)
    seen = [{"initial_weights": {KERNEL: np.zeros((8, 16), "float32")}}]
    references.prefetch(SPEC)  # the model's first cell: no weights to start from
    assert pool.runs == []
    references.get(SPEC, seen)
    adam = axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard")
    references.prefetch(adam)
    references._executor.submit(lambda: None).result()  # the early run is done
    assert pool.runs == [("colshard", True), ("colshard", True)]
    early = references.get(adam, seen)  # the ranks started from those weights: nothing more runs
    assert pool.runs == [("colshard", True), ("colshard", True)] and early.evidence is not None
    rmsprop = axes.cell_spec("mlp", "rmsprop", "arrays", "nojit", "colshard")
    references.prefetch(rmsprop)
    other = [{"initial_weights": {KERNEL: np.ones((8, 16), "float32")}}]
    references.get(rmsprop, other)  # other weights than expected: the ranks' own are run
    assert pool.runs[2:] == [("colshard", True), ("colshard", True)]
    references.close()


def test_an_early_jax_run_that_raises_is_raised_with_the_next_reference():
    from conformance.reference import JaxReferences

    class Broken(FakeJaxPool):
        def run(self, fn, spec, *args):
            if spec["optimizer_name"] == "adam":
                raise RuntimeError("the JAX pool could not start")
            return super().run(fn, spec, *args)

    references = JaxReferences(Broken(), 2)
    seen = [{"initial_weights": {KERNEL: np.zeros((8, 16), "float32")}}]
    references.get(SPEC, seen)
    references.prefetch(axes.cell_spec("mlp", "adam", "arrays", "nojit", "colshard"))
    with pytest.raises(RuntimeError, match="could not start"):
        references.get(axes.cell_spec("mlp", "adagrad", "arrays", "nojit", "rowshard"), seen)
    references.close()


def test_without_jax_installed_a_cell_says_why_no_jax_reference_ran():
    from conformance.reference import NO_JAX, JaxReferences

    jax = JaxReferences(None, 2).get(SPEC, [{"initial_weights": {}}])
    assert jax.evidence is None and jax.note == f"not run: {NO_JAX}"


def test_an_optimizer_row_whose_default_cells_are_not_cells_is_named():
    row = axes.Optimizer("SGD", {}, slots=axes.Slots(0), default_cells=(("arrays", "compiled"),))
    with pytest.raises(ValueError, match=r"axes.OPTIMIZERS\['x'\]: default_cells: \('arrays', 'compiled'\) is not"):
        axes.check_optimizers({"x": row})


def test_the_scale_sensitive_sgd_variants_have_one_default_cell_each():
    default = set(axes.training_cells(False))
    for name in ("sgd-ema", "sgd-accum", "sgd-clipnorm", "sgd-clipvalue", "sgd-globalclipnorm"):
        mine = [c for c in default if c[1] == name]
        assert mine == [("mlp", name, "arrays", "nojit", "colshard", "float32")], name
        assert ("mlp", name, "dataloader", "jit", "colshard", "float32") in axes.training_cells(True)


def test_a_spe4_cell_is_compared_with_the_running_loss_at_the_steps_it_reports():
    jax = {"step_losses": [4.0, 3.0, 2.0, 1.5], "epoch_loss": [1.5]}
    assert jax_compare.reported_steps([{"step_losses": [1.5]}], jax)["step_losses"] == [1.5]
    assert jax_compare.reported_steps([{"step_losses": [3.0, 1.5]}], jax)["step_losses"] == [3.0, 1.5]
    assert jax_compare.reported_steps([{"step_losses": [4.0, 3.0, 2.0, 1.5]}], jax) is jax
    # A count that divides none: compared as it is, so the shapes differ and the check says so.
    assert jax_compare.reported_steps([{"step_losses": [1.0, 2.0, 3.0]}], jax) is jax



def test_slot_counts_are_not_held_against_jax_where_it_cannot_attribute_its_slots():
    jax = {"variables": [{"path": KERNEL, "shape": (8, 16), "spec": [None, "model"]}], "slots": [],
           "mesh_axes": ["batch", "model"], "mesh_shape": [1, 2]}
    layout = axes.LAYOUTS["colshard"]
    (line,) = jax_compare.layout_departures(jax, layout, 2, "adagrad")
    assert line == f"{KERNEL}: the JAX backend keeps 0 optimizer slot(s) and 0 factored, adagrad keeps 1 and 0"
    assert jax_compare.layout_departures(dict(jax, unattributed_slots=["adam/momentum_3"]), layout, 2, "adagrad") == []
    assert jax_compare.layout_departures(jax, layout, 2, "adagrad", frozen={KERNEL}) == []  # a frozen kernel: none


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="JAX is not installed")
def test_the_jax_reference_loads_the_programs_it_compiled_before_from_the_compilation_cache(references, tmp_path):
    """Evaluate and predict are the same programs for every optimizer of a model and layout, so a
    second fitted run compiles only its train step; a later session compiles nothing and computes
    the same numbers, since a cached executable is the one XLA compiled."""
    from keras_dtensor_conformance.controller.launch import LaunchConfig
    from keras_dtensor_conformance.controller.pools import PoolManager

    from conformance.ranks import jax_reference as rank_jax

    sgd, adam = (axes.cell_spec("mlp", name, "arrays", "nojit", "colshard") for name in ("sgd", "adam"))
    initial = references.get(sgd).values[0]["initial_weights"]
    cache = str(tmp_path / "xla")

    def session(*specs):
        manager = PoolManager(LaunchConfig(None, str(tmp_path)), timeout=120)  # its own short folder: AF_UNIX paths
        try:
            pool = manager.jax_reference(2, cache)
            results = [pool.run(rank_jax.train, spec, initial, 2, True, True) for spec in specs]
        finally:
            manager.close_all()
        assert all(r.ok for r in results), [r.story() for r in results]
        return [r.values[0] for r in results]

    first_sgd, first_adam = session(sgd, adam)
    assert first_sgd["xla_cache"]["misses"] >= 3  # train, evaluate and predict steps: all new
    assert first_adam["xla_cache"]["hits"] >= 2  # evaluate and predict: SGD's programs
    assert first_adam["xla_cache"]["misses"] >= 1  # Adam's train step
    (later_sgd,) = session(sgd)
    assert later_sgd["xla_cache"] == {"hits": first_sgd["xla_cache"]["misses"], "misses": 0}
    assert later_sgd["step_losses"] == first_sgd["step_losses"]
    np.testing.assert_array_equal(later_sgd["predict"], first_sgd["predict"])
