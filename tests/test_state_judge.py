"""The state cells' judge on hand-made evidence: no ranks, no Keras.

Reconcile: ranks that agree on one global tensor, each holding its shard, within the initializer's
global bounds, pass; a replica of its own, a shard that is not the rank's part of the view, or a
draw wider than the global fans allow fail as numerics. Checkpoints: two writers of one file fail
as error; slots that did not load, numerics; a loaded kernel that lost its layout, sharding-lost.
"""

from __future__ import annotations

import numpy as np

from conformance import axes
from conformance.judge import state as judge

COLSHARD = axes.LAYOUTS["colshard"]
KERNEL = np.linspace(-0.4, 0.4, 8 * 16, dtype="float32").reshape(8, 16)  # within Glorot's 0.5 for (8, 16)


def kernel(rank: int, value=KERNEL, local=None) -> dict:
    part = value[:, rank * 8:(rank + 1) * 8] if local is None else local
    return {"path": "mlp/dense_a/kernel", "type": "Parameter", "shape": (8, 16), "dtensor": True,
            "placements": ["R", "S(1)"], "local_shape": part.shape, "local": part, "global": value,
            "initializer": "GlorotUniform"}


def reconcile_value(rank: int, **kw) -> dict:
    variables = [kernel(rank, **kw)]
    return {"stages": {"built": variables, "fit": variables}, "step_losses": [1.0, 0.5], "batch_part": [0, 1]}


def reference() -> dict:
    return {"stages": {"fit": [kernel(0)]}, "step_losses": [1.0, 0.5]}


SPEC = {"layout": COLSHARD}


def test_agreed_sharded_variables_pass():
    assert judge.reconcile_failure(SPEC, [reconcile_value(0), reconcile_value(1)], reference()) is None


def test_ranks_that_kept_their_own_initialisation_fail():
    other = KERNEL[::-1].copy()
    found = judge.reconcile_failure(SPEC, [reconcile_value(0), reconcile_value(1, value=other)], reference())
    assert found[0] == "numerics" and "ranks 0 and 1 see different values" in found[1]


def test_a_shard_that_is_not_the_ranks_part_fails():
    found = judge.reconcile_failure(SPEC, [reconcile_value(0), reconcile_value(1, local=KERNEL[:, :8])], reference())
    assert found[0] == "numerics" and "not its part of the global view" in found[1]


def test_a_draw_wider_than_the_global_fans_fails():
    wide = KERNEL * 1.4  # 0.56: within a (8, 8) shard's Glorot bound 0.61, beyond (8, 16)'s 0.5
    values = [reconcile_value(r, value=wide) for r in (0, 1)]
    ref = {"stages": {"fit": [kernel(0, value=wide)]}, "step_losses": [1.0, 0.5]}
    found = judge.reconcile_failure(SPEC, values, ref)
    assert found[0] == "numerics" and "not one global initialisation" in found[1]


def test_a_plain_kernel_is_sharding_lost():
    plain = dict(kernel(0), dtensor=False, type="Parameter")
    value = {"stages": {"built": [plain], "fit": [plain]}, "step_losses": [1.0], "batch_part": [0, 1]}
    assert judge.reconcile_failure(SPEC, [value, value], reference())[0] == "sharding-lost"


def test_training_unlike_the_reference_from_the_agreed_weights_fails():
    ref = {"stages": {"fit": [kernel(0, value=KERNEL + 0.01)]}, "step_losses": [1.0, 0.5]}
    found = judge.reconcile_failure(SPEC, [reconcile_value(0), reconcile_value(1)], ref)
    assert found[0] == "numerics" and "single-process reference" in found[1]


# ---------------------------------------------------------------- checkpoints
SLOT = np.full((8, 16), 0.25, dtype="float32")


def described(rank: int) -> dict:
    return {k: v for k, v in kernel(rank).items() if k not in ("local", "global", "initializer")}


def save(rank: int, wrote=None) -> dict:
    return {"uninterrupted": {"weights": {"mlp/dense_a/kernel": KERNEL}, "step_losses": [1.0, 0.8, 0.6, 0.4]},
            "saved_optimizer": {"adam/iterations": np.int64(2), "adam/mlp_dense_a_kernel_momentum": SLOT},
            "wrote": [f"/ck/model-rank{rank}.keras"] if wrote is None else wrote}


def resume(rank: int, slot=SLOT, variables=None) -> dict:
    slot_variable = {**described(rank), "path": "adam/mlp_dense_a_kernel_momentum", "reference": "mlp/dense_a/kernel"}
    return {"loaded": {"variables": variables or [described(rank)], "slots": [slot_variable],
                       "optimizer": {"adam/iterations": np.int64(2), "adam/mlp_dense_a_kernel_momentum": slot}},
            "step_losses": [0.6, 0.4], "weights": {"mlp/dense_a/kernel": KERNEL},
            "variables": [described(rank)], "batch_part": [0, 1]}


def test_a_checkpoint_that_resumes_passes():
    assert judge.checkpoint_failure(COLSHARD, [save(0), save(1)], [resume(0), resume(1)]) is None


def test_two_writers_of_one_file_fail_as_error():
    saves = [save(r, wrote=["/ck/model.keras"]) for r in (0, 1)]
    found = judge.checkpoint_failure(COLSHARD, saves, [None, None])
    assert found[0] == "error" and "ranks 0, 1" in found[1]


def test_slots_that_did_not_load_fail_as_numerics():
    fresh = np.zeros_like(SLOT)
    found = judge.checkpoint_failure(COLSHARD, [save(0), save(1)], [resume(0, fresh), resume(1, fresh)])
    assert found[0] == "numerics" and "mlp_dense_a_kernel_momentum" in found[1]


def test_a_loaded_kernel_without_its_layout_is_sharding_lost():
    plain = [dict(described(0), dtensor=False)]
    found = judge.checkpoint_failure(COLSHARD, [save(0), save(1)], [resume(0, variables=plain), resume(1)])
    assert found[0] == "sharding-lost" and "after load" in found[1]


def test_resumed_numbers_unlike_uninterrupted_training_fail():
    drifted = resume(1)
    drifted["weights"] = {"mlp/dense_a/kernel": KERNEL + 0.01}
    found = judge.checkpoint_failure(COLSHARD, [save(0), save(1)], [resume(0), drifted])
    assert found[0] == "numerics" and "uninterrupted" in found[1]
